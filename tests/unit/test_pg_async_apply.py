"""A worker's small apply on a non-blocking connection (``PgWorkerStore.open_async_apply``).

The same statement as ``apply_replicated`` for fewer than 50 rows; what it
refuses commits nothing and is left to the general way; a stale token is
refused; a lost connection says so.
"""

from __future__ import annotations

import select

import psycopg2
import pytest

from replication.streams import EVENTS
from storage.pg_worker import COPY_ROWS, PgAsyncApply
from storage.store import ApplyRefused, DatabaseUnavailable, StaleApply
from storage.worker_store import open_worker_store


def drive(call: PgAsyncApply, timeout: float = 10.0) -> None:
    while True:
        state = call.poll()
        if state == "done":
            return call.result()
        ready = (
            select.select([call.fileno()], [], [], timeout)
            if state == "read"
            else select.select([], [call.fileno()], [], timeout)
        )
        assert ready[0] or ready[1], "no answer"


def row(i: int) -> list:
    return [f"$e{i}", "!r", "m.room.message", None, None, 1000 + i]


@pytest.fixture
def worker_db(pg_url):
    store = open_worker_store(pg_url)
    store.create_replicated_table(EVENTS)
    call = store.open_async_apply()
    yield store, call
    call.close()
    store.close()


def rows_of(store) -> list[tuple]:
    return store.database.read(
        lambda cur: cur.execute(
            "SELECT token, instance_name, ts, event_id FROM replicated_events ORDER BY token"
        ).fetchall()
    )


def test_applies_moves_the_token_and_refuses_a_stale_one(worker_db) -> None:
    store, call = worker_db
    assert call.start("events", 2, EVENTS, [(1, "w", [row(1)]), (2, "w", [row(2), row(3)])])
    drive(call)
    assert store.applied_tokens() == {"events": 2}
    assert rows_of(store) == [(1, "w", 1001, "$e1"), (2, "w", 1002, "$e2"), (2, "w", 1003, "$e3")]
    assert call.start("events", 2, EVENTS, [(2, "w", [row(9)])])
    with pytest.raises(StaleApply):
        drive(call)
    assert len(rows_of(store)) == 3  # nothing inserted with a stale token
    assert call.start("events", 3, EVENTS, [(3, "w", [row(4)])])  # the connection is still usable
    drive(call)
    assert store.applied_tokens() == {"events": 3}


def test_rows_that_do_not_fit_are_refused_and_nothing_commits(worker_db) -> None:
    store, call = worker_db
    bad = ["$e1", "!r", 42, None, None, 1001]  # a number where text is declared
    assert call.start("events", 1, EVENTS, [(1, "w", [row(0)]), (1, "w", [bad])])
    with pytest.raises(ApplyRefused):
        drive(call)
    assert store.applied_tokens() == {} and rows_of(store) == []
    assert call.start("events", 1, EVENTS, [(1, "w", [row(1)])])  # usable afterwards
    drive(call)
    assert store.applied_tokens() == {"events": 1}


def test_many_rows_are_left_to_the_thread(worker_db) -> None:
    _store, call = worker_db
    assert not call.start("events", 1, EVENTS, [(1, "w", [row(i) for i in range(COPY_ROWS)])])


def test_a_terminated_connection_is_database_unavailable(worker_db, pg_url) -> None:
    store, call = worker_db
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'tickline-apply'")
        assert cur.fetchall() == [(True,)]
    conn.close()
    with pytest.raises(DatabaseUnavailable):
        call.start("events", 1, EVENTS, [(1, "w", [row(1)])])
        drive(call)
    assert store.applied_tokens() == {}
