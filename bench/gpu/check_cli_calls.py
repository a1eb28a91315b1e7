"""Check that the GPU scripts call each project command in the CLI that has it.

    python3 bench/gpu/check_cli_calls.py [FILE.py ...]   (default: bench/gpu/*.py)

The product's CLI (``python -m supervisor``, ``k26-supervisor``) and the development
tools (``python -m k26dev``, ``k26-dev``: sandbox, standin, demo) are two parsers. A
script that sends a command to the wrong one fails on the GPU host at once with
"invalid choice". This reads each script with ``ast`` and finds the argument lists it
hands either CLI:

* a list or tuple ``[sys.executable, "-m", "supervisor" | "k26dev", "cmd", ...]``;
* a list that starts with a name bound to a path ending in ``"k26-supervisor"`` or
  ``"k26-dev"`` (``CLI = ROOT / ".venv" / "bin" / "k26-supervisor"``), or ``str()`` of it;
* calls of a helper (in any of the scripts) whose body builds such a list from its
  ``*args``: ``self.cli("status", ...)``; a ``-m`` target taken from a parameter
  (``module: str = "supervisor"``) follows the call's keyword, else the default.

Each leading literal word is checked against the subcommands of the CLI's argparse
parser (``supervisor.cli.build_parser``, ``k26dev.cli.build_parser``), level by level
(``flashinfer bundle import``), up to the first option or non-literal. Exit 1 with one
line per bad call (file, line, the word, and the CLI that has it), else 0.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "devtools")]  # supervisor; k26dev (its own distribution)

MODULES = {"supervisor": "k26-supervisor", "k26dev": "k26-dev"}  # -m target -> program
PROGRAMS = {prog: module for module, prog in MODULES.items()}


def parsers() -> dict[str, argparse.ArgumentParser]:
    from k26dev import cli as dev_cli
    from supervisor import cli

    return {"supervisor": cli.build_parser(), "k26dev": dev_cli.build_parser()}


def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


@dataclass(frozen=True)
class Helper:
    skip: int  # positional parameters before *args (self counts when called as a method)
    module: str | None  # the fixed -m target, or None: taken from `param`
    param: str | None
    default: str | None


def is_sys_executable(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "executable"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def program_names(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a path whose last part is a CLI: name -> -m target."""
    found: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target, value = node.targets[0], node.value
        while isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div):
            value = value.right
        word = literal(value)
        if isinstance(target, ast.Name) and word is not None:
            module = PROGRAMS.get(word.rpartition("/")[2])
            if module:
                found[target.id] = module
    return found


def head(elts: list[ast.expr], names: dict[str, str]) -> tuple[str | ast.expr, int] | None:
    """(the -m target, or the expression naming it; where the CLI's own words start)."""
    if len(elts) >= 3 and is_sys_executable(elts[0]) and literal(elts[1]) == "-m":
        target = literal(elts[2])
        if target is not None:
            return (target, 3) if target in MODULES else None
        return elts[2], 3
    first = elts[0] if elts else None
    if (
        isinstance(first, ast.Call)
        and isinstance(first.func, ast.Name)
        and first.func.id == "str"
        and len(first.args) == 1
    ):
        first = first.args[0]
    if isinstance(first, ast.Name) and first.id in names:
        return names[first.id], 1
    return None


def helpers(tree: ast.Module) -> dict[str, Helper]:
    """Functions whose body hands their ``*args`` to a CLI."""
    found: dict[str, Helper] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.args.vararg is None:
            continue
        vararg = fn.args.vararg.arg
        params = [*fn.args.posonlyargs, *fn.args.args]
        # the last len(defaults) positional parameters have them; a keyword-only one, or None
        defaults = dict(zip([a.arg for a in params][::-1], fn.args.defaults[::-1], strict=False))
        for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True):
            if d is not None:
                defaults[a.arg] = d
        for node in ast.walk(fn):
            if not isinstance(node, ast.List | ast.Tuple):
                continue
            got = head(node.elts, {})
            if got is None or len(node.elts) <= got[1]:
                continue
            rest = node.elts[got[1]]
            if not (
                isinstance(rest, ast.Starred)
                and isinstance(rest.value, ast.Name)
                and rest.value.id == vararg
            ):
                continue
            target = got[0]
            if isinstance(target, str):
                found[fn.name] = Helper(len(params), target, None, None)
            elif isinstance(target, ast.Name) and target.id in defaults:
                default = literal(defaults[target.id])
                found[fn.name] = Helper(len(params), None, target.id, default)
    return found


def walk(words: list[ast.expr], module: str, parser: argparse.ArgumentParser) -> str | None:
    """The first literal word the parser has no subcommand for, as a message; else None."""
    path = [MODULES[module]]
    for node in words:
        word = literal(node)
        subs = choices(parser)
        if word is None or word.startswith("-") or subs is None:
            return None
        if word not in subs:
            return f"{' '.join(path)}: no command {word!r} (it has: {', '.join(subs)})"
        path.append(word)
        parser = subs[word]
    return None


def check(files: list[Path], verbose: bool = False) -> list[str]:
    trees = {f: ast.parse(f.read_text(), filename=str(f)) for f in files}
    known: dict[str, Helper] = {}
    for tree in trees.values():
        known.update(helpers(tree))
    clis = parsers()
    problems: list[str] = []
    checked = 0

    def report(f: Path, line: int, module: str, words: list[ast.expr]) -> None:
        nonlocal checked
        said = [w for w in map(literal, words) if w is not None]
        if not said or literal(words[0]) is None:
            return  # the helper's own [sys.executable, "-m", module, *args]
        checked += 1
        if verbose:
            print(f"{f}:{line}: {MODULES[module]} {' '.join(said)}", file=sys.stderr)
        bad = walk(words, module, clis[module])
        if bad is None:
            return
        first = literal(words[0]) if words else None
        for other in MODULES:
            if other != module and first and first in (choices(clis[other]) or {}):
                bad += f"; {first!r} is a {MODULES[other]} command (python -m {other} {first})"
        problems.append(f"{f}:{line}: {bad}")

    for f, tree in trees.items():
        names = program_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.List | ast.Tuple):
                got = head(node.elts, names)
                if got is not None and isinstance(got[0], str):
                    report(f, node.lineno, got[0], node.elts[got[1] :])
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                helper = known.get(name) if isinstance(name, str) else None
                if helper is None:
                    continue
                skip = helper.skip - 1 if isinstance(func, ast.Attribute) else helper.skip
                module = helper.module
                if module is None:
                    given = [k.value for k in node.keywords if k.arg == helper.param]
                    module = literal(given[0]) if given else helper.default
                if module not in MODULES:
                    continue  # a -m target this checker cannot read
                report(f, node.lineno, module, node.args[max(skip, 0) :])
    if not checked:
        problems.append(f"no CLI call found in {', '.join(map(str, files))}: is the checker stale?")
    else:
        print(f"checked {checked} CLI calls in {len(files)} files", file=sys.stderr)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("-v", "--verbose", action="store_true", help="list each call checked")
    args = parser.parse_args()
    files = args.files or sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name)
    problems = check(files, args.verbose)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
