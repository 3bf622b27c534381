"""Snapshots through the Python API, on SQLite and PostgreSQL, while a worker keeps applying rows."""

from __future__ import annotations

import pytest

from storage.schema import StreamSchema
from tests.spark.conftest import SAMPLE, TS_BASE, SimulatedWorker, as_tuples, expected_rows
from workers.handlers import ReplicatedRow
from workers.snapshot import (
    SnapshotError,
    custom_schema,
    incremental,
    jdbc_options,
    parse_json,
    read_bounds,
    snapshot,
    spark_schema,
)

SAMPLE_TYPES = {
    "token": "bigint",
    "instance_name": "string",
    "ts": "bigint",
    "name": "string",
    "amount": "bigint",
    "score": "double",
    "flag": "boolean",
    "payload": "string",
    "note": "string",
}


def test_snapshot_holds_exactly_the_rows_up_to_its_token_while_the_worker_writes(
    spark, worker: SimulatedWorker
) -> None:
    from pyspark.sql.functions import spark_partition_id

    worker.fill(1500)
    worker.start()
    worker.wait_for(1600)
    snap = snapshot(spark, worker.url, "sample", SAMPLE, num_partitions=4)
    assert snap.partitions == 4 == snap.dataframe.rdd.getNumPartitions()
    assert dict(snap.dataframe.dtypes) == SAMPLE_TYPES
    # The read happens here, while the worker goes on applying tokens above T.
    rows = snap.dataframe.withColumn("pid", spark_partition_id()).collect()
    worker.wait_for(snap.token + 50)  # rows above T certainly exist while we check
    after_read = worker.applied
    worker.stop()

    token = snap.token
    assert token >= 1600
    assert as_tuples(rows) == expected_rows(1, token)  # every row with token <= T ...
    assert len({(r["token"], r["ts"]) for r in rows}) == len(rows)  # ... each once
    assert after_read > token
    # Four token ranges, side by side, none empty.
    ranges: dict[int, tuple[int, int]] = {}
    for r in rows:
        low, high = ranges.get(r["pid"], (r["token"], r["token"]))
        ranges[r["pid"]] = (min(low, r["token"]), max(high, r["token"]))
    assert sorted(ranges) == [0, 1, 2, 3]
    spans = [ranges[p] for p in sorted(ranges)]
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))

    # Unpacks as (DataFrame, token); a later snapshot as of T reads the same rows.
    again, again_token = snapshot(spark, worker.url, "sample", SAMPLE, as_of=token, num_partitions=3)
    assert again_token == token
    assert again.count() == len(rows)


def test_two_incremental_reads_make_up_the_snapshot(spark, worker: SimulatedWorker) -> None:
    worker.fill(300)
    worker.start()
    first = incremental(spark, worker.url, "sample", 0, SAMPLE)
    first_rows = first.dataframe.collect()
    worker.wait_for(first.token + 100)
    second = incremental(spark, worker.url, "sample", first.token, SAMPLE)
    second_rows = second.dataframe.collect()
    whole = snapshot(spark, worker.url, "sample", SAMPLE, as_of=second.token).dataframe.collect()
    worker.stop()

    assert first.after == 0 and second.after == first.token and second.token > first.token
    assert all(r["token"] <= first.token for r in first_rows)
    assert all(first.token < r["token"] <= second.token for r in second_rows)
    assert as_tuples(first_rows + second_rows) == as_tuples(whole) == expected_rows(1, second.token)
    # Nothing new: an empty increment at the same token.
    empty = incremental(spark, worker.url, "sample", second.token, SAMPLE, upto=second.token)
    assert empty.dataframe.count() == 0 and empty.partitions == 1
    few = snapshot(spark, worker.url, "sample", SAMPLE, as_of=3, num_partitions=8)
    assert few.partitions == 3 == few.dataframe.rdd.getNumPartitions()  # (max + 1 - min) tokens


def test_64_bit_values_nulls_and_json(spark, worker: SimulatedWorker) -> None:
    from pyspark.sql.functions import col, get_json_object

    extremes = [
        ReplicatedRow("sample", 1, "w", 2**63 - 1, ("max", 2**63 - 1, 0.1, True, {"k": 2**62 + 1, "tags": ["a"]}, "n")),
        ReplicatedRow("sample", 1, "w", 2**53 + 1, ("min", -(2**63), -1.5e300, False, [1, "two", None], None)),
        ReplicatedRow("sample", 2, "other", TS_BASE + 3, ("nulls", 0, None, None, None, None)),
    ]
    worker.apply(1, extremes[:2])
    worker.apply(2, extremes[2:])
    df = snapshot(spark, worker.url, "sample", SAMPLE, num_partitions=4).dataframe
    rows = {r["name"]: r for r in df.collect()}
    assert rows["max"]["ts"] == 2**63 - 1 and rows["max"]["amount"] == 2**63 - 1
    assert rows["min"]["ts"] == 2**53 + 1 and rows["min"]["amount"] == -(2**63)
    assert rows["min"]["score"] == -1.5e300 and rows["max"]["flag"] is True and rows["min"]["flag"] is False
    assert [rows["nulls"][c] for c in ("score", "flag", "payload", "note")] == [None] * 4
    assert rows["min"]["note"] is None

    parsed = parse_json(df, "payload", "struct<k: bigint, tags: array<string>>", alias="p")
    got = {r["name"]: r["p"] for r in parsed.select("name", "p").collect()}
    assert got["max"]["k"] == 2**62 + 1 and got["max"]["tags"] == ["a"]
    assert got["nulls"] is None
    arrays = parse_json(df.where(col("name") == "min"), "payload", "array<string>").collect()
    assert arrays[0]["payload"] == ["1", "two", None]
    field = df.select("name", get_json_object("payload", "$.k").alias("k")).collect()
    assert {r["name"]: r["k"] for r in field}["max"] == str(2**62 + 1)


def test_bounds_and_errors(spark, worker: SimulatedWorker) -> None:
    assert read_bounds(worker.url, SAMPLE).token == 0  # nothing applied yet
    assert snapshot(spark, worker.url, "sample", SAMPLE).dataframe.count() == 0
    worker.fill(10)
    bounds = read_bounds(worker.url, SAMPLE, after=4)
    assert (bounds.token, bounds.after, bounds.min_token, bounds.max_token) == (10, 4, 5, 10)
    with pytest.raises(SnapshotError, match="above the worker's applied token 10"):
        read_bounds(worker.url, SAMPLE, as_of=11)
    with pytest.raises(SnapshotError, match="after token 11 is above"):
        read_bounds(worker.url, SAMPLE, after=11)
    with pytest.raises(SnapshotError, match="unknown stream 'nosuch'"):
        snapshot(spark, worker.url, "nosuch")
    other = StreamSchema("events", SAMPLE.columns)
    with pytest.raises(SnapshotError, match="no table replicated_events"):
        read_bounds(worker.url, other)
    with pytest.raises(SnapshotError, match="num_partitions"):
        snapshot(spark, worker.url, "sample", SAMPLE, num_partitions=0)


def test_schema_helpers() -> None:
    assert custom_schema(SAMPLE) == (
        "token BIGINT, instance_name STRING, ts BIGINT, name STRING, amount BIGINT, score DOUBLE, "
        "flag BOOLEAN, payload STRING, note STRING"
    )
    struct = spark_schema(SAMPLE)
    assert [(f.name, f.nullable) for f in struct.fields][:4] == [
        ("token", False),
        ("instance_name", False),
        ("ts", False),
        ("name", False),
    ]
    assert struct["note"].nullable
    assert jdbc_options("postgresql://u%40x:p%3Aw@db.example:5433/work?sslmode=require") == {
        "url": "jdbc:postgresql://db.example:5433/work",
        "driver": "org.postgresql.Driver",
        "user": "u@x",
        "password": "p:w",
        "sslmode": "require",
    }
    assert jdbc_options("sqlite:////var/lib/w.db")["url"] == "jdbc:sqlite:/var/lib/w.db"


def test_missing_database_is_an_error(tmp_path) -> None:
    with pytest.raises(SnapshotError, match="no SQLite database at"):
        read_bounds(f"sqlite:///{tmp_path}/absent.db", SAMPLE)
    assert not (tmp_path / "absent.db").exists()
