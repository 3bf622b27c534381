"""Fan-out on real sockets: many live raw-socket clients get every row once
and in order, and one that stops reading for a while and then resumes still
gets everything exactly once (from the shared window, without being dropped).
A replay by many clients at once of rows older than any fan-out gets every
row too."""

from __future__ import annotations

import selectors
import socket
import time

import pytest

CONFIG = """
streams:
  blobs:
    columns:
      - {name: body, type: text}
protocol:
  max_pause: 30.0
"""
BODY = "y" * 200


class Reader:
    """A raw-socket client that checks RDATA tokens arrive once and in order."""

    def __init__(self, host: str, port: int, name: str, request: bytes, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect((host, port))
        self.sock.sendall(b"NAME %s\n%s" % (name.encode(), request))
        self.sock.setblocking(False)
        self.buffer = b""
        self.expected = 1
        self.positions = 0
        self.closed = False

    def feed(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        if not data:
            self.closed = True
            return
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        for line in lines:
            if line.startswith(b"RDATA "):
                _, _, _, token, row = line.split(b" ", 4)
                assert int(token) == self.expected, (token, self.expected)
                assert row == b'["%06d%s"]' % (self.expected, BODY.encode())
                self.expected += 1
            elif line.startswith(b"POSITION "):
                self.positions += 1
            else:
                assert line.startswith((b"SERVER ", b"PING ")), line


def pump(readers: list[Reader], until: int, timeout: float) -> None:
    selector = selectors.DefaultSelector()
    for r in readers:
        selector.register(r.sock, selectors.EVENT_READ, r)
    deadline = time.monotonic() + timeout
    try:
        while any(r.expected <= until for r in readers):
            assert time.monotonic() < deadline, [r.expected - 1 for r in readers]
            for key, _ in selector.select(0.5):
                reader: Reader = key.data
                reader.feed()
                assert not reader.closed, f"closed after {reader.expected - 1} rows"
    finally:
        selector.close()


@pytest.mark.parametrize("max_lag_bytes", [16 << 20, 65536], ids=["lags-in-the-window", "falls-back-to-storage"])
def test_twenty_live_clients_and_one_that_stops_reading_for_a_while(master, db_url, max_lag_bytes: int) -> None:
    # Within max_lag_bytes the stopper stays in the fan-out and later takes the
    # shared bytes from the window; past it, it catches up on its own and rejoins.
    m = master(CONFIG + f"  max_lag_bytes: {max_lag_bytes}\n", database=db_url)
    rows = 30_000
    live = [Reader(m.host, m.port, f"live{i}", b"REPLICATE blobs 0\n") for i in range(20)]
    stopper = Reader(m.host, m.port, "stopper", b"REPLICATE blobs 0\n", rcvbuf=16 * 1024)
    # Every client is live (its POSITION arrived) before rows are written.
    deadline = time.monotonic() + 10
    while not all(r.positions for r in [*live, stopper]):
        assert time.monotonic() < deadline
        for r in [*live, stopper]:
            r.feed()
        time.sleep(0.01)  # polling non-blocking sockets for the handshake, bounded above
    for start in range(1, rows + 1, 1000):
        m.append("blobs", [[f"{i:06d}{BODY}"] for i in range(start, start + 1000)])
        pump(live, start + 999, timeout=30)  # the others keep up while the stopper reads nothing
    assert stopper.expected <= rows  # it stopped well before the end
    pump([stopper], rows, timeout=30)  # resumes: everything, once, in order
    assert stopper.expected == rows + 1
    assert all(r.expected == rows + 1 for r in live)
    log = m.log()
    assert "client stopped reading" not in log and "ERROR" not in log
    # Everyone is still in the shared fan-out.
    (token,) = m.append("blobs", [[f"{rows + 1:06d}{BODY}"]])
    pump([*live, stopper], token, timeout=10)
    for r in [*live, stopper]:
        r.sock.close()


def test_many_concurrent_replays_of_the_same_rows(master, db_url) -> None:
    m = master(CONFIG, database=db_url)
    rows = 20_000
    for start in range(1, rows + 1, 5000):
        m.append("blobs", [[f"{i:06d}{BODY}"] for i in range(start, start + 5000)])
    replays = [Reader(m.host, m.port, f"replay{i}", b"REPLICATE blobs 0\n") for i in range(20)]
    pump(replays, rows, timeout=60)
    assert all(r.expected == rows + 1 for r in replays)
    for r in replays:
        r.sock.close()
