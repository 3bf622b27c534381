"""The storage errors, the stored row's layout, the stream catalog and the stream store's factory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from storage.contracts import StoredRow, StreamStore
from storage.schema import StreamSchema
from storage.urls import DatabaseUrl, parse_database_url

__all__ = ["StoredRow", "StreamStore", "open_store"]

# Positions in a stored row (and, but for FIRST_VALUE, in a JSON row).
SEQ: Final = 0
TOKEN: Final = 1
INSTANCE: Final = 2
TS: Final = 3
FIRST_VALUE: Final = 4


class Database(Protocol):
    """What a store needs of the database object it holds (``SqliteDatabase``, ``PgDatabase``)."""

    placeholder: str

    def read(self, fn: Callable[[Any], Any]) -> Any: ...

    def write(self, fn: Callable[[Any], Any]) -> Any: ...


class StorageError(Exception):
    """Base of the storage layer's errors; the message names what was wrong."""


def error_line(e: BaseException) -> str:
    """An error's message as one line (a driver's may span several): its first, or the error's type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class DatabaseUnavailable(StorageError):
    """The database cannot be opened or reached."""


class CommitUnknown(DatabaseUnavailable):
    """The connection was lost after a ``COMMIT`` was sent: it may or may not have committed.

    A worker's apply: retrying the same group tells (a :class:`StaleApply`
    then means it had). A writer's append: its rows may be in the stream;
    written again, they would be there twice.
    """


class SchemaMismatch(StorageError):
    """A stream's declaration differs from what the database holds."""


class UnknownStream(StorageError, KeyError):
    """No stream of that name is registered."""

    def __str__(self) -> str:
        return f"unknown stream {self.args[0]!r}"


class StaleApply(StorageError):
    """An apply at or below the stream's applied token (a bug upstream: history is not rewritten)."""


class ApplyRefused(StorageError):
    """A one-statement apply refused its rows (a row does not fit): apply them the general way, which names it."""


class StreamCatalog:
    """The stream declarations a database holds, cached; each stream store holds one."""

    def __init__(self, database: Database) -> None:
        self._database = database
        self._schemas: dict[str, StreamSchema] = {}
        self._lock = threading.Lock()

    def catalog(self) -> dict[str, StreamSchema]:
        """Every stream registered in this database."""
        rows = self._database.read(lambda cur: cur.execute("SELECT name, columns FROM tickline_streams").fetchall())
        found = {name: StreamSchema.from_columns_json(name, columns) for name, columns in rows}
        with self._lock:
            self._schemas.update(found)
        return found

    def known(self) -> list[StreamSchema]:
        """The schemas seen so far (without reading the database)."""
        with self._lock:
            return list(self._schemas.values())

    def remember(self, schema: StreamSchema) -> None:
        with self._lock:
            self._schemas[schema.name] = schema

    def registered_already(self, cur: Any, schema: StreamSchema) -> bool:
        """In a registering transaction: is the stream there (refusing a changed declaration)?"""
        p = self._database.placeholder
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
) -> StreamStore:
    """Open (and migrate) the stream store behind a database URL.

    ``pg_options`` (``report_interval``, ``writer_timeout``) apply to PostgreSQL only.
    psycopg2 is imported only for a PostgreSQL URL. ``max_line_bytes`` (the
    protocol's line limit; the default's when None) bounds the RDATA line of
    every row written through the store.
    """
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    if parsed.is_sqlite:
        from storage.sqlite_store import SqliteStreamStore

        assert parsed.path is not None
        sqlite_store = SqliteStreamStore(parsed.path, clock=clock)
        if max_line_bytes is not None:
            sqlite_store.max_line_bytes = max_line_bytes
        sqlite_store.migrate()
        return sqlite_store
    require_postgres()
    from storage.pg_store import PgStreamStore

    assert parsed.dsn is not None
    pg_store = PgStreamStore(parsed.dsn, clock=clock, **pg_options)
    if max_line_bytes is not None:
        pg_store.max_line_bytes = max_line_bytes
    pg_store.migrate()
    return pg_store
