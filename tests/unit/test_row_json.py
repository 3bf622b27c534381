"""SQLite's stored row lines (``row_line``): written by every write path, migrated into old tables
(those without ``row_json`` and those with it),
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
from storage.contracts import Row
from storage.limits import check_row
from storage.schema import ROW_JSON_COLUMN, ROW_LINE_COLUMN, Column, SchemaError, StreamSchema
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
ROWS: list[Row] = [
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
    """Each row's token and stored line; ``row_json`` is NULL in every row (the line holds the values)."""
    rows = store.database.query(f"SELECT token, {ROW_JSON_COLUMN}, {ROW_LINE_COLUMN} FROM stream_mixed ORDER BY seq")
    assert [json for _, json, _ in rows] == [None] * len(rows)
    return [(token, line) for token, _, line in rows]


def _expected_json(row) -> bytes:
    """What the Python encoder sends for a row (the values as checked, then encoded)."""
    return SCHEMA.values_encoder()(check_row(SCHEMA, row, None))


def _expected_line(instance: str, token: int, row) -> bytes:
    return b"RDATA mixed %s %d %s\n" % (instance.encode(), token, _expected_json(row))


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
    instances = ["w1"] * 5 + ["w2"] * 2 + ["w3"] * len(ROWS)
    tokens = [1, 2, 3, 4, 4, 5, 6, *range(7, 7 + len(ROWS))]
    assert stored == [
        (token, _expected_line(instance, token, row))
        for instance, token, row in zip(instances, tokens, ROWS + ROWS, strict=True)
    ]
    # The stored values are exactly what the master's Python encoder makes of the stored columns.
    stored_rows = store.read_rows("mixed", 0, 100, 100)
    python = [b"RDATA mixed %s %d %s\n" % (r[2].encode(), r[1], row_encoder(SCHEMA)(r, False)) for r in stored_rows]
    assert [line for _, line in stored] == python
    # And read_rows_json takes them back out of the lines.
    assert [r[4] for r in store.read_rows_json("mixed", 0, 100, 100)] == [_expected_json(row) for row in ROWS + ROWS]


def test_a_write_that_fails_stores_no_row_json(tmp_path) -> None:
    store = _store(tmp_path)
    store.append("mixed", ROWS[:1], "w1")
    with pytest.raises(RuntimeError), store.writing("mixed", "w1") as txn:
        txn.append(ROWS[1:4])
        raise RuntimeError("roll back")
    with pytest.raises(Exception, match="line 3"):
        write_rows(store, "mixed", [("line 1", ROWS[0]), ("line 2", ROWS[1]), ("line 3", ["bad"])], "w1", chunk_rows=1)
    assert _stored(store) == [(1, _expected_line("w1", 1, ROWS[0]))]


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


def _old_table(path: str, with_row_json: bool) -> None:
    """A database as tickline wrote it before ``row_line``: the stream table without it.

    ``with_row_json``: as the tickline that stored each row's ``row_json``
    wrote it; else as the one before, without either column.
    """
    store = SqliteStreamStore(path)
    store.migrate()
    store.register_stream(SCHEMA)
    old_store_rows = [SCHEMA.check_row(row) for row in ROWS]
    names = ", ".join(SCHEMA.column_names)
    encode = SCHEMA.values_encoder()

    def run(conn: sqlite3.Connection) -> None:
        conn.execute(f"ALTER TABLE stream_mixed DROP COLUMN {ROW_LINE_COLUMN}")
        if with_row_json:
            conn.executemany(
                f"INSERT INTO stream_mixed (token, instance_name, ts, {names}, {ROW_JSON_COLUMN}) "
                "VALUES (?, 'old', ?, ?, ?, ?, ?, ?, ?)",
                [(i + 1, 1000 + i, *values, encode(values)) for i, values in enumerate(old_store_rows)],
            )
        else:
            conn.execute(f"ALTER TABLE stream_mixed DROP COLUMN {ROW_JSON_COLUMN}")
            conn.executemany(
                f"INSERT INTO stream_mixed (token, instance_name, ts, {names}) VALUES (?, 'old', ?, ?, ?, ?, ?, ?)",
                [(i + 1, 1000 + i, *values) for i, values in enumerate(old_store_rows)],
            )
        conn.execute("UPDATE tickline_stream_heads SET token = ? WHERE stream = 'mixed'", (len(ROWS),))

    store.database.write(run)
    store.close()


@pytest.mark.parametrize("with_row_json", [False, True])
def test_an_old_stream_table_gets_row_line_when_the_store_is_opened(tmp_path, with_row_json: bool) -> None:
    path = str(tmp_path / "old.db")
    _old_table(path, with_row_json)
    conn = sqlite3.connect(path)
    columns = {r[1] for r in conn.execute("PRAGMA table_info(stream_mixed)")}
    assert ROW_LINE_COLUMN not in columns and (ROW_JSON_COLUMN in columns) == with_row_json
    store = open_store(f"sqlite:///{path}")  # migrates
    assert isinstance(store, SqliteStreamStore)
    assert _stored(store) == [(i + 1, _expected_line("old", i + 1, row)) for i, row in enumerate(ROWS)]
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
    assert _stored(again) == [
        *((i + 1, _expected_line("old", i + 1, row)) for i, row in enumerate(ROWS)),
        (last + 1, _expected_line("new", last + 1, ROWS[0])),
    ]
    names = [r[1] for r in conn.execute("PRAGMA table_info(stream_mixed)")]
    assert names.count(ROW_JSON_COLUMN) == 1 and names.count(ROW_LINE_COLUMN) == 1


def _store_with_an_old_row(tmp_path, with_row_json: bool):
    """Rows 1-2 written by this tickline; row 3 (writer ``old``) as an older tickline wrote it: no
    ``row_line``, and ``row_json`` only with ``with_row_json``."""
    store = _store(tmp_path)
    store.append("mixed", ROWS[:2], "w1")
    names = ", ".join(SCHEMA.column_names)
    values = SCHEMA.check_row(ROWS[2])
    json_column, json_value = (f", {ROW_JSON_COLUMN}", ", ?") if with_row_json else ("", "")
    params = (*values, SCHEMA.values_encoder()(values)) if with_row_json else tuple(values)
    marks = ", ".join("?" * len(values))
    store.database.write(
        lambda conn: conn.execute(
            f"INSERT INTO stream_mixed (token, instance_name, ts, {names}{json_column}) "
            f"VALUES (3, 'old', 5, {marks}{json_value})",
            params,
        )
    )
    store.database.write(lambda conn: conn.execute("UPDATE tickline_stream_heads SET token = 3"))
    return store


def test_a_row_with_row_json_and_no_row_line_is_read_from_it(tmp_path) -> None:
    """A row written by the tickline that stored ``row_json`` (still running after the upgrade)."""
    store = _store_with_an_old_row(tmp_path, with_row_json=True)
    for with_ts in (False, True):
        assert store.read_lines_json("mixed", 0, 3, 100, PREFIX, with_ts) == (
            _python_lines(store, 0, 3, with_ts),
            3,
            3,
        )
    assert [r[4] for r in store.read_rows_json("mixed", 0, 3, 10)] == [_expected_json(row) for row in ROWS[:3]]


def test_a_row_without_row_json_is_still_read(tmp_path) -> None:
    """A row written by an older tickline still running after the upgrade: built by SQLite from the columns."""
    store = _store_with_an_old_row(tmp_path, with_row_json=False)
    built = store.read_lines_json("mixed", 0, 3, 100, PREFIX, True)
    assert built is not None and built[1:] == (3, 3)
    python = _python_lines(store, 0, 3, True)
    assert built[0].splitlines()[:2] == python.splitlines()[:2]
    old, want = built[0].splitlines()[2], python.splitlines()[2]
    assert old.startswith(b"RDATA mixed old 3 [")
    assert orjson.loads(old.split(b" ", 4)[4]) == orjson.loads(want.split(b" ", 4)[4])


@pytest.mark.parametrize("name", [ROW_JSON_COLUMN, ROW_LINE_COLUMN])
def test_row_json_and_row_line_are_reserved_column_names(name: str) -> None:
    with pytest.raises(SchemaError, match="reserved"):
        Column(name, "text")


def test_postgresql_tables_have_no_row_json_or_row_line() -> None:
    ddl = " ".join(SCHEMA.create_table_sql("postgresql"))
    assert ROW_JSON_COLUMN not in ddl and ROW_LINE_COLUMN not in ddl
    sqlite = " ".join(SCHEMA.create_table_sql("sqlite"))
    assert f"{ROW_JSON_COLUMN} BLOB" in sqlite and f"{ROW_LINE_COLUMN} BLOB" in sqlite


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


@pytest.mark.parametrize("with_ts", [False, True])
def test_a_row_changed_by_hand_is_read_from_its_columns(tmp_path, with_ts: bool) -> None:
    """The trigger drops the stored line of a row whose token, writer or values change: never a stale line."""
    store = _store(tmp_path)
    store.append("mixed", ROWS[:4], "w1")
    store.database.write(lambda conn: conn.execute("UPDATE stream_mixed SET name = 'changed' WHERE token = 2"))
    store.database.write(lambda conn: conn.execute("UPDATE stream_mixed SET instance_name = 'w7' WHERE token = 3"))
    # A change of a column that is not in the line (ts) keeps the line.
    store.database.write(lambda conn: conn.execute("UPDATE stream_mixed SET ts = ts + 1 WHERE token = 4"))
    lines = [line for _, line in _stored(store)]
    assert lines[0] is not None and lines[1] is None and lines[2] is None and lines[3] is not None
    got = store.read_lines_json("mixed", 0, 4, 100, PREFIX, with_ts)
    assert got is not None and got[1:] == (4, 4)
    python = _python_lines(store, 0, 4, with_ts)
    for built, want in zip(got[0].splitlines()[1:3], python.splitlines()[1:3], strict=True):
        # Built from the columns as they are now (a double may print with more digits).
        assert built.split(b" ", 4)[:4] == want.split(b" ", 4)[:4]
        assert orjson.loads(built.split(b" ", 4)[4]) == orjson.loads(want.split(b" ", 4)[4])
    assert b'RDATA mixed w1 2 ["changed",' in got[0] and b"RDATA mixed w7 3 " in got[0]
    if with_ts:
        assert got[0].splitlines()[3] == python.splitlines()[3]  # the new ts, added to the stored line
