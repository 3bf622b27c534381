"""Small helpers for tests against the real PostgreSQL server: a statement on a connection of the test's own."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg2

TS = 470_000_000_000_000_000


def query(url: str, sql: str, params: Any = ()) -> list[tuple]:
    """Run ``sql`` in autocommit on a new connection; its rows ([] for a statement that returns none)."""
    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def replicated_tokens(url: str) -> list[int]:
    """The tokens in a worker database's ``replicated_events``, in order."""
    return [t for (t,) in query(url, "SELECT token FROM replicated_events ORDER BY token")]


def received(first: int, last: int) -> list:
    """``events`` rows ``first`` to ``last`` as a worker receives them (one token each, instance ``m``)."""
    return [
        ([*range(first, last + 1)], "m", [[f"$e{n}", "!r", "m.t", None, None, TS + n] for n in range(first, last + 1)])
    ]


def until_waiting_on_a_lock(url: str, pid: int, bound: float = 30.0) -> None:
    """Until backend ``pid`` waits for a lock (its statement arrived); at most ``bound`` seconds."""
    deadline = time.monotonic() + bound
    sql = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s"
    while query(url, sql, (pid,)) != [("Lock",)]:
        assert time.monotonic() < deadline, f"backend {pid} never waited on a lock"
        time.sleep(0.01)  # polling the server's view: no event to await across processes


def lost_in_flight(url: str, table: str, thread: ThreadPoolExecutor, backend: int, call: Callable[[], Any]) -> Future:
    """``call`` run on ``thread`` (whose connection is ``backend``), its connection lost once its request was sent.

    ``table`` is locked by a session of the test's own, so the request waits
    at it on the server; then its backend is terminated (and awaited) and the
    lock released. Returns the call's future (its outcome: what the caller saw).
    """
    locker = psycopg2.connect(url)
    try:
        with locker.cursor() as cur:
            cur.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        future = thread.submit(call)
        until_waiting_on_a_lock(url, backend)
        assert query(url, "SELECT pg_terminate_backend(%s, 10000)", (backend,)) == [(True,)]
        future.exception(30)  # settled before the lock goes
    finally:
        locker.rollback()
        locker.close()
    return future
