"""The commands of the replication protocol: one class per command.

Each class owns its wire grammar: ``parse(args)`` turns the text after the
command name into an instance (raising :class:`MalformedCommand` with a
message naming what was wrong), and ``to_line()`` gives the line back without
its ``\\n``. :func:`parse_line` dispatches on the first word.

Lines look like ``NAME args...``. Arguments are separated by single spaces;
the last argument of some commands (``ERROR``'s message, ``RDATA``'s row JSON)
is the rest of the line and may itself contain spaces.

Which side may send which command is in :data:`SERVER_COMMANDS` and
:data:`CLIENT_COMMANDS`. The timeline's commands are in
:mod:`replication.timeline_commands` (a worker that only replicates does not
import them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import attr
import orjson

from storage.contracts import EscapeFreeRows
from storage.schema import INT64_MAX

__all__ = [
    "CLIENT_COMMANDS",
    "COMMAND_CLASSES",
    "SERVER_COMMANDS",
    "TIMELINE_COMMAND_NAMES",
    "AuthCommand",
    "ClearUserSyncCommand",
    "Command",
    "ErrorCommand",
    "FederationAckCommand",
    "MalformedCommand",
    "NameCommand",
    "OptionsCommand",
    "PingCommand",
    "PositionCommand",
    "RdataCommand",
    "RemoteServerUpCommand",
    "RemovePusherCommand",
    "ReplicateCommand",
    "ServerCommand",
    "UnknownCommand",
    "UserSyncCommand",
    "encode_rdata",
    "parse_line",
    "parse_rdata_fast",
]

# Stream, instance and server names are single words of printable ASCII.
_WORD = re.compile(r"[!-~]+")
_TOKEN = re.compile(r"0|[1-9][0-9]{0,18}")
MAX_TOKEN = INT64_MAX  # a token is stored as a signed 64-bit integer


class MalformedCommand(ValueError):
    """A line names a known command but its arguments are wrong."""


class UnknownCommand(ValueError):
    """A line's first word is no command of this protocol."""


# Words already checked (stream, instance and server names repeat on every line).
_GOOD_WORDS: set[str] = set()
_GOOD_WORDS_MAX = 4096
_GOOD_WORD_CHARS = 64  # longer words are checked every time, never kept (bounded memory)


def _word(value: str, what: str) -> str:
    if value in _GOOD_WORDS:
        return value
    if not _WORD.fullmatch(value):
        raise MalformedCommand(f"{what} must be one word of printable ASCII, got {value!r}")
    if len(_GOOD_WORDS) < _GOOD_WORDS_MAX and len(value) <= _GOOD_WORD_CHARS:
        _GOOD_WORDS.add(value)
    return value


def _token(value: str, what: str) -> int:
    if _TOKEN.fullmatch(value):
        token = int(value)
        if token <= MAX_TOKEN:
            return token
    raise MalformedCommand(f"{what} must be a non-negative integer, got {value!r}")


def _split(args: str, count: int, usage: str) -> list[str]:
    """Split ``args`` into exactly ``count`` words (the last one may hold spaces)."""
    parts = args.split(" ", count - 1) if args else []
    if len(parts) != count or "" in parts:
        raise MalformedCommand(f"expected {usage}")
    return parts


class Command:
    """Base of all commands; subclasses are attrs classes."""

    NAME: ClassVar[str]

    @classmethod
    def parse(cls, args: str) -> Command:
        raise NotImplementedError

    def to_args(self) -> str:
        raise NotImplementedError

    def to_line(self) -> str:
        args = self.to_args()
        return f"{self.NAME} {args}" if args else self.NAME

    def encode(self) -> bytes:
        """The command as bytes on the wire, with its ``\\n``."""
        return self.to_line().encode("utf-8") + b"\n"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ServerCommand(Command):
    """``SERVER <server_name>``: the master names itself first on connect."""

    NAME: ClassVar[str] = "SERVER"
    server_name: str

    @classmethod
    def parse(cls, args: str) -> ServerCommand:
        (name,) = _split(args, 1, "SERVER <server_name>")
        return cls(_word(name, "server_name"))

    def to_args(self) -> str:
        return self.server_name


@attr.s(slots=True, frozen=True, auto_attribs=True)
class PingCommand(Command):
    """``PING <unix_ms>``: keepalive; its timestamp gives round trip and clock offset."""

    NAME: ClassVar[str] = "PING"
    unix_ms: int

    @classmethod
    def parse(cls, args: str) -> PingCommand:
        (value,) = _split(args, 1, "PING <unix_ms>")
        return cls(_token(value, "unix_ms"))

    def to_args(self) -> str:
        return str(self.unix_ms)


@attr.s(slots=True, frozen=True, auto_attribs=True)
class NameCommand(Command):
    """``NAME <client_name>``: the client names itself (used in logs and metrics)."""

    NAME: ClassVar[str] = "NAME"
    client_name: str

    @classmethod
    def parse(cls, args: str) -> NameCommand:
        (name,) = _split(args, 1, "NAME <client_name>")
        return cls(_word(name, "client_name"))

    def to_args(self) -> str:
        return self.client_name


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ReplicateCommand(Command):
    """``REPLICATE``, ``REPLICATE <stream> <token>`` or ``REPLICATE <stream> @<unix_ms>``.

    Plain ``REPLICATE`` asks for a ``POSITION`` of every stream and live rows
    from then on. With a stream and a token the master replays that stream's
    rows after the token over the same connection, then continues live. With
    ``@<unix_ms>`` (start at a time) it replays the rows whose timestamp's
    physical time is at or after that Unix millisecond, answering first with
    ``POSITION <stream> <instance> <t> <t>`` where ``t`` is the token just
    before the first of them.
    """

    NAME: ClassVar[str] = "REPLICATE"
    stream: str | None = None
    token: int | None = None
    since_ms: int | None = None  # set (and token None) for @<unix_ms>

    @classmethod
    def parse(cls, args: str) -> ReplicateCommand:
        if not args:
            return cls()
        usage = "REPLICATE or REPLICATE <stream> <token> or REPLICATE <stream> @<unix_ms>"
        stream, token = _split(args, 2, usage)
        if " " in token:
            raise MalformedCommand(f"expected {usage}")
        if token.startswith("@"):
            return cls(_word(stream, "stream"), None, _token(token[1:], "@<unix_ms>"))
        return cls(_word(stream, "stream"), _token(token, "token"))

    def to_args(self) -> str:
        if self.stream is None:
            return ""
        if self.since_ms is not None:
            return f"{self.stream} @{self.since_ms}"
        return f"{self.stream} {self.token}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class PositionCommand(Command):
    """``POSITION <stream> <instance> <prev_token> <new_token>``.

    There are no rows for the client in ``(prev_token, new_token]`` beyond those
    already sent: a client whose applied token is below ``prev_token`` has
    missed rows and must catch up; otherwise it moves straight to ``new_token``.
    """

    NAME: ClassVar[str] = "POSITION"
    stream: str
    instance: str
    prev_token: int
    new_token: int

    @classmethod
    def parse(cls, args: str) -> PositionCommand:
        usage = "POSITION <stream> <instance> <prev_token> <new_token>"
        stream, instance, prev, new = _split(args, 4, usage)
        if " " in new:
            raise MalformedCommand(f"expected {usage}")
        prev_token = _token(prev, "prev_token")
        new_token = _token(new, "new_token")
        if new_token < prev_token:
            raise MalformedCommand(f"new_token {new_token} is below prev_token {prev_token}")
        return cls(_word(stream, "stream"), _word(instance, "instance"), prev_token, new_token)

    def to_args(self) -> str:
        return f"{self.stream} {self.instance} {self.prev_token} {self.new_token}"


BATCH = "batch"


def encode_rdata(stream: str, instance: str, token: int | None, row_json: bytes) -> bytes:
    """One ``RDATA`` line as bytes, from a row already serialized to JSON.

    The master's hot path uses this directly so that each row is serialized
    once, whatever the number of connections.
    """
    position = BATCH if token is None else str(token)
    return b"RDATA %s %s %s %s\n" % (
        stream.encode("utf-8"),
        instance.encode("utf-8"),
        position.encode("ascii"),
        row_json,
    )


@attr.s(slots=True, frozen=True, auto_attribs=True)
class RdataCommand(Command):
    """``RDATA <stream> <instance> <token or batch> <row_json>``.

    ``row_json`` is a JSON array on one line (it may contain spaces, never a
    newline). Rows that share one token are sent as ``batch`` lines followed by
    one line carrying the real token; a client applies nothing of a batch until
    that last line. ``token`` is ``None`` for a ``batch`` line.
    """

    NAME: ClassVar[str] = "RDATA"
    stream: str
    instance: str
    token: int | None
    row: list

    @classmethod
    def parse(cls, args: str) -> RdataCommand:
        usage = "RDATA <stream> <instance> <token or batch> <row_json>"
        stream, instance, position, row_json = _split(args, 4, usage)
        token = None if position == BATCH else _token(position, "token")
        try:
            row = orjson.loads(row_json)
        except orjson.JSONDecodeError as e:
            raise MalformedCommand(f"bad row JSON: {e}") from None
        if not isinstance(row, list):
            raise MalformedCommand("row JSON must be an array")
        return cls(_word(stream, "stream"), _word(instance, "instance"), token, row)

    def to_args(self) -> str:
        position = BATCH if self.token is None else str(self.token)
        return f"{self.stream} {self.instance} {position} {orjson.dumps(self.row).decode()}"

    def encode(self) -> bytes:
        return encode_rdata(self.stream, self.instance, self.token, orjson.dumps(self.row))


_RDATA_PREFIX = b"RDATA "
_BATCH_BYTES = BATCH.encode("ascii")


# Whole RDATA lines at once (the client's receiving hot path). A run of lines
# that start with "RDATA " and all carry the same stream and instance (raw
# newlines occur in JSON text only where lines end, so "\nRDATA <stream>
# <instance> " is a line start) is split at that prefix and each line's
# token by one regular expression (one match per line, or the run is not
# taken), and its rows are parsed
# by orjson in one call. Anything that is not exactly one well-formed line per
# newline leaves the run to the per-line parser.
RDATA_RUN = re.compile(rb"^(?:RDATA [^\n]*\n)+", re.M)
_LINE_TOKEN = rb"(0|[1-9][0-9]{0,17}|batch) "
_LINE_TOKENS: dict[bytes, re.Pattern[bytes]] = {}  # per "\nRDATA <stream> <instance> ": its split
_LINE_TOKENS_MAX = 64  # a peer's names: bounded (cleared when full)


def _line_token(prefix: bytes) -> re.Pattern[bytes]:
    """The split of a run at each line's start and token: the fixed prefix in the pattern (searched fast)."""
    found = _LINE_TOKENS.get(prefix)
    if found is None:
        if len(_LINE_TOKENS) >= _LINE_TOKENS_MAX:
            _LINE_TOKENS.clear()
        found = _LINE_TOKENS[prefix] = re.compile(re.escape(prefix) + _LINE_TOKEN)
    return found


def one_rdata_run(block: bytes) -> bool:
    """Whether ``block`` may be one run of ``RDATA`` lines of one stream and instance, tried whole.

    ``block`` holds whole lines, each ending with ``\\n``. Its first and last
    lines start with the same ``RDATA <stream> <instance> `` (two finds, no
    pass over the block): the receiving hot path's common case, a buffer of
    one stream's rows. Whether every line between does is
    :func:`parse_rdata_block`'s to say (None if not), in the same pass as
    its split.
    """
    if not block.startswith(_RDATA_PREFIX):
        return False
    first_space = block.find(b" ", 6)
    second_space = block.find(b" ", first_space + 1)
    if first_space < 0 or second_space < 0:
        return False
    last = block.rfind(b"\n", 0, len(block) - 1) + 1  # the last line's start (0: one line)
    return block.startswith(block[: second_space + 1], last) and block.find(b"\n") > second_space


def parse_rdata_block(block: bytes, max_line_bytes: int) -> tuple[str, str, list[bytes], list[list[Any]]] | None:
    """(stream, instance, tokens, rows) for a run of RDATA lines of one stream and instance.

    ``block`` holds whole lines, each ending with ``\\n``; a token is its
    digits, or ``b"batch"``. None unless every line is well formed (as
    :class:`RdataCommand` parses it) and no longer than ``max_line_bytes``:
    the caller then takes the lines one by one, with their errors.
    """
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
    # Split at every line start with the prefix and a well-formed token. A raw newline occurs
    # only where a line ends, so each match is at a line start, and a line that does not
    # match (another stream or instance, another command, a bad token) leaves its newline in
    # the text between two matches: every line matched if and only if the only newline left
    # is the block's last (no count of the lines, which is a slower pass than a find).
    parts = _line_token(prefix).split(b"\n" + block)
    if parts[0]:
        return None
    tokens = parts[1::2]
    bodies = parts[2::2]
    # A line is its prefix, a token of at most 18 digits, a space and its body: only if that
    # bound passes the limit are the lines themselves measured.
    if (
        len(block) > max_line_bytes
        and len(prefix) + 18 + max(map(len, bodies)) > max_line_bytes
        and max(map(len, block.split(b"\n"))) > max_line_bytes
    ):
        return None
    joined = b",".join(bodies)
    if joined.find(b"\n") != len(joined) - 1:
        return None
    try:
        rows = orjson.loads(b"[" + joined + b"]")
    except orjson.JSONDecodeError:
        return None
    if len(rows) != len(tokens) or set(map(type, rows)) != {list}:
        return None
    if b"\\" not in joined:  # one memchr: no escape sequence, so no value needing a COPY escape
        rows = EscapeFreeRows(rows)
    return stream, instance, tokens, rows


def parse_rdata_fast(raw: bytes) -> tuple[str, str, int | None, list] | None:
    """(stream, instance, token or None, row) of a well-formed ``RDATA`` line, else None.

    The receiving hot path: it accepts exactly what :meth:`RdataCommand.parse`
    accepts for names it has already checked once, and returns None for
    anything else, which then goes through the full parser (and its ERROR).
    """
    if not raw.startswith(_RDATA_PREFIX):
        return None
    parts = raw.split(b" ", 4)
    if len(parts) != 5:
        return None
    _, stream_b, instance_b, position, row_json = parts
    try:
        stream = stream_b.decode("ascii")
        instance = instance_b.decode("ascii")
    except UnicodeDecodeError:
        return None
    if stream not in _GOOD_WORDS or instance not in _GOOD_WORDS:
        return None
    if position == _BATCH_BYTES:
        token = None
    elif position.isdigit() and len(position) < 19 and (position == b"0" or position[:1] != b"0"):
        token = int(position)
    else:
        return None
    try:
        row = orjson.loads(row_json)
    except orjson.JSONDecodeError:
        return None
    if type(row) is not list:
        return None
    return stream, instance, token, row


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ErrorCommand(Command):
    """``ERROR <message>``: something the peer sent was wrong, or the peer is dropped."""

    NAME: ClassVar[str] = "ERROR"
    message: str

    @classmethod
    def parse(cls, args: str) -> ErrorCommand:
        if not args.strip():
            raise MalformedCommand("expected ERROR <message>")
        return cls(args)

    def to_args(self) -> str:
        # A message never spans lines: the line is the unit of the protocol.
        return " ".join(self.message.split())


@attr.s(slots=True, frozen=True, auto_attribs=True)
class UserSyncCommand(Command):
    """``USER_SYNC <instance> <user_id> <start or end> <last_sync_ms>``."""

    NAME: ClassVar[str] = "USER_SYNC"
    instance: str
    user_id: str
    is_syncing: bool
    last_sync_ms: int

    @classmethod
    def parse(cls, args: str) -> UserSyncCommand:
        usage = "USER_SYNC <instance> <user_id> <start or end> <last_sync_ms>"
        instance, user_id, state, last = _split(args, 4, usage)
        if state not in ("start", "end"):
            raise MalformedCommand(f"state must be 'start' or 'end', got {state!r}")
        return cls(
            _word(instance, "instance"),
            _word(user_id, "user_id"),
            state == "start",
            _token(last, "last_sync_ms"),
        )

    def to_args(self) -> str:
        state = "start" if self.is_syncing else "end"
        return f"{self.instance} {self.user_id} {state} {self.last_sync_ms}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ClearUserSyncCommand(Command):
    """``CLEAR_USER_SYNC <instance>``: the worker's users are no longer syncing."""

    NAME: ClassVar[str] = "CLEAR_USER_SYNC"
    instance: str

    @classmethod
    def parse(cls, args: str) -> ClearUserSyncCommand:
        (instance,) = _split(args, 1, "CLEAR_USER_SYNC <instance>")
        return cls(_word(instance, "instance"))

    def to_args(self) -> str:
        return self.instance


@attr.s(slots=True, frozen=True, auto_attribs=True)
class FederationAckCommand(Command):
    """``FEDERATION_ACK <instance> <token>``: the worker has handled up to token."""

    NAME: ClassVar[str] = "FEDERATION_ACK"
    instance: str
    token: int

    @classmethod
    def parse(cls, args: str) -> FederationAckCommand:
        instance, token = _split(args, 2, "FEDERATION_ACK <instance> <token>")
        return cls(_word(instance, "instance"), _token(token, "token"))

    def to_args(self) -> str:
        return f"{self.instance} {self.token}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class RemovePusherCommand(Command):
    """``REMOVE_PUSHER <app_id> <push_key> <user_id>``.

    ``push_key`` may contain spaces: ``app_id`` is the first word and
    ``user_id`` the last.
    """

    NAME: ClassVar[str] = "REMOVE_PUSHER"
    app_id: str
    push_key: str
    user_id: str

    @classmethod
    def parse(cls, args: str) -> RemovePusherCommand:
        usage = "REMOVE_PUSHER <app_id> <push_key> <user_id>"
        app_id, _, rest = args.partition(" ")
        push_key, _, user_id = rest.rpartition(" ")
        if not app_id or not push_key.strip() or not user_id:
            raise MalformedCommand(f"expected {usage}")
        return cls(_word(app_id, "app_id"), push_key, _word(user_id, "user_id"))

    def to_args(self) -> str:
        return f"{self.app_id} {self.push_key} {self.user_id}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class RemoteServerUpCommand(Command):
    """``REMOTE_SERVER_UP <server>``: relayed by the master to every other connection."""

    NAME: ClassVar[str] = "REMOTE_SERVER_UP"
    server: str

    @classmethod
    def parse(cls, args: str) -> RemoteServerUpCommand:
        (server,) = _split(args, 1, "REMOTE_SERVER_UP <server>")
        return cls(_word(server, "server"))

    def to_args(self) -> str:
        return self.server


@attr.s(slots=True, frozen=True, auto_attribs=True)
class AuthCommand(Command):
    """``AUTH <secret>``: the first command when the master requires a shared secret."""

    NAME: ClassVar[str] = "AUTH"
    secret: str

    @classmethod
    def parse(cls, args: str) -> AuthCommand:
        # The secret is the rest of the line with surrounding whitespace
        # stripped, so "AUTH  s3cret" (two spaces) means the same secret.
        secret = args.strip()
        if not secret:
            raise MalformedCommand("expected AUTH <secret>")
        return cls(secret)

    def to_args(self) -> str:
        return self.secret


# The options this implementation knows; a master acknowledges only these.
KNOWN_OPTIONS = frozenset({"ts", "live", "tick"})


@attr.s(slots=True, frozen=True, auto_attribs=True)
class OptionsCommand(Command):
    """``OPTIONS [<option>...]``: extensions asked for, and acknowledged (tickline's own).

    A client sends ``OPTIONS <option>...``; the master answers with one line
    ``OPTIONS <accepted>...`` naming the options it accepted (of those asked
    for, the ones in :data:`KNOWN_OPTIONS`; possibly none, then the line is
    just ``OPTIONS``). An option the master does not know is simply not
    acknowledged. A client relies on an option only once acknowledged; a
    seed-protocol master answers ``ERROR`` (unknown command) or nothing, which
    both mean "no options".

    ``ts``: every ``RDATA`` row JSON carries the row's timestamp as one more,
    last element of the array. Without it rows are exactly the stream's
    columns, as the seed protocol has them.

    ``live``: a replay (``REPLICATE <stream> <token>``) ends with
    ``POSITION <stream> <instance> <head> <head>`` when it reaches the live
    rows, so the client knows it has caught up.

    ``tick``: the master sends ``TICK`` (the stream's safe time, see
    :class:`TickCommand`) for every stream the client follows live.
    """

    NAME: ClassVar[str] = "OPTIONS"
    options: frozenset[str]

    @classmethod
    def parse(cls, args: str) -> OptionsCommand:
        # Options are separated by single spaces, like every argument.
        words = args.split(" ") if args else []
        if "" in words:
            raise MalformedCommand("expected OPTIONS [<option>...] separated by single spaces")
        if len(words) > 32:
            raise MalformedCommand(f"too many options: {len(words)}, at most 32")
        for word in words:
            _word(word, "option")
        return cls(frozenset(words))

    def to_args(self) -> str:
        return " ".join(sorted(self.options))

    def accepted(self) -> OptionsCommand:
        """The acknowledgment a master sends: the options asked for that it knows."""
        return OptionsCommand(self.options & KNOWN_OPTIONS)


_ALL: Iterable[type[Command]] = (
    ServerCommand,
    PingCommand,
    NameCommand,
    ReplicateCommand,
    PositionCommand,
    RdataCommand,
    ErrorCommand,
    UserSyncCommand,
    ClearUserSyncCommand,
    FederationAckCommand,
    RemovePusherCommand,
    RemoteServerUpCommand,
    AuthCommand,
    OptionsCommand,
)
COMMAND_CLASSES: dict[str, type[Command]] = {cls.NAME: cls for cls in _ALL}
# The timeline's commands are in replication.timeline_commands, imported (and so registered
# in COMMAND_CLASSES) the first time parse_line meets one of these names, or by whoever uses them.
TIMELINE_COMMAND_NAMES: frozenset[str] = frozenset(
    {"TIMELINE", "EXTEND", "RELEASE", "DELETE", "SCHEDULE", "MOVE", "CANCEL", "LEASE", "ACK", "NACK"}
)

# Which side may send which command.
SERVER_COMMANDS: frozenset[str] = frozenset(
    {"SERVER", "PING", "POSITION", "RDATA", "ERROR", "REMOTE_SERVER_UP", "OPTIONS", "LEASE", "ACK", "NACK"}
)
CLIENT_COMMANDS: frozenset[str] = frozenset(
    {
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
    }
)


def parse_line(line: str) -> Command:
    """Parse one line (without its line ending) into a command.

    Raises :class:`UnknownCommand` or :class:`MalformedCommand`; the message
    names what was wrong.
    """
    name, _, args = line.partition(" ")
    cls = COMMAND_CLASSES.get(name)
    if cls is None and name in TIMELINE_COMMAND_NAMES:
        import replication.timeline_commands  # noqa: F401  (registers the timeline's commands)

        cls = COMMAND_CLASSES.get(name)
    if cls is None:
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise UnknownCommand(f"unknown command {shown!r}")
    try:
        return cls.parse(args)
    except MalformedCommand as e:
        raise MalformedCommand(f"malformed {name}: {e}") from None


# -- time across streams (TICK) ---------------------------------------------------------


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TickCommand(Command):
    """``TICK <stream> <safe_token> <safe_ts>``: the stream's safe time (``OPTIONS tick``).

    No row of the stream with a timestamp at or below ``safe_ts`` has a token
    above ``safe_token``: once a client has every row up to ``safe_token`` it
    has every row of the stream up to ``safe_ts``, and every later row has a
    larger timestamp. Sent, to connections that asked for it, for every stream
    that is live on the connection, after each batch of rows the master fans
    out and at least every ``master.tick_interval`` while the stream is idle.
    ``safe_ts`` never goes backwards on a connection.
    """

    NAME: ClassVar[str] = "TICK"
    stream: str
    safe_token: int
    safe_ts: int

    @classmethod
    def parse(cls, args: str) -> TickCommand:
        usage = "TICK <stream> <safe_token> <safe_ts>"
        stream, token, ts = _split(args, 3, usage)
        if " " in ts:
            raise MalformedCommand(f"expected {usage}")
        return cls(_word(stream, "stream"), _token(token, "safe_token"), _token(ts, "safe_ts"))

    def to_args(self) -> str:
        return f"{self.stream} {self.safe_token} {self.safe_ts}"

    @staticmethod
    def line(stream: str, safe_token: int, safe_ts: int) -> bytes:
        """``TickCommand(stream, safe_token, safe_ts).encode()`` without the object (the master sends one per
        commit and subscription: one f-string, no call; the same bytes, tests/unit/test_commands.py)."""
        return f"TICK {stream} {safe_token} {safe_ts}\n".encode()


COMMAND_CLASSES[TickCommand.NAME] = TickCommand


SERVER_COMMANDS = SERVER_COMMANDS | {TickCommand.NAME}
__all__ += ["TickCommand", "parse_tick_fast"]
_TICK_PREFIX = b"TICK "


def _fast_token(digits: bytes) -> int | None:
    """A token of at most 18 digits without a leading zero (below MAX_TOKEN), else None (as in
    :func:`parse_rdata_fast`, where it is written out: one call fewer per line)."""
    if digits.isdigit() and len(digits) < 19 and (digits == b"0" or digits[:1] != b"0"):
        return int(digits)
    return None


def parse_tick_fast(raw: bytes) -> TickCommand | None:
    """The ``TICK`` of a well-formed line for a stream name already checked once, else None.

    The master sends one after each batch of rows it fans out: on the latency
    path, one per single-row commit. It accepts exactly what
    :meth:`TickCommand.parse` accepts for such lines and returns None for
    anything else, which then goes through the full parser (and its ERROR).
    """
    if not raw.startswith(_TICK_PREFIX):
        return None
    parts = raw.split(b" ")
    if len(parts) != 4:
        return None
    try:
        stream = parts[1].decode("ascii")
    except UnicodeDecodeError:
        return None
    if stream not in _GOOD_WORDS:
        return None
    token, ts = _fast_token(parts[2]), _fast_token(parts[3])
    if token is None or ts is None:
        return None
    return TickCommand(stream, token, ts)
