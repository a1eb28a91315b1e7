"""docs/architecture.md's layout names every product module with its room and job,
and nothing that is not there: a module added, moved or removed without the map
fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def documented() -> dict[str, str]:
    """Every path the layout block names under ``supervisor/``, with its job text."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout\n```\n", 1)[1].split("```", 1)[0]
    named: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        names, job = parts[0], parts[1] if len(parts) > 1 else ""
        entries = [n.strip() for n in names.split(",")]
        if not all(e.endswith((".py", "/")) for e in entries):
            continue  # a job's continuation line
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = stack[-1][1] if stack else ""
        for entry in entries:
            path = prefix + entry
            named[path] = job
            if entry.endswith("/"):
                stack.append((indent, path))
    return {p: j for p, j in named.items() if p.startswith("supervisor/")}


def product() -> set[str]:
    modules = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "supervisor").rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    packages = {
        str(p.parent.relative_to(ROOT)) + "/" for p in (ROOT / "supervisor").rglob("__init__.py")
    }
    return modules | packages


def test_every_product_module_and_package_is_on_the_map_with_its_job() -> None:
    named, actual = documented(), product()
    assert sorted(actual - set(named)) == [], "add these to docs/architecture.md's layout"
    assert sorted(set(named) - actual) == [], "docs/architecture.md names what is not there"
    jobless = [p for p, job in named.items() if not job and p != "supervisor/"]
    assert jobless == [], "give these a job in docs/architecture.md's layout"
