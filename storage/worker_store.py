"""A worker's database: applied tokens, written with the effects of the rows.

``apply`` runs the caller's effects and moves the stream's applied token in
one transaction: after a crash (even ``kill -9``) either both happened or
neither did, so a resumed worker neither loses nor repeats a row.

The backends live in ``storage.sqlite_worker`` and ``storage.pg_worker``;
the factories here import the PostgreSQL one (and psycopg2) only for a
PostgreSQL URL. :func:`open_snapshot_reader` opens a worker's database
read-only for a Spark snapshot: it never creates nor migrates it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from storage.contracts import ApplyTransaction, Effects, ReceivedRows, SnapshotReader, WorkerStore
from storage.store import StaleApply, require_postgres
from storage.urls import DatabaseUrl, parse_database_url

__all__ = [
    "ApplyTransaction",
    "Effects",
    "SnapshotReader",
    "StaleApply",
    "WorkerStore",
    "open_snapshot_reader",
    "open_worker_store",
]

Execute = Callable[[str, tuple[Any, ...]], Any]


def expand_received(received: Sequence[ReceivedRows]) -> list[ReceivedRows]:
    """``received`` with one entry per token: a run (a list of tokens, one per row) split into its tokens."""
    if all(type(entry[0]) is int for entry in received):
        return list(received)
    out: list[ReceivedRows] = []
    for token, instance, rows in received:
        if type(token) is list:
            out += [(t, instance, [row]) for t, row in zip(token, rows, strict=True)]
        else:
            out.append((token, instance, rows))
    return out


def move_applied_token_sql(p: str) -> str:
    """The statement moving a stream's applied token forwards (parameters: stream, token); rowcount 1 if it moved."""
    return (
        f"INSERT INTO tickline_applied (stream, token) VALUES ({p}, {p}) "
        "ON CONFLICT (stream) DO UPDATE SET token = excluded.token "
        "WHERE tickline_applied.token < excluded.token"
    )


def move_applied_token(execute: Execute, placeholder: str, stream: str, token: int) -> None:
    """Inside an apply transaction: move the stream's applied token forwards, or :class:`StaleApply`.

    One statement moves the token only forwards (and locks the row); ``execute``
    returns a cursor with ``rowcount``.
    """
    moved = execute(move_applied_token_sql(placeholder), (stream, token)).rowcount
    if moved != 1:
        raise StaleApply(f"stream {stream!r}: token {token} is not above the applied token")


def token_bounds(execute: Execute, p: str, table: str, after: int | None, upto: int) -> tuple[int | None, int | None]:
    """In a read transaction: lowest and highest token of ``table`` in ``(after, upto]``."""
    if not table.replace("_", "").isalnum():
        raise ValueError(f"bad table name {table!r}")
    if after is None:
        row = execute(f"SELECT min(token), max(token) FROM {table} WHERE token <= {p}", (upto,)).fetchone()
    else:
        row = execute(
            f"SELECT min(token), max(token) FROM {table} WHERE token > {p} AND token <= {p}", (after, upto)
        ).fetchone()
    low, high = row
    return (None if low is None else int(low)), (None if high is None else int(high))


def open_worker_store(
    url: str | DatabaseUrl, base_dir: str | None = None, synchronous_commit: bool = False
) -> WorkerStore:
    """Open (and migrate) a worker's database.

    ``synchronous_commit`` (PostgreSQL only): wait for each apply's WAL flush.
    Off by default, as PostgreSQL's apply workers: see ``docs/workers.md``.
    """
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    if parsed.is_sqlite:
        from storage.sqlite_worker import SqliteWorkerStore

        assert parsed.path is not None
        sqlite_store = SqliteWorkerStore(parsed.path)
        sqlite_store.migrate()
        return sqlite_store
    require_postgres()
    from storage.pg_worker import PgWorkerStore

    assert parsed.dsn is not None
    pg_store = PgWorkerStore(parsed.dsn, synchronous_commit)
    pg_store.migrate()
    return pg_store


def open_snapshot_reader(url: str | DatabaseUrl, base_dir: str | None = None) -> SnapshotReader:
    """A worker's database opened read-only, for snapshots (nothing is created or migrated).

    Raises :class:`~storage.store.DatabaseUnavailable` if there is no such database
    or it cannot be reached.
    """
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    if parsed.is_sqlite:
        from storage.sqlite_worker import SqliteSnapshotReader

        assert parsed.path is not None
        return SqliteSnapshotReader(parsed.path)
    require_postgres()
    from storage.pg_worker import PgSnapshotReader

    assert parsed.dsn is not None
    return PgSnapshotReader(parsed.dsn)
