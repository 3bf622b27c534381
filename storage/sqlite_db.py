"""A SQLite database file: one connection per thread, WAL, migrations.

``sqlite3`` connections must stay on their thread, so each thread gets its
own. WAL mode lets readers run beside the writer (and Spark's reads beside
both).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

from storage.migrate import apply_migrations
from storage.store import DatabaseUnavailable, StorageError


class SqliteDatabase:
    dialect = "sqlite"
    placeholder = "?"

    def __init__(self, path: str, busy_timeout_ms: int = 30_000) -> None:
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
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

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
