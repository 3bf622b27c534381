"""Benchmark scenario "ordered": delivery in timestamp order across two streams.

Two streams on PostgreSQL written at different rates by two writer processes
(``events`` fast, ``notes`` slow, in bursts with idle gaps), followed by two
workers in the same run: one with ``worker.ordered: true``, one with
``false``. Both record every row they are handed (in their own SQLite
database, in the apply transaction). Reported:

* latency: commit (the row's timestamp) -> handed to the handler, p50 and p99,
  ordered beside unordered; the difference is what ordering adds;
* rows/s: two fresh workers replay everything written, ordered beside
  unordered (the rate of the ordering gate with real applies behind it);
* whether the ordered worker saw timestamps go backwards (it must not).
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import subprocess
import sys
import time
from typing import Any

from scripts.benchmark import ROOT, BenchError, Server, _env, _fmt, _free_port

STREAMS_CONFIG = "streams:\n  notes:\n    columns:\n      - {name: body, type: text}\n"
EVENTS_RATE = 1000  # rows/s, in appends of 10 rows
NOTES_PLAN = (20, 1.5)  # 20 rows 10 ms apart, then 1.5 s idle, repeated


def record(ctx: Any, rows: list) -> None:
    """The benchmark's handler: what was handed over, and when."""
    now_ms = time.time() * 1000
    ctx.execute(
        "CREATE TABLE IF NOT EXISTS seen (n INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT, token BIGINT, "
        "ts BIGINT, handed_ms DOUBLE PRECISION)"
    )
    ctx.executemany(
        "INSERT INTO seen (stream, token, ts, handed_ms) VALUES (?, ?, ?, ?)",
        [(r.stream, r.token, r.ts, now_ms) for r in rows],
    )


def role_writer(url: str, stream: str, seconds: float) -> int:
    """A writer process: events at EVENTS_RATE, or notes in bursts; prints the row count."""
    from replication.streams import EVENTS
    from storage.schema import Column, StreamSchema
    from storage.store import open_store

    store = open_store(url)
    store.register_stream(EVENTS if stream == "events" else StreamSchema("notes", (Column("body", "text"),)))
    n = 0
    end = time.monotonic() + seconds
    next_at = time.monotonic()
    while time.monotonic() < end:
        if stream == "events":
            store.append("events", [[f"$b{n + i}", "!r", "t", None, None] for i in range(10)], "bench-events")
            n += 10
            next_at += 10 / EVENTS_RATE
            time.sleep(max(0.0, next_at - time.monotonic()))
        else:
            count, idle = NOTES_PLAN
            for _ in range(count):
                store.append("notes", [[f"n{n}"]], "bench-notes")
                n += 1
                time.sleep(0.01)
            time.sleep(idle)
    store.close()
    print(n, flush=True)
    return 0


def _config(workdir: str, name: str, master_url: str, port: int, ordered: bool) -> str:
    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(
            f"database: {master_url}\nlisten: 127.0.0.1:{port}\n{STREAMS_CONFIG}"
            f"worker:\n  name: {name}\n  database: sqlite:///{os.path.join(workdir, name + '.db')}\n"
            f"  ordered: {'true' if ordered else 'false'}\n  invalidate_caches: false\n"
            "  handlers:\n    events: [scripts.bench_ordered:record]\n    notes: [scripts.bench_ordered:record]\n"
        )
    return path


def _worker(workdir: str, name: str, config: str) -> subprocess.Popen:
    log = open(os.path.join(workdir, f"{name}.log"), "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "scripts.cli", "worker", "-c", config],
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _seen(workdir: str, name: str) -> list[tuple[str, int, int, float]]:
    path = os.path.join(workdir, name + ".db")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT stream, token, ts, handed_ms FROM seen ORDER BY n").fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return []


def _count(workdir: str, name: str) -> int:
    path = os.path.join(workdir, name + ".db")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT COUNT(*) FROM seen").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return 0


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def run_ordered(workdir: str, seconds: float = 8.0) -> dict[str, Any]:
    from scripts.pg_local import PostgresServer
    from storage.tso import physical_ms

    pg = PostgresServer()
    pg.start()
    procs: list[subprocess.Popen] = []
    master = None
    try:
        url = pg.new_database()
        port = _free_port()
        configs = {
            name: _config(workdir, name, url, port, ordered)
            for name, ordered in (("ordered", True), ("unordered", False), ("replay-ordered", True))
        }
        configs["replay-unordered"] = _config(workdir, "replay-unordered", url, port, False)
        master = Server(
            [sys.executable, "-m", "scripts.cli", "master", "-c", configs["ordered"]],
            os.path.join(workdir, "ordered-master.log"),
            "listening on",
            "master",
        )
        live = [_worker(workdir, name, configs[name]) for name in ("ordered", "unordered")]
        procs += live
        time.sleep(1.0)  # both connected and live
        writers = [
            subprocess.Popen(
                [sys.executable, "-m", "scripts.bench_ordered", url, stream, str(seconds)],
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                text=True,
            )
            for stream in ("events", "notes")
        ]
        procs += writers
        total = 0
        for w in writers:
            out, _ = w.communicate(timeout=seconds + 60)
            if w.returncode != 0:
                raise BenchError(f"writer failed: {out}")
            total += int(out.split()[-1])
        for name in ("ordered", "unordered"):
            _wait(lambda name=name: _count(workdir, name) >= total, 120, f"the {name} worker")
        results: dict[str, Any] = {"rows": total}
        for name in ("ordered", "unordered"):
            seen = _seen(workdir, name)
            delays = [handed - physical_ms(ts) for _, _, ts, handed in seen]
            stamps = [ts for _, _, ts, _ in seen]
            results[name] = {
                "p50": statistics.median(delays),
                "p99": _pct(delays, 99),
                "backwards": sum(1 for a, b in zip(stamps, stamps[1:], strict=False) if b < a),
                "exactly_once": len(seen) == total == len({(s, t, ts) for s, t, ts, _ in seen}),
            }
        # Replay: two fresh workers apply everything, ordered beside unordered, one after the other.
        for name in ("replay-unordered", "replay-ordered"):
            started = time.perf_counter()
            proc = _worker(workdir, name, configs[name])
            procs.append(proc)
            _wait(lambda name=name: _count(workdir, name) >= total, 300, f"the {name} worker")
            results[name] = total / (time.perf_counter() - started)
            _stop(proc)
        return results
    finally:
        for proc in procs:
            _stop(proc)
        if master is not None:
            master.stop()
        pg.stop()


def print_results(r: dict[str, Any]) -> None:
    o, u = r["ordered"], r["unordered"]
    print(
        f"ordered: latency commit->handler p50 {o['p50']:.1f} ms, p99 {o['p99']:.1f} ms; "
        f"unordered p50 {u['p50']:.1f} ms, p99 {u['p99']:.1f} ms; added p50 {o['p50'] - u['p50']:+.1f} ms, "
        f"p99 {o['p99'] - u['p99']:+.1f} ms ({r['rows']:,} rows, events {EVENTS_RATE} rows/s, notes in bursts)",
        flush=True,
    )
    print(
        f"  replay: ordered {_fmt(r['replay-ordered'])} rows/s, unordered {_fmt(r['replay-unordered'])} rows/s, "
        f"ratio {r['replay-ordered'] / r['replay-unordered']:.2f}; timestamps backwards: ordered "
        f"{o['backwards']}, unordered {u['backwards']}; exactly once: {o['exactly_once'] and u['exactly_once']}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(role_writer(sys.argv[1], sys.argv[2], float(sys.argv[3])))
