"""Congestion on real sockets: a client that stops reading costs the master
bounded memory and is disconnected after ``protocol.max_pause``; a slow reader
that keeps reading gets every row; everyone else is served meanwhile."""

from __future__ import annotations

import socket
import time

import orjson

CONFIG = """
streams:
  blobs:
    columns:
      - {name: body, type: text}
master:
  # The window of recent rows is bounded by recent_bytes on its own (tests in
  # test_wire_window.py); kept small here so that what is measured is what a
  # stalled connection costs.
  recent_bytes: 2097152
protocol:
  max_pause: 1.0
  close_grace: 0.5
  catchup_rows: 500
"""
ROWS = 40_000
BODY = "x" * 1000  # 40 MB of rows in all


def test_stalled_client_costs_bounded_memory_and_is_dropped_after_max_pause(master) -> None:
    m = master(CONFIG)
    for start in range(0, ROWS, 10_000):
        m.append("blobs", [[f"{i:06d}{BODY}"] for i in range(start, start + 10_000)])
    observer = m.connect()
    observer.handshake()
    observer.send("REPLICATE events 0")
    assert observer.next_command() == "POSITION events master 0 0"
    baseline_kib = m.memory_kib("VmHWM")

    # A client that asks for the whole stream and never reads.
    stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    stalled.connect((m.host, m.port))
    stalled.sendall(b"NAME stalled\nREPLICATE blobs 0\n")
    asked = time.monotonic()

    # The master keeps serving others meanwhile: live rows arrive promptly.
    for i in range(3):
        (token,) = m.append("events", [[f"$e{i}", "!r", "t", None, None]])
        assert observer.next_command(timeout=2.0).startswith(f"RDATA events writer {token} ")

    # It drops the stalled client with ERROR once max_pause has passed.
    log = m.wait_for_log("client stopped reading: paused for more than 1 s", timeout=10.0)
    dropped_after = time.monotonic() - asked
    assert 1.0 <= dropped_after < 8.0, dropped_after
    assert "stalled@" in log.split("client stopped reading")[0].splitlines()[-1]

    # Bounded memory: far less than the 40 MB the client asked for.
    grown_kib = m.memory_kib("VmHWM") - baseline_kib
    assert grown_kib < 20 * 1024, f"master peak memory grew by {grown_kib} KiB"

    # ... and the connection really ends (after close_grace at the latest).
    stalled.settimeout(5.0)
    received = 0
    deadline = time.monotonic() + 10.0
    try:
        while time.monotonic() < deadline:
            data = stalled.recv(1 << 20)
            if not data:
                break
            received += len(data)
    except ConnectionResetError:
        pass
    else:
        assert time.monotonic() < deadline, "connection still open"
    finally:
        stalled.close()
    assert received < ROWS * len(BODY)  # it was nowhere near all of it

    # Still serving: a new client replays the head of the stream.
    fresh = m.connect()
    fresh.handshake()
    fresh.send(f"REPLICATE blobs {ROWS - 2}")
    assert fresh.next_command() == f"POSITION blobs master {ROWS - 2} {ROWS - 2}"
    assert fresh.next_command().startswith(f"RDATA blobs writer {ROWS - 1} ")
    assert m.alive()


def test_slow_reader_that_keeps_reading_gets_every_row(master) -> None:
    m = master(CONFIG)
    count = 6_000
    m.append("blobs", [[f"{i:06d}{BODY}"] for i in range(1, count + 1)])
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    slow.connect((m.host, m.port))
    slow.sendall(b"NAME slow\nREPLICATE blobs 0\n")
    slow.settimeout(5.0)
    buffer = b""
    expected = 1
    deadline = time.monotonic() + 30.0
    try:
        while expected <= count:
            assert time.monotonic() < deadline, f"only {expected - 1} rows in time"
            data = slow.recv(64 * 1024)
            time.sleep(0.005)  # pacing a slow reader (~1.5 s in all, paused many times), not synchronization
            assert data, f"dropped after {expected - 1} rows"
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"RDATA "):
                    _, _stream, _, token, row = line.split(b" ", 4)
                    assert int(token) == expected
                    assert orjson.loads(row) == [f"{expected:06d}{BODY}"]
                    expected += 1
                else:
                    assert not line.startswith(b"ERROR"), line
    finally:
        slow.close()
    assert "client stopped reading" not in m.log()
