"""A thread done with a PostgreSQL worker store hands its idle connection to the next thread that needs one.

A worker's set-up thread opens, migrates and prepares the store during the
start's imports, then ends (``scripts.worker_start``); its database thread's
first ``COPY`` apply takes that connection instead of opening another after
the first rows arrived. On the real server: the same backend serves the other
thread, as a new connection would (autocommit, the server's default isolation,
the store's session settings), and rows applied through it commit once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from replication.streams import EVENTS
from storage.worker_store import open_worker_store
from tests.pg_sql import query, received, replicated_tokens
from tests.stores import pg_worker_store

T = TypeVar("T")


def _no_effects(txn: Any) -> None:
    raise AssertionError("the rows go by the one statement")


@pytest.fixture
def threads() -> Iterator[Callable[[Callable[[], T]], T]]:
    """Each call runs on a new thread (as the set-up thread, then the database thread)."""
    pools: list[ThreadPoolExecutor] = []

    def on_a_new_thread(fn: Callable[[], T]) -> T:
        pool = ThreadPoolExecutor(1)
        pools.append(pool)
        return pool.submit(fn).result()

    yield on_a_new_thread
    for pool in pools:
        pool.shutdown()


def _backend(conn: Any) -> int:
    """The connection's backend; a transaction this opened is ended (the connection left idle)."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pid = int(cur.fetchone()[0])
    if not conn.autocommit:
        conn.commit()
    return pid


def test_the_next_thread_applies_on_the_connection_handed_over(pg_url: str, threads) -> None:
    store = pg_worker_store(open_worker_store(pg_url))  # migrated on this thread's connection
    try:

        def set_up() -> int:
            store.create_replicated_table(EVENTS)
            assert store.applied_tokens() == {}  # a REPEATABLE READ transaction, committed
            backend = _backend(store.database.connection())
            store.hand_over_connection()
            return backend

        migrated_on = _backend(store.database.connection())
        set_up_on = threads(set_up)
        opened = len(store.database._all)

        def first_apply() -> tuple[int, bool, str, str]:
            store.apply_replicated("events", 5000, EVENTS, received(1, 5000), _no_effects)  # the COPY path
            conn = store.database.autocommit_connection()
            settings = query_on(
                conn, "SELECT current_setting('transaction_isolation'), current_setting('synchronous_commit')"
            )
            return _backend(conn), conn.autocommit, *settings

        backend, autocommit, isolation, synchronous = threads(first_apply)
        assert backend == set_up_on != migrated_on  # the set-up thread's backend, no new one
        assert len(store.database._all) == opened
        assert (autocommit, isolation, synchronous) == (True, "read committed", "off")
        assert replicated_tokens(pg_url) == list(range(1, 5001))
        assert query(pg_url, "SELECT token FROM tickline_applied WHERE stream = 'events'") == [(5000,)]
    finally:
        store.close()


def query_on(conn: Any, sql: str) -> tuple:
    with conn.cursor() as cur:
        cur.execute(sql)
        return tuple(cur.fetchone())


def test_a_connection_inside_a_transaction_is_closed_not_handed_over(pg_url: str, threads) -> None:
    store = pg_worker_store(open_worker_store(pg_url))
    try:

        def left_in_a_transaction() -> Any:
            conn = store.database.connection()
            with conn.cursor() as cur:
                cur.execute("SELECT 1")  # opens a transaction (not autocommit)
            store.hand_over_connection()
            return conn

        conn = threads(left_in_a_transaction)
        assert conn.closed
        assert _backend(threads(store.database.autocommit_connection)) != 0  # a new one, opened
    finally:
        store.close()


def test_a_connection_handed_over_and_then_terminated_is_replaced(pg_url: str, threads) -> None:
    store = pg_worker_store(open_worker_store(pg_url))
    try:

        def set_up() -> int:
            backend = _backend(store.database.connection())
            store.hand_over_connection()
            return backend

        gone = threads(set_up)
        query(pg_url, "SELECT pg_terminate_backend(%s)", (gone,))
        # The server's goodbye arrives asynchronously: wait until the socket shows it (no sleep).
        until_readable(store.database._spare[0])
        assert _backend(threads(store.database.autocommit_connection)) != gone
    finally:
        store.close()


def until_readable(conn: Any, bound: float = 30.0) -> None:
    import select

    watch = select.poll()
    watch.register(conn.fileno(), select.POLLIN)
    assert watch.poll(bound * 1000), "the terminated backend's connection never became readable"
