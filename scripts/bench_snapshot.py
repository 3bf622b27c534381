"""Benchmark scenario "snapshot": Spark reading a worker's ``replicated_events``.

A worker's database (SQLite, and PostgreSQL on a throwaway local server) holds
N rows of the ``events`` stream in ``replicated_events`` (default 1,000,000;
``--rows`` overrides), written through ``WorkerStore.apply`` as a worker
writes them (rows and applied token in one transaction, 50,000 rows each).
In one local[2] SparkSession, runs alternate between:

tickline   ``workers.snapshot.snapshot(spark, url, "events", num_partitions=4)``:
           the applied token and token range read in one transaction, then the
           JDBC read of ``token <= T`` in 4 token ranges;
baseline   a bare ``spark.read.jdbc`` of the same table: ``column="token"``,
           bounds known beforehand, the same 4 partitions, ``customSchema`` and
           ``fetchsize`` (without ``customSchema`` SQLite's BIGINTs would read
           as decimals, which is other work).

Each run is timed from the call to the end of an action that materializes
every row and column (``df.write.format("noop")``). The best run of each is
reported, as rows/s and the ratio tickline / baseline (the target: within
1.2x, a ratio of 0.83 or more).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from typing import Any

from scripts.benchmark import BenchError, _fmt, make_rows

DEFAULT_SNAPSHOT_ROWS = 1_000_000
PARTITIONS = 4
FILL_CHUNK = 50_000
TS_BASE = 1 << 58  # a realistic timestamp oracle value (ms << 18)


def fill_worker_database(url: str, rows: int) -> int:
    """``rows`` rows of ``events`` (one token each) in ``replicated_events``; returns the applied token."""
    from replication.streams import EVENTS
    from storage.urls import parse_database_url
    from storage.worker_store import ApplyTransaction, open_worker_store

    store = open_worker_store(url)
    store.create_replicated_table(EVENTS)
    sqlite = parse_database_url(url).is_sqlite
    columns = ", ".join(("token", "instance_name", "ts", *EVENTS.column_names))
    for start in range(0, rows, FILL_CHUNK):
        count = min(FILL_CHUNK, rows - start)
        values = [(start + i + 1, "master", TS_BASE + start + i, *row) for i, row in enumerate(make_rows(start, count))]
        effects: Callable[[ApplyTransaction], None]
        if sqlite:

            def effects(txn: ApplyTransaction, values: list = values) -> None:
                txn.replicate(EVENTS, values)
        else:
            text = "".join("\t".join("\\N" if v is None else str(v) for v in row) + "\n" for row in values)

            def copy(txn: ApplyTransaction, text: str = text) -> None:  # COPY: the fastest load PostgreSQL has
                txn.connection.cursor.copy_expert(
                    f"COPY {EVENTS.replicated_table} ({columns}) FROM STDIN", io.StringIO(text)
                )

            effects = copy

        store.apply("events", start + count, effects)
    store.close()
    if not sqlite:
        import psycopg2

        conn = psycopg2.connect(url)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"VACUUM ANALYZE {EVENTS.replicated_table}")
        conn.close()
    return rows


def _java_peak_kib(spark: Any) -> int | None:
    try:
        pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except Exception:
        return None
    return None


def measure_backend(spark: Any, url: str, rows: int, repeat: int, log: Any) -> dict[str, Any]:
    from replication.streams import EVENTS
    from workers.snapshot import custom_schema, jdbc_options, snapshot

    settings_fetchsize = 10000
    options = jdbc_options(url)
    jdbc_url = options.pop("url")
    properties = dict(options, customSchema=custom_schema(EVENTS), fetchsize=str(settings_fetchsize))

    def bare() -> int:
        df = spark.read.jdbc(
            jdbc_url,
            EVENTS.replicated_table,
            column="token",
            lowerBound=1,
            upperBound=rows + 1,
            numPartitions=PARTITIONS,
            properties=properties,
        )
        df.write.format("noop").mode("overwrite").save()
        return rows

    def tickline() -> int:
        snap = snapshot(spark, url, "events", num_partitions=PARTITIONS)
        snap.dataframe.write.format("noop").mode("overwrite").save()
        return snap.token  # one row per token

    # Both read the same rows: check once, untimed.
    check = snapshot(spark, url, "events", num_partitions=PARTITIONS)
    if check.token != rows or check.dataframe.count() != rows:
        raise BenchError(
            f"snapshot of {url} holds {check.dataframe.count()} rows at token {check.token}, expected {rows}"
        )
    runs: dict[str, list[float]] = {"baseline": [], "tickline": []}
    for i in range(repeat):
        for name, fn in (
            (("baseline", bare), ("tickline", tickline)) if i % 2 == 0 else (("tickline", tickline), ("baseline", bare))
        ):
            started = time.perf_counter()
            count = fn()
            rate = count / (time.perf_counter() - started)
            runs[name].append(rate)
            log(f"{name}: {_fmt(rate)} rows/s")
    return {"tickline": max(runs["tickline"]), "baseline": max(runs["baseline"]), "runs": runs}


def run_snapshot_bench(
    rows: int | None,
    repeat: int,
    workdir: str,
    verbose: bool = False,
    spark: Any = None,
    backends: tuple[str, ...] = ("sqlite", "postgresql"),
) -> dict[str, Any]:
    """Fill, measure and return ``{"snapshot-<backend>": {...}}``; uses ``spark`` if given, else starts one."""
    rows = DEFAULT_SNAPSHOT_ROWS if rows is None else rows

    def log(text: str) -> None:
        if verbose:
            print(f"  {text}", flush=True)

    from workers.snapshot import SnapshotError, require_spark, spark_session

    try:
        require_spark()
    except SnapshotError as e:
        raise BenchError(str(e)) from None
    own = spark is None
    results: dict[str, Any] = {}
    pg = None
    try:
        urls = {}
        if "sqlite" in backends:
            urls["sqlite"] = f"sqlite:///{os.path.join(workdir, 'snapshot-worker.db')}"
        if "postgresql" in backends:
            from scripts.pg_local import PostgresServer

            pg = PostgresServer()
            pg.start()
            urls["postgresql"] = pg.new_database()
        for backend, url in urls.items():
            started = time.monotonic()
            fill_worker_database(url, rows)
            log(f"{backend}: filled {rows:,} rows in {time.monotonic() - started:.1f} s")
        if spark is None:
            spark = spark_session("local[2]", app_name="tickline-bench", quiet=True)
        for backend, url in urls.items():
            result = measure_backend(spark, url, rows, repeat, lambda t, b=backend: log(f"{b} {t}"))
            result["rows"] = rows
            results[f"snapshot-{backend}"] = result
        peak = _java_peak_kib(spark)
        for result in results.values():
            result["java_peak_kib"] = peak
    finally:
        if own and spark is not None:
            spark.stop()
        if pg is not None:
            pg.stop()
    return results


def print_results(results: dict[str, Any]) -> None:
    for name, r in results.items():
        print(
            f"{name}: tickline {_fmt(r['tickline'])} rows/s, baseline {_fmt(r['baseline'])} rows/s, "
            f"ratio {r['tickline'] / r['baseline']:.2f}",
            flush=True,
        )
        peak = f", Spark JVM peak {r['java_peak_kib'] // 1024:,} MiB" if r.get("java_peak_kib") else ""
        print(
            f"  {r['rows']:,} rows, {PARTITIONS} partitions, local[2]; baseline: bare spark.read.jdbc of the "
            f"same table{peak}",
            flush=True,
        )
