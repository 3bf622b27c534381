"""Start at a time on a stream of a million rows: REPLICATE @<ms> and tail --since, exact and quick."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import TYPE_CHECKING

import pytest

from storage import sqlite_order, time_index
from storage.schema import Column, StreamSchema
from storage.store import open_store
from storage.tso import compose, physical_ms
from tests.conftest import run_tickline
from tests.stores import backend_store, pg_store, sqlite_store

if TYPE_CHECKING:
    from storage.pg_db import Cursor

ROWS = 1_000_000
BASE_MS = 1_790_000_000_000
BIG = StreamSchema("big", (Column("n", "bigint"),))
CONFIG = "streams:\n  big:\n    columns:\n      - {name: n, type: bigint}\n"


def ts_of(i: int) -> int:
    """Row i (token i + 1): 7 rows per millisecond, so instants fall inside and between milliseconds."""
    return compose(BASE_MS + i // 7, i % 7)


def fill(url: str) -> None:
    """A million rows the fast way (one statement or one executemany), then the heads and the oracle."""
    store = open_store(url)
    store.register_stream(BIG)
    last_ts = ts_of(ROWS - 1)
    if url.startswith("sqlite"):

        def run_sqlite(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT INTO stream_big (token, instance_name, ts, n) VALUES (?, 'bulk', ?, ?)",
                ((i + 1, ts_of(i), i) for i in range(ROWS)),
            )
            conn.execute("UPDATE tickline_stream_heads SET token = ? WHERE stream = 'big'", (ROWS,))
            conn.execute("UPDATE tickline_tso SET last_ts = MAX(last_ts, ?)", (last_ts,))

        sqlite_store(store).database.write(run_sqlite)
    else:

        def run_pg(cur: Cursor) -> None:
            cur.execute(
                "INSERT INTO stream_big (token, instance_name, ts, n) SELECT i + 1, 'bulk', "
                "((%s + i / 7) << 18) | (i %% 7), i FROM generate_series(0, %s) AS i",
                (BASE_MS, ROWS - 1),
            )
            cur.execute("SELECT setval('stream_big_token_seq', %s)", (ROWS,))
            cur.execute("UPDATE tickline_tso SET last_ts = GREATEST(last_ts, %s)", (last_ts,))
            cur.execute("ANALYZE stream_big")

        pg_store(store).database.write(run_pg)
    store.close()


@pytest.fixture
def big(master, db_url):
    fill(db_url)
    return master(CONFIG, database=db_url)


def first_index(since_ms: int) -> int:
    """The first row i whose physical time is at or after since_ms."""
    return max(0, min(ROWS, (since_ms - BASE_MS) * 7))


def test_the_search_is_a_few_index_lookups(db_url) -> None:
    fill(db_url)
    store = backend_store(open_store(db_url))
    try:
        for since_ms in (BASE_MS - 5, BASE_MS, BASE_MS + 1, BASE_MS + 70_000, BASE_MS + ROWS // 7 - 1):
            start = time.monotonic()
            at = store.first_token_at("big", time_index.ts_at_ms(since_ms))
            took = time.monotonic() - start
            assert at.token == first_index(since_ms) + 1
            assert at.queries <= 2 and took < 0.2, (at, took)
        at = store.first_token_at("big", time_index.ts_at_ms(BASE_MS + ROWS))
        assert at.token is None and at.before is None
        if db_url.startswith("sqlite"):
            # No index on SQLite (rows in rowid order): a binary search whose every probe is a rowid lookup.
            assert not store.database.query("SELECT 1 FROM tickline_unordered")
            sql = sqlite_order.bound_sql("stream_big", "ts", ">=", ":v")
            plan = "\n".join(r[3] for r in store.database.query("EXPLAIN QUERY PLAN " + sql, {"v": 0}))
            assert "SCAN stream_big" not in plan and "stream_big_ts" not in plan, plan
            assert "SEARCH stream_big USING INTEGER PRIMARY KEY (rowid>?)" in plan, plan
        else:
            # No ts index on PostgreSQL: a binary search whose every probe is a descent of the token index.
            sql = time_index.pg_search_sql("stream_big").replace("%(t)s", str(time_index.ts_at_ms(BASE_MS + 70_000)))
            plan = "\n".join(r[0] for r in store.database.query("EXPLAIN " + sql))
            assert "Seq Scan" not in plan and "stream_big_ts" not in plan, plan
            assert "Index Scan Backward using stream_big_token" in plan, plan
    finally:
        store.close()


def test_replicate_at_a_time_on_a_million_rows(big) -> None:
    client = big.connect()
    client.handshake()
    since_ms = BASE_MS + (ROWS - 3000) // 7 + 0  # about 3000 rows before the end
    start = time.monotonic()
    client.send("OPTIONS live ts", f"REPLICATE big @{since_ms}")
    assert client.expect("OPTIONS") == "OPTIONS live ts"
    position = client.expect("POSITION", timeout=10)
    answered = time.monotonic() - start
    first = first_index(since_ms)
    assert position.split()[1:] == ["big", "master", str(first), str(first)]
    assert answered < 1.0, answered
    lines = client.read_until(lambda line: line.startswith("POSITION big"), timeout=30)
    rows = [line.split(" ", 4) for line in lines if line.startswith("RDATA")]
    assert [int(r[3]) for r in rows] == list(range(first + 1, ROWS + 1))
    assert [json.loads(r[4])[0] for r in rows] == list(range(first, ROWS))
    assert all(physical_ms(json.loads(r[4])[-1]) >= since_ms for r in rows)
    assert physical_ms(ts_of(first - 1)) < since_ms


def test_tail_since_on_a_million_rows(big) -> None:
    since_ms = BASE_MS + (ROWS - 700) // 7
    first = first_index(since_ms)
    start = time.monotonic()
    result = run_tickline(
        "tail", "--master", big.address, "--since", str(since_ms), "--count", str(ROWS - first), "--ts", "big"
    )
    took = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["row"][0] for r in records] == list(range(first, ROWS))
    assert records[0]["ts"] == ts_of(first)
    assert records[0]["ts_iso"].endswith("Z") and records[0]["ts_iso"].startswith("2026-")
    assert took < 10, took
    # ISO-8601 gives the same answer.
    from scripts.when import iso_ms

    result = run_tickline("tail", "--master", big.address, "--since", iso_ms(since_ms), "--count", "1", "big")
    assert json.loads(result.stdout)["row"] == [first]


def test_tail_since_bad_input(big) -> None:
    result = run_tickline("tail", "--master", big.address, "--since", "soon", "big")
    assert result.returncode == 2 and "--since 'soon': expected Unix ms" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_tickline("tail", "--master", big.address, "--since", "-5m", "--from", "3", "big")
    assert result.returncode == 2 and "exclude each other" in result.stderr
    result = run_tickline("tail", "--master", big.address, "--since", "-5m", "nosuch")
    assert result.returncode == 1 and "unknown stream 'nosuch'" in result.stderr


def test_worker_start_at_a_time_for_a_new_stream(tmp_path) -> None:
    """worker.start_at: a stream the worker never applied starts at that time; a restart resumes by token."""
    from tests.integration.procs import Proc, accepts, free_port, query_one, sqlite_url, wait_for

    master_db, worker_db = tmp_path / "m.db", tmp_path / "w.db"
    from replication.streams import EVENTS

    store = open_store(sqlite_url(master_db))
    store.register_stream(EVENTS)
    old = store.append("events", [[f"$old{i}", "!r", "t", None, None] for i in range(5)], "w")
    time.sleep(0.01)
    cut_ms = int(time.time() * 1000)
    time.sleep(0.01)
    new = store.append("events", [[f"$new{i}", "!r", "t", None, None] for i in range(3)], "w")
    port = free_port()
    config = tmp_path / "tickline.yaml"
    config.write_text(
        f"database: {sqlite_url(master_db)}\nlisten: 127.0.0.1:{port}\n"
        f"worker:\n  database: {sqlite_url(worker_db)}\n  replicate: [events]\n  start_at: {cut_ms}\n"
    )
    master = Proc(tmp_path / "master.log", "master", "-c", str(config))
    worker = None
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(tmp_path / "worker.log", "worker", "-c", str(config))
        wait_for(
            lambda: query_one(worker_db, "SELECT token FROM tickline_applied WHERE stream = 'events'", 0) == new[-1],
            20,
            "the new rows",
        )
        assert worker.stop() == 0
        worker = None
        later = store.append("events", [["$later", "!r", "t", None, None]], "w")
        worker = Proc(tmp_path / "worker2.log", "worker", "-c", str(config))
        wait_for(
            lambda: query_one(worker_db, "SELECT token FROM tickline_applied WHERE stream = 'events'", 0) == later[0],
            20,
            "the row written while the worker was stopped",
        )
    finally:
        if worker is not None:
            worker.stop()
        master.stop()
        store.close()
    import sqlite3

    conn = sqlite3.connect(worker_db)
    tokens = [r[0] for r in conn.execute("SELECT token FROM replicated_events ORDER BY token")]
    assert tokens == [*new, *later]
    assert old[-1] < new[0]
