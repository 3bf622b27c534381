"""A worker apply whose connection is lost once its commit may have been sent: ``CommitUnknown``.

On the real PostgreSQL server: the ``COPY`` apply, whose ``COMMIT`` goes in the
same request as its rows (``test_pg_apply_after.py`` has the chained
``COPY``s on two connections); the small apply's one autocommit
statement (it commits on its own, so a connection lost once it was sent leaves
the outcome unknown) and the general apply's transaction, whose ``COMMIT`` is
sent after its backend was terminated. The worker settles a ``CommitUnknown``
by applying the same group again (``tests/workers/test_worker_protocol.py``);
a plain ``DatabaseUnavailable`` would be retried token by token, which stalls
on a stale token if the group had committed. In both cases here nothing
committed, and the next apply reconnects.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg2
import pytest

from replication.streams import EVENTS
from storage.store import CommitUnknown, DatabaseUnavailable
from storage.worker_store import open_worker_store
from tests.pg_sql import TS, lost_in_flight, query, received, replicated_tokens
from tests.stores import pg_worker_store


def _no_effects(txn: Any) -> None:
    raise AssertionError("the rows go by the one statement")


@pytest.fixture
def store(pg_url: str) -> Iterator[Any]:
    store = pg_worker_store(open_worker_store(pg_url))
    store.create_replicated_table(EVENTS)
    store.apply_replicated("events", 3, EVENTS, received(1, 3), _no_effects)  # applied: 3
    yield store
    store.close()


def _terminate(url: str, pid: int) -> None:
    """End backend ``pid`` and wait (up to 10 s) until it has exited."""
    killer = psycopg2.connect(url)
    killer.autocommit = True
    try:
        with killer.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
            assert cur.fetchone() == (True,)
    finally:
        killer.close()


def _lost_apply(store: Any, pg_url: str, *args: Any) -> Future:
    """``apply_replicated(*args)`` on one thread, its connection lost once the request was sent
    (held at ``replicated_events``, locked by the test). An earlier apply on that thread made the connection."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        backend = thread.submit(lambda: store.database.autocommit_connection().get_backend_pid()).result()
        return lost_in_flight(pg_url, "replicated_events", thread, backend, lambda: store.apply_replicated(*args))


def test_a_small_apply_whose_connection_is_lost_is_commit_unknown(store, pg_url) -> None:
    lost = _lost_apply(store, pg_url, "events", 5, EVENTS, received(4, 5), _no_effects)
    with pytest.raises(CommitUnknown) as raised:
        lost.result()
    assert str(raised.value).startswith("PostgreSQL at ") and "\n" not in str(raised.value)
    assert store.applied_tokens() == {"events": 3}
    assert replicated_tokens(pg_url) == [1, 2, 3]
    store.apply_replicated("events", 5, EVENTS, received(4, 5), _no_effects)  # a new connection
    assert replicated_tokens(pg_url) == [1, 2, 3, 4, 5]


def test_a_copy_apply_whose_connection_is_lost_is_commit_unknown(store, pg_url) -> None:
    """A ``COPY``-sized apply sends its ``COMMIT`` in the same request as its rows: a connection lost
    once that request was sent (here while it waits at the table) leaves the outcome unknown."""
    store.apply_replicated("events", 100, EVENTS, received(4, 100), _no_effects)  # the move prepared
    lost = _lost_apply(store, pg_url, "events", 200, EVENTS, received(101, 200), _no_effects)
    with pytest.raises(CommitUnknown):
        lost.result()
    assert store.applied_tokens() == {"events": 100}
    assert replicated_tokens(pg_url) == list(range(1, 101))
    store.apply_replicated("events", 200, EVENTS, received(101, 200), _no_effects)  # a new connection
    assert replicated_tokens(pg_url) == list(range(1, 201))


def test_an_apply_after_its_idle_connection_was_terminated_is_sent_on_a_new_one(store, pg_url) -> None:
    """The server closed the idle connection: found before the apply is sent (``pg_db.closed_while_idle``),
    so no ``CommitUnknown`` for a request the server never saw."""
    for last, first in ((5, 4), (100, 6)):  # the small apply, then the COPY-sized one
        _terminate(pg_url, store.database.autocommit_connection().get_backend_pid())
        store.apply_replicated("events", last, EVENTS, received(first, last), _no_effects)
        assert replicated_tokens(pg_url) == list(range(1, last + 1))


def test_a_copy_apply_the_server_refuses_commits_nothing(store, pg_url) -> None:
    """A row the server's ``COPY`` refuses (here a check constraint on the table) stops the request
    before its ``COMMIT``: neither the rows nor the token's move commit, the error is the server's
    (not ``CommitUnknown``), and the same connection applies the next group."""
    query(pg_url, "ALTER TABLE replicated_events ADD CONSTRAINT not_50 CHECK (token <> 50)")
    pid = store.database.autocommit_connection().get_backend_pid()
    with pytest.raises(psycopg2.Error, match="not_50") as raised:
        store.apply_replicated("events", 100, EVENTS, received(4, 100), _no_effects)
    assert not isinstance(raised.value, CommitUnknown)
    assert store.applied_tokens() == {"events": 3}
    assert replicated_tokens(pg_url) == [1, 2, 3]
    query(pg_url, "ALTER TABLE replicated_events DROP CONSTRAINT not_50")
    store.apply_replicated("events", 100, EVENTS, received(4, 100), _no_effects)
    assert store.database.autocommit_connection().get_backend_pid() == pid
    assert store.applied_tokens() == {"events": 100}
    assert replicated_tokens(pg_url) == list(range(1, 101))


def test_a_general_apply_whose_commit_finds_its_connection_gone_is_commit_unknown(store, pg_url) -> None:
    def effects(txn: Any) -> None:
        # The backend is ended while the transaction is open: the COMMIT that follows is sent
        # to a closed connection (whether a COMMIT arrived is what the error cannot tell).
        (pid,) = txn.connection.execute("SELECT pg_backend_pid()").fetchone()
        txn.replicate(EVENTS, [(4, "m", TS + 4, "$e4", "!r", "m.t", None, None)])
        _terminate(pg_url, pid)

    with pytest.raises(CommitUnknown):
        store.apply("events", 4, effects)
    assert store.applied_tokens() == {"events": 3}
    assert replicated_tokens(pg_url) == [1, 2, 3]


def test_a_general_apply_lost_before_its_commit_is_not_commit_unknown(store, pg_url) -> None:
    """A statement inside the transaction fails on the lost connection: nothing was committed, so
    the plain error (retried by the consumer as usual)."""

    def effects(txn: Any) -> None:
        (pid,) = txn.connection.execute("SELECT pg_backend_pid()").fetchone()
        _terminate(pg_url, pid)
        txn.connection.execute("SELECT 1")

    with pytest.raises(DatabaseUnavailable) as raised:
        store.apply("events", 4, effects)
    assert not isinstance(raised.value, CommitUnknown)
    assert store.applied_tokens() == {"events": 3}


def test_an_error_the_server_reports_is_not_commit_unknown(store, pg_url) -> None:
    """A lock timeout ends the statement with the server's own error: nothing committed, so the plain
    error (the consumer's retry with backoff), not an immediate apply again."""
    holder = psycopg2.connect(pg_url)
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT token FROM tickline_applied WHERE stream = 'events' FOR UPDATE")
        with store.database.autocommit_connection().cursor() as cur:
            cur.execute("SET lock_timeout = '50ms'")
        with pytest.raises(DatabaseUnavailable) as raised:
            store.apply_replicated("events", 5, EVENTS, received(4, 5), _no_effects)
        assert not isinstance(raised.value, CommitUnknown)
        assert "lock timeout" in str(raised.value)
    finally:
        holder.close()
    assert store.applied_tokens() == {"events": 3}
    store.apply_replicated("events", 5, EVENTS, received(4, 5), _no_effects)
    assert replicated_tokens(pg_url) == [1, 2, 3, 4, 5]
