"""Helpers for the hostile-client tests: raw sockets, a draining reader, /proc figures."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


def rss_kib(pid: int) -> int:
    """The resident set of a process now (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise KeyError("VmRSS")


def log_size(m) -> int:
    return len(m.log().encode("utf-8"))


class Drain:
    """Reads a socket in a thread until EOF, keeping the received bytes (up to a bound)."""

    def __init__(self, sock: socket.socket, keep: int = 1 << 20) -> None:
        self.sock = sock
        self.keep = keep
        self.data = b""  # the first ``keep`` bytes
        self.tail = b""  # the last 4 KiB
        self.total = 0
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(30)
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                self.total += len(chunk)
                self.tail = (self.tail + chunk)[-4096:]
                if len(self.data) < self.keep:
                    self.data += chunk[: self.keep - len(self.data)]
        except OSError:
            pass
        self.closed.set()

    def lines(self) -> list[str]:
        return self.data.decode("utf-8", "replace").splitlines()


def send_all(sock: socket.socket, data: bytes, chunk: int = 1 << 16) -> bool:
    """Send as much of ``data`` as the peer takes; False once it closed or reset."""
    view = memoryview(data)
    try:
        for i in range(0, len(view), chunk):
            sock.sendall(view[i : i + chunk])
    except OSError:
        return False
    return True


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` (bounded) until true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)  # polling interval, not synchronization
