"""A stand-in SGLang server for tests and demos: ``python -m k26dev.standin``.

It speaks SGLang's native HTTP shapes (``/health``, ``/health_generate``,
``/generate``, ``/get_model_info``) over a toy model, and can play the failures the
supervisor must explain: a CUDA OOM at load, FlashInfer rejecting the GPU on the
first *sampled* request while greedy health checks pass, host memory growing until
the cgroup OOM killer acts, and sampled requests that hang. Standard library only:
it runs as a unit's main process, inside any Python 3.11.
"""

from __future__ import annotations

from collections.abc import Sequence

from k26dev.standin.options import StandinOptions, build_parser, options_from_args
from k26dev.standin.server import serve

__all__ = ["StandinOptions", "build_parser", "main", "options_from_args", "serve"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return serve(options)
