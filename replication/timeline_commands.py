"""The timeline's commands (an extension of the protocol): scheduled messages with leases.

Their wire grammar as :mod:`replication.commands`' (one class per command,
``parse(args)`` and ``to_line()``); kept apart so that a process that only
replicates (a worker) does not build their ten attrs classes at every start
(about 3 ms; docs/benchmarks.md, wstart3). :func:`replication.commands.parse_line`
imports this module the first time it meets one of their names
(:data:`replication.commands.TIMELINE_COMMAND_NAMES`); importing it registers
them in :data:`replication.commands.COMMAND_CLASSES`.
"""

from __future__ import annotations

from typing import ClassVar

import attr
import orjson

from replication.commands import (
    COMMAND_CLASSES,
    TIMELINE_COMMAND_NAMES,
    Command,
    MalformedCommand,
    _split,
    _token,
    _word,
)

__all__ = [
    "ANSWERED_COMMANDS",
    "MAX_CREDIT",
    "MAX_DELAY_MS",
    "MAX_LEASE_MS",
    "MAX_MESSAGE_ID",
    "AckCommand",
    "CancelCommand",
    "DeleteCommand",
    "ExtendCommand",
    "LeaseCommand",
    "MoveCommand",
    "NackCommand",
    "ReleaseCommand",
    "ScheduleCommand",
    "TimelineCommand",
]

# -- the timeline (extension): scheduled messages with leases ------------------------
#
# All times are milliseconds. Message ids are one word of printable ASCII (at
# most MAX_MESSAGE_ID characters); ``-`` in SCHEDULE asks the master for a
# generated, sortable id. Bodies are JSON on one line (the rest of the line).

MAX_MESSAGE_ID = 200
MAX_CREDIT = 10_000  # active leases per consumer per connection
MAX_LEASE_MS = 7 * 24 * 3600 * 1000  # a week
MAX_DELAY_MS = 10 * 366 * 24 * 3600 * 1000  # ten years
# Client commands of the timeline that get exactly one ACK or NACK.
ANSWERED_COMMANDS: frozenset[str] = frozenset({"EXTEND", "RELEASE", "DELETE", "SCHEDULE", "MOVE", "CANCEL"})


def _message_id(value: str) -> str:
    _word(value, "id")
    if len(value) > MAX_MESSAGE_ID:
        raise MalformedCommand(f"id is longer than {MAX_MESSAGE_ID} characters")
    return value


def _ms(value: str, what: str, low: int, high: int) -> int:
    number = _token(value, what)
    if not low <= number <= high:
        raise MalformedCommand(f"{what} must be between {low} and {high}, got {number}")
    return number


def _at(value: str) -> tuple[int, bool]:
    """``<at>``: Unix ms, or ``+<ms>`` from the master's now; (ms, relative)."""
    if value.startswith("+"):
        return _ms(value[1:], "at (+ms)", 0, MAX_DELAY_MS), True
    return _token(value, "at (Unix ms or +ms)"), False


def _json_body(text: str) -> str:
    """The body as compact JSON text (any JSON value)."""
    try:
        return orjson.dumps(orjson.loads(text)).decode("utf-8")
    except (orjson.JSONDecodeError, TypeError) as e:
        raise MalformedCommand(f"bad body JSON: {e}") from None


def _at_text(at: int, relative: bool) -> str:
    return f"+{at}" if relative else str(at)


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TimelineCommand(Command):
    """``TIMELINE <topic> <consumer_id> <credit> <lease_ms>``: consume a timeline topic.

    The master leases due messages to this consumer and pushes them as
    ``LEASE`` lines, never more than ``credit`` active leases at once on this
    connection; the consumer id's active leases (a restart) are sent first.
    """

    NAME: ClassVar[str] = "TIMELINE"
    topic: str
    consumer: str
    credit: int
    lease_ms: int

    @classmethod
    def parse(cls, args: str) -> TimelineCommand:
        usage = "TIMELINE <topic> <consumer_id> <credit> <lease_ms>"
        topic, consumer, credit, lease = _split(args, 4, usage)
        if " " in lease:
            raise MalformedCommand(f"expected {usage}")
        return cls(
            _word(topic, "topic"),
            _message_id(consumer),
            _ms(credit, "credit", 1, MAX_CREDIT),
            _ms(lease, "lease_ms", 1, MAX_LEASE_MS),
        )

    def to_args(self) -> str:
        return f"{self.topic} {self.consumer} {self.credit} {self.lease_ms}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ExtendCommand(Command):
    """``EXTEND <topic> <id> <version> <lease_ms>``: the holder's lease ends at now + lease_ms."""

    NAME: ClassVar[str] = "EXTEND"
    topic: str
    id: str
    version: int
    lease_ms: int

    @classmethod
    def parse(cls, args: str) -> ExtendCommand:
        usage = "EXTEND <topic> <id> <version> <lease_ms>"
        topic, mid, version, lease = _split(args, 4, usage)
        if " " in lease:
            raise MalformedCommand(f"expected {usage}")
        return cls(
            _word(topic, "topic"), _message_id(mid), _token(version, "version"), _ms(lease, "lease_ms", 1, MAX_LEASE_MS)
        )

    def to_args(self) -> str:
        return f"{self.topic} {self.id} {self.version} {self.lease_ms}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ReleaseCommand(Command):
    """``RELEASE <topic> <id> <version> <delay_ms>``: the holder gives it back, due at now + delay_ms."""

    NAME: ClassVar[str] = "RELEASE"
    topic: str
    id: str
    version: int
    delay_ms: int

    @classmethod
    def parse(cls, args: str) -> ReleaseCommand:
        usage = "RELEASE <topic> <id> <version> <delay_ms>"
        topic, mid, version, delay = _split(args, 4, usage)
        if " " in delay:
            raise MalformedCommand(f"expected {usage}")
        return cls(
            _word(topic, "topic"),
            _message_id(mid),
            _token(version, "version"),
            _ms(delay, "delay_ms", 0, MAX_DELAY_MS),
        )

    def to_args(self) -> str:
        return f"{self.topic} {self.id} {self.version} {self.delay_ms}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class DeleteCommand(Command):
    """``DELETE <topic> <id> <version>``: the holder is done; the message is deleted."""

    NAME: ClassVar[str] = "DELETE"
    topic: str
    id: str
    version: int

    @classmethod
    def parse(cls, args: str) -> DeleteCommand:
        usage = "DELETE <topic> <id> <version>"
        topic, mid, version = _split(args, 3, usage)
        if " " in version:
            raise MalformedCommand(f"expected {usage}")
        return cls(_word(topic, "topic"), _message_id(mid), _token(version, "version"))

    def to_args(self) -> str:
        return f"{self.topic} {self.id} {self.version}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ScheduleCommand(Command):
    """``SCHEDULE <topic> <group> <id or -> <at> <body_json>``.

    ``<at>`` is Unix ms or ``+<ms>`` from the master's now; ``-`` asks for a
    generated sortable id. The same id again returns the existing message.
    """

    NAME: ClassVar[str] = "SCHEDULE"
    topic: str
    group: str
    id: str | None  # None: generate one
    at: int
    relative: bool
    body: str  # compact JSON text

    @classmethod
    def parse(cls, args: str) -> ScheduleCommand:
        usage = "SCHEDULE <topic> <group> <id or -> <at> <body_json>"
        topic, group, mid, at, body = _split(args, 5, usage)
        at_ms, relative = _at(at)
        return cls(
            _word(topic, "topic"),
            _message_id(group),
            None if mid == "-" else _message_id(mid),
            at_ms,
            relative,
            _json_body(body),
        )

    def to_args(self) -> str:
        mid = "-" if self.id is None else self.id
        return f"{self.topic} {self.group} {mid} {_at_text(self.at, self.relative)} {self.body}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class MoveCommand(Command):
    """``MOVE <topic> <group> <id> <at>``: the owner moves a message that has no active lease."""

    NAME: ClassVar[str] = "MOVE"
    topic: str
    group: str
    id: str
    at: int
    relative: bool

    @classmethod
    def parse(cls, args: str) -> MoveCommand:
        usage = "MOVE <topic> <group> <id> <at>"
        topic, group, mid, at = _split(args, 4, usage)
        if " " in at:
            raise MalformedCommand(f"expected {usage}")
        at_ms, relative = _at(at)
        return cls(_word(topic, "topic"), _message_id(group), _message_id(mid), at_ms, relative)

    def to_args(self) -> str:
        return f"{self.topic} {self.group} {self.id} {_at_text(self.at, self.relative)}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class CancelCommand(Command):
    """``CANCEL <topic> <group> <id>``: the owner deletes a message that has no active lease."""

    NAME: ClassVar[str] = "CANCEL"
    topic: str
    group: str
    id: str

    @classmethod
    def parse(cls, args: str) -> CancelCommand:
        usage = "CANCEL <topic> <group> <id>"
        topic, group, mid = _split(args, 3, usage)
        if " " in mid:
            raise MalformedCommand(f"expected {usage}")
        return cls(_word(topic, "topic"), _message_id(group), _message_id(mid))

    def to_args(self) -> str:
        return f"{self.topic} {self.group} {self.id}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class LeaseCommand(Command):
    """``LEASE <topic> <id> <version> <until_ms> <body_json>``: a message leased to the consumer."""

    NAME: ClassVar[str] = "LEASE"
    topic: str
    id: str
    version: int
    until_ms: int
    body: str

    @classmethod
    def parse(cls, args: str) -> LeaseCommand:
        topic, mid, version, until, body = _split(args, 5, "LEASE <topic> <id> <version> <until_ms> <body_json>")
        return cls(
            _word(topic, "topic"),
            _message_id(mid),
            _token(version, "version"),
            _token(until, "until_ms"),
            _json_body(body),
        )

    def to_args(self) -> str:
        return f"{self.topic} {self.id} {self.version} {self.until_ms} {self.body}"


def _answered(value: str) -> str:
    if value not in ANSWERED_COMMANDS:
        raise MalformedCommand(f"command must be one of {', '.join(sorted(ANSWERED_COMMANDS))}, got {value!r}")
    return value


@attr.s(slots=True, frozen=True, auto_attribs=True)
class AckCommand(Command):
    """``ACK <COMMAND> <topic> <id> <version> <timestamp_ms>``: the change committed (the new state)."""

    NAME: ClassVar[str] = "ACK"
    command: str
    topic: str
    id: str
    version: int
    timestamp_ms: int

    @classmethod
    def parse(cls, args: str) -> AckCommand:
        usage = "ACK <COMMAND> <topic> <id> <version> <timestamp_ms>"
        command, topic, mid, version, ts = _split(args, 5, usage)
        if " " in ts:
            raise MalformedCommand(f"expected {usage}")
        return cls(
            _answered(command),
            _word(topic, "topic"),
            _message_id(mid),
            _token(version, "version"),
            _token(ts, "timestamp_ms"),
        )

    def to_args(self) -> str:
        return f"{self.command} {self.topic} {self.id} {self.version} {self.timestamp_ms}"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class NackCommand(Command):
    """``NACK <COMMAND> <topic> <id> <reason>``: nothing changed; the reason names the failed condition."""

    NAME: ClassVar[str] = "NACK"
    command: str
    topic: str
    id: str
    reason: str

    @classmethod
    def parse(cls, args: str) -> NackCommand:
        command, topic, mid, reason = _split(args, 4, "NACK <COMMAND> <topic> <id> <reason>")
        return cls(_answered(command), _word(topic, "topic"), _message_id(mid), " ".join(reason.split()))

    def to_args(self) -> str:
        return f"{self.command} {self.topic} {self.id} {' '.join(self.reason.split())}"


_TIMELINE: tuple[type[Command], ...] = (
    TimelineCommand,
    ExtendCommand,
    ReleaseCommand,
    DeleteCommand,
    ScheduleCommand,
    MoveCommand,
    CancelCommand,
    LeaseCommand,
    AckCommand,
    NackCommand,
)
assert {cls.NAME for cls in _TIMELINE} == TIMELINE_COMMAND_NAMES
COMMAND_CLASSES.update({cls.NAME: cls for cls in _TIMELINE})
