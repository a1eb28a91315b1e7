"""Every command as a user meets it: ``--help`` works, bad arguments are one line and 64.

Both command lines: the product's ``k26-supervisor`` and the development tools'
``k26-dev``. The commands are discovered from each one's ``build_parser()`` (nested
verbs included), so a new command is covered the moment it is in its
COMMAND_MODULES. Each case runs the real CLI in a subprocess: ``python -m
supervisor`` or ``python -m k26dev``.
(``check-config`` on the example config is tested in test_cli_config_probe.py.)
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from k26dev import cli as dev_cli
from supervisor import cli

ROOT = Path(__file__).resolve().parents[3]
USAGE = 64
# prog -> (the module `python -m` runs, its parser, its command modules)
CLIS = {
    "k26-supervisor": ("supervisor", cli.build_parser, cli.COMMAND_MODULES),
    "k26-dev": ("k26dev", dev_cli.build_parser, dev_cli.COMMAND_MODULES),
}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _command_paths() -> list[tuple[str, ...]]:
    """('k26-supervisor', 'run'), ('k26-dev', 'sandbox'), ('k26-dev', 'sandbox', 'up'),
    ...: every parser a user can reach, each led by its command's name."""
    paths: list[tuple[str, ...]] = []

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        for name, child in _subcommands(parser).items():
            paths.append((*prefix, name))
            walk(child, (*prefix, name))

    for prog, (_, build_parser, _) in CLIS.items():
        walk(build_parser(), (prog,))
    return paths


PATHS = _command_paths()
IDS = [" ".join(p) for p in PATHS]


def k26(*args: str, prog: str = "k26-supervisor") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", CLIS[prog][0], *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def assert_one_usage_line(
    proc: subprocess.CompletedProcess[str], prog: str = "k26-supervisor"
) -> None:
    report = f"rc={proc.returncode}\nstdout={proc.stdout!r}\nstderr={proc.stderr!r}"
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, report
    assert proc.returncode == USAGE, report
    assert len(proc.stderr.splitlines()) == 1, report
    assert proc.stderr.startswith(f"{prog}: error: "), report
    assert proc.stdout == "", report


@pytest.mark.parametrize("prog", CLIS)
def test_every_command_module_registers_a_command(prog: str) -> None:
    _, build_parser, modules = CLIS[prog]
    top = set(_subcommands(build_parser()))
    for name in modules:
        probe = argparse.ArgumentParser()
        sub = probe.add_subparsers()
        importlib.import_module(name).register(sub)
        registered = set(_subcommands(probe))
        # One command per module, named after it: main() imports only that module.
        assert registered == {cli.command_of(name)}, f"{name}.register() added {registered}"
        assert registered <= top, f"{name}: {registered - top} missing from build_parser()"
    assert len([p for p in PATHS if p[0] == prog]) >= len(modules)


@pytest.mark.parametrize(
    ("prog", "args", "unwanted"),
    [
        ("k26-supervisor", ["explain", "--output", "/dev/null", "--json"], "supervisor.daemon"),
        ("k26-supervisor", ["check-config", "--help"], "supervisor.commands.status"),
        ("k26-dev", ["standin", "--help"], "k26dev.commands.demo"),
    ],
)
def test_a_command_line_imports_only_its_commands_module(
    prog: str, args: list[str], unwanted: str
) -> None:
    """Every CLI call (the daemon's ExecStartPre, an operator's status, each test)
    paid for importing every command's dependencies; now only its own."""
    package = CLIS[prog][0]
    code = (
        "import sys, atexit\n"
        f"atexit.register(lambda: print({unwanted!r} in sys.modules, file=sys.stderr))\n"
        f"from {package}.cli import main\n"
        f"sys.exit(main({args!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "False", done.stderr


def test_the_product_has_no_development_command() -> None:
    """sandbox, standin and demo are k26-dev's: the daemon's CLI refuses them."""
    for name in ("sandbox", "standin", "demo"):
        proc = k26(name, "--help")
        assert_one_usage_line(proc)
        assert "invalid choice" in proc.stderr, proc.stderr
    assert not any(m.startswith("k26dev") for m in cli.COMMAND_MODULES)


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_help_exits_0_with_usage(path: tuple[str, ...]) -> None:
    prog, *words = path
    proc = k26(*words, "--help", prog=prog)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {' '.join(path)} "), proc.stdout[:200]
    assert "options:" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_unknown_option_exits_64_with_one_line(path: tuple[str, ...]) -> None:
    prog, *words = path
    assert_one_usage_line(k26(*words, "--no-such-option", prog=prog), prog)


@pytest.mark.parametrize(
    "args",
    [
        ["no-such-command"],
        ["watch", "--count", "abc", "a.service"],
        ["watch", "--count", "-1", "a.service"],
        ["watch", "--bus", "session", "a.service"],
        ["run", "--config"],
        ["status", "--url"],
        ["status", "--url", "127.0.0.1:9436"],
        ["status", "--url", "http://127.0.0.1:1", "--config", "x.toml"],
        ["check-config"],
        ["check-config", "a.toml", "b.toml"],
        ["probe", "--url", "not-a-url"],
        ["probe", "--url", "http://127.0.0.1:1", "--top-k", "1"],
        ["probe", "--url", "http://127.0.0.1:1", "--timeout", "0"],
        ["flashinfer", "no-such-action"],
        [
            "flashinfer",
            "warm",
            "--python",
            "p",
            "--arch",
            "12.0",
            "--workspace",
            "w",
            "--timeout",
            "x",
        ],
    ],
    ids=" ".join,
)
def test_bad_arguments_exit_64_with_one_line(args: list[str]) -> None:
    assert_one_usage_line(k26(*args))


@pytest.mark.parametrize(
    "args",
    [
        ["no-such-command"],
        ["demo", "--dir"],
        ["standin", "--port", "abc"],
        ["standin", "--port", "99999"],
        ["standin", "--fail", "no-such-fault"],
        ["standin", "--load-seconds", "-1"],
        ["sandbox", "no-such-verb"],
        ["sandbox", "up", "--dir", "d", "--timeout", "abc"],
    ],
    ids=" ".join,
)
def test_bad_development_arguments_exit_64_with_one_line(args: list[str]) -> None:
    assert_one_usage_line(k26(*args, prog="k26-dev"), "k26-dev")


@pytest.mark.parametrize("prog", CLIS)
def test_no_command_exits_64_with_usage(prog: str) -> None:
    proc = k26(prog=prog)
    assert proc.returncode == USAGE
    assert proc.stderr.startswith(f"usage: {prog} ")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    for name in _subcommands(CLIS[prog][1]()):
        assert name in proc.stderr


@pytest.mark.parametrize("prog", CLIS)
def test_version(prog: str) -> None:
    proc = k26("--version", prog=prog)
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"{prog} ")


def test_the_demo_without_its_serving_venv_fails_at_once_with_the_setup_command(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "none" / "python"
    done = k26("demo", "--serving-python", str(missing), "--dir", str(tmp_path), prog="k26-dev")
    assert done.returncode == 69, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert "scripts/dev.sh demo" in done.stderr and str(missing) in done.stderr
    assert not (tmp_path / "sandbox").exists()  # nothing was brought up
