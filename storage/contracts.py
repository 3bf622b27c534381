"""What the layers above need from storage, as ``typing.Protocol`` s.

Both backends (SQLite and PostgreSQL) implement every contract here; the
factories (:func:`storage.store.open_store`,
:func:`storage.worker_store.open_worker_store`,
:func:`storage.worker_store.open_snapshot_reader`) return these types, and
the master, the workers and the scripts depend on nothing else. The stores
*hold* their database object: connections, ``read`` and ``write`` are not
part of any contract. SQL stays inside ``storage/``.

- :class:`StreamStore`: the master's side (and ``tickline write``): streams,
  appends, the timestamp oracle, heads and safe positions, rows for the
  fan-out and for replays, writer retirement, change notification.
- :class:`Notifier`: a file descriptor the master's reactor watches.
- :class:`WorkerStore` and :class:`ApplyTransaction`: a worker's database,
  where the effects of rows and the stream's applied token commit together.
- :class:`SnapshotReader` and :class:`SnapshotView`: the Spark snapshot's
  read-only look at a worker's database (applied token, token bounds,
  table and column checks), in one read transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attr

from storage.schema import StreamSchema
from storage.time_index import TokenAt

if TYPE_CHECKING:
    from storage.sqlite_db import CheckpointSchedule

# A stored row as read back: (seq, token, instance_name, ts, *column values).
# JSON columns are JSON text; booleans may come back as 0/1 from SQLite.
StoredRow = tuple[Any, ...]
# A row for the fan-out: (seq, token, instance_name as UTF-8 bytes, ts, the
# row's JSON array as UTF-8 bytes); ``replication.rows.encode_json_rows``
# turns a list of them into RDATA lines without touching the values.
JsonRow = tuple[int, int, bytes, int, bytes]
# A row as written: a list in column order or an object by column name.
Row = Sequence[Any] | Mapping[str, Any]
# A row for ``replicated_<stream>``: (token, instance_name, ts, *checked column values).
ReplicatedValues = tuple[Any, ...]
# The rows of one token as a worker received them: (token, instance_name, rows), each row
# the stream's values followed by the row's timestamp (``OPTIONS ts``). A run of single-row
# tokens (consecutive RDATA lines) may come as one entry whose token is the list of the
# rows' tokens, one per row: no tuple or list per row (``storage.worker_store.expand_received``
# gives the one-entry-per-token form).
ReceivedRows = tuple[int | list[int], str, list[list[Any]]]


class EscapeFreeRows(list[list[Any]]):
    """Received rows parsed from JSON text that held no backslash (``parse_rdata_block``).

    A JSON string holds no raw control character (a conforming parser, as
    orjson, refuses one), so without any escape sequence no text value in
    these rows holds a backslash, tab, newline, carriage return or NUL: their
    ``COPY`` text needs no escape and no check for one (``PgWorkerStore``).
    A slice or copy is a plain list (the mark is not carried over).
    """

    __slots__ = ()


# The master's wake-up (WakeQuery): per stream read, the token fanned out so far and the
# variants (with ``ts`` or not) its live subscriptions take.
WakeReads = Mapping[str, tuple[int, tuple[bool, ...]]]
# Per stream the safe time (None: no time was read), the safe positions, and per stream
# read that moved: ``(after, (lines per variant, last token, rows))``, present only when its
# new rows up to the position were at most the call's ``limit`` (every one of them; a larger
# range, or a line too long, is left to the master's own reads).
WakeResult = tuple[dict[str, int] | None, dict[str, int], dict[str, tuple[int, tuple[dict[bool, bytes], int, int]]]]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@attr.s(slots=True, frozen=True, auto_attribs=True)
class CommittedRows:
    """The rows of one committed single-statement append, as its notification told them (PostgreSQL).

    ``safe``: every token of the stream up to it had committed, or never
    will, when the notification was sent (the writer's claim, see
    ``docs/time.md``; None: no claim). ``rows``: ``(token, ts, JSON array
    of the values)`` in token order, one row per token, the same JSON the
    store's reads build. The master may fan these out without a read when
    they follow what it sent and ``safe`` covers them.
    """

    stream: str
    instance: str
    safe: int | None
    rows: list[tuple[int, int, bytes]]


class Notifier(Protocol):
    """Change notification (PostgreSQL ``LISTEN``): watched by the master's reactor."""

    def fileno(self) -> int:
        """The descriptor that becomes readable when notifications arrive."""
        ...

    def drain(self) -> set[str]:
        """The streams named by the notifications that arrived; never blocks."""
        ...

    def drain_committed(self) -> tuple[set[str], list[CommittedRows]]:
        """As :meth:`drain`: the streams named by notifications that carried no rows, and the rows
        the others carried, in the order they arrived (commit order)."""
        ...

    def close(self) -> None: ...


class ChangeWatch(Protocol):
    """A cheap look for commits of other connections (SQLite ``PRAGMA data_version``), for a poller.

    The master calls :meth:`changed` from its reactor every
    ``master.change_check_interval``: it must never wait for a lock.
    """

    def changed(self) -> bool:
        """Whether another connection committed since the last call (True when unsure)."""
        ...

    @property
    def schedule(self) -> CheckpointSchedule:
        """When the master should checkpoint next (used on the reactor, no I/O): rows delivered live
        since the last checkpoint, when it began, whether it copied everything, the frames it found."""
        ...

    def checkpoint(self) -> tuple[int, int, int]:
        """Checkpoint without waiting for anyone (a database thread, one at a time): (busy, frames, copied)."""
        ...

    def close(self) -> None: ...


class NonBlockingCall(Protocol[T_co]):
    """A storage call on a non-blocking connection (PostgreSQL), driven by the caller's reactor.

    One call at a time: the subclass's ``start`` sends it, then :meth:`poll`
    whenever the descriptor is ready until it says ``"done"``, then
    :meth:`result`. None of them blocks (opening the connection does). A
    lost connection raises :class:`~storage.store.DatabaseUnavailable` from
    ``start``, :meth:`poll` or :meth:`result`, and the object is then
    unusable (closed).
    """

    def fileno(self) -> int: ...

    def poll(self) -> str:
        """Read what arrived: ``"read"`` or ``"write"`` (wait for that), or ``"done"``."""
        ...

    def result(self) -> T_co:
        """The answer of the call, once :meth:`poll` said ``"done"``."""
        ...

    def close(self) -> None: ...


class WakeQuery(NonBlockingCall[WakeResult], Protocol):
    """The master's wake-up in one round trip (``storage.pg_wake``): safe times, positions, first lines."""

    def start(self, read_mark: bool, reads: WakeReads, limit: int) -> None:
        """Send the wake-up (never blocks); without ``read_mark`` the result has no safe times."""
        ...


class AsyncApply(NonBlockingCall[None], Protocol):
    """A worker's small apply as one statement on a non-blocking connection (``storage.pg_worker``).

    :meth:`result` raises :class:`~storage.store.StaleApply` as
    :meth:`WorkerStore.apply_replicated` does, and
    :class:`~storage.store.ApplyRefused` when the statement refused the rows
    (the caller then applies them with ``apply_replicated``, which names a
    bad row; nothing of the refused statement committed).
    """

    def start(self, stream: str, token: int, schema: StreamSchema, received: Sequence[ReceivedRows]) -> bool:
        """Send the apply (never blocks); False, nothing sent, for applies this path does not take (many rows)."""
        ...


class WriteTransaction(Protocol):
    """One open write transaction of a writer (``StreamStore.writing``)."""

    def append(self, rows: Iterable[Row], batch: bool = False) -> list[int]:
        """Check and insert rows: each gets its own token, or with ``batch`` all share one.

        A later batch append of the same transaction continues the
        transaction's batch token while no other token of the stream was
        allocated since; else it starts a new one, so that ``ts`` increases
        with the token (on SQLite only the transaction's own rows outside the
        batch can come between: it holds the write lock; on PostgreSQL
        another writer's rows can too).
        """
        ...


class StreamStore(Protocol):
    """The master's storage: streams with tokens, the oracle, reads for the fan-out."""

    # Rows whose RDATA line could be longer are refused (storage.limits); None: unchecked.
    max_line_bytes: int | None
    # Live reads of one stream the master runs at once (replication.read_ahead): 1, the next chunk
    # read while one is fanned out; more where reads on other connections run beside each other.
    parallel_reads: int

    def register_stream(self, schema: StreamSchema) -> None:
        """Create the stream's table if missing; :class:`~storage.store.SchemaMismatch` if declared otherwise."""
        ...

    def catalog(self) -> dict[str, StreamSchema]:
        """Every stream registered in the database."""
        ...

    def schema(self, stream: str) -> StreamSchema:
        """A registered stream's schema; :class:`~storage.store.UnknownStream` if none."""
        ...

    def append(self, stream: str, rows: Iterable[Row], instance_name: str, batch: bool = False) -> list[int]:
        """Append rows in one transaction (all or none); the token of each row."""
        ...

    def writing(self, stream: str, instance_name: str) -> AbstractContextManager[WriteTransaction]:
        """One write transaction for any number of appends: commits on exit, all or nothing."""
        ...

    def allocate_timestamps(self, count: int = 1) -> list[int]:
        """``count`` strictly increasing timestamps from the oracle."""
        ...

    def heads(self) -> dict[str, int]:
        """The highest token per stream (allocated; on SQLite also committed)."""
        ...

    def safe_positions(self, expire_writers: bool = True) -> dict[str, int]:
        """Per stream, the token up to which every row has committed."""
        ...

    def read_rows(self, stream: str, after: int, upto: int, limit: int) -> list[StoredRow]:
        """Rows with ``after < token <= upto`` in order, about ``limit`` (never splitting a token)."""
        ...

    def read_rows_json(self, stream: str, after: int, upto: int, limit: int) -> list[JsonRow]:
        """As :meth:`read_rows`, each row's values already one JSON array (bytes), for the fan-out."""
        ...

    def read_lines_json(
        self, stream: str, after: int, upto: int, limit: int, prefix: str, with_ts: bool
    ) -> tuple[bytes, int, int] | None:
        """Rows as ready lines ``<prefix><instance> <token> <JSON array>\\n`` (with ``ts``, the
        timestamp as the array's last element), built by the database: (bytes, last token, count).

        Same rows as :meth:`read_rows_json`. None when the store does not build
        them for this range (a token in it holds several rows, or the backend
        does not offer it): the caller then uses :meth:`read_rows_json`.
        """
        ...

    def retire_writers(self) -> None:
        """This process's writers stop holding their streams back (at shutdown)."""
        ...

    def first_token_at(self, stream: str, since_ts: int) -> TokenAt:
        """The first token whose row has ``ts >= since_ts``, by a bounded search (``storage.time_index``)."""
        ...

    def safe_point(self, expire_writers: bool = True, allocate: bool = True) -> tuple[dict[str, int], dict[str, int]]:
        """Per stream a safe time and the safe position (``storage.time_index.safe_point``)."""
        ...

    def notifier(self) -> Notifier | None:
        """A new change-notification listener, or None if the backend has none (poll)."""
        ...

    def change_watch(self) -> ChangeWatch | None:
        """A new cheap change check for polling (SQLite), or None (PostgreSQL: :meth:`notifier`)."""
        ...

    def open_wake(self) -> WakeQuery | None:
        """Blocking: a new non-blocking connection for the master's wake-up, or None (the backend has none)."""
        ...

    def close(self) -> None: ...


class ApplyTransaction(Protocol):
    """One open apply transaction of a worker store, handed to the effects."""

    @property
    def connection(self) -> Any:
        """The DB-API-like connection of the transaction, for handlers' own SQL."""
        ...

    @property
    def placeholder(self) -> str:
        """The parameter marker of the backend's SQL: ``?`` (SQLite) or ``%s`` (PostgreSQL)."""
        ...

    def replicate(self, schema: StreamSchema, rows: Sequence[ReplicatedValues]) -> None:
        """Insert rows into ``replicated_<stream>`` (many per statement where the backend can)."""
        ...


Effects = Callable[[ApplyTransaction], None]


class WorkerStore(Protocol):
    """A worker's database: applied tokens, moved with the effects of the rows."""

    def applied_tokens(self) -> dict[str, int]: ...

    def hand_over_connection(self) -> None:
        """The calling thread is done with the store: its idle connection is kept for the next
        thread that needs one, instead of that thread opening another (PostgreSQL; SQLite: nothing)."""
        ...

    def create_replicated_table(self, schema: StreamSchema) -> None:
        """Create ``replicated_<stream>`` if missing."""
        ...

    def apply(self, stream: str, token: int, effects: Effects) -> None:
        """Run ``effects`` and move the stream's applied token to ``token``, in one transaction.

        :class:`~storage.store.StaleApply` if ``token`` is not above the applied token.
        """
        ...

    def open_async_apply(self) -> AsyncApply | None:
        """Blocking: a non-blocking connection for small applies (PostgreSQL), or None."""
        ...

    def apply_replicated(
        self,
        stream: str,
        token: int,
        schema: StreamSchema,
        received: Sequence[ReceivedRows],
        effects: Effects,
        prepared: bytes | None = None,
    ) -> None:
        """As :meth:`apply` where ``effects`` only copies ``received`` into ``replicated_<stream>``.

        A store may take the rows as they came (PostgreSQL: one statement, the
        rows expanded by the server); where they do not fit that form, it runs
        ``effects`` (which checks each row and names a bad one). ``prepared``:
        what :meth:`prepare_replicated` made of the same ``received``, or None.
        """
        ...

    def prepare_replicated(self, schema: StreamSchema, received: Sequence[ReceivedRows]) -> bytes | None:
        """Pure, any thread: what :meth:`apply_replicated` would make of ``received`` before it
        sends anything (PostgreSQL: the ``COPY`` text), or None (nothing to make ahead)."""
        ...

    @property
    def concurrent_applies(self) -> bool:
        """The store can copy a group while the group before it commits (:meth:`apply_after`)."""
        ...

    def apply_after(
        self, stream: str, token: int, before: int, schema: StreamSchema, prepared: bytes, ready: Callable[[], bool]
    ) -> bool:
        """Apply ``prepared`` (:meth:`prepare_replicated`'s text) while the group ending at ``before`` may
        still be applied on another connection; the token moves from exactly ``before`` to ``token``.

        The rows are copied first; then ``ready()`` blocks until the group
        before is settled and says whether it committed. False: nothing
        commits, the method returns False. True: the token's move (only
        from ``before``: :class:`~storage.store.StaleApply` otherwise) and
        the commit. :class:`~storage.store.CommitUnknown` if the connection
        was lost after the commit was sent.
        """
        ...

    def close(self) -> None: ...


class SnapshotView(Protocol):
    """What a snapshot reads, inside one read-only transaction (one snapshot of the data)."""

    def has_table(self, table: str) -> bool: ...

    def table_columns(self, table: str) -> set[str]: ...

    def applied_token(self, stream: str) -> int:
        """The worker's applied token for the stream (0 if none)."""
        ...

    def token_bounds(self, table: str, after: int | None, upto: int) -> tuple[int | None, int | None]:
        """Lowest and highest ``token`` of ``table`` in ``(after, upto]`` (None, None if no rows)."""
        ...


class SnapshotReader(Protocol):
    """A worker's database opened read-only (never created nor migrated)."""

    def describe(self) -> str:
        """The database for messages: ``SQLite database /path`` or ``PostgreSQL database <url>`` (redacted)."""
        ...

    def read(self, fn: Callable[[SnapshotView], T]) -> T:
        """Run ``fn`` in one read-only transaction."""
        ...

    def close(self) -> None: ...
