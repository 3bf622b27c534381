"""A worker's database on SQLite: the worker store and the snapshot reader."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Sequence
from typing import TypeVar

from storage.contracts import Effects, ReceivedRows, ReplicatedValues, SnapshotView
from storage.schema import StreamSchema
from storage.sqlite_db import SqliteDatabase
from storage.store import DatabaseUnavailable
from storage.worker_store import move_applied_token, token_bounds

T = TypeVar("T")


class SqliteApplyTransaction:
    """Implements :class:`storage.contracts.ApplyTransaction` on an open SQLite transaction."""

    __slots__ = ("connection",)
    placeholder = "?"

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection

    def replicate(self, schema: StreamSchema, rows: Sequence[ReplicatedValues]) -> None:
        self.connection.executemany(schema.insert_replicated_sql("?"), rows)


class SqliteWorkerStore:
    """Implements :class:`storage.contracts.WorkerStore`; holds its :class:`SqliteDatabase`."""

    concurrent_applies = False  # one writer at a time: groups are applied one after another

    def __init__(self, path: str) -> None:
        self.database = SqliteDatabase(path)

    def migrate(self) -> list[int]:
        return self.database.migrate()

    def close(self) -> None:
        self.database.close()

    def hand_over_connection(self) -> None:
        """Nothing: opening a SQLite file takes no round trips to save."""

    def applied_tokens(self) -> dict[str, int]:
        rows = self.database.read(lambda conn: conn.execute("SELECT stream, token FROM tickline_applied").fetchall())
        return dict(rows)

    def create_replicated_table(self, schema: StreamSchema) -> None:
        def run(conn: sqlite3.Connection) -> None:
            for statement in schema.create_replicated_table_sql("sqlite"):
                conn.execute(statement)

        self.database.write(run)

    def apply(self, stream: str, token: int, effects: Effects) -> None:
        def run(conn: sqlite3.Connection) -> None:
            move_applied_token(conn.execute, "?", stream, token)
            effects(SqliteApplyTransaction(conn))

        self.database.write(run)

    def open_async_apply(self) -> None:
        """SQLite applies on the worker's database thread."""
        return None

    def apply_replicated(
        self,
        stream: str,
        token: int,
        schema: StreamSchema,
        received: Sequence[ReceivedRows],
        effects: Effects,
        prepared: bytes | None = None,
    ) -> None:
        self.apply(stream, token, effects)  # the rows go through the handlers' checks and executemany

    def prepare_replicated(self, schema: StreamSchema, received: Sequence[ReceivedRows]) -> None:
        """Nothing to make ahead on SQLite."""
        return None

    def apply_after(
        self, stream: str, token: int, before: int, schema: StreamSchema, prepared: bytes, ready: Callable[[], bool]
    ) -> bool:
        raise NotImplementedError("SQLite applies one group at a time (concurrent_applies is False)")


class _SqliteView:
    """Implements :class:`storage.contracts.SnapshotView` inside one read transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def has_table(self, table: str) -> bool:
        found = self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
        return found.fetchone() is not None

    def table_columns(self, table: str) -> set[str]:
        return {row[1] for row in self._conn.execute("SELECT * FROM pragma_table_info(?)", (table,)).fetchall()}

    def applied_token(self, stream: str) -> int:
        found = self._conn.execute("SELECT token FROM tickline_applied WHERE stream = ?", (stream,)).fetchone()
        return 0 if found is None else int(found[0])

    def token_bounds(self, table: str, after: int | None, upto: int) -> tuple[int | None, int | None]:
        return token_bounds(self._conn.execute, "?", table, after, upto)


class SqliteSnapshotReader:
    """Implements :class:`storage.contracts.SnapshotReader`: the file opened read-only (``mode=ro``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def describe(self) -> str:
        return f"SQLite database {self.path}"

    def read(self, fn: Callable[[SnapshotView], T]) -> T:
        if not os.path.isfile(self.path):
            raise DatabaseUnavailable(f"no SQLite database at {self.path} (is this the worker's database URL?)")
        try:
            conn = sqlite3.connect(f"file:{_uri_path(self.path)}?mode=ro", uri=True, timeout=30, isolation_level=None)
        except sqlite3.Error as e:
            raise DatabaseUnavailable(f"cannot open SQLite database {self.path}: {e}") from None
        try:
            # In WAL mode one read transaction sees one snapshot of the file.
            conn.execute("BEGIN")
            try:
                return fn(_SqliteView(conn))
            finally:
                conn.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            raise DatabaseUnavailable(f"cannot read SQLite database {self.path}: {e}") from None
        finally:
            conn.close()

    def close(self) -> None:
        """Nothing stays open between reads."""


def _uri_path(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="/")
