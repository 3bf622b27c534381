"""A single-row append's parameters written as SQL literals (``storage.pg_db.execute_literals``).

The text is what psycopg2 would send; values it cannot write (a double, a
boolean, a NUL), or a connection without ``standard_conforming_strings``,
go through psycopg2's adaptation as before. Either way every value is stored
as written.
"""

from __future__ import annotations

from typing import Any

import psycopg2

from replication.streams import EVENTS
from storage.pg_db import execute_literals
from storage.store import FIRST_VALUE, open_store
from tests.unit.test_apply_replicated import MIXED, TEXTS

VALUES = [*TEXTS, "it's", "a\\b\\'c", "''", "--x", "E'x'", None, 0, 7, -3, 2**63 - 1, -(2**63)]


def test_the_literals_are_the_text_psycopg2_sends(pg_url: str) -> None:
    conn = psycopg2.connect(pg_url)
    try:
        with conn.cursor() as cur:
            execute = f"EXECUTE tickline_9 ({', '.join(['%s'] * len(VALUES))})"
            assert execute_literals(cur, execute, VALUES) == cur.mogrify(execute, VALUES).decode()
            for bad in ([1.5], [True], ["a\x00b"], [b"x"]):
                assert execute_literals(cur, "EXECUTE tickline_9 (%s)", bad) is None
            cur.execute("SET standard_conforming_strings = off")
            assert execute_literals(cur, "EXECUTE tickline_9 (%s)", ["a\\b"]) is None
    finally:
        conn.close()


def test_single_row_appends_store_every_value_as_written(pg_url: str) -> None:
    store = open_store(pg_url)
    try:
        store.register_stream(EVENTS)
        store.register_stream(MIXED)
        texts = [v for v in VALUES if isinstance(v, str)]
        events = [[text, "!r:x", "m.type", text, None] for text in texts]
        tokens = [store.append("events", [row], "w")[0] for row in events]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
        stored = store.read_rows("events", 0, tokens[-1], 1000)
        assert [list(r[FIRST_VALUE:]) for r in stored] == events
        # Doubles and booleans are not written as literals: psycopg2 adapts them, as before.
        mixed: list[list[Any]] = [["a'b", -5, -1.5, True, {"k": "v"}], [None, 2**63 - 1, 1e300, False, None]]
        last = [store.append("mixed", [row], "w")[0] for row in mixed][-1]
        got = [list(r[FIRST_VALUE:]) for r in store.read_rows("mixed", 0, last, 10)]
        assert got[0][:4] == ["a'b", -5, -1.5, True]
        assert got[1][:4] == [None, 2**63 - 1, 1e300, False] and got[1][4] is None
    finally:
        store.close()


def test_a_double_keeps_its_exact_value_and_the_sign_of_zero_in_small_appends(pg_url: str) -> None:
    """One row, a few rows (a prepared statement) and 20 rows (not prepared): -0.0 stays -0.0 (it was
    stored as 0 by the prepared statement, whose argument read -0.0 as a numeric), and every double
    reads back exactly."""
    doubles = [-0.0, 0.1, 1e300, 5e-324, -2.5e-310, 1 / 3, 2.0**53 + 2]
    store = open_store(pg_url)
    try:
        store.register_stream(MIXED)
        for count in (1, 3, 20):
            rows = [[None, None, doubles[k % len(doubles)], True, None] for k in range(count)]
            tokens = store.append("mixed", rows, "w")
            got = [r[FIRST_VALUE + 2] for r in store.read_rows("mixed", tokens[0] - 1, tokens[-1], 100)]
            assert [repr(x) for x in got] == [repr(r[2]) for r in rows], count
        conn = psycopg2.connect(pg_url)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM stream_mixed WHERE x = 0 AND x::text = '-0'")
                assert cur.fetchone()[0] == 1 + 1 + 3  # counts 1, 3 and 20: a -0.0 at positions 0 and 7, 14
        finally:
            conn.close()
    finally:
        store.close()
