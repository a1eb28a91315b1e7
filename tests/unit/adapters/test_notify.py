"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.adapters.notify import Notifier, watchdog_interval_s

DEADLINE_S = 5.0


class Systemd:
    """The receiving end of $NOTIFY_SOCKET."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address

    def receive(self) -> list[str]:
        self.sock.settimeout(DEADLINE_S)
        return self.sock.recv(4096).decode().split("\n")


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[Systemd]:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    yield Systemd(sock, str(path))
    sock.close()


@pytest.fixture
def notifier(systemd: Systemd) -> Iterator[Notifier]:
    notifier = Notifier(systemd.address)
    yield notifier
    notifier.close()


def test_ready_with_status(notifier: Notifier, systemd: Systemd) -> None:
    assert notifier.ready("serving 2 units")
    assert systemd.receive() == ["READY=1", "STATUS=serving 2 units"]


def test_each_message(notifier: Notifier, systemd: Systemd) -> None:
    assert notifier.ready()
    assert systemd.receive() == ["READY=1"]
    assert notifier.status("probing sglang-k26.service")
    assert systemd.receive() == ["STATUS=probing sglang-k26.service"]
    assert notifier.watchdog()
    assert systemd.receive() == ["WATCHDOG=1"]
    assert notifier.extend_timeout(90)
    assert systemd.receive() == ["EXTEND_TIMEOUT_USEC=90000000"]
    assert notifier.extend_timeout(0.0015)
    assert systemd.receive() == ["EXTEND_TIMEOUT_USEC=1500"]
    assert notifier.stopping("draining")
    assert systemd.receive() == ["STOPPING=1", "STATUS=draining"]


def test_status_is_kept_on_one_line(notifier: Notifier, systemd: Systemd) -> None:
    notifier.status("unit failed:\nout of memory\r\n")
    assert systemd.receive() == ["STATUS=unit failed: out of memory"]


def test_abstract_socket() -> None:
    name = f"k26-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        notifier = Notifier("@" + name)
        try:
            assert notifier.watchdog()
            sock.settimeout(DEADLINE_S)
            assert sock.recv(4096) == b"WATCHDOG=1"
        finally:
            notifier.close()


def test_from_env(monkeypatch: pytest.MonkeyPatch, systemd: Systemd) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", systemd.address)
    notifier = Notifier.from_env()
    assert notifier.enabled
    assert notifier.ready()
    assert systemd.receive() == ["READY=1"]
    notifier.close()


def test_no_socket_means_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier.from_env()
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    notifier.close()
    assert not Notifier.from_env({"NOTIFY_SOCKET": ""}).enabled


@pytest.mark.parametrize("value", ["vsock:2:1234", "relative/path"])
def test_unsupported_addresses_disable_notifying(value: str) -> None:
    assert not Notifier(value).enabled


def test_a_missing_receiver_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier(str(tmp_path / "gone"))
    with caplog.at_level(logging.WARNING, logger="supervisor.adapters.notify"):
        assert not notifier.ready()
    assert "READY=1" in caplog.text
    notifier.close()


def test_a_full_receiver_queue_does_not_block(notifier: Notifier, systemd: Systemd) -> None:
    # Nobody reads: the kernel queue fills and the non-blocking send gives up.
    results = [notifier.watchdog() for _ in range(5000)]
    assert results[0] is True
    assert False in results
    assert systemd.receive() == ["WATCHDOG=1"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval_s(env) == expected


def test_watchdog_interval_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 1.0
    assert watchdog_interval_s(pid=os.getpid() + 1) == 1.0  # no WATCHDOG_PID: it is ours
