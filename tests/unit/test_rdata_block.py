"""The client's block parser: whole buffers of RDATA lines in one call, with
exactly the per-line parser's answers (and its errors) for everything else."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.testing import MemoryReactorClock, StringTransport

from replication.client import ClientProtocol, ReplicationHandler
from replication.commands import RdataCommand, parse_line, parse_rdata_block
from replication.protocol import ProtocolConfig

GOOD = [
    b'RDATA events w1 1 ["$a","!r",null]',
    b"RDATA events w1 batch [1]",
    b"RDATA events w1 batch [2]",
    b"RDATA events w1 7 [3]\r",
    b'RDATA caches m 0 ["c",["k"],5]',
    b"RDATA events w1 123456789012345678 []",
    b"RDATA events w1 8  [4]",
    b'RDATA events w1 9 ["a\\nRDATA events w1 10 [5]"]',  # a line start, escaped inside a string
]
BAD = [
    b"RDATA events w1 01 [1]",  # leading zero
    b"RDATA events w1 x [1]",
    b"RDATA events w1 9 {}",  # not an array
    b"RDATA events w1 9 [1",
    b"RDATA events w1 9 [1],[2]",
    b"RDATA events w1 9 [1]],[[2",
    b"RDATA events 9 [1]",
    b'RDATA ev"ents w1 9 [1]',  # a name the block parser leaves to the per-line path
    b"RDATA events w2 9 [1]",  # another instance
]


def test_a_block_of_good_lines_parses_like_each_line() -> None:
    good = [line for line in GOOD if b" events w1 " in line and b"  " not in line]
    parsed = parse_rdata_block(b"\n".join(good) + b"\n", 65536)
    assert parsed is not None
    stream, instance, tokens, rows = parsed
    for line, position, row in zip(good, tokens, rows, strict=True):
        command = parse_line(line.decode().strip())
        assert isinstance(command, RdataCommand)
        expected = (command.stream, command.instance, command.token, command.row)
        assert expected == (stream, instance, None if position == b"batch" else int(position), row)


def test_a_run_of_several_streams_is_left_to_the_line_by_line_path() -> None:
    assert parse_rdata_block(b"\n".join(GOOD) + b"\n", 65536) is None


@pytest.mark.parametrize("bad", BAD)
def test_any_bad_line_sends_the_block_to_the_line_by_line_path(bad: bytes) -> None:
    assert parse_rdata_block(b"\n".join([GOOD[0], bad, GOOD[1]]) + b"\n", 65536) is None


def test_a_line_over_the_limit_sends_the_block_to_the_line_by_line_path() -> None:
    line = b'RDATA events w1 1 ["' + b"x" * 100 + b'"]'
    assert parse_rdata_block(line + b"\n", len(line)) is not None
    assert parse_rdata_block(line + b"\n", len(line) - 1) is None


class Recorder(ReplicationHandler):
    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, rows: list) -> None:
        self.events.append((stream, instance, token, rows))

    def on_error(self, client: ClientProtocol, message: str) -> None:
        self.events.append(("ERROR", message))


def feed(chunks: list[bytes]) -> tuple[list[Any], bytes]:
    handler = Recorder()
    proto = ClientProtocol(handler, "w", ProtocolConfig(max_line_bytes=200), MemoryReactorClock())
    transport = StringTransport()
    proto.makeConnection(transport)
    transport.clear()
    for chunk in chunks:
        proto.dataReceived(chunk)
    return handler.events, transport.value()


def test_any_split_of_the_stream_gives_the_same_rows() -> None:
    lines = [
        b"POSITION events m 0 0",
        b"POSITION caches m 0 0",
        *GOOD,
        b"PING 1700000000000",
        b"RDATA events w1 batch [9]",
        b"RDATA events w1 40 [10]",
        b"",
        b"RDATA nostream w1 41 [11]",  # before its POSITION: dropped
        b"RDATA events w1 41 [12]",
    ]
    data = b"\n".join(lines) + b"\n"
    expected, expected_sent = feed([line + b"\n" for line in lines])
    assert [e[2] for e in expected] == [1, 7, 0, 123456789012345678, 8, 9, 40, 41]
    assert expected[-2][3] == [[9], [10]]  # the batch and its last row, together
    assert b"ERROR" not in expected_sent
    for size in (1, 7, 64, len(data)):
        got, sent = feed([data[i : i + size] for i in range(0, len(data), size)])
        assert got == expected, size
        assert sent == expected_sent, size


@pytest.mark.parametrize("bad", BAD[:3])
def test_a_bad_line_in_a_run_stops_at_that_line_whatever_the_split(bad: bytes) -> None:
    lines = [b"POSITION events m 0 0", GOOD[0], bad, b"RDATA events w1 50 [1]"]
    data = b"\n".join(lines) + b"\n"
    expected, expected_sent = feed([line + b"\n" for line in lines])
    assert [e[2] for e in expected] == [1]  # nothing after the line it cannot use
    assert expected_sent.count(b"ERROR ") == 1
    for size in (1, 5, len(data)):
        got, sent = feed([data[i : i + size] for i in range(0, len(data), size)])
        assert (got, sent) == (expected, expected_sent), size


def test_the_per_name_split_patterns_stay_bounded() -> None:
    """A peer choosing ever new instance names cannot grow the parser's cache of patterns."""
    from replication import commands

    for i in range(3 * commands._LINE_TOKENS_MAX):
        parsed = parse_rdata_block(b"RDATA events w%d 1 [1]\nRDATA events w%d 2 [2]\n" % (i, i), 65536)
        assert parsed is not None and parsed[1] == f"w{i}" and parsed[2] == [b"1", b"2"]
        assert len(commands._LINE_TOKENS) <= commands._LINE_TOKENS_MAX


class RunRecorder(Recorder):
    """Takes runs of single-row tokens in one call, as the worker does."""

    def on_rows_run(self, client: ClientProtocol, stream: str, instance: str, tokens: list, rows: list) -> bool:
        self.events.append(("run", stream, instance, list(tokens), rows))
        return True


def _feed_runs(data: bytes) -> list[Any]:
    handler = RunRecorder()
    proto = ClientProtocol(handler, "w", ProtocolConfig(max_line_bytes=200), MemoryReactorClock())
    proto.makeConnection(StringTransport())
    proto.dataReceived(b"POSITION events m 0 0\n")
    proto.dataReceived(data)
    return handler.events


def test_a_buffer_of_only_rdata_lines_is_one_run_and_other_lines_split_it() -> None:
    lines = [b"RDATA events w1 %d [%d]" % (n, n) for n in range(1, 5)]
    assert _feed_runs(b"\n".join(lines) + b"\n") == [
        ("run", "events", "w1", [b"1", b"2", b"3", b"4"], [[1], [2], [3], [4]])
    ]
    # A line of another command inside: two runs around it, nothing lost or reordered.
    mixed = [*lines[:2], b"PING 1700000000000", *lines[2:]]
    assert _feed_runs(b"\n".join(mixed) + b"\n") == [
        ("run", "events", "w1", [b"1", b"2"], [[1], [2]]),
        ("run", "events", "w1", [b"3", b"4"], [[3], [4]]),
    ]
    # An RDATA look-alike inside a JSON string is not a line start: still one run.
    tricky = [lines[0], b'RDATA events w1 2 ["x\\nRDATA events w1 9 [9]"]']
    assert _feed_runs(b"\n".join(tricky) + b"\n") == [
        ("run", "events", "w1", [b"1", b"2"], [[1], ["x\nRDATA events w1 9 [9]"]])
    ]
