"""Config and input validation: numbers in range, names SQL can take, files that are not UTF-8 or YAML.

Every bad value gets one message naming the key; the master and
``check-config`` refuse the same files; a secret is never echoed.
"""

from __future__ import annotations

import math

import attr
import pytest

from replication.settings import MasterConfig, ProtocolConfig
from scripts.config import COUNT, NUMBER_RANGES, SECONDS, ConfigError, config_from_mapping, load_config
from storage.contracts import ApplyTransaction
from storage.schema import SQL_KEYWORDS, Column, SchemaError, StreamSchema
from storage.store import open_store
from workers.settings import ApplySettings, WorkerConfig
from workers.snapshot import SparkSettings


def _numeric_keys() -> list[tuple[str, type]]:
    """Every numeric key of the configuration, as the loader names it."""
    keys = []
    for cls, prefix, skip in (
        (MasterConfig, "master.", {"listen_port"}),
        (ProtocolConfig, "protocol.", set()),
        (WorkerConfig, "worker.", {"master_port"}),
        (ApplySettings, "worker.", set()),
        (SparkSettings, "spark.", set()),
    ):
        for field in attr.fields(cls):
            kind = {"float": float, "int": int}.get(str(field.type))
            if kind is not None and field.name not in skip:
                keys.append((prefix + field.name, kind))
    return [*keys, ("caches.max_size", int)]


def _mapping(key: str, value) -> dict:
    section, name = key.split(".")
    return {section: {name: value}}


def test_every_numeric_key_has_a_sensible_range() -> None:
    for key, kind in _numeric_keys():
        low, high = NUMBER_RANGES.get(key, SECONDS if kind is float else COUNT)
        assert 0 < low < high < 2**31, key


@pytest.mark.parametrize("key, kind", _numeric_keys())
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e-300, -1, 0, 10**12, 1e300, "5", True, None])
def test_every_numeric_key_refuses_what_would_break_it(key, kind, value) -> None:
    if value is None and key == "caches.max_size":
        return  # null: unbounded caches
    with pytest.raises(ConfigError) as e:
        config_from_mapping(_mapping(key, value))
    message = str(e.value)
    assert message.startswith(f"{key}: ") and "\n" not in message


@pytest.mark.parametrize("key, kind", _numeric_keys())
def test_every_numeric_key_takes_its_bounds(key, kind) -> None:
    low, high = NUMBER_RANGES.get(key, SECONDS if kind is float else COUNT)
    for value in (low, high):
        raw = _mapping(key, kind(value))
        if key == "protocol.ping_interval":
            raw["protocol"]["ping_timeout"] = max(value * 2, 15)
        if key == "protocol.ping_timeout":
            raw["protocol"]["ping_interval"] = min(value / 2, 3600.0)
        if key in ("worker.reconnect_max", "worker.retry_max"):
            raw["worker"][key.replace("_max", "_initial").split(".")[1]] = min(value, 0.01)
        if key in ("worker.reconnect_initial", "worker.retry_initial"):
            raw["worker"][key.replace("_initial", "_max").split(".")[1]] = max(value, 86400.0)
        if key == "worker.apply_linger_rows":
            raw["worker"]["apply_rows"] = value
        if key == "worker.apply_rows":
            raw["worker"]["apply_linger_rows"] = min(value, 256)
        config_from_mapping(raw)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"master": {"poll_interval": float("inf")}}, "master.poll_interval: expected a finite number, got inf"),
        ({"master": {"poll_interval": 1e-300}}, "master.poll_interval: 1e-300 is out of range (0.001 to 60 seconds)"),
        ({"master": {"poll_interval": -1}}, "master.poll_interval: expected a positive number, got -1"),
        ({"protocol": {"max_line_bytes": 10**12}}, "protocol.max_line_bytes: 1000000000000 is out of range"),
        ({"protocol": {"ping_interval": 20}}, "protocol.ping_interval (20 s) must be below protocol.ping_timeout"),
        (
            {"worker": {"reconnect_initial": 10}},
            "worker.reconnect_initial (10 s) must not be above worker.reconnect_max",
        ),
        ({"master": {"db_threads": 100000}}, "master.db_threads: 100000 is out of range (1 to 64)"),
        (
            {"worker": {"apply_linger_rows": 10000}},
            "worker.apply_linger_rows (10000) must not be above worker.apply_rows (5000)",
        ),
    ],
)
def test_range_messages(raw, message) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping(raw)
    assert message in str(e.value)


@pytest.mark.parametrize("secret", ["hunter2 x", "hunter2\tx", "hunter2é", "hunter2" * 50, "", "hunter2\nx", 12345])
def test_a_bad_secret_is_never_echoed(secret) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping({"secret": secret})
    assert str(e.value).startswith("secret: ") and "value not shown" in str(e.value)
    assert "hunter2" not in str(e.value) and "12345" not in str(e.value)


def test_a_password_in_a_bad_database_url_is_masked() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping({"database": "mysql://admin:hunter2@db/x"})
    assert "hunter2" not in str(e.value) and "admin:***@db" in str(e.value)


def test_invalid_utf8_and_deep_nesting_in_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"server_name: ok\nlisten: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"is not valid UTF-8 \(line 2, byte 25\)"):
        load_config(str(bad))
    deep = tmp_path / "deep.yaml"
    deep.write_text("streams: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"nested too deeply|not valid YAML|streams"):
        load_config(str(deep))
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * 2_000_000 + "\n")
    with pytest.raises(ConfigError, match="is larger than"):
        load_config(str(big))


# -- names that SQL can take ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["order", "select", "user", "values", "group", "from", "table", "limit"])
def test_sql_keywords_are_refused_as_column_names_with_the_reason(name) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping({"streams": {"m": {"columns": [{"name": name, "type": "text"}]}}})
    assert f"column name {name!r} is an SQL keyword" in str(e.value)
    assert f"{name + '_'!r}" in str(e.value)


def test_stream_names_fit_postgresql_identifiers() -> None:
    StreamSchema("s" * 46, (Column("a", "text"),))
    with pytest.raises(SchemaError, match="at most 46 characters"):
        StreamSchema("s" * 47, (Column("a", "text"),))


# Keywords that are not refused: they must work as column names on both backends.
ALLOWED_KEYWORDS = [
    "type", "keys", "key", "position", "time", "timestamp", "action", "name", "value", "level", "data",
    "comment", "source", "version", "year", "first", "last", "row", "rows", "int", "char", "text",
    "over", "filter", "range", "match", "plan", "query", "temp", "view", "without", "within", "zone",
    "abort", "after", "before", "begin", "by", "cascade", "conflict", "current", "database", "deferred",
    "detach", "each", "exclude", "exclusive", "explain", "fail", "following", "generated", "glob",
    "groups", "if", "ignore", "immediate", "indexed", "instead", "materialized", "no", "nulls",
    "of", "others", "partition", "pragma", "preceding", "recursive", "regexp", "reindex", "release",
    "rename", "replace", "restrict", "rollback", "savepoint", "ties", "trigger", "unbounded", "vacuum",
    "virtual", "attach", "always", "between_", "setof", "none", "out", "inout", "national", "nchar",
]  # fmt: skip


def test_keywords_not_refused_work_as_columns_on_both_backends(db_url) -> None:
    from storage.worker_store import open_worker_store

    store = open_store(db_url)
    for i, word in enumerate(ALLOWED_KEYWORDS):
        schema = StreamSchema(f"k{i}", (Column(word, "text"), Column("j", "json", True), Column("d", "double", True)))
        store.register_stream(schema)
        store.append(schema.name, [["v", [1], 0.5]], "w")
        assert store.read_rows(schema.name, 0, 10, 10)[0][4:] == ("v", "[1]", 0.5)
        if hasattr(store, "read_rows_json"):
            store.read_rows_json(schema.name, 0, 10, 10)
    store.close()
    worker = open_worker_store(db_url)
    for i, word in enumerate(ALLOWED_KEYWORDS[:20]):
        schema = StreamSchema(f"k{i}", (Column(word, "text"),))
        worker.create_replicated_table(schema)

        def effects(txn: ApplyTransaction, schema: StreamSchema = schema) -> None:
            txn.replicate(schema, [(1, "w", 1, "v")])

        worker.apply(schema.name, 1, effects)
    worker.close()


def test_every_reserved_postgresql_keyword_is_refused(pg_url) -> None:
    """A newer PostgreSQL may reserve more words: this catches it."""
    import psycopg2

    conn = psycopg2.connect(pg_url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT word FROM pg_get_keywords() WHERE catcode IN ('R', 'T')")
            reserved = {word for (word,) in cur.fetchall()}
    finally:
        conn.close()
    assert reserved <= SQL_KEYWORDS, sorted(reserved - SQL_KEYWORDS)
