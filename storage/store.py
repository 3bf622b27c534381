"""The stream store's errors, row shape and factory (one per database URL)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from storage.schema import StreamSchema
from storage.urls import DatabaseUrl, parse_database_url

# A stored row as read back: (seq, token, instance_name, ts, *column values).
# JSON columns are JSON text; booleans may come back as 0/1 from SQLite.
StoredRow = tuple[Any, ...]
SEQ, TOKEN, INSTANCE, TS, FIRST_VALUE = 0, 1, 2, 3, 4


class StorageError(Exception):
    """Base of the storage layer's errors; the message names what was wrong."""


class DatabaseUnavailable(StorageError):
    """The database cannot be opened or reached."""


class SchemaMismatch(StorageError):
    """A stream's declaration differs from what the database holds."""


class UnknownStream(StorageError, KeyError):
    """No stream of that name is registered."""

    def __str__(self) -> str:
        return f"unknown stream {self.args[0]!r}"


class StreamCatalog:
    """The stream declarations a store knows, cached; mixed into both stores."""

    _schemas: dict[str, StreamSchema]
    _lock: threading.Lock
    placeholder: str
    read: Callable[[Callable[[Any], Any]], Any]

    def catalog(self) -> dict[str, StreamSchema]:
        """Every stream registered in this database."""
        rows = self.read(lambda cur: cur.execute("SELECT name, columns FROM tickline_streams").fetchall())
        found = {name: StreamSchema.from_columns_json(name, columns) for name, columns in rows}
        with self._lock:
            self._schemas.update(found)
        return found

    def _registered_already(self, cur: Any, schema: StreamSchema) -> bool:
        """In a registering transaction: is the stream there (refusing a changed declaration)?"""
        p = self.placeholder
        found = cur.execute(f"SELECT columns FROM tickline_streams WHERE name = {p}", (schema.name,)).fetchone()
        if found is None:
            return False
        stored = StreamSchema.from_columns_json(schema.name, found[0])
        if stored != schema:
            raise SchemaMismatch(
                f"stream {schema.name!r} is declared with columns {schema.columns_json()} "
                f"but the database has {stored.columns_json()}"
            )
        return True

    def schema(self, stream: str) -> StreamSchema:
        schema = self._schemas.get(stream)
        if schema is None:
            schema = self.catalog().get(stream)
        if schema is None:
            raise UnknownStream(stream)
        return schema


def require_postgres() -> None:
    """Fail with one line naming the extra when psycopg2 is not installed."""
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        raise DatabaseUnavailable(
            "PostgreSQL support is not installed (psycopg2 is missing): pip install 'tickline[postgres]'"
        ) from None


def open_store(
    url: str | DatabaseUrl,
    clock: Callable[[], float] = time.time,
    base_dir: str | None = None,
    max_line_bytes: int | None = None,
    **pg_options: Any,
):
    """Open (and migrate) the stream store behind a database URL.

    ``max_line_bytes`` (the protocol's line limit; the default's when None)
    bounds the RDATA line of every row written through this store.
    """
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    store: Any
    if parsed.is_sqlite:
        from storage.sqlite_store import SqliteStreamStore

        assert parsed.path is not None
        store = SqliteStreamStore(parsed.path, clock=clock)
    else:
        require_postgres()
        from storage.pg_store import PgStreamStore

        assert parsed.dsn is not None

        store = PgStreamStore(parsed.dsn, clock=clock, **pg_options)
    if max_line_bytes is not None:
        store.max_line_bytes = max_line_bytes
    store.migrate()
    return store
