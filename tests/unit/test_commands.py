"""The command classes: parse/serialize round trips, malformed arguments, directions."""

from __future__ import annotations

import pytest

import replication.timeline_commands  # noqa: F401  (registers the timeline's commands in COMMAND_CLASSES)
from replication.commands import (
    CLIENT_COMMANDS,
    COMMAND_CLASSES,
    SERVER_COMMANDS,
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
    encode_rdata,
    parse_line,
)

TIMELINE_NAMES = {
    "TIMELINE",
    "EXTEND",
    "RELEASE",
    "DELETE",
    "SCHEDULE",
    "MOVE",
    "CANCEL",
    "LEASE",
    "ACK",
    "NACK",
}

# (line on the wire, the command it parses to)
ROUND_TRIPS = [
    ("SERVER master.example.com", ServerCommand("master.example.com")),
    ("PING 1700000000123", PingCommand(1700000000123)),
    ("PING 0", PingCommand(0)),
    ("NAME worker-1", NameCommand("worker-1")),
    ("REPLICATE", ReplicateCommand()),
    ("REPLICATE events 42", ReplicateCommand("events", 42)),
    ("REPLICATE events 0", ReplicateCommand("events", 0)),
    ("REPLICATE events @1700000000123", ReplicateCommand("events", None, 1700000000123)),
    ("TICK events 12 470655961688440832", TickCommand("events", 12, 470655961688440832)),
    ("POSITION events master 5 9", PositionCommand("events", "master", 5, 9)),
    ("POSITION caches master 7 7", PositionCommand("caches", "master", 7, 7)),
    (
        'RDATA events master 12 ["$ev:x","!room:x","m.room.message",null,null]',
        RdataCommand("events", "master", 12, ["$ev:x", "!room:x", "m.room.message", None, None]),
    ),
    (
        'RDATA events w1 batch ["a b c",1,2.5,true,{"k":[1,2]}]',
        RdataCommand("events", "w1", None, ["a b c", 1, 2.5, True, {"k": [1, 2]}]),
    ),
    ("RDATA caches master 3 []", RdataCommand("caches", "master", 3, [])),
    ("ERROR unknown command 'FOO'", ErrorCommand("unknown command 'FOO'")),
    (
        "USER_SYNC worker1 @alice:example.com start 1700000000000",
        UserSyncCommand("worker1", "@alice:example.com", True, 1700000000000),
    ),
    ("USER_SYNC worker1 @bob:example.com end 0", UserSyncCommand("worker1", "@bob:example.com", False, 0)),
    ("CLEAR_USER_SYNC worker1", ClearUserSyncCommand("worker1")),
    ("FEDERATION_ACK federation_sender 1234", FederationAckCommand("federation_sender", 1234)),
    (
        "REMOVE_PUSHER m.http some_key @alice:example.com",
        RemovePusherCommand("m.http", "some_key", "@alice:example.com"),
    ),
    ("REMOVE_PUSHER m.http a key with spaces @alice:x", RemovePusherCommand("m.http", "a key with spaces", "@alice:x")),
    ("REMOTE_SERVER_UP example.org", RemoteServerUpCommand("example.org")),
    ("AUTH s3cret", AuthCommand("s3cret")),
    ("AUTH a secret with spaces", AuthCommand("a secret with spaces")),
    ("OPTIONS ts", OptionsCommand(frozenset({"ts"}))),
]


@pytest.mark.parametrize("line, command", ROUND_TRIPS, ids=[line[:40] for line, _ in ROUND_TRIPS])
def test_parse_and_serialize_round_trip(line: str, command: Command) -> None:
    parsed = parse_line(line)
    assert type(parsed) is type(command)
    assert parsed == command
    assert parsed.to_line() == line
    assert parsed.encode() == line.encode("utf-8") + b"\n"
    assert parse_line(parsed.to_line()) == parsed


def test_every_command_has_a_class_and_a_direction() -> None:
    expected = {
        "SERVER",
        "PING",
        "NAME",
        "REPLICATE",
        "POSITION",
        "RDATA",
        "ERROR",
        "USER_SYNC",
        "CLEAR_USER_SYNC",
        "FEDERATION_ACK",
        "REMOVE_PUSHER",
        "REMOTE_SERVER_UP",
        "AUTH",
        "OPTIONS",
        "TICK",
    } | TIMELINE_NAMES
    assert set(COMMAND_CLASSES) == expected
    for name, cls in COMMAND_CLASSES.items():
        assert name == cls.NAME
    assert expected == SERVER_COMMANDS | CLIENT_COMMANDS
    # every class is exercised by a round trip above (the timeline's in test_timeline_commands)
    assert {type(c).NAME for _, c in ROUND_TRIPS} == expected - TIMELINE_NAMES


def test_direction_sets_follow_the_protocol_table() -> None:
    assert {
        "SERVER",
        "PING",
        "POSITION",
        "RDATA",
        "ERROR",
        "REMOTE_SERVER_UP",
        "OPTIONS",
        "TICK",
        "LEASE",
        "ACK",
        "NACK",
    } == SERVER_COMMANDS
    assert {
        "PING",
        "NAME",
        "REPLICATE",
        "ERROR",
        "USER_SYNC",
        "CLEAR_USER_SYNC",
        "FEDERATION_ACK",
        "REMOVE_PUSHER",
        "REMOTE_SERVER_UP",
        "AUTH",
        "OPTIONS",
        "TIMELINE",
        "EXTEND",
        "RELEASE",
        "DELETE",
        "SCHEDULE",
        "MOVE",
        "CANCEL",
    } == CLIENT_COMMANDS
    # Sent by both sides: exactly those marked S,C in the table.
    # OPTIONS: the client asks, the master answers with what it accepted.
    assert {"PING", "ERROR", "REMOTE_SERVER_UP", "OPTIONS"} == SERVER_COMMANDS & CLIENT_COMMANDS
    # A client may never send what only the master sends.
    for name in ("SERVER", "POSITION", "RDATA", "TICK"):
        assert name not in CLIENT_COMMANDS
    for name in ("NAME", "REPLICATE", "USER_SYNC", "AUTH"):
        assert name not in SERVER_COMMANDS


def test_rdata_row_json_may_contain_spaces_but_serializes_on_one_line() -> None:
    command = RdataCommand("events", "master", 4, ["two\nlines", "a  b", {"x": "y z"}])
    line = command.to_line()
    assert "\n" not in line
    assert parse_line(line) == command
    assert command.encode().count(b"\n") == 1
    # parse accepts JSON with spaces after separators
    parsed = parse_line('RDATA events master 4 [1, "a b",  {"k": 2}]')
    assert parsed == RdataCommand("events", "master", 4, [1, "a b", {"k": 2}])


def test_encode_rdata_matches_the_command_class() -> None:
    assert encode_rdata("events", "w", 7, b'["a",null]') == b'RDATA events w 7 ["a",null]\n'
    assert encode_rdata("events", "w", None, b"[1]") == b"RDATA events w batch [1]\n"
    command = RdataCommand("events", "w", 7, ["a", None])
    assert command.encode() == encode_rdata("events", "w", 7, b'["a",null]')
    assert parse_line(command.encode().decode().rstrip("\n")) == command


def test_error_message_never_spans_lines() -> None:
    command = ErrorCommand("bad\nthing\r\nhappened")
    assert command.to_line() == "ERROR bad thing happened"
    assert parse_line(command.to_line()) == ErrorCommand("bad thing happened")


def test_replicate_without_arguments_is_plain_replicate() -> None:
    command = parse_line("REPLICATE")
    assert command == ReplicateCommand(None, None)
    assert command.to_line() == "REPLICATE"


def test_options_serialize_sorted_and_deduplicated() -> None:
    assert parse_line("OPTIONS ts ts") == OptionsCommand(frozenset({"ts"}))
    assert OptionsCommand(frozenset({"ts"})).to_line() == "OPTIONS ts"


def test_options_answer_names_only_known_options_possibly_none() -> None:
    asked, unknown = parse_line("OPTIONS live gzip ts"), parse_line("OPTIONS gzip")
    assert isinstance(asked, OptionsCommand) and isinstance(unknown, OptionsCommand)
    assert asked.accepted().to_line() == "OPTIONS live ts"
    assert unknown.accepted().to_line() == "OPTIONS"
    assert parse_line("OPTIONS") == OptionsCommand(frozenset())  # an answer that accepted nothing


def test_position_token_boundaries() -> None:
    top = 2**63 - 1
    assert parse_line(f"POSITION s i 0 {top}") == PositionCommand("s", "i", 0, top)
    with pytest.raises(MalformedCommand, match="new_token"):
        parse_line(f"POSITION s i 0 {top + 1}")


# (line, words the error message must contain)
MALFORMED = [
    ("SERVER", ["malformed SERVER", "SERVER <server_name>"]),
    ("SERVER two words", ["malformed SERVER", "server_name", "'two words'"]),
    ("PING", ["malformed PING", "PING <unix_ms>"]),
    ("PING abc", ["malformed PING", "unix_ms", "'abc'"]),
    ("PING -5", ["malformed PING", "unix_ms", "'-5'"]),
    ("PING 1.5", ["malformed PING", "unix_ms"]),
    ("PING 007", ["malformed PING", "unix_ms"]),
    ("PING 99999999999999999999", ["malformed PING", "unix_ms"]),
    ("PING 1 2", ["malformed PING", "unix_ms", "'1 2'"]),
    ("NAME", ["malformed NAME", "NAME <client_name>"]),
    ("NAME a b", ["malformed NAME", "client_name", "'a b'"]),
    ("NAME caf\u00e9", ["malformed NAME", "client_name"]),
    ("REPLICATE events", ["malformed REPLICATE", "REPLICATE <stream> <token>"]),
    ("REPLICATE events abc", ["malformed REPLICATE", "token", "'abc'"]),
    ("REPLICATE events -1", ["malformed REPLICATE", "token", "'-1'"]),
    ("REPLICATE events 1 2", ["malformed REPLICATE", "REPLICATE <stream> <token>"]),
    ("REPLICATE events  5", ["malformed REPLICATE"]),
    ("REPLICATE events @", ["malformed REPLICATE", "@<unix_ms> must be a non-negative integer", "''"]),
    ("REPLICATE events @-1", ["malformed REPLICATE", "@<unix_ms>", "'-1'"]),
    ("REPLICATE events @1 2", ["malformed REPLICATE", "REPLICATE <stream> @<unix_ms>"]),
    ("REPLICATE events @@5", ["malformed REPLICATE", "@<unix_ms>", "'@5'"]),
    ("TICK events 1", ["malformed TICK", "TICK <stream> <safe_token> <safe_ts>"]),
    ("TICK events x 2", ["malformed TICK", "safe_token", "'x'"]),
    ("TICK events 1 2 3", ["malformed TICK", "TICK <stream> <safe_token> <safe_ts>"]),
    ("POSITION events master 1", ["malformed POSITION", "POSITION <stream> <instance> <prev_token> <new_token>"]),
    ("POSITION events master x 2", ["malformed POSITION", "prev_token", "'x'"]),
    ("POSITION events master 1 y", ["malformed POSITION", "new_token", "'y'"]),
    ("POSITION events master 9 3", ["malformed POSITION", "new_token 3 is below prev_token 9"]),
    ("POSITION events master 1 2 3", ["malformed POSITION"]),
    ("RDATA events master 1", ["malformed RDATA", "RDATA <stream> <instance> <token or batch> <row_json>"]),
    ("RDATA events master x []", ["malformed RDATA", "token", "'x'"]),
    ("RDATA events master 1 [1,", ["malformed RDATA", "bad row JSON"]),
    ("RDATA events master 1 not json", ["malformed RDATA", "bad row JSON"]),
    ('RDATA events master 1 {"a":1}', ["malformed RDATA", "row JSON must be an array"]),
    ("RDATA events master 1 5", ["malformed RDATA", "row JSON must be an array"]),
    ("ERROR", ["malformed ERROR", "ERROR <message>"]),
    ("ERROR    ", ["malformed ERROR", "ERROR <message>"]),
    ("USER_SYNC w1 @a:x maybe 5", ["malformed USER_SYNC", "'start' or 'end'", "'maybe'"]),
    (
        "USER_SYNC w1 @a:x start",
        ["malformed USER_SYNC", "USER_SYNC <instance> <user_id> <start or end> <last_sync_ms>"],
    ),
    ("USER_SYNC w1 @a:x start soon", ["malformed USER_SYNC", "last_sync_ms", "'soon'"]),
    ("CLEAR_USER_SYNC", ["malformed CLEAR_USER_SYNC", "CLEAR_USER_SYNC <instance>"]),
    ("CLEAR_USER_SYNC a b", ["malformed CLEAR_USER_SYNC", "instance"]),
    ("FEDERATION_ACK w1", ["malformed FEDERATION_ACK", "FEDERATION_ACK <instance> <token>"]),
    ("FEDERATION_ACK w1 abc", ["malformed FEDERATION_ACK", "token", "'abc'"]),
    ("REMOVE_PUSHER m.http", ["malformed REMOVE_PUSHER", "REMOVE_PUSHER <app_id> <push_key> <user_id>"]),
    ("REMOVE_PUSHER m.http key", ["malformed REMOVE_PUSHER", "REMOVE_PUSHER <app_id> <push_key> <user_id>"]),
    ("REMOTE_SERVER_UP", ["malformed REMOTE_SERVER_UP", "REMOTE_SERVER_UP <server>"]),
    ("REMOTE_SERVER_UP a b", ["malformed REMOTE_SERVER_UP", "server"]),
    ("AUTH", ["malformed AUTH", "AUTH <secret>"]),
    ("OPTIONS ts caf\u00e9", ["malformed OPTIONS", "option must be one word", "'caf\u00e9'"]),
    ("OPTIONS ts  live", ["malformed OPTIONS", "single spaces"]),
]


@pytest.mark.parametrize("line, words", MALFORMED, ids=[line for line, _ in MALFORMED])
def test_malformed_arguments_name_what_was_wrong(line: str, words: list[str]) -> None:
    with pytest.raises(MalformedCommand) as info:
        parse_line(line)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# REPLICATE alone is plain REPLICATE; OPTIONS alone is an answer that accepted nothing.
WITH_ARGUMENTS: list[type[Command]] = sorted(
    set(COMMAND_CLASSES.values()) - {ReplicateCommand, OptionsCommand}, key=lambda c: c.NAME
)


@pytest.mark.parametrize("cls", WITH_ARGUMENTS)
def test_every_command_with_arguments_rejects_none(cls: type[Command]) -> None:
    with pytest.raises(MalformedCommand):
        cls.parse("")


def test_malformed_is_raised_by_the_class_parse_too() -> None:
    with pytest.raises(MalformedCommand, match="token"):
        ReplicateCommand.parse("events nope")
    with pytest.raises(MalformedCommand, match="row JSON"):
        RdataCommand.parse("events master 1 [")


@pytest.mark.parametrize("line", ["FOO", "foo bar", "ping 1", "REPLICATE_ALL", "RDATA\tevents", "\u00e9t\u00e9 1"])
def test_unknown_command_is_named(line: str) -> None:
    with pytest.raises(UnknownCommand) as info:
        parse_line(line)
    assert "unknown command" in str(info.value)
    assert repr(line.split(" ")[0]) in str(info.value)


def test_unknown_command_name_is_shortened_in_the_message() -> None:
    with pytest.raises(UnknownCommand) as info:
        parse_line("X" * 10_000 + " args")
    assert len(str(info.value)) < 100


def test_unknown_and_malformed_are_value_errors_but_distinct() -> None:
    assert issubclass(UnknownCommand, ValueError)
    assert issubclass(MalformedCommand, ValueError)
    assert not issubclass(UnknownCommand, MalformedCommand)
    assert not issubclass(MalformedCommand, UnknownCommand)


def test_commands_are_immutable_values() -> None:
    command = PositionCommand("events", "master", 1, 2)
    assert command == PositionCommand("events", "master", 1, 2)
    assert hash(command) == hash(PositionCommand("events", "master", 1, 2))
    with pytest.raises(AttributeError):
        command.new_token = 3  # type: ignore[misc]  # deliberately: a frozen command refuses it


# -- the receiving fast path ---------------------------------------------------------

from replication.commands import RdataCommand as _Rdata  # noqa: E402
from replication.commands import parse_line as _parse  # noqa: E402
from replication.commands import parse_rdata_fast  # noqa: E402


@pytest.mark.parametrize(
    "line",
    [
        'RDATA events master 12 ["$e", "!r", "t", null, null]',
        'RDATA events master batch ["a b", {"k": [1, 2]}]',
        "RDATA events master 0 []",
        'RDATA events master 9223372036854775807 ["x"]',
        'RDATA events master 1 ["x"]\r',
    ],
)
def test_fast_rdata_parse_agrees_with_the_command_class(line: str) -> None:
    full = _parse(line.strip())
    assert isinstance(full, _Rdata)  # also teaches the fast path the names
    fast = parse_rdata_fast(line.encode())
    if fast is not None:  # the fast path may decline; it must never disagree
        assert fast == (full.stream, full.instance, full.token, full.row)
    assert parse_rdata_fast(b'RDATA events master 3 ["x"]') == ("events", "master", 3, ["x"])


@pytest.mark.parametrize(
    "raw",
    [
        b'RDATA events master 01 ["x"]',
        b'RDATA events master -1 ["x"]',
        b"RDATA events master 1 {bad",
        b'RDATA events master 1 {"a": 1}',
        b"RDATA events master 1",
        b'RDATA events master 99999999999999999999 ["x"]',
        b'RDATA ev\xc3\xa9nts master 1 ["x"]',
        b'RDATA never-seen-name master 1 ["x"]',
        b"POSITION events master 1 2",
    ],
)
def test_fast_rdata_parse_declines_what_the_full_parser_must_judge(raw: bytes) -> None:
    _parse('RDATA events master 1 ["x"]')
    assert parse_rdata_fast(raw) is None


@pytest.mark.parametrize("stream, token, ts", [("events", 12, 470655961688440832), ("a_b", 0, 0), ("é", 2**62, 1)])
def test_tick_line_is_the_tick_commands_bytes(stream: str, token: int, ts: int) -> None:
    assert TickCommand.line(stream, token, ts) == TickCommand(stream, token, ts).encode()
