"""A SQLite database file: one connection per thread, WAL, migrations.

``sqlite3`` connections must stay on their thread, so each thread gets its
own. WAL mode lets readers run beside the writer (and Spark's reads beside
both).

WAL checkpoints (copying the WAL's pages into the database file, which is
also when the WAL is synced: with ``synchronous = NORMAL`` a commit is
durable against a power loss once a checkpoint has run after it) are left to
the master where one follows the database: after its passes it runs a passive
checkpoint through SQLite (``PRAGMA wal_checkpoint(PASSIVE)`` on a database
thread, :meth:`SqliteChangeWatch.checkpoint`) once it delivered
:data:`CHECKPOINT_ROWS` rows to live connections since its last one, or
:data:`CHECKPOINT_SECONDS` went by
(:func:`checkpoint_due`, weighed by the watch's :class:`CheckpointSchedule`), so a large commit's checkpoint runs after its rows
went out, not beside the delivery. The master never opens SQLite's files
itself (closing any descriptor of ``<db>-shm`` would drop the process's
``fcntl`` locks on it: docs/benchmarks.md, "sqfan"). The writers of a stream
database (``SqliteStreamStore``) checkpoint on their own commits only once
the WAL holds :data:`WRITER_CHECKPOINT_BYTES` (SQLite's automatic
checkpoint, the backstop where no master runs): that bounds the WAL's growth
and what a power loss can take. Other databases (a worker's, a timeline's)
keep SQLite's default, 1000 pages.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attr

from storage.migrate import apply_migrations
from storage.store import DatabaseUnavailable, StorageError

# The master checkpoints after a pass once it delivered this many rows live since
# its last checkpoint (about SQLite's own 1000 pages for rows of ~300 bytes in
# single-row commits, more rows per page in large ones) ...
CHECKPOINT_ROWS = 1000
# ... or this long after its last one (the master's own commits, rows nobody
# took live from it, anything else written to the file); a checkpoint
# with nothing to copy does no I/O.
CHECKPOINT_SECONDS = 30.0
# After a checkpoint that could not copy every frame (a reader's snapshot holds
# them, or another checkpoint ran), the next try waits this long.
CHECKPOINT_RETRY_SECONDS = 1.0
# While the WAL holds this many frames (SQLite's own threshold, 1000 pages) the
# master checkpoints every CHECKPOINT_RETRY_SECONDS until a write started it over.
CHECKPOINT_FRAMES = 1000
# A writer's automatic checkpoint (wal_autocheckpoint, in pages of the file's
# size) runs only past this: the backstop where no master checkpoints. A
# transaction of 200,000 rows of the fan-out benchmark is about 62 MiB of WAL;
# its checkpoint costs about 0.65 us of CPU per row (docs/benchmarks.md, "sqfan").
WRITER_CHECKPOINT_BYTES = 256 << 20


def checkpoint_due(rows: int, seconds: float, complete: bool, paused: bool, frames: int = 0) -> bool:
    """Whether the master checkpoints the WAL now.

    ``rows``: rows it delivered live since its last checkpoint began (those it did not
    copy counted again); ``seconds``: since then; ``complete``: whether that
    checkpoint copied every frame (one that did not is tried again after
    :data:`CHECKPOINT_RETRY_SECONDS`); ``paused``: whether a connection is
    paused (its client has not taken what was written to it: the delivery is
    not over; then only once :data:`CHECKPOINT_SECONDS` went by); ``frames``:
    the frames the WAL held at that checkpoint (SQLite's answer). From
    :data:`CHECKPOINT_FRAMES` on (SQLite's own rule) it is also due every
    :data:`CHECKPOINT_RETRY_SECONDS` until an answer shows fewer: a WAL is
    started over from its beginning only by a write that finds every frame
    checkpointed and no reader in it, and a write that could not (the
    master's own timestamp commit beside a read) leaves frames that keep
    the next large commit from starting it over, so the file would grow by
    each burst.
    """
    if seconds >= CHECKPOINT_SECONDS:
        return True
    if paused:
        return False
    if seconds >= CHECKPOINT_RETRY_SECONDS and (not complete or frames >= CHECKPOINT_FRAMES):
        return True
    return complete and rows >= CHECKPOINT_ROWS


@attr.s(slots=True, auto_attribs=True)
class CheckpointSchedule:
    """When the master checkpoints the WAL next: what :func:`checkpoint_due` weighs, in one place.

    Held by the :class:`SqliteChangeWatch` and used on the master's reactor
    (no I/O). ``at``: when the last checkpoint began (reactor time; the
    master's start before the first); ``rows``: rows delivered live since
    (those a checkpoint did not copy counted again); ``complete``: whether
    it copied every frame; ``frames``: the frames the WAL held then
    (SQLite's answer).
    """

    at: float = 0.0
    rows: int = 0
    complete: bool = True
    frames: int = 0

    def delivered(self, rows: int) -> None:
        """``rows`` went out to live connections: checkpointed after their delivery."""
        self.rows += rows

    def due(self, now: float, paused: bool) -> bool:
        """:func:`checkpoint_due` now; ``paused``: whether a connection is paused (a delivery not over)."""
        return checkpoint_due(self.rows, now - self.at, self.complete, paused, self.frames)

    def begin(self, now: float) -> int:
        """A checkpoint begins now; returns the rows it covers (given back to :meth:`finished`)."""
        rows, self.rows = self.rows, 0
        self.at = now
        return rows

    def finished(self, rows: int, answer: tuple[int, int, int] | None) -> None:
        """SQLite's answer ``(busy, frames, copied)`` to the checkpoint that covered ``rows`` (None: it failed).

        One that did not copy every frame leaves its rows due again (after
        :data:`CHECKPOINT_RETRY_SECONDS`).
        """
        if answer is None:
            complete, frames = False, 0
        else:
            busy, frames, copied = answer
            complete = busy == 0 and frames == copied
        self.complete = complete
        self.frames = max(frames, 0)
        if not complete:
            self.rows += rows


class SqliteDatabase:
    dialect = "sqlite"
    placeholder = "?"

    def __init__(self, path: str, busy_timeout_ms: int = 30_000, checkpoint_bytes: int | None = None) -> None:
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
        # The size of the WAL past which a commit of this object's connections
        # checkpoints (None: SQLite's default, 1000 pages).
        self._checkpoint_bytes = checkpoint_bytes
        self._local = threading.local()

    # -- connections ------------------------------------------------------

    def connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            directory = os.path.dirname(self.path) or "."
            if not os.path.isdir(directory):
                raise DatabaseUnavailable(
                    f"cannot open SQLite database {self.path}: directory {directory} does not exist"
                )
            try:
                conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
                if self._checkpoint_bytes is not None:
                    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
                    conn.execute(f"PRAGMA wal_autocheckpoint = {max(1, self._checkpoint_bytes // int(page_size))}")
            except sqlite3.Error as e:
                raise DatabaseUnavailable(f"cannot open SQLite database {self.path}: {e}") from None
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        with self.transaction() as conn:
            return fn(conn)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (the write lock taken first): commits on exit, rolls back on error."""
        conn = self.connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise DatabaseUnavailable(f"cannot write SQLite database {self.path}: {e}") from None
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._commit(conn)

    def _commit(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as e:  # a full disk, say: nothing was committed
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise StorageError(f"cannot commit to SQLite database {self.path}: {e}; nothing was written") from None

    def try_write(self, fn: Callable[[sqlite3.Connection], Any]) -> tuple[bool, Any]:
        """Like :meth:`write` if the write lock is free now: ``(True, result)``; else ``(False, None)`` at once.

        For work that can do without writing (the master's oracle allocation):
        it never waits behind a writer's long transaction.
        """
        conn = self.connection()
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                return False, None
            raise DatabaseUnavailable(f"cannot write SQLite database {self.path}: {e}") from None
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        try:
            result = fn(conn)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._commit(conn)
        return True, result

    def query(self, sql: str, params: Any = ()) -> list[Any]:
        """One statement's rows, in a read transaction of its own."""
        rows: list[Any] = self.read(lambda conn: conn.execute(sql, params).fetchall())
        return rows

    def read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        conn = self.connection()
        conn.execute("BEGIN")
        try:
            return fn(conn)
        finally:
            conn.execute("COMMIT")

    def migrate(self) -> list[int]:
        """Create or upgrade the core tables; returns the versions applied."""

        def run(conn: sqlite3.Connection) -> list[int]:
            return apply_migrations(lambda sql, params: conn.execute(sql, params).fetchall(), "?")

        return self.write(run)


class SqliteChangeWatch:
    """Implements :class:`storage.contracts.ChangeWatch`: ``PRAGMA data_version`` on a connection of its own.

    SQLite changes a connection's ``data_version`` when another connection
    (of any process) committed since the connection last looked; a look is a
    read of the WAL index in shared memory, a few microseconds, and with a
    busy timeout of 0 it never waits for a lock (a busy database answers
    "changed", and the master's pass that follows runs on a database thread).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._checkpointer: sqlite3.Connection | None = None  # opened by the first checkpoint
        self.schedule = CheckpointSchedule()  # when the master checkpoints next (on its reactor)
        try:
            self._conn: sqlite3.Connection | None = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout = 0")
            self._version = self._read()
        except sqlite3.Error as e:
            raise DatabaseUnavailable(f"cannot open SQLite database {path}: {e}") from None

    def _read(self) -> int:
        assert self._conn is not None
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def changed(self) -> bool:
        if self._conn is None:
            return True
        try:
            version = self._read()
        except sqlite3.Error:
            return True
        if version == self._version:
            return False
        self._version = version
        return True

    def checkpoint(self) -> tuple[int, int, int]:
        """A passive checkpoint (never waits for readers or writers), on a database thread, one at a time.

        Returns SQLite's answer: (busy, frames in the WAL, frames checkpointed);
        every frame was copied when busy is 0 and the last two are equal (-1
        and -1 for a database not in WAL mode). Its own connection, opened on
        first use: the master never opens SQLite's files itself.
        """
        if self._checkpointer is None:
            try:
                self._checkpointer = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                self._checkpointer.execute("PRAGMA busy_timeout = 0")
            except sqlite3.Error as e:
                raise DatabaseUnavailable(f"cannot open SQLite database {self.path}: {e}") from None
        busy, frames, done = self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return int(busy), int(frames), int(done)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
