"""``[flashinfer] registry``: optional, and a bad value is one line naming the field."""

from __future__ import annotations

import pytest

from supervisor.core.config import InvalidConfig, parse_toml, split_registry

UNIT = """
[[units]]
name = "sglang-k26.service"
role = "autoregressive"
url = "http://127.0.0.1:30000"
"""


def config(flashinfer: str) -> bytes:
    return f"[flashinfer]\n{flashinfer}\n{UNIT}".encode()


def test_the_registry_is_optional_and_taken_as_written() -> None:
    assert parse_toml(config("")).flashinfer.registry is None
    parsed = parse_toml(config('registry = "https://reg.example:5000/k26/bundles"'))
    assert parsed.flashinfer.registry == "https://reg.example:5000/k26/bundles"
    assert parsed.flashinfer.registry_timeout_s == 30.0
    assert split_registry(parsed.flashinfer.registry) == (
        "https://reg.example:5000",
        "k26/bundles",
    )


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ('"reg.example:5000/k26"', "must start with http:// or https://"),
        ('"http://reg.example:5000"', "names no repository"),
        ('"http://reg.example:5000/K26/Bundles"', "not a valid OCI repository name"),
        ('"http://user:pw@reg.example/k26"', "must not carry credentials"),
        ('"http://reg.example:99999/k26"', "invalid port"),
        ('"http://reg.example/k26?x=1"', "must not have a query"),
        ("5000", "must be a string"),
    ],
)
def test_a_bad_registry_is_named(value: str, match: str) -> None:
    with pytest.raises(InvalidConfig, match=f"flashinfer.registry: .*{match}"):
        parse_toml(config(f"registry = {value}"))


def test_a_bad_registry_timeout_is_named() -> None:
    with pytest.raises(InvalidConfig, match=r"flashinfer\.registry_timeout_s"):
        parse_toml(config("registry_timeout_s = 0.0"))
    with pytest.raises(InvalidConfig, match=r"flashinfer\.registry_timeout_s"):
        parse_toml(config("registry_timeout_s = inf"))
