"""Small helpers for tests against the real PostgreSQL server: a statement on a connection of the test's own."""

from __future__ import annotations

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
