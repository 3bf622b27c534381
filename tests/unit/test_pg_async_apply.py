"""A worker's small apply on a non-blocking connection (``PgWorkerStore.open_async_apply``).

The same statement as ``apply_replicated`` for fewer than 50 rows (one row:
typed parameters, storing what the JSON statement stores); what it refuses
commits nothing and is left to the general way; a stale token is refused; a
lost connection says so.
"""

from __future__ import annotations

import math
import select
from typing import Any

import psycopg2
import pytest

from replication.streams import EVENTS
from storage.pg_db import sql_literals
from storage.pg_worker import COPY_ROWS, PgAsyncApply, one_row_params
from storage.schema import StreamSchema
from storage.store import ApplyRefused, DatabaseUnavailable, StaleApply
from storage.worker_store import open_worker_store
from tests.stores import pg_worker_store
from tests.unit.test_apply_replicated import MIXED


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
    store = pg_worker_store(open_worker_store(pg_url))
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


# -- one row: typed parameters instead of JSON (replicate_one_sql) -------------------------

# MIXED (every column type) is test_apply_replicated's: one definition of the apply tests' schema.
# The same columns, applied by the JSON statement (apply_replicated's, on the threads).
BY_JSON = StreamSchema("by_json", MIXED.columns)
TAKEN: list[list[Any]] = [
    ["a", 1, 1.5, True, None],
    [None, None, None, False, None],
    ["tab\there new\nline \\N 'q' \"dq\" %s %(x)s ünïcode ☃", -(2**63), -0.0, True, {"k": [1, 2.5, None, "s"]}],
    ["", 2**63 - 1, 5e-324, False, "text"],
    ["x", 0, 1e300, True, 3],
    ["x", 0, 7, True, [True, None]],  # an integer for a double
    ["x", 0, 2**64 - 1, True, -0.0],  # an integer beyond bigint for a double: its nearest double
]
LEFT_TO_JSON: list[list[Any]] = [
    ["a", 5.0, 1.5, True, None],  # a float for a bigint
    ["a", True, 1.5, True, None],  # a boolean for a bigint
    ["a", 2**63, 1.5, True, None],  # beyond bigint
    [1, 1, 1.5, True, None],  # a number for text
    ["a", 1, True, True, None],  # a boolean for a double
    ["a", 1, "1.5", True, None],  # text for a double
    ["a", 1, 1.5, 1, None],  # a number for a boolean
    ["a\x00b", 1, 1.5, True, None],  # NUL in text (PostgreSQL text cannot hold it)
]
REFUSED_BY_BOTH: list[list[Any]] = [["a", 1, 1.5, None, None]]  # null where the column may not hold it


def one_row_outcome(store, call, schema: StreamSchema, token: int, row: list) -> tuple | str:
    """Apply ``row`` alone at ``token``; what was stored (values as PostgreSQL's text) or ``"refused"``."""
    received = [(token, "w\\1", [row])]
    if schema is MIXED:
        assert call.start(schema.name, token, schema, received)
        try:
            drive(call)
        except ApplyRefused:
            return "refused"
    else:

        def refused(txn) -> None:
            raise LookupError("refused")

        try:
            store.apply_replicated(schema.name, token, schema, received, refused)
        except LookupError:
            return "refused"
    found = store.database.read(
        lambda cur: cur.execute(
            f"SELECT token, instance_name, ts, t, n::text, x::text, ok, j::text FROM {schema.replicated_table} "
            "WHERE token = %s",
            (token,),
        ).fetchall()
    )
    assert len(found) == 1
    return tuple(found[0])


@pytest.fixture
def mixed_db(pg_url):
    store = pg_worker_store(open_worker_store(pg_url))
    store.create_replicated_table(MIXED)
    store.create_replicated_table(BY_JSON)
    call = store.open_async_apply()
    yield store, call
    call.close()
    store.close()


def test_one_row_by_typed_parameters_stores_what_the_json_statement_stores(mixed_db) -> None:
    store, call = mixed_db
    refused = 0
    for token, row in enumerate(TAKEN + REFUSED_BY_BOTH + LEFT_TO_JSON, 1):
        full = [*row, 1000 + token]
        left = any(row is r for r in LEFT_TO_JSON)
        assert (one_row_params(MIXED, [(token, "w", [full])]) is None) == left, row
        typed = one_row_outcome(store, call, MIXED, token, full)
        by_json = one_row_outcome(store, call, BY_JSON, token, full)
        assert typed == by_json, row
        refused += typed == "refused"
        if any(row is r for r in TAKEN):
            assert typed != "refused", row
    assert refused == 1 + len(LEFT_TO_JSON)  # the JSON statement refuses each of them too
    applied = store.applied_tokens()
    assert applied["mixed"] == applied["by_json"]
    negative_zero = store.database.read(
        lambda cur: cur.execute("SELECT x FROM replicated_mixed WHERE token = 3").fetchone()[0]
    )
    assert negative_zero == 0 and math.copysign(1.0, negative_zero) == -1.0


def test_one_row_of_a_run_another_width_or_an_odd_ts_is_left_to_the_json_statement() -> None:
    row = ["a", 1, 1.5, True, None, 7]
    assert one_row_params(MIXED, [([4], "w", [row])]) == [4, "w", 7, "a", "1", "1.5", "true", None]
    assert one_row_params(MIXED, [([4, 5], "w", [row, row])]) is None
    assert one_row_params(MIXED, [(4, "w", [row, row])]) is None
    assert one_row_params(MIXED, [(4, "w", [row]), (5, "w", [row])]) is None
    assert one_row_params(MIXED, [(4, "w", [[*row[:-2], 7]])]) is None
    for ts in ("7", 7.0, -1, None):
        assert one_row_params(MIXED, [(4, "w", [[*row[:-1], ts]])]) is None


def test_one_row_prepares_once_and_a_stale_token_commits_nothing(mixed_db) -> None:
    """The second apply reuses the statement (a second PREPARE of the name would fail)."""
    store, call = mixed_db
    for token in (1, 2):
        assert call.start("mixed", token, MIXED, [(token, "w", [["a", token, 1.0, True, None, token]])])
        drive(call)
    assert call.start("mixed", 2, MIXED, [(2, "w", [["b", 9, 1.0, True, None, 9]])])
    with pytest.raises(StaleApply):
        drive(call)
    assert store.applied_tokens() == {"mixed": 2}
    count = store.database.read(lambda cur: cur.execute("SELECT count(*) FROM replicated_mixed").fetchone()[0])
    assert count == 2


def test_a_value_psycopg2_will_not_quote_sends_nothing_and_the_connection_stays_usable(mixed_db) -> None:
    """A lone surrogate (no RDATA line carries one: the client's JSON parser refuses it): not this path."""
    store, call = mixed_db
    params = one_row_params(MIXED, [(1, "w", [["a\ud800", 1, 1.0, True, None, 1]])])
    assert params is not None
    assert not call._start_one("mixed", 1, MIXED, params)
    assert call.start("mixed", 1, MIXED, [(1, "w", [["a", 1, 1.0, True, None, 1]])])
    drive(call)
    assert store.applied_tokens() == {"mixed": 1}


def test_one_row_literals_are_what_psycopg2_would_send_and_store_the_same(mixed_db) -> None:
    """The one-row apply writes its values as literals (standard_conforming_strings on): the text
    psycopg2 makes of them, and each stored as written (quotes, backslashes, non-ASCII, NULL)."""
    store, call = mixed_db
    values = [
        "it's",
        "a\\b\\'c",
        "''",
        "\u00e9\u4e2d\U0001f600",
        "",
        "--x",
        "E'x'",
        "%s %(x)s",
        None,
        0,
        7,
        -3,
        2**63 - 1,
    ]
    check = psycopg2.connect(store.database.dsn)
    try:
        with check.cursor() as cur:
            cur.execute("SET standard_conforming_strings = on")
            assert sql_literals(values) == cur.mogrify(", ".join(["%s"] * len(values)), values).decode()
    finally:
        check.close()
    for bad in (["a\x00b"], [True], [1.5], [b"x"]):
        with pytest.raises(ValueError):
            sql_literals(bad)  # type: ignore[arg-type]  # deliberately a bool, float or bytes too
    texts = [v for v in values if isinstance(v, str)]
    for token, text in enumerate(texts, 1):
        assert one_row_params(MIXED, [(token, "w", [[text, token, 1.0, True, None, token]])]) is not None
        assert call.start("mixed", token, MIXED, [(token, "w", [[text, token, 1.0, True, None, token]])])
        drive(call)
    stored = store.database.read(lambda cur: cur.execute("SELECT t FROM replicated_mixed ORDER BY token").fetchall())
    assert [r[0] for r in stored] == texts
