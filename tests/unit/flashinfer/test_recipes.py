"""Recipe mechanics: anchors must match exactly once, or nothing changes.

The recipes are proven against real FlashInfer releases in
tests/integration/test_flashinfer_gate.py; these check the pure rules.
"""

from __future__ import annotations

import pytest

from supervisor.flashinfer import recipes

CONTEXT = """\
        elif major == 12:
            from flashinfer.jit.cpp_ext import is_cuda_version_at_least

            if is_cuda_version_at_least("12.9"):
                return (major, "0f")
            else:
                raise RuntimeError("SM 12.x requires CUDA >= 12.9")
"""


def test_cuda128_recipe_selected_and_applied() -> None:
    files = {"compilation_context.py": CONTEXT}
    recipe = recipes.select(
        files, target="12.0", gate_error="RuntimeError: SM 12.x requires CUDA >= 12.9"
    )
    assert recipe.strategy == "native"
    new = recipes.apply(recipe, files)["compilation_context.py"]
    assert 'return (major, "0a")' in new and recipes.MARK in new
    with pytest.raises(recipes.RecipeMismatch, match="already carries"):
        recipes.apply(recipe, {"compilation_context.py": new})


def test_unexpected_file_is_refused() -> None:
    files = {"compilation_context.py": CONTEXT.replace("12.9", "13.1")}
    with pytest.raises(recipes.RecipeMismatch, match="expected exactly one"):
        recipes.select(files, target="12.0", gate_error="SM 12.x requires CUDA >= 12.9")


def test_unknown_rejection_is_refused() -> None:
    with pytest.raises(recipes.RecipeMismatch, match="no recipe knows"):
        recipes.select({}, target="12.0", gate_error="RuntimeError: something else")


def test_ptx_forward_needs_torch_to_not_know_the_arch() -> None:
    with pytest.raises(recipes.RecipeMismatch, match=r"torch knows 12\.0"):
        recipes.select(
            {}, target="12.0", gate_error="ValueError: Unknown CUDA arch (12.0)",
            torch_known=("9.0", "10.0", "12.0"),
        )  # fmt: skip


def test_ptx_forward_wrapper_text() -> None:
    recipe = recipes.ptx_forward_recipe("12.0", "10.0")
    assert recipe.files == ("jit/env.py", "jit/cpp_ext.py", "jit/core.py")
    wrapper = recipe.edits[0].new
    assert "-gencode=arch=compute_100,code=compute_100" in wrapper
    compile(wrapper, "env.py", "exec")
