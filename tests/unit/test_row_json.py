"""SQLite's stored row JSON (``row_json``): written by every write path, migrated into old tables,
read back as lines byte for byte those of the Python encoder; the master's change check and
the safe point that never waits behind a writer."""

from __future__ import annotations

import sqlite3
import threading
import time

import orjson
import pytest

from replication.rows import encode_json_rows, encode_rows, row_encoder
from storage.bulk import write_rows
from storage.limits import check_row
from storage.schema import ROW_JSON_COLUMN, Column, SchemaError, StreamSchema
from storage.sqlite_db import SqliteChangeWatch
from storage.sqlite_store import SqliteStreamStore
from storage.store import open_store

SCHEMA = StreamSchema(
    "mixed",
    (
        Column("name", "text"),
        Column("n", "bigint", True),
        Column("x", "double", True),
        Column("ok", "boolean", True),
        Column("doc", "json", True),
    ),
)
ROWS = [
    ["plain", 1, 0.5, True, {"a": [1, "b"]}],
    ['quote " back \\ slash / tab \t nl \n é 😀', -(2**63), -1.25e-7, False, [None, True, 1.5]],
    ["nulls", None, None, None, None],
    ["big", 2**63 - 1, 1e300, True, "just a string"],
    ["int-like double", 3, 2.0, False, 42],
    ["17 digits", 0, 0.30000000000000004, None, 0.1],
    {"name": "by name", "x": 1e-300, "doc": {"k": {"deep": [1, 2.5, "é"]}}},
]
PREFIX = "RDATA mixed "


def _store(tmp_path) -> SqliteStreamStore:
    store = open_store(f"sqlite:///{tmp_path / 'm.db'}")
    assert isinstance(store, SqliteStreamStore)
    store.register_stream(SCHEMA)
    return store


def _stored(store: SqliteStreamStore) -> list[tuple[int, bytes | None]]:
    return store.database.query(f"SELECT token, {ROW_JSON_COLUMN} FROM stream_mixed ORDER BY seq")


def _expected_json(row) -> bytes:
    """What the Python encoder sends for a row (the values as checked, then encoded)."""
    return SCHEMA.values_encoder()(check_row(SCHEMA, row, None))


def _python_lines(store: SqliteStreamStore, after: int, upto: int, with_ts: bool) -> bytes:
    return encode_rows("mixed", store.read_rows("mixed", after, upto, 10**6), row_encoder(SCHEMA), with_ts)[0]


def test_every_sqlite_write_path_stores_each_rows_json(tmp_path) -> None:
    store = _store(tmp_path)
    store.append("mixed", ROWS[:3], "w1")  # one token each
    store.append("mixed", ROWS[3:5], "w1", batch=True)  # one token for both
    with store.writing("mixed", "w2") as txn:  # several appends in one transaction
        txn.append(ROWS[5:6])
        txn.append(ROWS[6:])
    runs = write_rows(store, "mixed", ((f"line {i}", row) for i, row in enumerate(ROWS)), "w3", chunk_rows=3)
    assert len(runs) == len(ROWS)
    stored = _stored(store)
    assert [json for _, json in stored] == [_expected_json(row) for row in ROWS + ROWS]
    # The stored bytes are exactly what the master's Python encoder makes of the stored columns.
    python = [row_encoder(SCHEMA)(row, False) for row in store.read_rows("mixed", 0, 100, 100)]
    assert [json for _, json in stored] == python


def test_a_write_that_fails_stores_no_row_json(tmp_path) -> None:
    store = _store(tmp_path)
    store.append("mixed", ROWS[:1], "w1")
    with pytest.raises(RuntimeError), store.writing("mixed", "w1") as txn:
        txn.append(ROWS[1:4])
        raise RuntimeError("roll back")
    with pytest.raises(Exception, match="line 3"):
        write_rows(store, "mixed", [("line 1", ROWS[0]), ("line 2", ROWS[1]), ("line 3", ["bad"])], "w1", chunk_rows=1)
    assert _stored(store) == [(1, _expected_json(ROWS[0]))]


@pytest.mark.parametrize("with_ts", [False, True])
def test_lines_from_storage_are_byte_for_byte_the_python_encoders(tmp_path, with_ts: bool) -> None:
    store = _store(tmp_path)
    for i, row in enumerate(ROWS):
        store.append("mixed", [row], f"w{i % 3}")  # writers change from row to row
    store.append("mixed", ROWS[:2], "w9", batch=True)  # token 8: a batch
    last = len(ROWS)
    built = store.read_lines_json("mixed", 0, last, 100, PREFIX, with_ts)
    assert built == (_python_lines(store, 0, last, with_ts), last, last)
    # Ranges that start inside, and ones cut by the limit.
    assert store.read_lines_json("mixed", 2, 5, 100, PREFIX, with_ts) == (_python_lines(store, 2, 5, with_ts), 5, 3)
    assert store.read_lines_json("mixed", 1, last, 2, PREFIX, with_ts) == (_python_lines(store, 1, 3, with_ts), 3, 2)
    # A batch in range: the caller builds the lines from read_rows_json, the same bytes again.
    assert store.read_lines_json("mixed", 0, last + 1, 100, PREFIX, with_ts) is None
    from_json_rows, _ = encode_json_rows("mixed", store.read_rows_json("mixed", 0, last + 1, 100), with_ts)
    assert from_json_rows == _python_lines(store, 0, last + 1, with_ts)
    assert b"RDATA mixed w9 batch " in from_json_rows


def test_rows_deleted_by_hand_leave_a_gap_that_is_told_from_a_batch(tmp_path) -> None:
    store = _store(tmp_path)
    store.append("mixed", ROWS[:3], "w1")  # tokens 1-3
    store.append("mixed", ROWS[3:5], "w1", batch=True)  # token 4, two rows
    store.append("mixed", ROWS[5:7], "w1")  # tokens 5-6
    store.database.write(lambda conn: conn.execute("DELETE FROM stream_mixed WHERE token IN (2, 5)"))
    # Tokens 1, 3, 4, 4, 6: as many rows as tokens 1..6, yet a batch.
    assert store.read_lines_json("mixed", 0, 6, 100, PREFIX, False) is None
    # Tokens 1, 3: a gap, no batch.
    assert store.read_lines_json("mixed", 0, 3, 100, PREFIX, False) == (_python_lines(store, 0, 3, False), 3, 2)
    # A range that starts in a gap moves to the next row.
    assert store.read_lines_json("mixed", 4, 6, 1, PREFIX, False) == (_python_lines(store, 4, 6, False), 6, 1)


def _old_table(path: str) -> None:
    """A database as tickline wrote it before ``row_json``: the stream table without the column."""
    store = SqliteStreamStore(path)
    store.migrate()
    store.register_stream(SCHEMA)
    old_store_rows = [SCHEMA.check_row(row) for row in ROWS]
    names = ", ".join(SCHEMA.column_names)

    def run(conn: sqlite3.Connection) -> None:
        conn.execute(f"ALTER TABLE stream_mixed DROP COLUMN {ROW_JSON_COLUMN}")
        conn.executemany(
            f"INSERT INTO stream_mixed (token, instance_name, ts, {names}) VALUES (?, 'old', ?, ?, ?, ?, ?, ?)",
            [(i + 1, 1000 + i, *values) for i, values in enumerate(old_store_rows)],
        )
        conn.execute("UPDATE tickline_stream_heads SET token = ? WHERE stream = 'mixed'", (len(ROWS),))

    store.database.write(run)
    store.close()


def test_an_old_stream_table_gets_row_json_when_the_store_is_opened(tmp_path) -> None:
    path = str(tmp_path / "old.db")
    _old_table(path)
    conn = sqlite3.connect(path)
    assert ROW_JSON_COLUMN not in {r[1] for r in conn.execute("PRAGMA table_info(stream_mixed)")}
    store = open_store(f"sqlite:///{path}")  # migrates
    assert isinstance(store, SqliteStreamStore)
    assert [json for _, json in _stored(store)] == [_expected_json(row) for row in ROWS]
    last = len(ROWS)
    for with_ts in (False, True):
        assert store.read_lines_json("mixed", 0, last, 100, PREFIX, with_ts) == (
            _python_lines(store, 0, last, with_ts),
            last,
            last,
        )
    # New rows go on as before; opening again changes nothing.
    store.append("mixed", ROWS[:1], "new")
    store.close()
    again = open_store(f"sqlite:///{path}")
    assert isinstance(again, SqliteStreamStore)
    assert [json for _, json in _stored(again)] == [_expected_json(row) for row in ROWS + ROWS[:1]]
    assert [r[1] for r in conn.execute("PRAGMA table_info(stream_mixed)")].count(ROW_JSON_COLUMN) == 1


def test_a_row_without_row_json_is_still_read(tmp_path) -> None:
    """A row written by an older tickline still running after the upgrade: built by SQLite from the columns."""
    store = _store(tmp_path)
    store.append("mixed", ROWS[:2], "w1")
    names = ", ".join(SCHEMA.column_names)
    values = SCHEMA.check_row(ROWS[2])
    store.database.write(
        lambda conn: conn.execute(
            f"INSERT INTO stream_mixed (token, instance_name, ts, {names}) VALUES (3, 'old', 5, ?, ?, ?, ?, ?)",
            values,
        )
    )
    store.database.write(lambda conn: conn.execute("UPDATE tickline_stream_heads SET token = 3"))
    built = store.read_lines_json("mixed", 0, 3, 100, PREFIX, True)
    assert built is not None and built[1:] == (3, 3)
    python = _python_lines(store, 0, 3, True)
    assert built[0].splitlines()[:2] == python.splitlines()[:2]
    old, want = built[0].splitlines()[2], python.splitlines()[2]
    assert old.startswith(b"RDATA mixed old 3 [")
    assert orjson.loads(old.split(b" ", 4)[4]) == orjson.loads(want.split(b" ", 4)[4])


def test_row_json_is_a_reserved_column_name() -> None:
    with pytest.raises(SchemaError, match="reserved"):
        Column(ROW_JSON_COLUMN, "text")


def test_postgresql_tables_have_no_row_json() -> None:
    ddl = " ".join(SCHEMA.create_table_sql("postgresql"))
    assert ROW_JSON_COLUMN not in ddl
    assert f"{ROW_JSON_COLUMN} BLOB" in " ".join(SCHEMA.create_table_sql("sqlite"))


def test_the_change_watch_sees_commits_of_other_connections_only(tmp_path) -> None:
    store = _store(tmp_path)
    watch = store.change_watch()
    try:
        assert watch.changed() is False
        store.append("mixed", ROWS[:1], "w1")  # another connection (this thread's)
        assert watch.changed() is True
        assert watch.changed() is False  # once per change
        store.read_rows("mixed", 0, 10, 10)  # reads change nothing
        assert watch.changed() is False
        other = open_store(f"sqlite:///{tmp_path / 'm.db'}")
        other.append("mixed", ROWS[1:2], "w2")
        assert watch.changed() is True
        other.close()
    finally:
        watch.close()
    assert watch.changed() is True  # closed: never claims nothing happened


def test_the_change_watch_does_not_wait_for_a_writer(tmp_path) -> None:
    store = _store(tmp_path)
    writer = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None)
    watch = SqliteChangeWatch(str(tmp_path / "m.db"))
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE tickline_tso SET last_ts = last_ts + 1")
        started = time.monotonic()
        assert watch.changed() is False  # uncommitted: nothing to see
        writer.execute("COMMIT")
        assert watch.changed() is True
        assert time.monotonic() - started < 1.0
    finally:
        watch.close()
        writer.close()
        store.close()


def test_the_safe_point_does_not_wait_behind_a_long_write(tmp_path) -> None:
    """SQLite: with the write lock taken, the safe point reads the oracle's mark instead of allocating."""
    store = _store(tmp_path)
    store.append("mixed", ROWS[:2], "w1")
    times_before, _ = store.safe_point(allocate=True)
    writer = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        result: list = []
        thread = threading.Thread(target=lambda: result.append(store.safe_point(allocate=True)))
        started = time.monotonic()
        thread.start()
        thread.join(10)
        assert result, "the safe point waited for the write lock"
        assert time.monotonic() - started < 2.0  # the busy timeout is 30 s
        times, positions = result[0]
        assert positions["mixed"] == 2
        assert times["mixed"] >= times_before["mixed"]  # the mark, not a new allocation
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    # The lock is free again: a fresh timestamp above every earlier one.
    times_after, _ = store.safe_point(allocate=True)
    assert times_after["mixed"] > times_before["mixed"]
    # The busy timeout of the store's connection is back to its setting.
    assert store.database.connection().execute("PRAGMA busy_timeout").fetchone()[0] == 30_000
