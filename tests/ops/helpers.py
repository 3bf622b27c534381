"""Helpers for the operations tests: a NOTIFY_SOCKET, a fake master, /metrics scrapes.

Processes are started with ``tests.integration.procs.Proc`` (output in a log
file) and ``tests.conftest``'s ``master`` fixture; everything waits with
bounded deadlines, never with a bare sleep.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import HOST, LineClient
from tests.integration.procs import Proc, wait_for

__all__ = ["EVENT_ROW", "FakeMaster", "NotifySocket", "Proc", "sample", "scrape", "wait_for", "wait_for_log"]

EVENT_ROW = '["$e{n}", "!room", "m.room.message", null, null]'  # a row of the built-in events stream


class NotifySocket:
    """A unix datagram socket standing in for systemd's ``NOTIFY_SOCKET``.

    Each datagram is one message of ``KEY=value`` lines; ``messages`` keeps
    every one received, in order, as a dict, and ``pids`` the sender's pid of
    each (from ``SO_PASSCRED``, as systemd checks ``NotifyAccess=main``).
    ``abstract=True`` binds in the abstract namespace (``NOTIFY_SOCKET=@name``).
    """

    def __init__(self, abstract: bool = False) -> None:
        self._dir: str | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        if abstract:
            name = f"tickline-test-{os.getpid()}-{id(self)}"
            self.sock.bind(b"\0" + name.encode())
            self.address = "@" + name
        else:
            # A short directory: unix socket paths are limited to ~107 bytes.
            self._dir = tempfile.mkdtemp(prefix="tl-notify-")
            self.address = os.path.join(self._dir, "notify.sock")
            self.sock.bind(self.address)
        self.messages: list[dict[str, str]] = []
        self.pids: list[int | None] = []
        self.times: list[float] = []  # time.monotonic() when each message was read

    def _read_one(self) -> None:
        data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(struct.calcsize("iII")))
        pid = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _uid, _gid = struct.unpack("iII", payload[: struct.calcsize("iII")])
        lines = data.decode("utf-8").split("\n")
        self.messages.append(dict(line.split("=", 1) for line in lines if "=" in line))
        self.pids.append(pid)
        self.times.append(time.monotonic())

    def _receive(self, timeout: float) -> bool:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            self._read_one()
        except TimeoutError:
            return False
        return True

    def drain(self) -> None:
        """Read whatever has arrived, without waiting."""
        while self._receive(0.001):
            pass

    def wait(
        self,
        key: str,
        value: str | None = None,
        timeout: float = 15.0,
        after: int = 0,
        pid: int | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> tuple[int, dict[str, str]]:
        """The first message from index ``after`` on with ``key`` (and ``value``, and sender ``pid``).

        Returns (index, message); fails after ``timeout`` s, or at once when
        ``alive()`` turns false and nothing matching has arrived.
        """
        deadline = time.monotonic() + timeout
        index = after
        while True:
            while index < len(self.messages):
                message = self.messages[index]
                if key in message and (value is None or message[key] == value) and pid in (None, self.pids[index]):
                    return index, message
                index += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no {key}={value or '*'} notification within {timeout} s; got {self.messages[-10:]!r}"
                )
            if alive is not None and not alive():
                self.drain()
                if index >= len(self.messages):
                    raise AssertionError(f"the process exited before {key}={value or '*'}; got {self.messages[-10:]!r}")
            self._receive(min(remaining, 0.1))

    def of(self, pid: int, start: int = 0, end: int | None = None) -> list[dict[str, str]]:
        """The messages that ``pid`` sent, from index ``start`` to ``end``."""
        return [m for m, p in zip(self.messages[start:end], self.pids[start:end], strict=False) if p == pid]

    def close(self) -> None:
        self.sock.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class AcceptedConnection(LineClient):
    """The server side of one connection, with ``LineClient``'s bounded reads."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:  # super().__init__ not called on purpose
        self.sock = sock
        self.timeout = timeout
        self._buffer = b""
        self.closed = False


class FakeMaster:
    """A listening socket the test answers by hand, to see exactly what a worker sends."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((HOST, 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.timeout = timeout
        self.connections: list[AcceptedConnection] = []

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def accept(self, timeout: float | None = None) -> AcceptedConnection:
        self.listener.settimeout(self.timeout if timeout is None else timeout)
        sock, _ = self.listener.accept()
        conn = AcceptedConnection(sock, self.timeout)
        self.connections.append(conn)
        return conn

    def handshake(self, conn: AcceptedConnection, streams: list[str], server_name: str = "fake") -> list[str]:
        """SERVER and PING; answer each ``REPLICATE <stream> <token>`` as a master with no rows.

        The answer's POSITION, then (after ``OPTIONS live``) the end-of-replay
        POSITION. Returns the lines read.
        """
        conn.send(f"SERVER {server_name}", f"PING {int(time.time() * 1000)}")
        wanted = set(streams)
        lines = []
        live = False
        while wanted:
            line = conn.read_line()
            lines.append(line)
            if line.startswith("OPTIONS ") and "live" in line.split():
                live = True
            if line.startswith("REPLICATE "):
                _, stream, token = line.split()
                conn.send(f"POSITION {stream} {server_name} {token} {token}")
                if live:
                    conn.send(f"POSITION {stream} {server_name} {token} {token}")
                wanted.discard(stream)
        return lines

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.listener.close()


def scrape(port: int, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=timeout) as response:
        assert response.status == 200
        return response.read().decode("utf-8")


def families(text: str) -> dict:
    """Metric families by name, parsed with prometheus_client's own parser."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample (by its exposed name and labels), or None."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def value_of(text: str, name: str, **labels: str) -> float:
    """The value of one sample that must be exposed (the test fails if it is not)."""
    value = sample(text, name, **labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


def wait_for_log(proc: Proc, text: str, timeout: float = 15.0, after: int = 0) -> str:
    """Wait (bounded) until ``text`` is in the process's log after character ``after``; returns the log."""
    deadline = time.monotonic() + timeout
    while text not in (log := proc.output())[after:]:
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {proc.log.name} within {timeout} s:\n{log[-3000:]}")
        time.sleep(0.02)  # polling interval, not synchronization
    return log
