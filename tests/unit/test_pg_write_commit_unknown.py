"""A writer whose connection is lost once its ``COMMIT`` may have been sent: ``CommitUnknown``, said so.

On the real PostgreSQL server, the backend of the writer's connection is
terminated (and awaited) at a chosen point. Lost before any statement with
the ``COMMIT`` went out, the write certainly did not commit: a plain
``DatabaseUnavailable`` ("nothing was committed" from ``tickline write``).
Lost once it went out, the writer cannot tell whether the rows are in:
``CommitUnknown``, and ``tickline write``'s error says the write may have
committed, so that nobody writes the rows again believing they are not there
(they would be twice). Here the backend was gone before the ``COMMIT``
arrived, so nothing committed; the next write reconnects.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from replication.streams import EVENTS
from storage.bulk import CHUNK_ROWS, write_rows
from storage.pg_db import PgDatabase, closed_while_idle
from storage.store import CommitUnknown, DatabaseUnavailable, StorageError, open_store
from tests.pg_sql import lost_in_flight, query
from tests.stores import pg_store

ROW = ["$a", "!r", "m.room.message", None, None]


@pytest.fixture
def store(pg_url):
    s = pg_store(open_store(pg_url, report_interval=3600.0))
    s.register_stream(EVENTS)
    yield s
    s.close()


def _terminate(url: str, pid: int) -> None:
    assert query(url, "SELECT pg_terminate_backend(%s, 10000)", (pid,)) == [(True,)]


def _tokens(store) -> list[int]:
    return [r[1] for r in store.read_rows("events", 0, 10**9, 10**6)]


def test_a_transaction_whose_commit_finds_its_connection_gone_is_commit_unknown(store, pg_url) -> None:
    with pytest.raises(CommitUnknown) as raised, store.writing("events", "w") as txn:
        txn.append([ROW, ROW])
        _terminate(pg_url, store._writes.conn.get_backend_pid())
    assert "\n" not in str(raised.value)
    assert _tokens(store) == []
    assert store.append("events", [ROW], "w") == [3]  # a new connection; tokens 1-2 are skipped


def test_a_transaction_lost_before_its_commit_is_not_commit_unknown(store, pg_url) -> None:
    with pytest.raises(DatabaseUnavailable) as raised, store.writing("events", "w") as txn:
        txn.append([ROW])
        _terminate(pg_url, store._writes.conn.get_backend_pid())
        txn.append([ROW])
    assert not isinstance(raised.value, CommitUnknown)
    assert _tokens(store) == []


@pytest.mark.parametrize("count", [1, 3])
def test_a_single_statement_append_whose_connection_is_lost_is_commit_unknown(store, pg_url, count) -> None:
    """A small append is one autocommit statement: sent, it commits on its own.

    The statement is held at the stream's table (locked by another session)
    until its backend is terminated: lost after it was sent. Both appends run
    on one thread, so on one connection (the store's are per thread).
    """
    with ThreadPoolExecutor(max_workers=1) as thread:
        first = thread.submit(store.append, "events", [ROW] * count, "w").result()  # statements prepared
        backend = thread.submit(lambda: store._side.conn.get_backend_pid()).result()
        lost = lost_in_flight(
            pg_url, "stream_events", thread, backend, lambda: store.append("events", [ROW] * count, "w")
        )
    with pytest.raises(CommitUnknown) as raised:
        lost.result()
    assert "\n" not in str(raised.value) and "PostgreSQL at" in str(raised.value)
    assert _tokens(store) == first
    again = store.append("events", [ROW] * count, "w")
    assert _tokens(store) == first + again


@pytest.mark.parametrize("count", [1, 3, CHUNK_ROWS])
def test_an_append_after_its_idle_connection_was_terminated_is_written_on_a_new_one(store, pg_url, count) -> None:
    """Terminated while idle, the connection is found closed before the next append is sent: no error at all.

    Before, the append was sent on the dead connection, and its loss read as a
    commit whose answer was lost ("may have committed"), though nothing had
    been sent.
    """
    first = store.append("events", [ROW] * count, "w")
    for conn in (store._side.conn, getattr(store._writes, "conn", None)):
        if conn is not None:
            _terminate(pg_url, conn.get_backend_pid())
    again = store.append("events", [ROW] * count, "w")
    assert _tokens(store) == first + again


def test_a_transaction_after_its_idle_connection_was_terminated_is_written_on_a_new_one(store, pg_url) -> None:
    with store.writing("events", "w") as txn:
        first = txn.append([ROW, ROW])
    _terminate(pg_url, store._writes.conn.get_backend_pid())
    with store.writing("events", "w") as txn:
        again = txn.append([ROW, ROW])
    assert _tokens(store) == first + again


def test_tickline_write_says_a_write_lost_at_its_commit_may_have_committed(store, pg_url) -> None:
    def rows() -> Iterator[tuple[str, list]]:
        for n in range(CHUNK_ROWS):
            yield f"stdin line {n + 1}", ROW
        # Every row appended (a full chunk): the connection goes before the COMMIT is sent.
        _terminate(pg_url, store._writes.conn.get_backend_pid())

    with pytest.raises(StorageError) as raised:
        write_rows(store, "events", rows(), "w")
    message = str(raised.value)
    assert message.startswith("the write may have committed: the connection was lost as it committed (PostgreSQL at ")
    assert message.endswith("look for its rows before writing them again") and "\n" not in message
    assert _tokens(store) == []


def test_tickline_write_lost_before_its_commit_says_nothing_was_committed(store, pg_url) -> None:
    def rows() -> Iterator[tuple[str, list]]:
        yield "stdin line 1", ROW
        _terminate(pg_url, store._writes.conn.get_backend_pid())  # the connection is open since the first row
        yield "stdin line 2", ROW

    with pytest.raises(StorageError) as raised:
        write_rows(store, "events", rows(), "w", chunk_rows=1)
    assert str(raised.value).startswith("the write failed, nothing was committed: PostgreSQL at ")
    assert _tokens(store) == []


def test_connections_closed_are_let_go(pg_url) -> None:
    """A process that reconnects again and again holds only its open connections (``PgDatabase._all``)."""
    database = PgDatabase(pg_url)
    try:
        for _ in range(20):
            database.connect(autocommit=True).close()
        kept = database.connect(autocommit=True)
        assert database._all == [kept]
    finally:
        database.close()


def test_an_open_connection_on_a_descriptor_past_1024_is_not_taken_for_closed(pg_url) -> None:
    """``closed_while_idle`` polls: ``select`` would refuse a descriptor from 1024 on, and every write of
    a process with many sockets would then open a new connection."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        pytest.skip(f"the soft limit of open files is {soft}")
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    database = PgDatabase(pg_url)
    try:
        conn = database.connect(autocommit=True)
        assert conn.fileno() >= 1024
        assert not closed_while_idle(conn)
    finally:
        database.close()
        for fd in spare:
            os.close(fd)
