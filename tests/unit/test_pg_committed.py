"""``storage.pg_db.committed``: the explicit transaction of the master's reads on an autocommit connection.

On the real server: what the body wrote is committed after it; a body that
fails leaves nothing of it and the connection idle, ready for the next
statement (not in an aborted transaction).
"""

from __future__ import annotations

import psycopg2
import psycopg2.extensions
import pytest

from storage.pg_db import committed


def _connection(pg_url: str):
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    return conn


def test_the_body_is_committed_after_it(pg_url: str) -> None:
    conn = _connection(pg_url)
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE t (v int)")
            with committed(cur):
                cur.execute("BEGIN; INSERT INTO t VALUES (1)")
                assert conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_INTRANS
            assert conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
            cur.execute("SELECT v FROM t")
            assert cur.fetchall() == [(1,)]
    finally:
        conn.close()


def test_a_failing_body_leaves_nothing_and_the_connection_idle(pg_url: str) -> None:
    conn = _connection(pg_url)
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE t (v int)")
            with pytest.raises(psycopg2.errors.DivisionByZero), committed(cur):
                cur.execute("BEGIN; INSERT INTO t VALUES (1)")
                cur.execute("SELECT 1 / 0")
            assert conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
            cur.execute("SELECT count(*) FROM t")
            assert cur.fetchall() == [(0,)]
    finally:
        conn.close()
