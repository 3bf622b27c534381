"""Ordered delivery across streams with real processes: master, two writer processes, a worker.

One stream is written steadily, the other in bursts with idle seconds between;
the worker's handler records every row it is given (in its own database, in
the apply transaction). Timestamps never go backwards across the streams,
every row arrives exactly once, and while the other stream is idle the busy
stream's rows reach the handler within about a tick of their commit.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from storage.tso import physical_ms
from tests.conftest import ROOT, _env
from tests.integration.procs import Proc, accepts, free_port, query_one, sqlite_url, wait_for

TICK_INTERVAL = 0.2


def writer(url: str, stream: str, plan: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.time_writer", url, stream, plan],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )


def config_text(database: str, port: int, worker_db: Path, metrics: int, extra: str = "") -> str:
    return (
        f"database: {database}\n"
        f"listen: 127.0.0.1:{port}\n"
        "master:\n"
        f"  tick_interval: {TICK_INTERVAL}\n"
        "  writer_timeout: 3.0\n"
        "streams:\n"
        "  notes:\n"
        "    columns:\n"
        "      - {name: body, type: text}\n"
        "worker:\n"
        "  name: w1\n"
        f"  database: {sqlite_url(worker_db)}\n"
        f"  metrics_listen: 127.0.0.1:{metrics}\n"
        "  handlers:\n"
        "    events: [tests.integration.time_handlers:record]\n"
        "    notes: [tests.integration.time_handlers:record]\n" + extra
    )


def test_two_streams_in_timestamp_order_with_an_idle_stream(db_url, tmp_path) -> None:
    port, metrics = free_port(), free_port()
    worker_db = tmp_path / "w.db"
    config = tmp_path / "tickline.yaml"
    config.write_text(config_text(db_url, port, worker_db, metrics))
    master = Proc(tmp_path / "master.log", "master", "-c", str(config))
    worker = None
    writers: list[subprocess.Popen] = []
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(tmp_path / "worker.log", "worker", "-c", str(config))
        wait_for(lambda: "delivers events, notes in timestamp order" in worker.output(), 15, "the worker")
        # events: steadily for ~4 s; notes: a burst, 2.5 s idle, a burst, idle.
        writers = [
            writer(db_url, "events", "150x25"),
            writer(db_url, "notes", "5x10,idle2500,5x10,idle500"),
        ]
        counts = []
        for w in writers:
            out, _ = w.communicate(timeout=60)
            assert w.returncode == 0, out
            counts.append(int(out.split()[-1]))
        total = sum(counts)
        wait_for(lambda: query_one(worker_db, "SELECT COUNT(*) FROM seen", 0) >= total, 30, "every row")
        time.sleep(0.5)  # nothing more may come
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
        if worker is not None:
            worker.stop()
        master.stop()
    conn = sqlite3.connect(worker_db)
    seen = conn.execute("SELECT stream, token, ts, body, applied_ms FROM seen ORDER BY n").fetchall()
    # Every row exactly once.
    assert len(seen) == total
    assert len({body for _, _, _, body, _ in seen}) == total
    assert sorted(body for s, _, _, body, _ in seen if s == "events") == sorted(f"events-{i}" for i in range(150))
    # Timestamps never go backwards across the streams; tokens in order per stream.
    stamps = [ts for _, _, ts, _, _ in seen]
    assert stamps == sorted(stamps)
    for stream in ("events", "notes"):
        tokens = [t for s, t, _, _, _ in seen if s == stream]
        assert tokens == sorted(tokens)
    # While notes was idle (between its bursts), events rows reached the handler
    # within a tick plus a margin of their timestamp (taken just before commit).
    notes_ms = sorted(physical_ms(ts) for s, _, ts, _, _ in seen if s == "notes")
    idle_from, idle_to = notes_ms[4] + 300, notes_ms[5] - 300
    delays = sorted(
        applied - physical_ms(ts)
        for s, _, ts, _, applied in seen
        if s == "events" and idle_from < physical_ms(ts) < idle_to
    )
    assert len(delays) > 20, delays
    p90 = delays[int(len(delays) * 0.9)]
    print(
        f"events while notes idle: {len(delays)} rows, delay p50 {delays[len(delays) // 2]} ms, p90 {p90} ms, max {delays[-1]} ms"
    )
    assert p90 <= TICK_INTERVAL * 1000 + 250, delays
    assert delays[-1] <= TICK_INTERVAL * 1000 + 1000, delays


def test_lag_is_zero_when_idle_and_grows_while_the_worker_applies_nothing(tmp_path, monkeypatch) -> None:
    from tests.ops.helpers import sample, scrape

    pause = tmp_path / "pause"
    monkeypatch.setenv("TICKLINE_TEST_PAUSE", str(pause))
    port, metrics = free_port(), free_port()
    worker_db = tmp_path / "w.db"
    config = tmp_path / "tickline.yaml"
    database = sqlite_url(tmp_path / "m.db")
    text = config_text(database, port, worker_db, metrics)
    text = text.replace("time_handlers:record]", "time_handlers:record_unless_paused]")
    config.write_text(text + "  retry_initial: 0.1\n  retry_max: 0.2\n")
    master = Proc(tmp_path / "master.log", "master", "-c", str(config))
    worker = None

    def lag(stream: str) -> float:
        try:
            value = sample(scrape(metrics, timeout=5), "tickline_worker_lag_seconds", stream=stream)
        except OSError:
            return 99.0  # not serving /metrics yet
        return 99.0 if value is None or value != value else value  # absent or NaN: not known yet

    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(tmp_path / "worker.log", "worker", "-c", str(config))
        wait_for(lambda: lag("notes") < 1 and lag("events") < 1, 20, "idle streams to lag about zero")
        time.sleep(1.5)
        assert lag("notes") < 1 and lag("events") < 1  # idle for seconds: still about zero
        # The worker stops applying (its handler fails and is retried): lag grows.
        pause.touch()
        w = writer(database, "events", "1x0")
        assert w.communicate(timeout=30)[0].startswith("DONE")
        wait_for(lambda: lag("events") > 1.0, 10, "the lag to grow past 1 s")
        first = lag("events")
        time.sleep(1.0)
        assert lag("events") >= first + 0.5
        # Applying again: back to about zero.
        pause.unlink()
        wait_for(lambda: lag("events") < 1, 20, "the worker to catch up")
        assert query_one(worker_db, "SELECT COUNT(*) FROM seen WHERE stream = 'events'", 0) == 1
    finally:
        if worker is not None:
            worker.stop()
        master.stop()


def test_idle_stream_written_by_short_lived_tickline_write_processes(pg_url, tmp_path) -> None:
    """Each ``tickline write`` registers, writes and leaves: between them the idle stream has no live writer."""
    from tests.conftest import run_tickline

    port, metrics = free_port(), free_port()
    worker_db = tmp_path / "w.db"
    config = tmp_path / "tickline.yaml"
    config.write_text(config_text(pg_url, port, worker_db, metrics))
    master = Proc(tmp_path / "master.log", "master", "-c", str(config))
    worker = None
    busy = None
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(tmp_path / "worker.log", "worker", "-c", str(config))
        wait_for(lambda: "delivers events, notes in timestamp order" in worker.output(), 15, "the worker")
        busy = writer(pg_url, "events", "120x25")
        for n in range(3):
            time.sleep(0.8)
            result = run_tickline("write", "-c", str(config), "notes", f'["cli-{n}"]')
            assert result.returncode == 0, result.stderr
        out, _ = busy.communicate(timeout=60)
        assert busy.returncode == 0, out
        wait_for(lambda: query_one(worker_db, "SELECT COUNT(*) FROM seen", 0) >= 123, 30, "every row")
    finally:
        if busy is not None and busy.poll() is None:
            busy.kill()
        if worker is not None:
            worker.stop()
        master.stop()
    conn = sqlite3.connect(worker_db)
    seen = conn.execute("SELECT stream, ts, applied_ms FROM seen ORDER BY n").fetchall()
    assert len(seen) == 123
    stamps = [ts for _, ts, _ in seen]
    assert stamps == sorted(stamps)
    delays = sorted(applied - physical_ms(ts) for s, ts, applied in seen if s == "events")
    assert delays[int(len(delays) * 0.9)] <= TICK_INTERVAL * 1000 + 250, delays
