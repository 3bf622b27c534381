"""A worker started after 100,000 rows catches up through replay, in bounded memory."""

from __future__ import annotations

import sqlite3

from tests.conftest import run_tickline
from tests.integration.procs import Proc, accepts, free_port, peak_rss_kb, query_one, sqlite_url, wait_for

ROWS = 100_000
# Generous bounds: what they catch is memory growing with the backlog
# (100,000 rows held at once would be several hundred MB in Python objects).
MASTER_PEAK_KB = 200_000
WORKER_PEAK_KB = 200_000


def test_late_worker_catches_up_100k_rows_in_bounded_memory(tmp_path) -> None:
    master_db, worker_db = tmp_path / "master.db", tmp_path / "worker.db"
    rows = "".join(f'["$e{i}", "!room{i % 50}", "m.room.message", null, null]\n' for i in range(ROWS))
    written = run_tickline("write", "--database", sqlite_url(master_db), "events", "-", input=rows, timeout=300)
    assert written.returncode == 0, written.stderr
    assert written.stdout.split()[-1] == str(ROWS)

    port = free_port()
    master = Proc(
        tmp_path / "master.log", "master", "--database", sqlite_url(master_db), "--listen", f"127.0.0.1:{port}"
    )
    worker = None
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(
            tmp_path / "worker.log",
            "worker",
            "--name",
            "late",
            "--master",
            f"127.0.0.1:{port}",
            "--database",
            sqlite_url(worker_db),
            "--replicate",
            "events",
        )
        wait_for(
            lambda: query_one(worker_db, "SELECT token FROM tickline_applied WHERE stream = 'events'", 0) == ROWS,
            180,
            f"the worker to apply {ROWS} rows",
        )
        master_peak, worker_peak = peak_rss_kb(master.pid), peak_rss_kb(worker.pid)
    finally:
        if worker is not None:
            worker.stop()
        master.stop()
    conn = sqlite3.connect(worker_db)
    count, distinct, low, high = conn.execute(
        "SELECT COUNT(*), COUNT(DISTINCT token), MIN(token), MAX(token) FROM replicated_events"
    ).fetchone()
    assert (count, distinct, low, high) == (ROWS, ROWS, 1, ROWS)
    print(f"peak RSS: master {master_peak} kB, worker {worker_peak} kB")
    assert master_peak is not None and master_peak < MASTER_PEAK_KB
    assert worker_peak is not None and worker_peak < WORKER_PEAK_KB
