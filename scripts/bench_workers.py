"""Benchmark scenarios that run through workers: "catch-up" and "end-to-end".

catch-up    rows/s from replay to applied in ``replicated_events`` (SQLite), for
            a worker started after N rows were written; baseline: copying the
            same rows between two SQLite files directly (executemany, 5,000-row
            transactions), the write ceiling of the worker's database.
end-to-end  PostgreSQL through the master to a worker's ``replicated_events`` in
            PostgreSQL: throughput of a writer appending as fast as it can, next
            to the same writer without master and worker; and commit -> applied
            latency at 1,000 rows/s (p50, p99), next to PostgreSQL's own
            commit -> LISTEN/NOTIFY round trip on the same server.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from scripts.benchmark import ROOT, BenchError, Server, _env, _fmt, _free_port, fill_database, make_rows


def _tickline(*args: str) -> list[str]:
    return [sys.executable, "-m", "scripts.cli", *args]


def _peak_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Worker:
    def __init__(self, workdir: str, port: int, database: str, log_name: str = "worker.log") -> None:
        self._log = open(os.path.join(workdir, log_name), "wb")
        self.proc = subprocess.Popen(
            _tickline(
                "worker",
                "--name",
                "bench",
                "--master",
                f"127.0.0.1:{port}",
                "--database",
                database,
                "--replicate",
                "events",
            ),
            cwd=ROOT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _wait(condition: Any, timeout: float, what: str, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def _sqlite_applied(path: str) -> int:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            row = conn.execute("SELECT token FROM tickline_applied WHERE stream = 'events'").fetchone()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return 0
    return row[0] if row else 0


def _master(workdir: str, database: str, log_name: str = "master.log") -> tuple[Server, int]:
    port = _free_port()
    server = Server(
        _tickline("master", "--database", database, "--listen", f"127.0.0.1:{port}"),
        os.path.join(workdir, log_name),
        "listening on",
        "master",
    )
    return server, port


def run_catch_up(rows: int, workdir: str) -> dict[str, Any]:
    master_db = os.path.join(workdir, "catchup-master.db")
    worker_db = os.path.join(workdir, "catchup-worker.db")
    head = fill_database(f"sqlite:///{master_db}", rows)

    # Baseline: the same rows copied straight into a table of another file.
    copy_db = os.path.join(workdir, "catchup-copy.db")
    src = sqlite3.connect(master_db)
    dst = sqlite3.connect(copy_db, isolation_level=None)
    dst.execute("PRAGMA journal_mode = WAL")
    dst.execute("PRAGMA synchronous = NORMAL")
    dst.execute(
        "CREATE TABLE copy (token BIGINT, instance_name TEXT, ts BIGINT, event_id TEXT, room_id TEXT, "
        "type TEXT, state_key TEXT, redacts TEXT)"
    )
    started = time.perf_counter()
    cursor = src.execute(
        "SELECT token, instance_name, ts, event_id, room_id, type, state_key, redacts "
        "FROM stream_events ORDER BY token, seq"
    )
    while chunk := cursor.fetchmany(5000):
        dst.execute("BEGIN")
        dst.executemany("INSERT INTO copy VALUES (?, ?, ?, ?, ?, ?, ?, ?)", chunk)
        dst.execute("COMMIT")
    baseline = rows / (time.perf_counter() - started)
    src.close()
    dst.close()

    master, port = _master(workdir, f"sqlite:///{master_db}", "catchup-master.log")
    worker = None
    try:
        started = time.perf_counter()
        worker = Worker(workdir, port, f"sqlite:///{worker_db}", "catchup-worker.log")
        _wait(lambda: _sqlite_applied(worker_db) >= head, 600, f"the worker to apply {rows:,} rows", 0.02)
        elapsed = time.perf_counter() - started
        peaks = (_peak_kib(master.proc.pid), _peak_kib(worker.proc.pid))
    finally:
        if worker is not None:
            worker.stop()
        master.stop()
    return {"tickline": rows / elapsed, "baseline": baseline, "master_kib": peaks[0], "worker_kib": peaks[1]}


# -- end-to-end on PostgreSQL ------------------------------------------------------------


def _pg_applied(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT token FROM tickline_applied WHERE stream = 'events'")
        row = cur.fetchone()
    return row[0] if row else 0


def _writer_throughput(url: str, rows: int, chunk: int) -> tuple[float, int]:
    from replication.streams import EVENTS
    from storage.store import open_store

    store = open_store(url)
    store.register_stream(EVENTS)
    started = time.perf_counter()
    last = 0
    for start in range(0, rows, chunk):
        last = store.append("events", make_rows(start, min(chunk, rows - start)), "bench-writer")[-1]
    rate = rows / (time.perf_counter() - started)
    store.close()
    return rate, last


def _latencies(url: str, worker_url: str, rate: int, seconds: float) -> list[float]:
    """Append ``rate`` rows/s for ``seconds``; commit -> applied delays in ms."""
    import psycopg2

    from storage.store import open_store

    store = open_store(url)
    committed: dict[int, float] = {}
    applied_at: dict[int, float] = {}
    done = threading.Event()

    def poll() -> None:
        conn = psycopg2.connect(worker_url)
        conn.autocommit = True
        seen = 0
        while not done.is_set() or seen < max(committed, default=0):
            token = _pg_applied(conn)
            now = time.perf_counter()
            if token > seen:
                for t in range(seen + 1, token + 1):
                    applied_at[t] = now
                seen = token
            time.sleep(0.001)
        conn.close()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    batch = 10  # ten rows per 10 ms: 1,000 rows/s
    interval = batch / rate
    next_at = time.perf_counter()
    n = 0
    end = next_at + seconds
    while next_at < end:
        for _ in range(batch):
            (token,) = store.append("events", make_rows(10_000_000 + n, 1), "bench-latency")
            committed[token] = time.perf_counter()
            n += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.perf_counter()))
    done.set()
    poller.join(60)
    store.close()
    return [(applied_at[t] - c) * 1000 for t, c in committed.items() if t in applied_at]


def _notify_round_trips(url: str, count: int = 2000) -> list[float]:
    """PostgreSQL's own floor: commit of a NOTIFY -> received by a listener, in ms."""
    import select

    import psycopg2

    listener = psycopg2.connect(url)
    listener.autocommit = True
    with listener.cursor() as cur:
        cur.execute("LISTEN bench")
    sender = psycopg2.connect(url)
    out = []
    for _ in range(count):
        with sender.cursor() as cur:
            cur.execute("SELECT pg_notify('bench', 'x')")
        started = time.perf_counter()
        sender.commit()
        while not listener.notifies:
            select.select([listener], [], [], 1.0)
            listener.poll()
        out.append((time.perf_counter() - started) * 1000)
        listener.notifies.clear()
        time.sleep(0.001)
    listener.close()
    sender.close()
    return out


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def run_end_to_end(rows: int, workdir: str, latency_seconds: float = 10.0) -> dict[str, Any]:
    import psycopg2

    from scripts.pg_local import PostgresServer

    pg = PostgresServer()
    pg.start()
    try:
        # Baseline: the writer alone.
        alone, _ = _writer_throughput(pg.new_database(), rows, 1000)
        master_url, worker_url = pg.new_database(), pg.new_database()
        from replication.streams import CACHES, EVENTS
        from storage.store import open_store

        prepared = open_store(master_url)
        prepared.register_stream(EVENTS)
        prepared.register_stream(CACHES)
        prepared.close()
        master, port = _master(workdir, master_url, "e2e-master.log")
        worker = Worker(workdir, port, worker_url, "e2e-worker.log")
        try:
            conn = psycopg2.connect(worker_url)
            conn.autocommit = True
            _wait(lambda: _table_exists(conn), 30, "the worker to start")
            started = time.perf_counter()
            rate, last = _writer_throughput(master_url, rows, 1000)
            _wait(lambda: _pg_applied(conn) >= last, 600, f"the worker to apply {rows:,} rows", 0.005)
            through = rows / (time.perf_counter() - started)
            conn.close()
            delays = _latencies(master_url, worker_url, 1000, latency_seconds)
        finally:
            worker.stop()
            master.stop()
        floor = _notify_round_trips(pg.new_database())
    finally:
        pg.stop()
    return {
        "tickline": through,
        "baseline": alone,
        "writer_with_master": rate,
        "p50": statistics.median(delays),
        "p99": _percentile(delays, 99),
        "samples": len(delays),
        "notify_p50": statistics.median(floor),
        "notify_p99": _percentile(floor, 99),
    }


def _table_exists(conn: Any) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass('replicated_events') IS NOT NULL")
        return bool(cur.fetchone()[0])


def run_worker_scenarios(chosen: list[str], rows: int, workdir: str) -> None:
    """Run and print the chosen worker scenarios."""
    if "catch-up" in chosen:
        r = run_catch_up(rows, workdir)
        print(
            f"catch-up: tickline {_fmt(r['tickline'])} rows/s, baseline {_fmt(r['baseline'])} rows/s, "
            f"ratio {r['tickline'] / r['baseline']:.2f}",
            flush=True,
        )
        print(
            f"  peak memory: master {r['master_kib'] or 0:,} KiB, worker {r['worker_kib'] or 0:,} KiB "
            f"(baseline: direct SQLite-to-SQLite copy)",
            flush=True,
        )
    if "end-to-end" in chosen:
        r = run_end_to_end(rows, workdir)
        print(
            f"end-to-end: tickline {_fmt(r['tickline'])} rows/s, baseline {_fmt(r['baseline'])} rows/s, "
            f"ratio {r['tickline'] / r['baseline']:.2f}",
            flush=True,
        )
        print(
            f"  (baseline: the same writer with no master or worker; with them it wrote "
            f"{_fmt(r['writer_with_master'])} rows/s)",
            flush=True,
        )
        print(
            f"end-to-end latency at 1,000 rows/s: p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms "
            f"({r['samples']:,} rows); baseline commit->NOTIFY p50 {r['notify_p50']:.2f} ms, "
            f"p99 {r['notify_p99']:.2f} ms; ratio p99 {r['p99'] / max(r['notify_p99'], 1e-3):.1f}",
            flush=True,
        )
