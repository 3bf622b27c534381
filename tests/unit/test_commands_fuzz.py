"""Property-based tests of the command parser (``replication/commands.py``) and the client's framing.

Every command survives ``parse(serialize(command))``; any text, any bytes,
and any arguments after a known command name either parse or raise the
parser's own errors (``UnknownCommand``, ``MalformedCommand``), never anything
else; the receiving fast path agrees with the full parser; and a client fed
random bytes never raises, whatever it does with them.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.testing import MemoryReactorClock, StringTransport

import replication.timeline_commands  # noqa: F401  (registers the timeline's commands in COMMAND_CLASSES)
from replication.client import ClientProtocol, ReplicationHandler
from replication.commands import (
    COMMAND_CLASSES,
    KNOWN_OPTIONS,
    MAX_TOKEN,
    AuthCommand,
    ClearUserSyncCommand,
    Command,
    ErrorCommand,
    FederationAckCommand,
    MalformedCommand,
    NameCommand,
    OptionsCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    RemovePusherCommand,
    ReplicateCommand,
    ServerCommand,
    TickCommand,
    UnknownCommand,
    UserSyncCommand,
    parse_line,
    parse_rdata_fast,
    parse_tick_fast,
)
from replication.protocol import ProtocolConfig

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

words = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
tokens = st.integers(min_value=0, max_value=MAX_TOKEN)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
# Free text of one line (ERROR messages, push keys): anything but line breaks.
line_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\n\r"), max_size=80)


def _nonblank(text: str) -> bool:
    return bool(text.strip())


commands: st.SearchStrategy[Command] = st.one_of(
    st.builds(ServerCommand, words),
    st.builds(PingCommand, tokens),
    st.builds(NameCommand, words),
    st.just(ReplicateCommand()),
    st.builds(ReplicateCommand, words, tokens),
    st.builds(
        lambda s, i, a, b: PositionCommand(s, i, min(a, b), max(a, b)),
        words,
        words,
        tokens,
        tokens,
    ),
    st.builds(RdataCommand, words, words, st.none() | tokens, st.lists(json_values, max_size=6)),
    st.builds(ErrorCommand, line_text.filter(_nonblank).map(lambda t: " ".join(t.split()))),
    st.builds(UserSyncCommand, words, words, st.booleans(), tokens),
    st.builds(ClearUserSyncCommand, words),
    st.builds(FederationAckCommand, words, tokens),
    st.builds(RemovePusherCommand, words, line_text.filter(_nonblank), words),
    st.builds(RemoteServerUpCommand, words),
    st.builds(AuthCommand, words),
    st.builds(OptionsCommand, st.frozensets(st.sampled_from(sorted(KNOWN_OPTIONS)), min_size=1)),
)


@FUZZ
@given(commands)
def test_every_command_round_trips(command: Command) -> None:
    line = command.to_line()
    assert "\n" not in line
    assert parse_line(line) == command
    wire = command.encode()
    assert wire.endswith(b"\n") and wire.count(b"\n") == 1
    assert parse_line(wire[:-1].decode("utf-8")) == command


@FUZZ
@given(st.builds(RdataCommand, words, words, st.none() | tokens, st.lists(json_values, max_size=6)))
def test_the_rdata_fast_path_agrees_with_the_parser(command: RdataCommand) -> None:
    raw = command.encode()[:-1]
    parse_line(raw.decode())  # the full parser first: it marks the names as seen
    fast = parse_rdata_fast(raw)
    # None sends the line to the full parser (a 19-digit token, names not cached): never a different answer.
    assert fast is None or fast == (command.stream, command.instance, command.token, command.row)
    parse_line('RDATA events master 12 ["a",1]')
    assert parse_rdata_fast(b'RDATA events master 12 ["a",1]') == ("events", "master", 12, ["a", 1])


def _parses_or_refuses(line: str) -> Command | None:
    try:
        return parse_line(line)
    except (UnknownCommand, MalformedCommand) as e:
        assert str(e)
        return None


@FUZZ
@given(st.text(max_size=200))
def test_any_text_parses_or_is_refused_by_the_parser(text: str) -> None:
    _parses_or_refuses(text)


@FUZZ
@given(st.sampled_from(sorted(COMMAND_CLASSES)), st.text(max_size=200))
def test_any_arguments_after_a_known_name_parse_or_are_refused(name: str, args: str) -> None:
    command = _parses_or_refuses(f"{name} {args}")
    if command is not None:
        assert type(command) is COMMAND_CLASSES[name]
        # What parsed serializes to a line that parses back to that same line.
        assert parse_line(command.to_line()).to_line() == command.to_line()


@FUZZ
@given(
    st.sampled_from(sorted(COMMAND_CLASSES)),
    st.lists(st.one_of(words, tokens.map(str), st.sampled_from(["", " ", "batch", "-1", "01", "[", "[]"])), max_size=6),
)
def test_near_miss_arguments_parse_or_are_refused(name: str, parts: list[str]) -> None:
    command = _parses_or_refuses(" ".join([name, *parts]))
    if command is not None:
        assert parse_line(command.to_line()).to_line() == command.to_line()


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_after_rdata_never_crash_the_fast_path(data: bytes) -> None:
    for raw in (data, b"RDATA " + data, b"RDATA events master " + data):
        result = parse_rdata_fast(raw)
        if result is not None:
            assert isinstance(result[3], list)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        _parses_or_refuses(text.strip())


def test_deep_json_and_huge_numbers_are_the_parsers_errors() -> None:
    for row in (b"[" * 5000 + b"]" * 5000, b"[1e999999]", b"[" + b"9" * 5000 + b"]", b'["\\ud800"]'):
        line = b"RDATA events master 1 " + row
        parsed = parse_rdata_fast(line)
        assert parsed is None or isinstance(parsed[3], list)
        _parses_or_refuses(line.decode())


class _Handler(ReplicationHandler):
    def __init__(self) -> None:
        self.rows: list[Any] = []

    def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, rows: list[list[Any]]) -> None:
        self.rows.append((stream, token, rows))


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=20))
def test_a_client_fed_random_bytes_never_raises(chunks: list[bytes]) -> None:
    clock = MemoryReactorClock()
    handler = _Handler()
    proto = ClientProtocol(handler, "fuzz", ProtocolConfig(max_line_bytes=1024), clock)
    transport = StringTransport()
    proto.makeConnection(transport)
    proto.dataReceived(b"POSITION events master 0 0\n")
    for chunk in chunks:
        proto.dataReceived(chunk)
        if proto.close_reason is not None:
            # It closed rather than skip a line it could not use, and said why.
            assert transport.value().rstrip(b"\n").split(b"\n")[-1].startswith(b"ERROR ")
            break
    clock.advance(60)
    proto.connectionLost(None)


@FUZZ
@given(st.lists(json_values, max_size=5), st.integers(min_value=1, max_value=20))
def test_a_client_reassembles_lines_split_anywhere(row: list, pieces: int) -> None:
    clock = MemoryReactorClock()
    handler = _Handler()
    proto = ClientProtocol(handler, "fuzz", ProtocolConfig(), clock)
    proto.makeConnection(StringTransport())
    data = b"POSITION s1 m 0 0\n" + RdataCommand("s1", "m", 7, row).encode()
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        proto.dataReceived(data[i : i + step])
    assert handler.rows == [("s1", 7, [orjson.loads(orjson.dumps(row))])]
    assert proto.close_reason is None
    proto.connectionLost(None)


@FUZZ
@given(words, tokens, tokens)
def test_the_tick_fast_path_agrees_with_the_parser(stream: str, token: int, ts: int) -> None:
    command = TickCommand(stream, token, ts)
    raw = command.encode()[:-1]
    assert parse_line(raw.decode()) == command  # the full parser first: it marks the name as seen
    fast = parse_tick_fast(raw)
    # None sends the line to the full parser (a 19-digit token): never a different answer.
    assert fast is None or fast == command
    assert parse_tick_fast(f"TICK {stream} 12 34".encode()) == TickCommand(stream, 12, 34)


@FUZZ
@given(st.binary(max_size=60))
def test_the_tick_fast_path_takes_no_line_the_parser_refuses(tail: bytes) -> None:
    parse_line("TICK events 1 2")
    raw = b"TICK events " + tail
    fast = parse_tick_fast(raw)
    if fast is not None:
        assert parse_line(raw.decode()) == fast


def _parsed_or_none(raw: bytes) -> Command | None:
    try:
        return parse_line(raw.decode())
    except (MalformedCommand, UnicodeDecodeError):
        return None


@FUZZ
@given(st.integers(min_value=0, max_value=10**20), st.integers(min_value=0, max_value=10**20), st.booleans())
def test_the_tick_fast_path_agrees_with_the_parser_on_tokens_at_the_edges(token: int, ts: int, zero: bool) -> None:
    # Up to 21 digits, around MAX_TOKEN (19), with and without a leading zero.
    parse_line("TICK events 1 2")
    raw = f"TICK events {'0' if zero else ''}{token} {ts}".encode()
    fast = parse_tick_fast(raw)
    assert fast is None or fast == _parsed_or_none(raw)


def test_the_tick_fast_path_refuses_each_line_the_parser_refuses() -> None:
    parse_line("TICK events 1 2")  # the stream's name seen and checked once
    for bad in (
        b"TICK events 01 2",
        b"TICK events 1 2 3",
        b"TICK events 1  2",
        b"TICK events 1 2\r",
        b"TICK events -1 2",
        b"TICK events 1 9223372036854775808",
        b"TICK events 1 99999999999999999999",
        b"TICK ev\x01nts 1 2",
        "TICK events \u0661 2".encode(),
        b"TICK events 1",
    ):
        assert _parsed_or_none(bad) is None, bad
        assert parse_tick_fast(bad) is None, bad
