"""The SQLite stream store: migrations, streams, tokens, batches, reads, bad input."""

from __future__ import annotations

import multiprocessing
import socket
import sqlite3

import orjson
import pytest

from replication.streams import CACHES, EVENTS
from storage.contracts import ApplyTransaction, Effects
from storage.migrate import migrations
from storage.schema import Column, RowError, SchemaError, StreamSchema
from storage.sqlite_store import SqliteStreamStore
from storage.store import (
    INSTANCE,
    TOKEN,
    TS,
    DatabaseUnavailable,
    SchemaMismatch,
    UnknownStream,
    open_store,
)
from storage.urls import BadDatabaseUrl, parse_database_url, redact_url
from tests.stores import backend_worker_store, pg_worker_store, sqlite_store

EVENT = ["$e", "!r", "m.room.message", None, None]


@pytest.fixture
def store(db_url):
    s = open_store(db_url)
    s.register_stream(EVENTS)
    s.register_stream(CACHES)
    yield s
    s.close()


def test_migrations_are_versioned_and_applied_once(tmp_path) -> None:
    s = SqliteStreamStore(str(tmp_path / "m.db"))
    versions = [v for v, _, _ in migrations()]
    assert versions == sorted(versions) and versions[0] == 1
    assert s.migrate() == versions
    assert s.migrate() == []
    rows = sqlite3.connect(tmp_path / "m.db").execute("SELECT version FROM tickline_schema_version").fetchall()
    assert [r[0] for r in rows] == versions


def test_wal_mode(tmp_path) -> None:
    store = sqlite_store(open_store(f"sqlite:///{tmp_path}/t.db"))
    assert sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_tokens_strictly_increase_one_per_row(store) -> None:
    assert store.append("events", [EVENT, EVENT], "w") == [1, 2]
    assert store.append("events", [EVENT], "w") == [3]
    assert store.safe_positions()["events"] == 3
    assert store.safe_positions()["caches"] == 0


def test_batch_rows_share_one_token(store) -> None:
    store.append("events", [EVENT], "w")
    assert store.append("events", [EVENT, EVENT, EVENT], "w", batch=True) == [2, 2, 2]
    assert store.append("events", [EVENT], "w") == [3]
    rows = store.read_rows("events", 0, 100, 100)
    assert [r[TOKEN] for r in rows] == [1, 2, 2, 2, 3]
    ts = [r[TS] for r in rows]
    assert ts == sorted(ts) and len(set(ts)) == 5


def test_rows_keep_instance_and_values(store) -> None:
    store.append("events", [{"event_id": "$a", "room_id": "!r", "type": "t", "state_key": ""}], "writer-1")
    (row,) = store.read_rows("events", 0, 10, 10)
    assert row[INSTANCE] == "writer-1"
    assert list(row[4:]) == ["$a", "!r", "t", "", None]


def test_read_rows_never_splits_a_token(store) -> None:
    store.append("events", [EVENT] * 2, "w")
    store.append("events", [EVENT] * 5, "w", batch=True)  # token 3
    store.append("events", [EVENT] * 2, "w")
    rows = store.read_rows("events", 0, 100, 3)
    assert [r[TOKEN] for r in rows] == [1, 2, 3, 3, 3, 3, 3]
    rest = store.read_rows("events", 3, 100, 3)
    assert [r[TOKEN] for r in rest] == [4, 5]
    assert [r[TOKEN] for r in store.read_rows("events", 1, 3, 100)] == [2, 3, 3, 3, 3, 3]


def test_json_columns_round_trip(store) -> None:
    store.append("caches", [["c", ["k1", {"a": 1}], 7], ["all", None, 8]], "w")
    rows = store.read_rows("caches", 0, 10, 10)
    assert orjson.loads(rows[0][5]) == ["k1", {"a": 1}]
    assert rows[1][5] is None


@pytest.mark.parametrize(
    "row, message",
    [
        (["$e", "!r"], "expects 5 values"),
        (["$e", "!r", None, None, None], "'type' may not be null"),
        (["$e", 5, "t", None, None], "'room_id' expects text"),
        ({"event_id": "$e", "room_id": "!r", "type": "t", "nope": 1}, "no column 'nope'"),
        ("just a string", "must be a JSON array or object"),
    ],
)
def test_bad_rows_are_refused_naming_the_problem_and_write_nothing(store, row, message) -> None:
    with pytest.raises(RowError, match=message):
        store.append("events", [EVENT, row], "w")
    assert store.safe_positions()["events"] == 0
    assert store.read_rows("events", 0, 100, 100) == []


def test_typed_columns_check_values(db_url) -> None:
    s = open_store(db_url)
    schema = StreamSchema(
        "metrics",
        (Column("n", "bigint"), Column("x", "double"), Column("ok", "boolean"), Column("j", "json", True)),
    )
    s.register_stream(schema)
    s.append("metrics", [[2**63 - 1, 1, True, {"a": [1]}]], "w")
    (row,) = s.read_rows("metrics", 0, 10, 10)
    assert row[4:6] == (2**63 - 1, 1.0) and row[6] in (1, True)
    assert orjson.loads(row[7]) == {"a": [1]}
    with pytest.raises(RowError, match="does not fit in 64 bits"):
        s.append("metrics", [[2**63, 1, True, None]], "w")
    with pytest.raises(RowError, match="'ok' expects boolean"):
        s.append("metrics", [[1, 1, "yes", None]], "w")
    with pytest.raises(RowError, match="'n' expects bigint"):
        s.append("metrics", [[True, 1, True, None]], "w")


def test_unknown_stream(store) -> None:
    with pytest.raises(UnknownStream, match="unknown stream 'nope'"):
        store.append("nope", [EVENT], "w")
    with pytest.raises(UnknownStream):
        store.read_rows("nope", 0, 1, 1)


def test_declared_stream_is_in_the_catalog_for_other_processes(db_url) -> None:
    url = db_url
    schema = StreamSchema("metrics", (Column("host", "text"), Column("value", "double")))
    open_store(url).register_stream(schema)
    other = open_store(url)  # knows nothing of the declaration
    assert other.catalog()["metrics"] == schema
    assert other.append("metrics", [["h", 1.5]], "w") == [1]


def test_changed_declaration_is_refused(db_url) -> None:
    url = db_url
    open_store(url).register_stream(StreamSchema("metrics", (Column("host", "text"),)))
    with pytest.raises(SchemaMismatch, match="stream 'metrics' is declared with columns"):
        open_store(url).register_stream(StreamSchema("metrics", (Column("host", "bigint"),)))


@pytest.mark.parametrize(
    "name, columns, message",
    [
        ("Bad-Name", (Column("a", "text"),), "bad stream name"),
        ("ok", (), "has no columns"),
        ("ok", (Column("a", "text"), Column("a", "text")), "declares column 'a' twice"),
    ],
)
def test_bad_stream_declarations(name, columns, message) -> None:
    with pytest.raises(SchemaError, match=message):
        StreamSchema(name, columns)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "token", "type": "text"}, "reserved"),
        ({"name": "a", "type": "varchar"}, "unknown type 'varchar'"),
        ({"name": "A b", "type": "text"}, "bad column name"),
    ],
)
def test_bad_column_declarations(kwargs, message) -> None:
    with pytest.raises(SchemaError, match=message):
        Column(**kwargs)


def test_database_urls(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_database_url("sqlite:///rel/x.db").path == str(tmp_path / "rel" / "x.db")
    assert parse_database_url("sqlite:////abs/x.db").path == "/abs/x.db"
    assert parse_database_url("postgresql://u@h:5432/db").scheme == "postgresql"
    for bad in ("", "mysql://x", "sqlite://x.db", "sqlite:///", "nonsense"):
        with pytest.raises(BadDatabaseUrl):
            parse_database_url(bad)


def test_unreachable_database_names_the_path(tmp_path) -> None:
    with pytest.raises(DatabaseUnavailable, match="does not exist"):
        open_store(f"sqlite:///{tmp_path}/missing-dir/t.db")


def test_unreachable_postgresql_names_the_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(
        DatabaseUnavailable, match=f"cannot connect to PostgreSQL at postgresql://u@127.0.0.1:{port}/db"
    ):
        open_store(f"postgresql://u@127.0.0.1:{port}/db")


def test_redact_url_hides_every_password_form() -> None:
    cases = {
        "postgresql://u:hunter2@127.0.0.1:5432/db": "postgresql://u:***@127.0.0.1:5432/db",
        "at postgresql://u:p@ss@h/db: refused": "at postgresql://u:***@h/db: refused",
        "postgresql://u@h/db?sslmode=require&password=hunter2": "postgresql://u@h/db?sslmode=require&password=***",
        "host=h password='hunter 2' user=u": "host=h password=*** user=u",
        "postgresql://u@h/db": "postgresql://u@h/db",
        "sqlite:////var/lib/a@b/x.db": "sqlite:////var/lib/a@b/x.db",
    }
    for text, redacted in cases.items():
        assert redact_url(text) == redacted


def test_no_message_shows_a_password(tmp_path) -> None:
    from storage.worker_store import open_snapshot_reader, open_worker_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://u:hunter2@127.0.0.1:{port}/db"
    for fail in (
        lambda: open_store(url),
        lambda: open_worker_store(url),
        lambda: open_snapshot_reader(url).read(lambda view: None),
    ):
        with pytest.raises(DatabaseUnavailable) as raised:
            fail()
        assert "hunter2" not in str(raised.value) and "u:***@" in str(raised.value)
    for bad in ("postgresql://u:hunter2@/", "sqlite://u:hunter2@x", "mysql://u:hunter2@h/db"):
        with pytest.raises(BadDatabaseUrl) as refused:
            parse_database_url(bad)
        assert "hunter2" not in str(refused.value)


def test_snapshot_reader_never_creates_a_database(tmp_path) -> None:
    from storage.worker_store import open_snapshot_reader

    reader = open_snapshot_reader(f"sqlite:///{tmp_path}/absent.db")
    with pytest.raises(DatabaseUnavailable, match="no SQLite database"):
        reader.read(lambda view: view.applied_token("events"))
    assert list(tmp_path.iterdir()) == []


def test_snapshot_reader_sees_the_worker_state_read_only(db_url) -> None:
    from storage.worker_store import open_snapshot_reader, open_worker_store

    store = open_worker_store(db_url)
    store.create_replicated_table(EVENTS)
    for token in (3, 5, 9):

        def effects(txn: ApplyTransaction, t: int = token) -> None:
            txn.replicate(EVENTS, [(t, "w", 1, "$e", "!r", "t", None, None)])

        store.apply("events", token, effects)
    store.close()

    def look(view):
        return (
            view.has_table("tickline_applied"),
            view.has_table("replicated_nothing"),
            {"token", "instance_name", "ts", "event_id"} <= view.table_columns("replicated_events"),
            view.applied_token("events"),
            view.applied_token("caches"),
            view.token_bounds("replicated_events", None, 9),
            view.token_bounds("replicated_events", 3, 8),
            view.token_bounds("replicated_events", 9, 9),
        )

    reader = open_snapshot_reader(db_url)
    assert reader.read(look) == (True, False, True, 9, 0, (3, 9), (5, 5), (None, None))
    assert "hunter2" not in reader.describe()


def _append_many(url: str, instance: str, count: int, queue) -> None:
    s = open_store(url)
    queue.put([s.append("events", [EVENT], instance)[0] for _ in range(count)])
    s.close()


def test_concurrent_writer_processes_get_distinct_increasing_tokens(db_url) -> None:
    url = db_url
    open_store(url).register_stream(EVENTS)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_append_many, args=(url, f"w{i}", 100, queue)) for i in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    tokens = sorted(t for r in results for t in r)
    assert tokens == list(range(1, 301))
    for result in results:
        assert result == sorted(result)
    rows = open_store(url).read_rows("events", 0, 1000, 1000)
    assert [r[TOKEN] for r in rows] == tokens
    ts = [r[TS] for r in rows]
    assert len(set(ts)) == len(ts)


def test_worker_apply_moves_the_token_only_forwards_with_its_effects(db_url) -> None:
    from storage.worker_store import StaleApply, open_worker_store

    store = backend_worker_store(open_worker_store(db_url))
    store.create_replicated_table(EVENTS)

    def effects(token: int) -> Effects:
        return lambda txn: txn.replicate(EVENTS, [(token, "w", 1, f"$e{token}", "!r", "t", None, None)])

    store.apply("events", 5, effects(5))
    with pytest.raises(StaleApply):
        store.apply("events", 5, effects(5))
    with pytest.raises(StaleApply):
        store.apply("events", 3, effects(3))
    store.apply("events", 6, effects(6))
    assert store.applied_tokens() == {"events": 6}
    rows = store.database.read(lambda c: c.execute("SELECT token FROM replicated_events ORDER BY token").fetchall())
    assert [r[0] for r in rows] == [5, 6]  # the refused applies left nothing behind
    store.close()


@pytest.mark.parametrize("count", [1, 7, 250])  # one statement, and COPY from 100 rows
@pytest.mark.parametrize("batch", [False, True])
def test_every_value_round_trips_by_statement_and_by_copy(db_url, count, batch) -> None:
    s = open_store(db_url)
    schema = StreamSchema(
        "mixed",
        (
            Column("t", "text", True),
            Column("n", "bigint", True),
            Column("x", "double", True),
            Column("ok", "boolean", True),
            Column("j", "json", True),
        ),
    )
    s.register_stream(schema)
    texts = ["tab\there", "new\nline\r\n", "back\\slash \\N \\t", "ünïcode ☃", "", "\\", "end\\"]
    rows = []
    for i in range(count):
        rows.append(
            [
                texts[i % len(texts)] if i % 5 else None,
                [-(2**63), 2**63 - 1, 0, i][i % 4] if i % 6 else None,
                [1.5, -0.0, 1e308, 2.5e-7, -1e-300][i % 5] if i % 7 else None,
                [True, False][i % 2] if i % 8 else None,
                {"k": texts[i % len(texts)], "n": [i, None]} if i % 3 else None,
            ]
        )
    tokens = s.append("mixed", rows, "w\\x", batch=batch)
    assert len(tokens) == count
    assert tokens == ([tokens[0]] * count if batch else list(range(tokens[0], tokens[0] + count)))
    stored = s.read_rows("mixed", 0, 10**9, 10**6)
    assert [r[TOKEN] for r in stored] == tokens
    assert {r[INSTANCE] for r in stored} == {"w\\x"}
    stamps = [r[TS] for r in stored]
    assert stamps == sorted(stamps) and len(set(stamps)) == count
    for row, back in zip(rows, stored, strict=True):
        assert list(back[4:8]) == [row[0], row[1], row[2], row[3] if row[3] is None else back[7]]
        if row[3] is not None:
            assert bool(back[7]) is row[3]
        assert (None if back[8] is None else orjson.loads(back[8])) == row[4]
    s.close()


def test_a_transaction_of_several_appends_commits_once(db_url) -> None:
    s = open_store(db_url)
    s.register_stream(EVENTS)
    writing = getattr(s, "writing", None)
    if writing is None:
        pytest.skip("this store has no writing()")
    with writing("events", "w") as txn:
        first = txn.append([EVENT])
        many = txn.append([EVENT] * 150)
        shared = txn.append([EVENT] * 2, batch=True) + txn.append([EVENT] * 120, batch=True)
    assert many[0] == first[0] + 1 and len(set(shared)) == 1 and shared[0] > many[-1]
    assert len(s.read_rows("events", 0, 10**9, 10**6)) == 1 + 150 + 122
    assert s.safe_positions()["events"] >= shared[0]
    s.close()


@pytest.mark.parametrize("count", [3, 120])  # one multi-row INSERT, and COPY from 50 rows
def test_worker_replicates_every_value_by_statement_and_by_copy(db_url, count) -> None:
    from storage.worker_store import open_worker_store

    schema = StreamSchema(
        "mixed",
        (Column("t", "text", True), Column("x", "double", True), Column("ok", "boolean"), Column("j", "json", True)),
    )
    store = backend_worker_store(open_worker_store(db_url))
    store.create_replicated_table(schema)
    texts = ["tab\there", "new\nline\r", "back\\slash \\N", "ünïcode ☃", ""]
    rows = [
        (
            7,
            "w\\1",
            100 + i,
            *schema.check_row([texts[i % 5] if i % 4 else None, i / 3, i % 2 == 0, {"k": texts[i % 5]}]),
        )
        for i in range(count)
    ]
    store.apply("mixed", 7, lambda txn: txn.replicate(schema, rows))
    back = store.database.read(
        lambda c: c.execute("SELECT token, instance_name, ts, t, x, ok, j FROM replicated_mixed ORDER BY ts").fetchall()
    )
    assert len(back) == count
    for row, got in zip(rows, back, strict=True):
        assert tuple(got[:5]) == row[:5] and bool(got[5]) is row[5]
        assert (
            orjson.loads(got[6]) == orjson.loads(row[6]) if isinstance(got[6], str) else got[6] == orjson.loads(row[6])
        )
    store.close()


def test_worker_synchronous_commit_is_a_choice(pg_url) -> None:
    from storage.worker_store import open_worker_store

    for choice, expected in ((False, "off"), (True, "on")):
        store = pg_worker_store(open_worker_store(pg_url, synchronous_commit=choice))
        assert store.database.read(lambda c: c.execute("SHOW synchronous_commit").fetchone()[0]) == expected
        store.close()


def test_a_bad_row_in_a_large_append_is_named_and_nothing_is_written(db_url) -> None:
    s = open_store(db_url)
    schema = StreamSchema("m", (Column("n", "bigint"), Column("x", "double"), Column("j", "json", True)))
    s.register_stream(schema)
    good = [[i, i, {"i": i}] for i in range(150)]  # ints for a double are converted
    with pytest.raises(RowError, match="'n' expects bigint"):
        s.append("m", [*good[:70], ["7", 1.0, None], *good[70:]], "w")
    with pytest.raises(RowError, match="expects 3 values"):
        s.append("m", [*good, [1, 2.0]], "w")
    assert s.read_rows("m", 0, 10**9, 10**6) == []
    s.append("m", good, "w")
    back = s.read_rows("m", 0, 10**9, 10**6)
    assert [(r[4], r[5], orjson.loads(r[6])) for r in back] == [(i, float(i), {"i": i}) for i in range(150)]
    s.close()
