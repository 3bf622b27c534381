"""The timeline store's contract: message rows, outcomes and the operations.

A timeline topic holds messages placed on a timeline by their timestamp
(Unix ms on the master's clock). The status of a message follows from its
timestamp, its consumer and *now*:

- ``available``: ``ts <= now`` (new, released, or a lease that expired);
- ``waiting``: ``ts > now`` and no consumer;
- ``processing``: ``ts > now`` and a consumer (the lease ends at ``ts``).

Every change is one atomic conditional statement, checked against these
conditions and the version the caller holds; a failed condition changes
nothing and is reported as one of the :data:`REASONS`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attr

AVAILABLE, WAITING, PROCESSING = "available", "waiting", "processing"
STATUSES = (AVAILABLE, WAITING, PROCESSING)

# Why a change was refused (the NACK reasons on the wire).
NOT_HOLDER = "not the holder"
STALE_VERSION = "stale version"
LEASE_EXPIRED = "lease expired"
LEASED = "leased"
NOT_OWNER = "not the owner"
UNKNOWN_MESSAGE = "unknown message"
NOT_DUE = "not due"  # only the master's own lease of one message (never on the wire)
REASONS = (NOT_HOLDER, STALE_VERSION, LEASE_EXPIRED, LEASED, NOT_OWNER, UNKNOWN_MESSAGE)

MAX_ID_LENGTH = 200


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TimelineMessage:
    topic: str
    id: str
    ts: int  # place on the timeline; for a leased message, the end of the lease
    body: str  # JSON text
    group: str  # the producer group that owns it
    consumer: str | None  # the lease holder (active only while ts > now)
    bucket: int
    version: int
    created_ms: int

    def status(self, now_ms: int) -> str:
        if self.ts <= now_ms:
            return AVAILABLE
        return WAITING if self.consumer is None else PROCESSING


@attr.s(slots=True, frozen=True, auto_attribs=True)
class Leased:
    """A message the master just leased: the message after the lease, and when it was due.

    ``tid`` is where the leased row version lives (PostgreSQL's ``ctid``), a
    hint that lets the holder's ``DELETE`` find it without an index; every
    change still checks its conditions, and a stale hint falls back to the
    primary key.
    """

    message: TimelineMessage
    due_ms: int
    tid: str | None = None


@attr.s(slots=True, frozen=True, auto_attribs=True)
class PassResult:
    """One topic's lease pass in a cycle: the leases per request, the next due time, more due or not.

    ``more``: every request got all it asked (more messages may be due);
    then ``next_due`` is the pass's now, not read from storage.
    """

    leased: list[list[Leased]]
    next_due: int | None
    more: bool


@attr.s(slots=True, frozen=True, auto_attribs=True)
class Outcome:
    """The result of one conditional change: the new state, or the failed condition."""

    ok: bool
    message: TimelineMessage | None = None
    reason: str | None = None  # one of REASONS when not ok
    created: bool = False  # schedule: a new message (False: the existing one returned)

    @classmethod
    def refused(cls, reason: str) -> Outcome:
        return cls(False, None, reason)


class Database(Protocol):
    """The database object a timeline store holds (``SqliteDatabase`` or ``PgDatabase``)."""

    dialect: str

    def write(self, fn: Callable[[Any], Any]) -> Any: ...

    def read(self, fn: Callable[[Any], Any]) -> Any: ...

    def migrate(self) -> list[int]: ...

    def close(self) -> None: ...


class TimelineStore(Protocol):
    """What the master, the CLI and the tests need from a timeline store.

    Every method blocks (call it off the reactor thread); ``now_ms`` is the
    caller's clock, so the store itself never reads a clock.
    """

    def schedule(
        self, topic: str, group: str, message_id: str | None, at_ms: int, body: str, now_ms: int
    ) -> Outcome: ...

    def move(self, topic: str, group: str, message_id: str, at_ms: int, now_ms: int) -> Outcome: ...

    def cancel(self, topic: str, group: str, message_id: str, now_ms: int) -> Outcome: ...

    def lease(self, topic: str, message_id: str, consumer: str, lease_ms: int, now_ms: int) -> Outcome: ...

    def lease_due(
        self, topic: str, consumer: str, lease_ms: int, limit: int, now_ms: int, others_only: bool = False
    ) -> list[Leased]: ...

    def lease_pass(
        self, topic: str, requests: Sequence[tuple[str, int, int]], now_ms: int
    ) -> tuple[list[list[Leased]], int | None]: ...

    def cycle(
        self,
        calls: Sequence[tuple[str, tuple[Any, ...]]],
        frees: Sequence[tuple[int, int] | None],
        passes: Sequence[tuple[str, Sequence[tuple[str, int, int]], int]],
    ) -> tuple[list[Any], list[PassResult]]: ...

    def extend(
        self, topic: str, message_id: str, consumer: str, version: int, lease_ms: int, now_ms: int
    ) -> Outcome: ...

    def release(
        self, topic: str, message_id: str, consumer: str, version: int, delay_ms: int, now_ms: int
    ) -> Outcome: ...

    def delete(
        self, topic: str, message_id: str, consumer: str, version: int, now_ms: int, tid: str | None = None
    ) -> Outcome: ...

    def get(self, topic: str, message_id: str) -> TimelineMessage | None: ...

    def active_leases(self, topic: str, consumer: str, now_ms: int, limit: int = 10_000) -> list[TimelineMessage]: ...

    def next_due(self, topic: str) -> int | None: ...

    def counts(
        self, topic: str, now_ms: int, start_ms: int | None = None, end_ms: int | None = None
    ) -> dict[str, int]: ...

    def list_messages(
        self,
        topic: str,
        now_ms: int,
        status: str | None = None,
        start_ms: int | None = None,
        end_ms: int | None = None,
        limit: int = 1000,
    ) -> list[TimelineMessage]: ...

    def deleted_count(self) -> int: ...

    def remove_deleted(self, limit: int = 1000) -> int: ...

    def apply(self, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]: ...

    def close(self) -> None: ...


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_message_id(now_ms: int | None = None) -> str:
    """A sortable id (ULID layout): 10 characters of Unix ms, 16 of randomness."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms & ((1 << 48) - 1)) << 80 | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))
