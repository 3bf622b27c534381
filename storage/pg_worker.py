"""A worker's database on PostgreSQL: the worker store and the snapshot reader.

Imported only for PostgreSQL URLs (it imports psycopg2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg2
import psycopg2.extensions

from storage.contracts import Effects, ReplicatedValues, SnapshotView
from storage.pg_copy import copy_rows
from storage.pg_db import Cursor, PgDatabase
from storage.schema import StreamSchema
from storage.store import DatabaseUnavailable
from storage.urls import redact_url
from storage.worker_store import move_applied_token, token_bounds

T = TypeVar("T")
COPY_ROWS = 50  # applies of at least this many rows go by COPY


class PgApplyTransaction:
    """Implements :class:`storage.contracts.ApplyTransaction` on an open PostgreSQL transaction."""

    __slots__ = ("connection",)
    placeholder = "%s"

    def __init__(self, connection: Cursor) -> None:
        self.connection = connection

    def replicate(self, schema: StreamSchema, rows: Sequence[ReplicatedValues]) -> None:
        # Many rows per statement: by COPY from COPY_ROWS rows, else one multi-row INSERT.
        if len(rows) >= COPY_ROWS:
            copy_rows(self.connection.cursor, schema.replicated_table, schema, rows)
        else:
            self.connection.execute_values(schema.insert_replicated_values_sql(), rows)


class PgWorkerStore:
    """Implements :class:`storage.contracts.WorkerStore`; holds its :class:`PgDatabase`."""

    def __init__(self, dsn: str, synchronous_commit: bool = False) -> None:
        # synchronous_commit off (the default, as PostgreSQL's own apply workers):
        # a commit returns before its WAL is flushed. Exactly once still holds,
        # since the applied token commits in the same transaction as the
        # effects; a crash of the server may lose the last applies, token and
        # effects together, and the worker fetches those rows again.
        self.database = PgDatabase(dsn, settings={"synchronous_commit": "on" if synchronous_commit else "off"})

    def migrate(self) -> list[int]:
        return self.database.migrate()

    def close(self) -> None:
        self.database.close()

    def applied_tokens(self) -> dict[str, int]:
        rows = self.database.read(lambda cur: cur.execute("SELECT stream, token FROM tickline_applied").fetchall())
        return dict(rows)

    def create_replicated_table(self, schema: StreamSchema) -> None:
        def run(cur: Cursor) -> None:
            for statement in schema.create_replicated_table_sql("postgresql"):
                cur.execute(statement)

        self.database.write(run)

    def apply(self, stream: str, token: int, effects: Effects) -> None:
        def run(cur: Cursor) -> None:
            move_applied_token(cur.execute, "%s", stream, token)
            effects(PgApplyTransaction(cur))

        self.database.write(run)


class _PgView:
    """Implements :class:`storage.contracts.SnapshotView` inside one REPEATABLE READ transaction."""

    def __init__(self, cur: Any) -> None:
        self._cur = Cursor(cur)

    def has_table(self, table: str) -> bool:
        return self._cur.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None

    def table_columns(self, table: str) -> set[str]:
        rows = self._cur.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = %s AND table_schema = ANY (current_schemas(false))",
            (table,),
        ).fetchall()
        return {row[0] for row in rows}

    def applied_token(self, stream: str) -> int:
        found = self._cur.execute("SELECT token FROM tickline_applied WHERE stream = %s", (stream,)).fetchone()
        return 0 if found is None else int(found[0])

    def token_bounds(self, table: str, after: int | None, upto: int) -> tuple[int | None, int | None]:
        return token_bounds(self._cur.execute, "%s", table, after, upto)


class PgSnapshotReader:
    """Implements :class:`storage.contracts.SnapshotReader`: read-only REPEATABLE READ transactions."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def describe(self) -> str:
        return f"PostgreSQL database {redact_url(self.dsn)}"

    def read(self, fn: Callable[[SnapshotView], T]) -> T:
        try:
            conn = psycopg2.connect(self.dsn, connect_timeout=5, application_name="tickline-snapshot")
        except psycopg2.Error as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DatabaseUnavailable(redact_url(f"cannot connect to PostgreSQL at {self.dsn}: {message}")) from None
        try:
            # REPEATABLE READ: every statement sees the same snapshot.
            conn.set_session(isolation_level=psycopg2.extensions.ISOLATION_LEVEL_REPEATABLE_READ, readonly=True)
            with conn.cursor() as cur:
                result = fn(_PgView(cur))
            conn.commit()
            return result
        except psycopg2.Error as e:
            raise DatabaseUnavailable(redact_url(f"cannot read PostgreSQL at {self.dsn}: {str(e).strip()}")) from None
        finally:
            conn.close()

    def close(self) -> None:
        """Nothing stays open between reads."""
