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
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as e:  # a full disk, say: nothing was committed
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise StorageError(f"cannot commit to SQLite database {self.path}: {e}; nothing was written") from None

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
