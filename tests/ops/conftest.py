"""Fixtures of the operations tests: NOTIFY_SOCKET, background ``tickline`` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.ops.helpers import FakeMaster, NotifySocket, Proc

WATCHDOG_USEC = 200_000  # 0.2 s: the process kicks every 0.1 s


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Children inherit os.environ (Proc and the master fixture copy it):
    # no systemd variables of the test runner's own may leak into them.
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def notify(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    """A NOTIFY_SOCKET (with WATCHDOG_USEC=200000, no WATCHDOG_PID) for the processes started after it."""
    sock = NotifySocket()
    monkeypatch.setenv("NOTIFY_SOCKET", sock.address)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    yield sock
    sock.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Factory ``procs(name, *tickline_args)``: a background ``tickline``, log in ``tmp_path/name.log``.

    Whatever still runs at teardown is killed.
    """
    started: list[Proc] = []

    def start(name: str, *args: str) -> Proc:
        proc = Proc(tmp_path / f"{name}.log", *args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.popen.poll() is None:
            proc.kill()
        else:
            proc._file.close()


@pytest.fixture
def fake_master() -> Iterator[FakeMaster]:
    fake = FakeMaster()
    yield fake
    fake.close()
