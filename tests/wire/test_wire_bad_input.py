"""Bad input on a real socket: every class gets ``ERROR <what was wrong>``; the
connection stays open where it can still be trusted, and the master keeps
serving everyone else."""

from __future__ import annotations

import socket
import time

import pytest

EVENT_ROW = ["$e", "!room", "m.type", None, None]

# (bytes sent, the ERROR line that must answer it) — the connection stays open.
RECOVERABLE = [
    ("unknown command", b"FOO bar\n", "ERROR unknown command 'FOO'"),
    (
        "RDATA from a client",
        b'RDATA events master 1 ["$e","!r","t",null,null]\n',
        "ERROR RDATA may not be sent by the client",
    ),
    ("POSITION from a client", b"POSITION events master 0 1\n", "ERROR POSITION may not be sent by the client"),
    ("SERVER from a client", b"SERVER impostor\n", "ERROR SERVER may not be sent by the client"),
    (
        "malformed arguments",
        b"REPLICATE events abc\n",
        "ERROR malformed REPLICATE: token must be a non-negative integer, got 'abc'",
    ),
    ("missing arguments", b"PING\n", "ERROR malformed PING: expected PING <unix_ms>"),
    ("bad JSON", b"RDATA events master 1 [1,\n", "ERROR malformed RDATA: bad row JSON"),
    ("JSON that is no array", b'RDATA events master 1 {"a":1}\n', "ERROR malformed RDATA: row JSON must be an array"),
    ("unknown stream", b"REPLICATE nosuch 0\n", "ERROR unknown stream 'nosuch' (streams: caches, events)"),
    ("token above the head", b"REPLICATE events 1000000\n", "ERROR token 1000000 is above the head "),
    ("invalid UTF-8", b"NAME caf\xc3\x28\n", "ERROR invalid UTF-8 at byte 8 of the line"),
    ("invalid UTF-8 command", b"\xff\xfe\xfd\n", "ERROR invalid UTF-8 at byte 0 of the line"),
    ("bad option", b"OPTIONS ts \x01\n", "ERROR malformed OPTIONS: option must be one word of printable ASCII"),
]


@pytest.fixture
def served(master):
    """A master with two events rows and an observer that follows every stream."""
    m = master("protocol:\n  max_line_bytes: 1024\n")
    m.append("events", [EVENT_ROW, EVENT_ROW])
    observer = m.connect()
    observer.handshake()
    observer.send("NAME observer", "REPLICATE events 0")
    assert observer.next_command() == "POSITION events master 0 0"
    assert observer.next_command().startswith("RDATA events writer 1 ")
    assert observer.next_command().startswith("RDATA events writer 2 ")
    return m, observer


def assert_master_serves(m, observer, expect_token: int) -> None:
    """The observer still receives live rows and a new client gets a handshake."""
    (token,) = m.append("events", [EVENT_ROW])
    assert token == expect_token
    assert observer.next_command(timeout=3.0).startswith(f"RDATA events writer {token} ")
    fresh = m.connect()
    fresh.handshake()
    fresh.send("REPLICATE caches 0")
    assert fresh.next_command() == "POSITION caches master 0 0"
    fresh.close()


def test_each_bad_input_gets_error_and_the_connection_stays_open(served) -> None:
    m, observer = served
    client = m.connect()
    client.handshake()
    for _i, (what, data, error) in enumerate(RECOVERABLE):
        client.send_raw(data)
        line = client.next_command()
        assert line.startswith(error), f"{what}: {line!r}"
        # the same connection still works
        client.send("REPLICATE caches 0")
        assert client.next_command() == "POSITION caches master 0 0", what
    assert_master_serves(m, observer, expect_token=3)


def test_master_keeps_serving_after_each_bad_input_class(served) -> None:
    m, observer = served
    for i, (what, data, error) in enumerate(RECOVERABLE):
        bad = m.connect()
        bad.handshake()
        bad.send_raw(data)
        assert bad.next_command().startswith(error), what
        bad.close()  # and the client goes away abruptly
        assert_master_serves(m, observer, expect_token=3 + i)


def test_token_above_the_head_names_the_head(served) -> None:
    m, _ = served
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 3")
    assert client.next_command() == "ERROR token 3 is above the head 2 of stream 'events'"
    client.send("REPLICATE events 2")  # the head itself is fine
    assert client.next_command() == "POSITION events master 2 2"


def test_several_errors_in_one_packet_each_get_an_answer(served) -> None:
    m, _ = served
    client = m.connect()
    client.handshake()
    client.send_raw(b"A\nB\n\n  \nC\r\nREPLICATE caches 0\n")
    assert [client.next_command() for _ in range(4)] == [
        "ERROR unknown command 'A'",
        "ERROR unknown command 'B'",
        "ERROR unknown command 'C'",
        "POSITION caches master 0 0",
    ]


def test_line_at_the_configured_limit_is_accepted(served) -> None:
    m, _ = served
    client = m.connect()
    client.handshake()
    # ERROR from a client is logged, not answered (a NAME is capped at master.max_name_bytes).
    message = "n" * (1024 - len("ERROR "))
    client.send(f"ERROR {message}", "REPLICATE caches 0")
    assert client.next_command() == "POSITION caches master 0 0"


def test_over_long_line_gets_error_and_close(served) -> None:
    m, observer = served
    for i, size in enumerate([1025, 5000, 300_000]):
        client = m.connect()
        client.handshake()
        try:
            client.send_raw(b"NAME " + b"n" * (size - 5) + b"\nREPLICATE\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the master may close before it has read everything
        lines = client.wait_closed()
        assert [line for line in lines if not line.startswith("PING ")] == [lines[-1]], size
        assert lines[-1].startswith("ERROR line too long"), size
        assert "the limit is 1024" in lines[-1]
        assert_master_serves(m, observer, expect_token=3 + i)


def test_over_long_line_without_newline_gets_error_and_close(served) -> None:
    m, observer = served
    client = m.connect()
    client.handshake()
    client.send_raw(b"x" * 3000)  # never a newline
    lines = client.wait_closed()
    assert lines[-1].startswith("ERROR line too long")
    assert_master_serves(m, observer, expect_token=3)


def test_default_line_limit_is_64_kib(master) -> None:
    m = master()
    ok = m.connect()
    ok.handshake()
    ok.send("ERROR " + "n" * (65536 - 6), "REPLICATE caches 0")
    assert ok.next_command() == "POSITION caches master 0 0"
    too_long = m.connect()
    too_long.handshake()
    too_long.send_raw(b"NAME " + b"n" * (65537 - 5) + b"\n")
    lines = too_long.wait_closed()
    assert lines[-1].startswith("ERROR line too long") and "65536" in lines[-1]


def test_master_keeps_serving_after_clients_are_dropped(served) -> None:
    m, observer = served
    # a client that resets its connection in the middle of a line
    rude = socket.create_connection((m.host, m.port))
    rude.sendall(b"REPLICATE ev")
    rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    rude.close()  # RST
    # a client dropped by the master for an over-long line
    dropped = m.connect()
    dropped.handshake()
    dropped.send_raw(b"y" * 2000 + b"\n")
    assert dropped.wait_closed()[-1].startswith("ERROR line too long")
    # a client that replicates and then vanishes while rows are flowing
    gone = m.connect()
    gone.send("REPLICATE events 0")
    gone.close()
    m.append("events", [EVENT_ROW] * 50)
    assert [observer.next_command(timeout=3.0).split(" ")[3] for _ in range(50)] == [str(t) for t in range(3, 53)]
    assert_master_serves(m, observer, expect_token=53)
    assert m.alive()
    assert "Traceback" not in m.log()


def test_connection_is_kept_for_a_slow_typist(master) -> None:
    """Bytes trickling in one at a time, as from a person in telnet, form one command."""
    m = master()
    client = m.connect()
    client.handshake()
    for byte in b"REPLICATE caches 0\r\n":
        client.send_raw(bytes([byte]))
        time.sleep(0.002)  # pacing the typist, not synchronization
    assert client.next_command() == "POSITION caches master 0 0"
