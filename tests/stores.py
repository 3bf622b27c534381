"""Typed views of the stores tests open: the backend class behind ``open_store`` / ``open_worker_store``.

``open_store`` and ``open_worker_store`` return the contracts (``StreamStore``,
``WorkerStore``); tests that reach into a backend (its ``database``, its
``path``, a PostgreSQL writer's reporting thread) narrow the store to the
class it is with these helpers, which fail the test if it is another one.
PostgreSQL's classes are imported only when the store is not SQLite's (no
psycopg2 needed for SQLite tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from storage.sqlite_store import SqliteStreamStore
from storage.sqlite_worker import SqliteWorkerStore

if TYPE_CHECKING:
    from storage.contracts import StreamStore, WorkerStore
    from storage.pg_store import PgStreamStore
    from storage.pg_worker import PgWorkerStore


def backend_store(store: StreamStore) -> SqliteStreamStore | PgStreamStore:
    """The stream store as its backend's class (SQLite's or PostgreSQL's)."""
    if isinstance(store, SqliteStreamStore):
        return store
    return pg_store(store)


def sqlite_store(store: StreamStore) -> SqliteStreamStore:
    """The stream store, which must be SQLite's."""
    assert isinstance(store, SqliteStreamStore), f"not a SQLite store: {store!r}"
    return store


def pg_store(store: StreamStore) -> PgStreamStore:
    """The stream store, which must be PostgreSQL's."""
    from storage.pg_store import PgStreamStore

    assert isinstance(store, PgStreamStore), f"not a PostgreSQL store: {store!r}"
    return store


def backend_worker_store(store: WorkerStore) -> SqliteWorkerStore | PgWorkerStore:
    """The worker store as its backend's class (SQLite's or PostgreSQL's)."""
    if isinstance(store, SqliteWorkerStore):
        return store
    return pg_worker_store(store)


def sqlite_worker_store(store: WorkerStore) -> SqliteWorkerStore:
    """The worker store, which must be SQLite's."""
    assert isinstance(store, SqliteWorkerStore), f"not a SQLite worker store: {store!r}"
    return store


def pg_worker_store(store: WorkerStore) -> PgWorkerStore:
    """The worker store, which must be PostgreSQL's."""
    from storage.pg_worker import PgWorkerStore

    assert isinstance(store, PgWorkerStore), f"not a PostgreSQL worker store: {store!r}"
    return store
