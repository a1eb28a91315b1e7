"""``k26-dev standin``: run the stand-in SGLang server (tests and demos)."""

from __future__ import annotations

import argparse

from k26dev.standin import options_from_args, serve
from k26dev.standin.options import add_arguments
from supervisor.core.errors import UsageError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "standin",
        help="run a stand-in SGLang server that can fail on purpose",
        description=(
            "A stand-in SGLang server (the same as 'python -m k26dev.standin'): "
            "SGLang's /health, /health_generate, /generate and /get_model_info over a toy "
            "model, with faults: cuda-oom, sampling-arch, grow-memory, sampled-hang."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
    except ValueError as exc:
        raise UsageError(f"k26-dev standin: {exc}") from exc
    return serve(options)
