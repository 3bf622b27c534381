"""The client's one-run detection (a buffer of one stream's RDATA lines tried whole, its lines checked
in the split's pass) does exactly what the run-by-run parse it replaced did, on arbitrary input:
the same rows to the handler, the same ERROR sent, the same close.

The replaced code is kept here, as it was, as the reference."""

from __future__ import annotations

import re
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.testing import MemoryReactorClock, StringTransport

from replication.client import _BATCH, ClientProtocol, ReplicationHandler
from replication.commands import RDATA_RUN, MalformedCommand, _line_token, _word, one_rdata_run, parse_rdata_block
from replication.protocol import LineCommandProtocol, ProtocolConfig
from replication.stats import STATS
from storage.limits import MAX_BATCH_ROWS

MAX_LINE = 200


def reference_parse_rdata_block(block: bytes, max_line_bytes: int) -> tuple[str, str, list[bytes], list[Any]] | None:
    """``parse_rdata_block`` before the one-run detection (lines counted, then matched)."""
    lines = block.count(b"\n")
    if len(block) > max_line_bytes and max(map(len, block.split(b"\n"))) > max_line_bytes:
        return None
    first_space = block.find(b" ", 6)
    second_space = block.find(b" ", first_space + 1)
    if first_space < 0 or second_space < 0 or second_space > block.find(b"\n"):
        return None
    prefix = b"\n" + block[: second_space + 1]
    try:
        stream = _word(block[6:first_space].decode("ascii"), "stream")
        instance = _word(block[first_space + 1 : second_space].decode("ascii"), "instance")
    except (UnicodeDecodeError, MalformedCommand):
        return None
    parts = _line_token(prefix).split(b"\n" + block)
    tokens = parts[1::2]
    if parts[0] or len(tokens) != lines:
        return None
    try:
        rows = orjson.loads(b"[" + b",".join(parts[2::2]) + b"]")
    except orjson.JSONDecodeError:
        return None
    if len(rows) != lines or not all(type(row) is list for row in rows):
        return None
    return stream, instance, tokens, rows


class ReferenceClient(ClientProtocol):
    """The client's block parse before the one-run detection: every block through RDATA_RUN."""

    def _lines_received(self, block: bytes) -> None:
        done = 0
        for run in RDATA_RUN.finditer(block):
            start, end = run.span()
            if start > done:
                LineCommandProtocol._lines_received(self, block[done:start])
            if self._closing:
                return
            self._reference_run(block[start:end] if start or end < len(block) else block)
            if self._closing:
                return
            done = end
        if done < len(block):
            LineCommandProtocol._lines_received(self, block[done:] if done else block)

    def _reference_run(self, run: bytes) -> None:
        parsed = reference_parse_rdata_block(run, self.config.max_line_bytes)
        if parsed is None:
            LineCommandProtocol._lines_received(self, run)
            return
        stream, instance, tokens, entries = parsed
        STATS.received["RDATA"] += len(entries)
        if self.options_pending:
            self._settle_options(frozenset(), "the master sent rows without acknowledging OPTIONS")
        if stream not in self.positioned:
            return
        pending = self._pending_batch.pop(stream, None)
        if (
            pending is None
            and _BATCH not in tokens
            and self.handler.on_rows_run(self, stream, instance, tokens, entries)
        ):
            return
        on_rows = self.handler.on_rows
        for position, row in zip(tokens, entries, strict=True):
            if position == _BATCH:
                if pending is None:
                    pending = [row]
                else:
                    pending.append(row)
                    if len(pending) > MAX_BATCH_ROWS:
                        self._batch_too_long(stream)
                        return
                continue
            if pending is None:
                rows = [row]
            else:
                pending.append(row)
                rows = pending
                pending = None
            on_rows(self, stream, instance, int(position), rows)
            if self._closing:
                return
            if stream not in self.positioned:
                return
        if pending is not None:
            self._pending_batch[stream] = pending


class Recorder(ReplicationHandler):
    def __init__(self, runs: bool) -> None:
        self.runs = runs
        self.events: list[Any] = []

    def on_position(self, client: ClientProtocol, command: Any) -> None:
        self.events.append(("POSITION", command))

    def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, rows: list) -> None:
        self.events.append((stream, instance, token, rows))

    def on_rows_run(self, client: ClientProtocol, stream: str, instance: str, tokens: list, rows: list) -> bool:
        if self.runs:
            self.events.append(("run", stream, instance, list(tokens), rows))
        return self.runs

    def on_error(self, client: ClientProtocol, message: str) -> None:
        self.events.append(("ERROR", message))


def run(cls: type[ClientProtocol], chunks: list[bytes], runs: bool, options: bool) -> Any:
    handler = Recorder(runs)
    proto = cls(handler, "w", ProtocolConfig(max_line_bytes=MAX_LINE), MemoryReactorClock(), with_ts=options)
    transport = StringTransport()
    proto.makeConnection(transport)
    for chunk in chunks:
        proto.dataReceived(chunk)
    return handler.events, transport.value(), proto._closing, proto.close_reason, proto.acknowledged


# Mostly one stream and instance, so that runs form; the rest splits them.
STREAMS = st.sampled_from([b"events"] * 6 + [b"caches", b"nostream", b"ev\xc3\xa9", b""])
INSTANCES = st.sampled_from([b"w1"] * 4 + [b"w2", b"m"])
TOKENS = st.one_of(
    st.integers(0, 10**18 - 1).map(lambda n: str(n).encode()),
    st.just(b"batch"),
    st.sampled_from([b"01", b"x", b"1234567890123456789", b"-1", b"", b"batch2"]),
)
BODIES = st.one_of(
    st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.none()), max_size=3).map(orjson.dumps),
    st.just(b'["a\\nRDATA events w1 10 [5]"]'),  # a line start, escaped inside a string
    st.sampled_from(
        [
            b"{}",
            b"[1",
            b"[1],[2]",
            b"[1]],[[2",
            b"",
            b"[" + b"x" * MAX_LINE + b"]",
            b"[1]\r",
            b"[\xff]",
            b"[1,",
            b"[[1]",
        ]
    ),
)


@st.composite
def lines(draw: Any) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind <= 5:
        spaces = b"  " if draw(st.integers(0, 19)) == 0 else b" "
        return b"RDATA %s %s %s%s%s" % (draw(STREAMS), draw(INSTANCES), draw(TOKENS), spaces, draw(BODIES))
    if kind == 6:
        return b"POSITION %s m %d %d" % (draw(STREAMS), draw(st.integers(0, 5)), draw(st.integers(0, 10**6)))
    other = [b"PING 1700000000000", b"", b"POSITION events", b"OPTIONS ts", b"TICK events 5", b"NOPE x", b"RDATA"]
    continued = [b"2]", b"]", b"[3]", b",[4]", b"\r"]  # lines that continue a body a line before left open
    return draw(st.sampled_from(other + continued))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    st.lists(lines(), max_size=12),
    st.booleans(),
    st.booleans(),
    st.lists(st.integers(1, 300), min_size=1, max_size=5),
    st.booleans(),
)
def test_one_run_detection_does_what_the_run_by_run_parse_did(
    body: list[bytes], positioned: bool, runs: bool, sizes: list[int], options: bool
) -> None:
    head = [b"POSITION events m 0 0", b"POSITION caches m 0 0"] if positioned else []
    data = b"\n".join([*head, *body]) + b"\n"
    chunks: list[bytes] = []
    i = 0
    while i < len(data):
        size = sizes[len(chunks) % len(sizes)]
        chunks.append(data[i : i + size])
        i += size
    got = run(ClientProtocol, chunks, runs, options)
    assert got == run(ReferenceClient, chunks, runs, options)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lines(), min_size=1, max_size=12))
def test_parse_rdata_block_answers_as_before_on_any_block(body: list[bytes]) -> None:
    block = b"\n".join(body) + b"\n"
    if block.startswith(b"RDATA "):
        assert parse_rdata_block(block, MAX_LINE) == reference_parse_rdata_block(block, MAX_LINE)
    if one_rdata_run(block):
        first = block[: block.index(b" ", block.index(b" ", 6) + 1) + 1]
        assert body[-1].startswith(first)


def test_a_block_of_one_streams_lines_is_tried_whole_and_anything_else_run_by_run() -> None:
    good = b"".join(b"RDATA events w1 %d [%d]\n" % (n, n) for n in range(1, 6))
    assert one_rdata_run(good)
    assert not one_rdata_run(good + b"PING 1\n")
    assert not one_rdata_run(good + b"RDATA events w2 9 [9]\n")
    assert not one_rdata_run(b"PING 1\n" + good)
    # First and last lines alike, a line between them another command's: not one run when parsed.
    mixed = good + b"PING 1\n" + good
    assert one_rdata_run(mixed) and parse_rdata_block(mixed, 65536) is None
    events, *_ = run(ClientProtocol, [b"POSITION events m 0 0\n" + mixed], True, False)
    assert [e[3] for e in events[1:]] == [[b"1", b"2", b"3", b"4", b"5"]] * 2
    assert re.fullmatch(rb"(RDATA [^\n]*\n)+", good)
