"""``PgWorkerStore.apply_after``: a group copied while the group before it is still applied.

On the real PostgreSQL server: the group before is an open transaction on a
connection of the test's (it has moved the token and inserted its rows, not
committed), the group behind it runs ``apply_after`` on a thread of its own.
Its rows are copied at once; its token moves only from exactly the group
before's last token, after that committed; if that did not commit, nothing of
it commits. A lost connection commits nothing and the next apply reconnects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest

from replication.streams import EVENTS
from storage.store import CommitUnknown, StaleApply
from storage.worker_store import open_worker_store
from tests.integration.procs import wait_for
from tests.pg_sql import TS, received, replicated_tokens
from tests.stores import pg_worker_store


@pytest.fixture
def store(pg_url: str) -> Iterator[Any]:
    store = pg_worker_store(open_worker_store(pg_url))
    store.create_replicated_table(EVENTS)
    store.apply_replicated("events", 100, EVENTS, received(1, 100), _no_effects)  # applied: 100
    yield store
    store.close()


def _no_effects(txn: Any) -> None:
    raise AssertionError("the rows go by COPY")


def _backends_waiting_for_a_lock(url: str) -> int:
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            (waiting,) = cur.fetchone()
            return int(waiting)
    finally:
        conn.close()


def _before_open(url: str) -> Any:
    """The group before (tokens 101..200) as another connection applies it: token moved, rows in, not committed."""
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("UPDATE tickline_applied SET token = 200 WHERE stream = 'events' AND token = 100")
        cur.execute(
            "INSERT INTO replicated_events (token, instance_name, ts, event_id, room_id, type) "
            "SELECT n, 'm', %s + n, '$e' || n, '!r', 'm.t' FROM generate_series(101, 200) AS n",
            (TS,),
        )
    return conn


class Behind(threading.Thread):
    """``apply_after`` of tokens 201..300 behind the group ending at 200, its ``ready()`` answered by the test."""

    def __init__(self, store: Any, before: int = 200) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.before = before
        self.copied = threading.Event()  # ready() was called: the COPY is done
        self.answer: Callable[[], bool] = lambda: True
        self.go = threading.Event()
        self.result: Any = None

    def ready(self) -> bool:
        self.copied.set()
        assert self.go.wait(30)
        return self.answer()

    def run(self) -> None:
        text = self.store.prepare_replicated(EVENTS, received(201, 300))
        try:
            self.result = self.store.apply_after("events", 300, self.before, EVENTS, text, self.ready)
        except Exception as e:
            self.result = e

    def finish(self, answer: bool) -> Any:
        self.answer = lambda: answer
        self.go.set()
        self.join(30)
        assert not self.is_alive()
        return self.result


def test_a_group_copied_beside_the_one_before_commits_only_after_it(store, pg_url) -> None:
    before = _before_open(pg_url)
    behind = Behind(store)
    behind.start()
    assert behind.copied.wait(30)  # copied while the group before is open
    assert replicated_tokens(pg_url) == list(range(1, 101))  # neither is visible yet
    before.commit()
    assert behind.finish(True) is True
    before.close()
    assert store.applied_tokens() == {"events": 300}
    assert replicated_tokens(pg_url) == list(range(1, 301))  # every row once, in order


def test_a_group_behind_one_that_did_not_commit_commits_nothing(store, pg_url) -> None:
    before = _before_open(pg_url)
    behind = Behind(store)
    behind.start()
    assert behind.copied.wait(30)
    before.rollback()
    before.close()
    assert behind.finish(False) is False
    assert store.applied_tokens() == {"events": 100}
    assert replicated_tokens(pg_url) == list(range(1, 101))
    # The thread's connection is usable: the groups are applied again, in order.
    store.apply_replicated("events", 200, EVENTS, received(101, 200), _no_effects)
    assert store.apply_after(
        "events", 300, 200, EVENTS, store.prepare_replicated(EVENTS, received(201, 300)), lambda: True
    )
    assert replicated_tokens(pg_url) == list(range(1, 301))


def test_the_token_moves_only_from_exactly_the_group_before(store, pg_url) -> None:
    """Told that the group before committed when it did not (rolled back): the move finds the token
    elsewhere and nothing commits, so even a wrong answer never skips a group."""
    before = _before_open(pg_url)
    behind = Behind(store)
    behind.start()
    assert behind.copied.wait(30)
    before.rollback()
    before.close()
    assert isinstance(behind.finish(True), StaleApply)
    assert store.applied_tokens() == {"events": 100}
    assert replicated_tokens(pg_url) == list(range(1, 101))
    # A token beyond the group before (applied twice?): refused as well.
    with pytest.raises(StaleApply):
        store.apply_after("events", 300, 50, EVENTS, store.prepare_replicated(EVENTS, received(201, 300)), lambda: True)
    assert replicated_tokens(pg_url) == list(range(1, 101))


def test_the_move_waits_for_the_row_lock_of_the_group_before(store, pg_url) -> None:
    """Answered True while the group before is still open (its commit on the way): the move waits for
    that transaction's row lock and moves once it committed (READ COMMITTED re-reads the row)."""
    before = _before_open(pg_url)
    behind = Behind(store)
    behind.start()
    assert behind.copied.wait(30)
    behind.answer = lambda: True
    behind.go.set()
    # Blocked on the group before's row lock (awaited, not slept on: a plain UPDATE would not wait).
    wait_for(lambda: _backends_waiting_for_a_lock(pg_url) == 1, 30.0, "the move to wait for the row lock")
    assert behind.is_alive()
    assert replicated_tokens(pg_url) == list(range(1, 101))
    before.commit()
    before.close()
    assert behind.finish(True) is True
    assert store.applied_tokens() == {"events": 300}
    assert replicated_tokens(pg_url) == list(range(1, 301))


def test_a_lost_connection_commits_nothing_and_the_next_apply_reconnects(store, pg_url) -> None:
    behind = Behind(store, before=100)  # the group before committed long ago
    behind.start()
    assert behind.copied.wait(30)
    killer = psycopg2.connect(pg_url)
    killer.autocommit = True
    with killer.cursor() as cur:
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'idle in transaction'"
        )
        assert len(cur.fetchall()) == 1
    killer.close()
    result = behind.finish(True)
    # The connection fails as the move and COMMIT are sent: whether they arrived is not known
    # there (the worker applies the same group again to find out); here they did not.
    assert isinstance(result, CommitUnknown)
    assert store.applied_tokens() == {"events": 100}
    assert replicated_tokens(pg_url) == list(range(1, 101))
    assert store.apply_after(
        "events", 300, 100, EVENTS, store.prepare_replicated(EVENTS, received(101, 300)), lambda: True
    )
    assert replicated_tokens(pg_url) == list(range(1, 301))
