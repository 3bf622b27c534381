"""A worker's database: applied tokens, written with the effects of the rows.

``apply`` runs the caller's effects and moves the stream's applied token in
one transaction: after a crash (even ``kill -9``) either both happened or
neither did, so a resumed worker neither loses nor repeats a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from storage.schema import StreamSchema
from storage.sqlite_db import SqliteDatabase
from storage.store import require_postgres
from storage.urls import DatabaseUrl, parse_database_url

Effects = Callable[[Any], None]


class WorkerStore:
    """Worker state on either database (mixed into its connection class)."""

    placeholder: str
    dialect: str
    read: Callable[[Callable[[Any], Any]], Any]
    write: Callable[[Callable[[Any], Any]], Any]

    def applied_tokens(self) -> dict[str, int]:
        rows = self.read(lambda conn: conn.execute("SELECT stream, token FROM tickline_applied").fetchall())
        return dict(rows)

    def create_replicated_table(self, schema: StreamSchema) -> None:
        def run(conn: Any) -> None:
            for statement in schema.create_replicated_table_sql(self.dialect):
                conn.execute(statement)

        self.write(run)

    def apply(self, stream: str, token: int, effects: Effects) -> None:
        """Run ``effects(connection)`` and set the applied token, atomically.

        Refuses to move the token backwards (a stale or repeated apply is a bug
        upstream, and must not rewrite history).
        """

        p = self.placeholder

        def run(conn: Any) -> None:
            # One statement moves the token only forwards (and locks the row).
            moved = conn.execute(
                f"INSERT INTO tickline_applied (stream, token) VALUES ({p}, {p}) "
                "ON CONFLICT (stream) DO UPDATE SET token = excluded.token "
                "WHERE tickline_applied.token < excluded.token",
                (stream, token),
            ).rowcount
            if moved != 1:
                raise StaleApply(f"stream {stream!r}: token {token} is not above the applied token")
            effects(conn)

        self.write(run)


class StaleApply(Exception):
    """An apply at or below the stream's applied token."""


class SqliteWorkerStore(WorkerStore, SqliteDatabase):
    placeholder = "?"


def open_worker_store(url: str | DatabaseUrl, base_dir: str | None = None) -> WorkerStore:
    """Open (and migrate) a worker's database."""
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    store: WorkerStore
    if parsed.is_sqlite:
        assert parsed.path is not None
        store = SqliteWorkerStore(parsed.path)
    else:
        require_postgres()
        from storage.pg_db import PgDatabase

        class PgWorkerStore(WorkerStore, PgDatabase):
            placeholder = "%s"

        assert parsed.dsn is not None
        store = PgWorkerStore(parsed.dsn)
    store.migrate()
    return store
