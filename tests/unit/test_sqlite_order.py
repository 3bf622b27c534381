"""SQLite stream tables without indexes (``storage.sqlite_order``): reads by binary search over the rowid,
a stream with a row out of order marked by the triggers and read through indexes again."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replication.rows import encode_rows, row_encoder
from storage import sqlite_order, time_index
from storage.bulk import write_rows
from storage.schema import Column, StreamSchema
from storage.sqlite_store import SqliteStreamStore
from storage.store import open_store

SCHEMA = StreamSchema("ev", (Column("name", "text"), Column("n", "bigint", True)))
PREFIX = "RDATA ev "
COLUMNS = "seq, token, instance_name, ts, name, n"


def _store(path: Path) -> SqliteStreamStore:
    store = open_store(f"sqlite:///{path}")
    assert isinstance(store, SqliteStreamStore)
    store.register_stream(SCHEMA)
    return store


def _rows(first: int, count: int) -> list[list[object]]:
    return [[f"row {i}", i] for i in range(first, first + count)]


def _marked(store: SqliteStreamStore) -> bool:
    return bool(store.database.query("SELECT 1 FROM tickline_unordered WHERE stream = 'ev'"))


def _indexes(store: SqliteStreamStore) -> set[str]:
    rows = store.database.query("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'stream_ev'")
    return {name for (name,) in rows}


def _by_token(store: SqliteStreamStore, after: int, upto: int) -> list[tuple[object, ...]]:
    """Every row of ``(after, upto]`` in ``(token, seq)`` order, by a plain sort (no search, no index)."""
    sql = f"SELECT {COLUMNS} FROM stream_ev WHERE token > ? AND token <= ? ORDER BY token, seq"
    return [tuple(row) for row in store.database.query(sql, (after, upto))]


def _lines(store: SqliteStreamStore, after: int, upto: int, with_ts: bool) -> bytes:
    return encode_rows("ev", _by_token(store, after, upto), row_encoder(SCHEMA), with_ts)[0]


def _insert_by_hand(store: SqliteStreamStore, token: int, ts: int, n: int, seq: int | None = None) -> None:
    store.database.write(
        lambda conn: conn.execute(
            "INSERT INTO stream_ev (seq, token, instance_name, ts, name, n) VALUES (?, ?, 'hand', ?, 'by hand', ?)",
            (seq, token, ts, n),
        )
    )


def _last_ts_upto(store: SqliteStreamStore, token: int) -> int | None:
    """The last row's timestamp in ``(token, seq)`` order (what the token index gave), by a plain sort."""
    sql = "SELECT ts FROM stream_ev WHERE token <= ? ORDER BY token DESC, seq DESC LIMIT 1"
    found = store.database.query(sql, (token,))
    return int(found[0][0]) if found else None


def _delete(store: SqliteStreamStore, token: int) -> None:
    def run(conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM stream_ev WHERE token = ?", (token,))

    store.database.write(run)


def _ts(store: SqliteStreamStore, token: int) -> int:
    return int(store.database.query("SELECT ts FROM stream_ev WHERE token = ? ORDER BY seq LIMIT 1", (token,))[0][0])


def test_a_new_stream_table_has_no_index_and_tickline_writes_keep_it_ordered(tmp_path: Path) -> None:
    store = _store(tmp_path / "s.db")
    try:
        assert _indexes(store) == set()
        store.append("ev", _rows(0, 3), "w1")
        store.append("ev", _rows(3, 4), "w2", batch=True)
        with store.writing("ev", "w3") as txn:
            txn.append(_rows(7, 2))
            txn.append(_rows(9, 2), batch=True)
        write_rows(store, "ev", ((f"line {i}", row) for i, row in enumerate(_rows(11, 5))), "w1", chunk_rows=2)
        store.allocate_timestamps(3)
        store.append("ev", _rows(16, 1), "w1")
        assert not _marked(store) and _indexes(store) == set()
        head = store.heads()["ev"]
        assert [tuple(r) for r in store.read_rows("ev", 0, head, 10**6)] == _by_token(store, 0, head)
    finally:
        store.close()


@pytest.mark.parametrize("what", ["token", "ts", "seq"])
def test_a_row_inserted_out_of_order_marks_the_stream_and_reads_stay_in_token_order(tmp_path: Path, what: str) -> None:
    store = _store(tmp_path / "s.db")
    try:
        store.append("ev", _rows(0, 6), "w1")  # tokens 1-6
        if what == "token":  # an older token after newer ones (another writer's, say)
            _insert_by_hand(store, 3, _ts(store, 6) + 1, 100)
        elif what == "ts":  # the next token with an older timestamp
            _insert_by_hand(store, 7, _ts(store, 2), 100)
        else:  # a row put in a hole of the rowids, before rows with larger tokens
            store.database.write(lambda conn: conn.execute("DELETE FROM stream_ev WHERE token = 2"))
            _insert_by_hand(store, 7, _ts(store, 6) + 1, 100, seq=2)
        assert _marked(store)
        assert _indexes(store) == set()  # created by the first read that finds the mark
        head = int(store.database.query("SELECT max(token) FROM stream_ev")[0][0])
        rows = [tuple(r) for r in store.read_rows("ev", 0, head, 10**6)]
        assert _indexes(store) == {"stream_ev_token", "stream_ev_ts"}
        assert rows == _by_token(store, 0, head)
        assert [r[1] for r in rows] == sorted(r[1] for r in rows)
        for after in range(head):
            got = store.read_lines_json("ev", after, head, 100, PREFIX, False)
            if got is None:  # two rows of token 3: batch lines, from read_rows_json
                assert what == "token" and after < 3
                assert [r[1] for r in store.read_rows_json("ev", after, head, 100)] == [
                    r[1] for r in _by_token(store, after, head)
                ]
                continue
            assert got == (_lines(store, after, head, False), head, len(_by_token(store, after, head)))
    finally:
        store.close()


def test_updates_mark_only_when_they_change_the_order_columns(tmp_path: Path) -> None:
    store = _store(tmp_path / "s.db")
    try:
        store.append("ev", _rows(0, 4), "w1")
        store.database.write(lambda conn: conn.execute("UPDATE stream_ev SET n = 7, name = 'x' WHERE token = 2"))
        store.database.write(lambda conn: conn.execute("UPDATE stream_ev SET token = token WHERE token = 2"))
        assert not _marked(store)
        store.database.write(lambda conn: conn.execute("UPDATE stream_ev SET ts = ts + 1 WHERE token = 4"))
        assert _marked(store)
        assert [tuple(r) for r in store.read_rows("ev", 0, 4, 10)] == _by_token(store, 0, 4)
    finally:
        store.close()


def test_a_mark_made_by_another_connection_is_seen_by_the_next_read(tmp_path: Path) -> None:
    """The master's store reads; another process writes the row out of order: the next read uses indexes."""
    master = _store(tmp_path / "s.db")
    writer = _store(tmp_path / "s.db")
    try:
        writer.append("ev", _rows(0, 5), "w1")
        assert master.read_lines_json("ev", 0, 5, 100, PREFIX, False) == (_lines(master, 0, 5, False), 5, 5)
        _insert_by_hand(writer, 2, _ts(writer, 5) + 1, 100)
        assert master.read_lines_json("ev", 0, 5, 100, PREFIX, False) is None  # token 2 holds two rows now
        assert _indexes(master) == {"stream_ev_token", "stream_ev_ts"}
        assert [tuple(r) for r in master.read_rows("ev", 2, 5, 100)] == _by_token(master, 2, 5)
    finally:
        master.close()
        writer.close()


def test_a_limit_inside_a_batch_reads_the_whole_batch(tmp_path: Path) -> None:
    store = _store(tmp_path / "s.db")
    try:
        store.append("ev", _rows(0, 2), "w1")  # 1, 2
        store.append("ev", _rows(2, 5), "w1", batch=True)  # 3 (five rows)
        store.append("ev", _rows(7, 2), "w1")  # 4, 5
        for after, limit in ((0, 3), (2, 1), (2, 5), (0, 100)):
            rows = [tuple(r) for r in store.read_rows("ev", after, 5, limit)]
            expected = _by_token(store, after, 5)
            assert rows == expected[: len(rows)] and len(rows) >= min(limit, len(expected))
            assert rows[-1][1] != 3 or sum(1 for r in rows if r[1] == 3) == 5
        assert store.read_lines_json("ev", 0, 5, 100, PREFIX, False) is None
        assert store.read_lines_json("ev", 3, 5, 100, PREFIX, True) == (_lines(store, 3, 5, True), 5, 2)
        assert not _marked(store)
    finally:
        store.close()


def test_time_lookup_equals_the_indexed_answer(tmp_path: Path) -> None:
    store = _store(tmp_path / "s.db")
    try:
        assert store.first_token_at("ev", 0) == time_index.TokenAt(None, None, 1)
        assert store.last_ts_upto("ev", 5) is None
        for i in range(8):
            store.append("ev", _rows(i * 3, 3), "w1", batch=i % 3 == 1)
            store.allocate_timestamps(2)  # holes in the timestamps
        store.database.write(lambda conn: conn.execute("DELETE FROM stream_ev WHERE token IN (1, 5, 11)"))
        assert not _marked(store)
        stamps = [ts for (ts,) in store.database.query("SELECT ts FROM stream_ev ORDER BY seq")]
        head = store.heads()["ev"]
        for t in sorted({0, *stamps, *(ts + 1 for ts in stamps), *(ts - 1 for ts in stamps)}):
            got = store.first_token_at("ev", t)
            indexed = time_index.first_token_at(store, "ev", t)  # the SQL through a ts index, as before
            assert (got.token, got.ts) == (indexed.token, indexed.ts), t
        for token in range(head + 2):
            assert store.last_ts_upto("ev", token) == _last_ts_upto(store, token), token
    finally:
        store.close()


def _make_old(store: SqliteStreamStore) -> None:
    """The stream tables as a tickline before storage.sqlite_order left them: indexes, no triggers, no mark table."""

    def run(conn: sqlite3.Connection) -> None:
        conn.execute("DROP TRIGGER stream_ev_order_insert")
        conn.execute("DROP TRIGGER stream_ev_order_update")
        conn.execute("CREATE INDEX stream_ev_token ON stream_ev (token)")
        conn.execute("CREATE INDEX stream_ev_ts ON stream_ev (ts)")
        conn.execute("DROP TABLE tickline_unordered")
        conn.execute("DELETE FROM tickline_schema_version WHERE version = 6")

    store.database.write(run)


def _triggers(store: SqliteStreamStore) -> set[str]:
    rows = store.database.query("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'stream_ev'")
    return {name for (name,) in rows}


def test_upgrade_of_an_old_database_drops_the_indexes_of_an_ordered_stream(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = _store(path)
    store.append("ev", _rows(0, 5), "w1")
    _make_old(store)
    store.close()
    store = _store(path)  # open_store migrates
    try:
        assert _indexes(store) == set() and not _marked(store)
        assert _triggers(store) == {"stream_ev_stale_line", "stream_ev_order_insert", "stream_ev_order_update"}
        assert store.migrate() == []  # nothing left to do, no write
        store.append("ev", _rows(5, 2), "w1")
        assert [tuple(r) for r in store.read_rows("ev", 0, 7, 100)] == _by_token(store, 0, 7) and not _marked(store)
    finally:
        store.close()


def test_upgrade_of_an_old_database_with_rows_out_of_order_marks_it_and_keeps_the_indexes(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = _store(path)
    store.append("ev", _rows(0, 5), "w1")
    _make_old(store)
    _insert_by_hand(store, 2, _ts(store, 5) + 1, 100)  # no trigger then
    store.close()
    store = _store(path)
    try:
        assert _marked(store) and _indexes(store) == {"stream_ev_token", "stream_ev_ts"}
        assert "stream_ev_order_insert" in _triggers(store)
        assert [tuple(r) for r in store.read_rows("ev", 0, 5, 100)] == _by_token(store, 0, 5)
    finally:
        store.close()


def test_migrate_gives_a_marked_stream_its_indexes(tmp_path: Path) -> None:
    store = _store(tmp_path / "s.db")
    try:
        store.append("ev", _rows(0, 3), "w1")
        _insert_by_hand(store, 1, _ts(store, 3) + 1, 100)
        assert _marked(store) and _indexes(store) == set()
        store.migrate()
        assert _indexes(store) == {"stream_ev_token", "stream_ev_ts"}
    finally:
        store.close()


# -- property: the binary searches read what a plain sort reads ----------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 5), st.booleans(), st.sampled_from(["w1", "w2"])),
        st.tuples(st.just("delete"), st.integers(0, 60)),
        st.tuples(st.just("tick"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=25,
)
READS = st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70), st.integers(1, 12)), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, reads=READS)
def test_binary_search_reads_equal_order_by_reads(tmp_path: Path, ops: list[tuple], reads: list[tuple]) -> None:
    path = tmp_path / "p.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    store = _store(path)
    try:
        n = 0
        for op in ops:
            if op[0] == "append":
                _, count, batch, writer = op
                store.append("ev", _rows(n, count), writer, batch=batch and count > 1)
                n += count
            elif op[0] == "delete":
                _delete(store, op[1])
            else:
                store.allocate_timestamps(op[1])
        assert not _marked(store)
        head = store.heads()["ev"]
        for a, b, limit in reads:
            after, upto = min(a, b), max(a, b)
            expected = _by_token(store, after, upto)
            rows = [tuple(r) for r in store.read_rows("ev", after, upto, limit)]
            # At least limit rows (or all), whole tokens, in (token, seq) order.
            assert rows == expected[: len(rows)] and len(rows) >= min(limit, len(expected))
            assert not rows or len(rows) == len(expected) or expected[len(rows)][1] != rows[-1][1]
            got = store.read_lines_json("ev", after, upto, limit, PREFIX, limit % 2 == 0)
            if got is None:
                tokens = [r[1] for r in expected]
                assert len(tokens) != len(set(tokens))  # only where a batch is
            elif got[2] == 0:
                assert got == (b"", after, 0) and not expected
            else:
                data, last, count = got
                assert after < last <= upto and data == _lines(store, after, last, limit % 2 == 0)
                assert count == len(_by_token(store, after, last))
        stamps = [ts for (ts,) in store.database.query("SELECT ts FROM stream_ev")]
        for t in {0, *stamps, *(ts + 1 for ts in stamps)}:
            got_at = store.first_token_at("ev", t)
            indexed = time_index.first_token_at(store, "ev", t)
            assert (got_at.token, got_at.ts) == (indexed.token, indexed.ts)
        for token in range(0, head + 2, 3):
            assert store.last_ts_upto("ev", token) == _last_ts_upto(store, token)
    finally:
        store.close()


def test_the_search_reads_a_few_rows_only(tmp_path: Path) -> None:
    """Each probe is a rowid lookup: the plan has no scan of the stream table."""
    store = _store(tmp_path / "s.db")
    try:
        for column, op in (("token", ">"), ("ts", ">=")):
            sql = sqlite_order.bound_sql("stream_ev", column, op, ":v")
            plan = "\n".join(r[3] for r in store.database.query("EXPLAIN QUERY PLAN " + sql, {"v": 0}))
            assert "SCAN stream_ev" not in plan, plan
    finally:
        store.close()
