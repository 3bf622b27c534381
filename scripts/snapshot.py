"""``tickline snapshot``: a worker's replicated stream read by Spark as of one token.

::

    tickline snapshot [-c FILE] [--database URL] --stream NAME [--partitions N]
                      [--as-of TOKEN | --after TOKEN] [--out DIR]

Prints one JSON object on stdout: ``stream``, ``token`` (the upper bound,
inclusive), ``after`` (incremental reads only: the lower bound, exclusive),
``rows``, ``partitions``, ``applied`` (the worker's applied token when read),
``seconds``, and with ``--out`` the directory written. With ``--out`` the rows
go to Parquet in ``DIR/<stream>_<after>_<token>/`` (``after`` is 0 for a full
snapshot), beside a manifest ``_manifest.json`` (Spark skips files starting
with ``_`` when it reads the directory). The directory appears complete or
not at all: it is written under a hidden name and renamed.

Everything that can be checked without Spark (the stream, the database, the
table, the tokens) is checked before the JVM starts, so mistakes fail fast.
Progress of the Spark read goes to stderr every few seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import threading
import time
from typing import Any, TextIO

from scripts.config import Config
from storage.urls import parse_database_url, redact_url
from workers.snapshot import (
    SnapshotBounds,
    SnapshotError,
    load,
    output_name,
    read_bounds,
    require_spark,
    resolve_schema,
    spark_session,
)

MANIFEST = "_manifest.json"
JOB_GROUP = "tickline-snapshot"


def run_snapshot(args: argparse.Namespace, config: Config) -> int:
    try:
        result = take_snapshot(args, config)
    except SnapshotError as e:
        print(f"tickline snapshot: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


def _range_text(bounds: SnapshotBounds) -> str:
    return f"({bounds.after or 0}, {bounds.token}]"


def take_snapshot(args: argparse.Namespace, config: Config, err: TextIO | None = None) -> dict[str, Any]:
    started = time.monotonic()
    err = err or sys.stderr
    require_spark()  # before anything else: without it nothing below can finish
    schema = resolve_schema(args.stream, streams=config.streams)
    partitions = config.spark.num_partitions if args.partitions is None else args.partitions
    if partitions < 1:
        raise SnapshotError(f"--partitions must be at least 1, got {partitions}")
    url = parse_database_url(args.database or config.worker.database)
    bounds = read_bounds(url, schema, as_of=args.as_of, after=args.after)

    target = None
    if args.out:
        target = os.path.join(os.path.abspath(args.out), output_name(schema.name, bounds.after, bounds.token))
        if os.path.exists(target):
            raise SnapshotError(f"{target} already exists (it holds the same rows if a snapshot wrote it)")

    print(
        f"tickline snapshot: {schema.name} {_range_text(bounds)} (applied token {bounds.applied}), "
        f"{partitions} partition(s); starting Spark",
        file=err,
        flush=True,
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its connection chatter at INFO
    from pyspark.sql import SparkSession

    own_session = SparkSession.getActiveSession() is None  # called in-process beside a session: leave it be
    spark = spark_session(app_name="tickline-snapshot", settings=config.spark, quiet=True)
    try:
        snap = load(spark, bounds, partitions, config.spark)
        sc = spark.sparkContext
        sc.setJobGroup(JOB_GROUP, f"tickline snapshot {schema.name} {_range_text(bounds)}")
        with Progress(sc, f"{schema.name} {_range_text(bounds)}", err):
            if target is None:
                rows = snap.dataframe.count()
            else:
                rows = _write_parquet(spark, snap, target, url.text, started)
    except SnapshotError:
        raise
    except Exception as e:  # a failure inside Spark: one line, not a Java stack
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = next((line for line in lines if "Exception" in line), lines[0] if lines else type(e).__name__)
        raise SnapshotError(f"Spark failed: {first}") from None
    finally:
        if own_session:
            spark.stop()

    result: dict[str, Any] = {"stream": schema.name, "token": bounds.token}
    if bounds.after is not None:
        result["after"] = bounds.after
    result.update(
        rows=rows, partitions=snap.partitions, applied=bounds.applied, seconds=round(time.monotonic() - started, 3)
    )
    if target is not None:
        result["out"] = target
    return result


def _write_parquet(spark: Any, snap: Any, target: str, database: str, started: float) -> int:
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    temporary = os.path.join(parent, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        snap.dataframe.write.parquet(temporary)
        rows = spark.read.parquet(temporary).count()  # from the files' metadata
        bounds = snap.bounds
        manifest = {
            "stream": bounds.stream,
            "after": bounds.after or 0,
            "token": bounds.token,
            "incremental": bounds.after is not None,
            "rows": rows,
            "partitions": snap.partitions,
            "applied": bounds.applied,
            "min_token": bounds.min_token,
            "max_token": bounds.max_token,
            "database": redact_url(database),
            "format": "parquet",
            "files": sorted(f for f in os.listdir(temporary) if f.endswith(".parquet")),
            "columns": [
                {"name": "token", "type": "bigint", "nullable": False},
                {"name": "instance_name", "type": "text", "nullable": False},
                {"name": "ts", "type": "bigint", "nullable": False},
                *[c.to_json() for c in bounds.schema.columns],
            ],
            "spark_schema": json.loads(snap.dataframe.schema.json()),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - started, 3),
        }
        with open(os.path.join(temporary, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        os.rename(temporary, target)
        return rows
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


class Progress:
    """Report the snapshot's Spark tasks on stderr while it runs (first after 2 s, then every 5 s)."""

    def __init__(self, sc: Any, what: str, out: TextIO, first: float = 2.0, every: float = 5.0) -> None:
        self.sc = sc
        self.what = what
        self.out = out
        self.first = first
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="snapshot-progress", daemon=True)
        self._started = 0.0

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def tasks(self) -> tuple[int, int, int] | None:
        """(done, running, total) over the snapshot's Spark jobs so far."""
        tracker = self.sc.statusTracker()
        done = running = total = 0
        for job_id in tracker.getJobIdsForGroup(JOB_GROUP):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job else ():
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    done += stage.numCompletedTasks
                    running += stage.numActiveTasks
                    total += stage.numTasks
        return (done, running, total) if total else None

    def _run(self) -> None:
        wait = self.first
        while not self._stop.wait(wait):
            wait = self.every
            try:
                tasks = self.tasks()
            except Exception:  # the context is stopping
                return
            elapsed = time.monotonic() - self._started
            state = f"{tasks[0]} of {tasks[2]} tasks done, {tasks[1]} running" if tasks else "waiting for Spark"
            print(f"tickline snapshot: {self.what}: {state}, {elapsed:.0f} s", file=self.out, flush=True)
