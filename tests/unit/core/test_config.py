"""Config models and load_config: defaults, every rule, and the messages users see."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest

from supervisor.adapters.config_file import load_config
from supervisor.core.config import (
    Config,
    InvalidConfig,
    normalize_server_url,
    parse_config,
    split_listen,
)
from supervisor.core.errors import ConfigError
from supervisor.core.policy import Role

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "config" / "k26-supervisor.toml"

UNITS = """
[[units]]
name = "sglang-k26-eagle3.service"
role = "eagle3"
url = "http://127.0.0.1:30000"
fallback = "sglang-k26.service"

[[units]]
name = "sglang-k26.service"
role = "autoregressive"
url = "http://127.0.0.1:30000"
"""


_MIN: dict[str, Any] = {
    "flashinfer": {"enabled": False},
    "units": [
        {"name": "sglang-k26.service", "role": "autoregressive", "url": "http://127.0.0.1:30000"}
    ],
}


def write(tmp_path: Path, text: str, name: str = "k26.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(tmp_path: Path, text: str) -> dict[str, str]:
    path = write(tmp_path, text)
    with pytest.raises(InvalidConfig) as info:
        load_config(path)
    err = info.value
    assert isinstance(err, ConfigError) and err.exit_code == 78
    assert str(path) in str(err)
    return {p.path: p.message for p in err.problems}


# --- good configs ------------------------------------------------------------------


def test_the_example_config_is_valid_and_holds_the_defaults() -> None:
    config = load_config(EXAMPLE)
    assert config == parse_config(
        {"units": [u.model_dump(mode="json") for u in config.units]}
    )  # every value in the example is the default
    assert [u.role for u in config.units] == [Role.EAGLE3, Role.AUTOREGRESSIVE]


def test_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, UNITS))
    s, fi, p, r, fb = (
        config.supervisor,
        config.flashinfer,
        config.probe,
        config.restart,
        config.fallback,
    )
    assert (s.bus, s.listen, s.listen_host, s.listen_port) == (
        "system",
        "127.0.0.1:9436",
        "127.0.0.1",
        9436,
    )
    assert fi.enabled and fi.arch == "12.0" and fi.modules == ("sampling",)
    assert fi.python == Path("/opt/sglang/venv/bin/python")
    assert not fi.allow_patch and not fi.pytorch_sampling_fallback
    assert (p.temperature, p.top_k, p.top_p, p.max_new_tokens, p.seed) == (0.7, 20, 0.8, 4, 1234)
    assert (p.startup_deadline_s, p.interval_s, p.failures_to_fail) == (900, 30, 3)
    assert (r.backoff_initial_s, r.backoff_max_s, r.backoff_reset_after_s) == (10, 300, 600)
    assert (r.max_failures, r.failure_window_s) == (5, 600)
    assert (fb.oom_exits, fb.window_s, fb.retry_preferred_after_s) == (2, 900, 3600)
    assert config.unit("sglang-k26.service").fallback is None


def test_overrides_and_frozen_models(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            '[supervisor]\nbus = "user"\nlisten = "[::1]:9000"\n'
            "[probe]\ntop_k = -1\ntemperature = 1\n"
            '[flashinfer]\nenabled = false\npython = "relative/is/fine/when/disabled"\n' + UNITS,
        )
    )
    assert config.supervisor.bus == "user"
    assert (config.supervisor.listen_host, config.supervisor.listen_port) == ("::1", 9000)
    assert config.probe.top_k == -1 and config.probe.temperature == 1.0
    with pytest.raises(pydantic.ValidationError):
        config.probe.top_k = 5  # type: ignore[misc]
    assert isinstance(config.units, tuple)


def test_urls_are_normalized() -> None:
    assert normalize_server_url("http://127.0.0.1:30000/") == "http://127.0.0.1:30000"
    assert normalize_server_url("https://gpu-7:443") == "https://gpu-7:443"
    assert normalize_server_url("http://[::1]:30000") == "http://[::1]:30000"


# --- bad configs: each names its field -----------------------------------------------

BAD: list[tuple[str, str, str, str]] = [
    # (id, TOML, the field's path, part of the message)
    ("bus", '[supervisor]\nbus = "session"\n', "supervisor.bus", "'system' or 'user'"),
    ("listen-no-port", '[supervisor]\nlisten = "9436"\n', "supervisor.listen", "HOST:PORT"),
    ("listen-port-0", '[supervisor]\nlisten = "127.0.0.1:0"\n', "supervisor.listen", "1 to 65535"),
    ("listen-big", '[supervisor]\nlisten = "h:70000"\n', "supervisor.listen", "1 to 65535"),
    ("listen-v6", '[supervisor]\nlisten = "::1:9436"\n', "supervisor.listen", "brackets"),
    ("unknown-key", "[supervisor]\nbuss = 1\n", "supervisor.buss", "known keys here: bus"),
    ("unknown-table", "[supervisr]\nbus = 1\n", "supervisr", "unknown key"),
    ("arch", '[flashinfer]\narch = "sm_120"\n', "flashinfer.arch", "'12.0' or '9.0'"),
    ("arch-bare", '[flashinfer]\narch = "12"\n', "flashinfer.arch", "compute capability"),
    ("python-rel", '[flashinfer]\npython = "venv/bin/python"\n', "flashinfer.python", "absolute"),
    ("workspace-rel", '[flashinfer]\nworkspace = "cache"\n', "flashinfer.workspace", "absolute"),
    ("modules-empty", "[flashinfer]\nmodules = []\n", "flashinfer.modules", "at least 1"),
    ("modules-bad", '[flashinfer]\nmodules = ["../x"]\n', "flashinfer.modules", "identifiers"),
    ("enabled-int", "[flashinfer]\nenabled = 1\n", "flashinfer.enabled", "true or false"),
    ("timeout-str", '[flashinfer]\ntimeout_s = "10"\n', "flashinfer.timeout_s", "a number"),
    ("overlap", '[flashinfer]\noverlap = "always"\n', "flashinfer.overlap", "'auto' or 'never'"),
    ("temperature-0", "[probe]\ntemperature = 0\n", "probe.temperature", "greater than 0"),
    ("temperature-inf", "[probe]\ntemperature = inf\n", "probe.temperature", "at most 2"),
    ("top-k-1", "[probe]\ntop_k = 1\n", "probe.top_k", "greater than 1 (or -1"),
    ("top-k-0", "[probe]\ntop_k = 0\n", "probe.top_k", "sampling kernels"),
    ("top-k-float", "[probe]\ntop_k = 20.0\n", "probe.top_k", "whole number"),
    ("top-p-1", "[probe]\ntop_p = 1.0\n", "probe.top_p", "less than 1"),
    ("top-p-0", "[probe]\ntop_p = 0\n", "probe.top_p", "greater than 0"),
    ("tokens-0", "[probe]\nmax_new_tokens = 0\n", "probe.max_new_tokens", "at least 1"),
    ("prompt-empty", '[probe]\nprompt = ""\n', "probe.prompt", "at least 1"),
    ("interval-neg", "[probe]\ninterval_s = -5\n", "probe.interval_s", "greater than 0"),
    ("interval-nan", "[probe]\ninterval_s = nan\n", "probe.interval_s", "got nan"),
    ("backoff-order", "[restart]\nbackoff_max_s = 5\n", "restart.backoff_max_s", "at least"),
    ("factor", "[restart]\nbackoff_factor = 0.5\n", "restart.backoff_factor", "at least 1"),
    ("max-failures", "[restart]\nmax_failures = 0\n", "restart.max_failures", "at least 1"),
    ("oom-exits", "[fallback]\noom_exits = 0\n", "fallback.oom_exits", "at least 1"),
    ("section-type", 'probe = "x"\n', "probe", "must be a table"),
]


@pytest.mark.parametrize(("text", "path", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_value_names_its_field(tmp_path: Path, text: str, path: str, needle: str) -> None:
    problems = problems_of(tmp_path, text + UNITS)
    assert path in problems, problems
    assert needle in problems[path]


UNIT_TEMPLATE = """
[[units]]
name = "a.service"
role = "autoregressive"
url = "http://127.0.0.1:30000"
"""

BAD_UNITS: list[tuple[str, str, str, str]] = [
    ("no-units", "", "units", "required"),
    ("empty-units", "units = []\n", "units", "at least one [[units]]"),
    ("url-path", UNIT_TEMPLATE.replace(":30000", ":30000/generate"), "units[0].url", "base URL"),
    ("url-scheme", UNIT_TEMPLATE.replace("http://", "ftp://"), "units[0].url", "http://"),
    ("url-port", UNIT_TEMPLATE.replace("30000", "99999"), "units[0].url", "invalid port"),
    ("url-creds", UNIT_TEMPLATE.replace("http://", "http://u:p@"), "units[0].url", "credentials"),
    ("url-space", UNIT_TEMPLATE.replace("127.0.0.1", "127.0.0.1 x"), "units[0].url", "spaces"),
    ("url-no-host", UNIT_TEMPLATE.replace("127.0.0.1:30000", ""), "units[0].url", "no host"),
    ("role", UNIT_TEMPLATE.replace("autoregressive", "draft"), "units[0].role", "'eagle3' or"),
    ("missing-url", UNIT_TEMPLATE.replace('url = "http://127.0.0.1:30000"', ""), "units[0].url",
     "required"),
    ("unit-extra", UNIT_TEMPLATE + 'restart = "always"\n', "units[0].restart", "known keys here"),
    ("not-service", UNIT_TEMPLATE.replace("a.service", "a.socket"), "units[0].name", ".service"),
    ("duplicate", UNIT_TEMPLATE * 2, "units[1].name", "already configured as units[0]"),
    (
        "eagle-no-fallback",
        UNIT_TEMPLATE.replace("autoregressive", "eagle3"),
        "units[0].fallback",
        "needs a fallback",
    ),
    (
        "fallback-unknown",
        UNIT_TEMPLATE.replace("autoregressive", "eagle3") + 'fallback = "b.service"\n',
        "units[0].fallback",
        "not a configured unit",
    ),
    (
        "fallback-self",
        UNIT_TEMPLATE.replace("autoregressive", "eagle3") + 'fallback = "a.service"\n',
        "units[0].fallback",
        "its own fallback",
    ),
    (
        "fallback-on-ar",
        UNIT_TEMPLATE + 'fallback = "b.service"\n' + UNIT_TEMPLATE.replace("a.s", "b.s"),
        "units[0].fallback",
        "only an eagle3 unit",
    ),
    (
        "fallback-is-eagle",
        UNIT_TEMPLATE.replace("autoregressive", "eagle3") + 'fallback = "b.service"\n'
        + UNIT_TEMPLATE.replace("a.s", "b.s").replace("autoregressive", "eagle3")
        + 'fallback = "a.service"\n',
        "units[0].fallback",
        "must be autoregressive",
    ),
    (
        "fallback-shared",
        UNIT_TEMPLATE.replace("autoregressive", "eagle3") + 'fallback = "c.service"\n'
        + UNIT_TEMPLATE.replace("a.s", "b.s").replace("autoregressive", "eagle3")
        + 'fallback = "c.service"\n' + UNIT_TEMPLATE.replace("a.s", "c.s"),
        "units[1].fallback",
        "already the fallback of units[0]",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "path", "needle"), [b[1:] for b in BAD_UNITS], ids=[b[0] for b in BAD_UNITS]
)
def test_a_bad_unit_names_its_field(tmp_path: Path, text: str, path: str, needle: str) -> None:
    problems = problems_of(tmp_path, text)
    assert path in problems, problems
    assert needle in problems[path]


HOSTILE_NAMES = [
    "../../etc/passwd",
    "x.service; rm -rf /",
    "a\nb.service",
    "$(reboot).service",
    "`id`.service",
    "a b.service",
    "",
    ".service",
    "-.service/..",
    "x" * 300 + ".service",
    "templ@.service",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_hostile_unit_names_are_rejected_and_shown_safely(tmp_path: Path, name: str) -> None:
    escaped = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    text = UNIT_TEMPLATE.replace('"a.service"', f'"{escaped}"')
    path = write(tmp_path, text)
    with pytest.raises(InvalidConfig) as info:
        load_config(path)
    problems = {p.path: p.message for p in info.value.problems}
    assert "units[0].name" in problems
    # However hostile the name, the report keeps one line per problem.
    lines = str(info.value).splitlines()
    assert len(lines) == 1 + len(info.value.problems)
    assert all(line.startswith("  ") for line in lines[1:])


def test_hostile_fallback_names_are_rejected_too(tmp_path: Path) -> None:
    text = UNIT_TEMPLATE.replace("autoregressive", "eagle3") + 'fallback = "../../etc/passwd"\n'
    problems = problems_of(tmp_path, text)
    assert "units[0].fallback" in problems


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = '[supervisor]\nbus = "x"\n[probe]\ntop_k = 1\ntop_p = 2\n' + UNIT_TEMPLATE.replace(
        "http://", "ftp://"
    ).replace("a.service", "a b")
    problems = problems_of(tmp_path, text)
    assert {"supervisor.bus", "probe.top_k", "probe.top_p", "units[0].url", "units[0].name"} <= set(
        problems
    )


# --- unreadable and malformed files ------------------------------------------------------


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[supervisor]\nbus = "system"\nlisten = \n')
    with pytest.raises(InvalidConfig) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line 3, column")
    assert "TOML syntax error" in message
    assert "\n" not in message


def test_duplicate_toml_key_is_a_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[probe]\ntop_k = 20\ntop_k = 30\n")
    with pytest.raises(InvalidConfig, match=r"line 3"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="cannot read the config file: No such file"):
        load_config(tmp_path / "absent.toml")


def test_directory_is_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="Is a directory"):
        load_config(tmp_path)


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[probe]\nprompt = "ok"\n# \xff\xfe\n')
    with pytest.raises(InvalidConfig, match="line 3: not valid UTF-8"):
        load_config(path)


# --- helpers ------------------------------------------------------------------------------


# split_listen is the package's one listen-address parser (config and status server).
@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:9436", ("127.0.0.1", 9436)),
        ("[::1]:9436", ("::1", 9436)),
        ("[::]:1", ("::", 1)),
        ("[fe80::1%lo]:80", ("fe80::1%lo", 80)),
        ("localhost:80", ("localhost", 80)),
        ("h:65535", ("h", 65535)),
    ],
)
def test_split_listen(listen: str, expected: tuple[str, int]) -> None:
    assert split_listen(listen) == expected
    assert split_listen(listen, allow_port_zero=True) == expected


@pytest.mark.parametrize(
    ("listen", "message"),
    [
        ("", "HOST:PORT"),
        ("9436", "HOST:PORT"),
        (":9436", "HOST:PORT"),
        (":80", "HOST:PORT"),
        ("127.0.0.1:", "1 to 65535"),
        ("h:", "1 to 65535"),
        ("h:x", "1 to 65535"),
        ("a:b", "1 to 65535"),
        ("h:-1", "1 to 65535"),
        ("h:+80", "1 to 65535"),
        ("h:\u0663", "1 to 65535"),  # a non-ASCII digit
        ("h:0", "1 to 65535"),
        ("127.0.0.1:70000", "1 to 65535"),
        ("::1:9436", "brackets"),
        ("[]:80", "not an IPv6 address"),
        ("[nope]:1", "not an IPv6 address"),
        ("[127.0.0.1]:80", "not an IPv6 address"),
        ("a/b:80", "invalid host"),
        ("a b:80", "invalid host"),
        ("user@h:80", "invalid host"),
        ("h\n:80", "invalid host"),
        ("[::1%a b]:80", "invalid host"),  # ipaddress takes any zone id
        ("[::1%a\nb]:80", "invalid host"),
    ],
)
def test_split_listen_rejects(listen: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_listen(listen)


def test_split_listen_takes_port_0_only_when_allowed() -> None:
    assert split_listen("localhost:0", allow_port_zero=True) == ("localhost", 0)
    assert split_listen("[::1]:0", allow_port_zero=True) == ("::1", 0)
    with pytest.raises(ValueError, match="0 to 65535"):
        split_listen("localhost:70000", allow_port_zero=True)


def test_models_can_be_built_in_code() -> None:
    config = Config.model_validate(
        {"units": [{"name": "x.service", "role": "autoregressive", "url": "http://h:1"}]}
    )
    assert config.units[0].url == "http://h:1"


# --- SIGHUP: what a running daemon can take over ------------------------------------


def test_a_reload_that_changes_only_runtime_keys_is_accepted() -> None:
    from supervisor.core.config import reload_refusals, unit_policy

    old = parse_config(_MIN)
    new = parse_config({**_MIN, "probe": {"interval_s": 5.0}, "restart": {"max_failures": 9}})
    assert reload_refusals(old, new) == []
    assert unit_policy(new).probe_interval_s == 5.0 and unit_policy(new).max_failures == 9


def test_a_reload_that_needs_a_restart_names_every_such_key() -> None:
    from supervisor.core.config import reload_refusals

    old = parse_config(_MIN)
    units = [{**_MIN["units"][0], "url": "http://127.0.0.1:31000"}]
    new = parse_config(
        {**_MIN, "supervisor": {"listen": "127.0.0.1:9999", "bus": "user"}, "units": units}
    )
    paths = [p.path for p in reload_refusals(old, new)]
    assert paths == ["supervisor.bus", "supervisor.listen", "units"]
    assert all("restart k26-supervisor" in p.message for p in reload_refusals(old, new))
