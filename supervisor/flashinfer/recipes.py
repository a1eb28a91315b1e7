"""The SM120 patch recipes: exact text edits to a FlashInfer release. Pure.

Each recipe names the releases it was written against and edits by anchor: an
anchor must occur exactly once in its file, or the recipe does not apply and
nothing is changed. Two ways to make a rejecting FlashInfer accept 12.x:

``cuda128-sm120a`` (native)
    FlashInfer 0.6.7 to 0.7.x before PR #3633 raise "SM 12.x requires CUDA >=
    12.9" in ``CompilationContext._normalize_cuda_arch`` although CUDA 12.8
    compiles ``sm_120a``. The edit adds that branch, as PR #3633 did upstream.

``torch-ptx-forward``
    FlashInfer 0.2.x takes its gate and its nvcc arch flags from torch's
    ``_get_cuda_arch_flags``, which raises "Unknown CUDA arch (12.0)" on a torch
    that predates 12.0 (2.6 and older). The edit wraps that function in
    ``jit/env.py``: for the target arch only, it returns PTX for the newest arch
    that torch knows, which the driver JIT-compiles forward to the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

MARK = "k26-supervisor SM120 patch"

Strategy = Literal["native", "ptx-forward"]


class RecipeMismatch(ValueError):
    """The files are not what any recipe expects; nothing may be changed."""


@dataclass(frozen=True)
class Edit:
    relpath: str
    old: str
    new: str


@dataclass(frozen=True)
class Recipe:
    name: str
    strategy: Strategy
    summary: str
    edits: tuple[Edit, ...]

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(edit.relpath for edit in self.edits))


_CUDA128_OLD = """\
            else:
                raise RuntimeError("SM 12.x requires CUDA >= 12.9")
"""
_CUDA128_NEW = f"""\
            elif minor == 0 and is_cuda_version_at_least("12.8"):
                # {MARK}: CUDA 12.8 compiles sm_120a (FlashInfer PR #3633).
                return (major, "0a")
            else:
                raise RuntimeError("SM 12.x requires CUDA >= 12.9")
"""

_ENV_IMPORT = "from torch.utils.cpp_extension import _get_cuda_arch_flags\n"
_CPP_EXT_CALL = "    cuda_cflags += _get_cuda_arch_flags(extra_cuda_cflags)\n"
_CORE_CALL = "    for cuda_arch_flags in torch_cpp_ext._get_cuda_arch_flags():\n"


def _ptx_wrapper(targets: tuple[str, ...], ptx: str) -> str:
    wanted = ", ".join(f'"{t}", "{t}+PTX"' for t in targets)
    return f"""\
from torch.utils.cpp_extension import _get_cuda_arch_flags as _k26_torch_cuda_arch_flags


def _get_cuda_arch_flags(cflags=None):
    # {MARK}: this torch does not know {", ".join(targets)}. Build PTX for
    # compute_{ptx}, the newest arch it knows; the driver JIT-compiles it forward.
    try:
        return _k26_torch_cuda_arch_flags(cflags)
    except ValueError:
        requested = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";").split(";")
        if not requested or not set(requested) <= {{{wanted}}}:
            raise
        return ["-gencode=arch=compute_{ptx},code=compute_{ptx}"]
"""


def cuda128_recipe() -> Recipe:
    return Recipe(
        name="cuda128-sm120a",
        strategy="native",
        summary="accept 12.0 on CUDA 12.8 as sm_120a (native SASS), as FlashInfer PR #3633 does",
        edits=(Edit("compilation_context.py", _CUDA128_OLD, _CUDA128_NEW),),
    )


def ptx_forward_recipe(target: str, newest_known: str) -> Recipe:
    ptx = newest_known.replace(".", "")
    return Recipe(
        name="torch-ptx-forward",
        strategy="ptx-forward",
        summary=(
            f"torch knows archs up to {newest_known} only: build PTX for compute_{ptx}, "
            f"which the driver JIT-compiles forward to sm_{target.replace('.', '')}"
        ),
        edits=(
            Edit("jit/env.py", _ENV_IMPORT, _ptx_wrapper((target,), ptx)),
            Edit(
                "jit/cpp_ext.py",
                _CPP_EXT_CALL,
                _CPP_EXT_CALL.replace("_get_cuda_arch_flags", "jit_env._get_cuda_arch_flags"),
            ),
            Edit(
                "jit/core.py",
                _CORE_CALL,
                _CORE_CALL.replace("torch_cpp_ext.", "jit_env."),
            ),
        ),
    )


def apply(recipe: Recipe, files: Mapping[str, str]) -> dict[str, str]:
    """New texts for every file the recipe edits. Raises RecipeMismatch, changes nothing."""
    out = {path: files[path] for path in recipe.files if path in files}
    for edit in recipe.edits:
        text = out.get(edit.relpath)
        if text is None:
            raise RecipeMismatch(f"{edit.relpath} is missing")
        if MARK in text:
            raise RecipeMismatch(f"{edit.relpath} already carries a {MARK}")
        count = text.count(edit.old)
        if count != 1:
            first = edit.old.strip().splitlines()[0]
            raise RecipeMismatch(f"{edit.relpath}: expected exactly one {first!r}, found {count}")
        out[edit.relpath] = text.replace(edit.old, edit.new)
    return out


def _fits(recipe: Recipe, files: Mapping[str, str], reasons: list[str]) -> bool:
    """Whether ``recipe`` applies to ``files``; if not, why, added to ``reasons``."""
    try:
        apply(recipe, files)
    except RecipeMismatch as exc:
        reasons.append(f"{recipe.name}: {exc}")
        return False
    return True


def select(
    files: Mapping[str, str],
    *,
    target: str,
    gate_error: str,
    torch_known: tuple[str, ...] = (),
) -> Recipe:
    """Pick the recipe whose anchors this release has and whose cause the gate shows.

    Raises RecipeMismatch with the reasons every recipe was turned down.
    """
    reasons: list[str] = []
    if "requires CUDA >= 12.9" in gate_error:
        recipe = cuda128_recipe()
        if _fits(recipe, files, reasons):
            return recipe
    if "Unknown CUDA arch" in gate_error:
        if not torch_known:
            reasons.append("torch-ptx-forward: torch reports no arch it knows")
        elif target in torch_known:
            reasons.append(f"torch-ptx-forward: torch knows {target}; the rejection is elsewhere")
        else:
            recipe = ptx_forward_recipe(target, torch_known[-1])
            if _fits(recipe, files, reasons):
                return recipe
    if not reasons:
        reasons.append(f"no recipe knows this rejection: {gate_error}")
    raise RecipeMismatch("; ".join(reasons))
