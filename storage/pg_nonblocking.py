"""A non-blocking (asynchronous) psycopg2 connection: opened and set up off the reactor, its poll states.

The master's wake-up (``storage.pg_wake``) and the worker's small applies
(``storage.pg_worker``) each run one on the reactor. Apart from ``pg_wake`` so
that a worker does not import the master's reading machinery with it
(``pg_store``, ``pg_lines``: about 2 ms of every worker start;
docs/benchmarks.md, wstart3).
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.extensions

from storage.pg_db import session_settings
from storage.store import DatabaseUnavailable, error_line
from storage.urls import redact_url

SETUP_SECONDS = 5.0  # connecting and setting the session up (off the reactor)


def _wait(conn: Any, timeout: float = SETUP_SECONDS) -> None:
    """Blocking: poll an asynchronous connection until its operation is done (off the reactor)."""
    while True:
        state = conn.poll()
        if state == psycopg2.extensions.POLL_OK:
            return
        if state == psycopg2.extensions.POLL_READ:
            ready = select.select([conn.fileno()], [], [], timeout)[0]
        elif state == psycopg2.extensions.POLL_WRITE:
            ready = select.select([], [conn.fileno()], [], timeout)[1]
        else:
            raise psycopg2.OperationalError(f"unexpected poll state {state}")
        if not ready:
            raise psycopg2.OperationalError(f"no answer within {timeout:g} s")


# What a non-blocking connection's poll() says, as NonBlockingCall.poll words it.
_POLL_WORDS = {
    psycopg2.extensions.POLL_OK: "done",
    psycopg2.extensions.POLL_READ: "read",
    psycopg2.extensions.POLL_WRITE: "write",
}


def poll_word(state: int, lost: Callable[[BaseException], DatabaseUnavailable]) -> str:
    """``"done"``, ``"read"`` or ``"write"`` for a poll state; anything else loses the connection."""
    word = _POLL_WORDS.get(state)
    if word is None:
        raise lost(psycopg2.OperationalError(f"unexpected poll state {state}"))
    return word


def open_nonblocking(dsn: str, application_name: str, settings: dict[str, str] | None = None) -> Any:
    """Blocking (off the reactor): a new asynchronous psycopg2 connection, set up.

    ``READ COMMITTED`` whatever the server's default (each statement of the
    wake-up function then takes its own snapshot: the order its proof
    needs), one generic plan per prepared statement (as ``PgDatabase``'s
    connections), and ``settings`` (``SET`` for the session).
    """
    try:
        conn = psycopg2.connect(dsn, async_=1, connect_timeout=5, application_name=application_name)
        _wait(conn)
        values = session_settings(
            conn.server_version, {"default_transaction_isolation": "read committed", **(settings or {})}
        )
        with conn.cursor() as cur:
            cur.execute(
                "; ".join(["SELECT set_config(%s, %s, false)"] * len(values)), [x for kv in values.items() for x in kv]
            )
            _wait(conn)
        return conn
    except psycopg2.Error as e:
        raise DatabaseUnavailable(
            redact_url(f"cannot open a non-blocking connection to PostgreSQL at {dsn}: {error_line(e)}")
        ) from None
