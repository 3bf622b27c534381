"""Chaos: SIGKILL the worker again and again, restart the master, lose nothing, repeat nothing."""

from __future__ import annotations

import random
import sqlite3
import threading
from pathlib import Path

from tests.conftest import run_tickline
from tests.integration.procs import Proc, accepts, free_port, query_one, sqlite_url, wait_for

APPLIED = "SELECT token FROM tickline_applied WHERE stream = 'events'"
HEAD = "SELECT token FROM tickline_stream_heads WHERE stream = 'events'"


class SteadyWriter(threading.Thread):
    """Runs ``tickline write`` over and over: single rows, several rows, batches."""

    def __init__(self, database: str) -> None:
        super().__init__(daemon=True)
        self.database = database
        self.stop_event = threading.Event()
        self.writes = 0
        self.error = None

    def run(self) -> None:
        rng = random.Random(7)
        n = 0
        while not self.stop_event.is_set():
            rows = []
            for _ in range(rng.choice((1, 1, 3, 20))):
                n += 1
                state_key = None if n % 4 else f"@u{n}:x"
                rows.append(
                    f'["$chaos{n}", "!room{n % 7}", "m.room.message", {"null" if state_key is None else chr(34) + state_key + chr(34)}, null]'
                )
            args = ["write", "--database", self.database, "--instance", f"writer{n % 2}"]
            if len(rows) > 1 and rng.random() < 0.5:
                args.append("--batch")
            result = run_tickline(*args, "events", *rows)
            if result.returncode != 0:
                self.error = result.stderr
                return
            self.writes += 1


def master_rows(db: Path) -> list[tuple]:
    conn = sqlite3.connect(db)
    return conn.execute(
        "SELECT token, instance_name, ts, event_id, room_id, type, state_key, redacts FROM stream_events ORDER BY token, seq"
    ).fetchall()


def replicated_rows(db: Path) -> list[tuple]:
    conn = sqlite3.connect(db)
    return conn.execute(
        "SELECT token, instance_name, ts, event_id, room_id, type, state_key, redacts FROM replicated_events "
        "ORDER BY token, rowid"
    ).fetchall()


def test_worker_killed_and_master_restarted_replicates_exactly_once(tmp_path) -> None:
    master_db, worker_db = tmp_path / "master.db", tmp_path / "worker.db"
    port = free_port()
    master_args = ("master", "--database", sqlite_url(master_db), "--listen", f"127.0.0.1:{port}")
    worker_args = (
        "worker",
        "--name",
        "chaos",
        "--master",
        f"127.0.0.1:{port}",
        "--database",
        sqlite_url(worker_db),
        "--replicate",
        "events",
    )
    master = Proc(tmp_path / "master.log", *master_args)
    wait_for(lambda: accepts(port), 15, "the master to listen")
    writer = SteadyWriter(sqlite_url(master_db))
    writer.start()
    worker = Proc(tmp_path / "worker.log", *worker_args)
    try:
        kills = 0
        for round_ in range(4):
            before = query_one(worker_db, APPLIED, 0)
            wait_for(
                lambda: query_one(worker_db, APPLIED, 0) > before, 60, f"the worker to apply more (round {round_})"
            )
            worker.kill()
            kills += 1
            if round_ == 1:
                # Restart the master too, while the worker is down and rows keep coming.
                master.kill()
                master = Proc(tmp_path / "master.log", *master_args)
                wait_for(lambda: accepts(port), 15, "the restarted master to listen")
            worker = Proc(tmp_path / "worker.log", *worker_args)
        # One more master restart with the worker connected: it must reconnect by itself.
        before = query_one(worker_db, APPLIED, 0)
        master.stop()
        master = Proc(tmp_path / "master.log", *master_args)
        wait_for(lambda: accepts(port), 15, "the master to listen again")
        wait_for(lambda: query_one(worker_db, APPLIED, 0) > before, 60, "the worker to reconnect and apply")
        # Keep writing for a while after the last restart too.
        target = writer.writes + 20
        wait_for(lambda: writer.writes >= target or writer.error is not None, 60, "more writes")
    finally:
        writer.stop_event.set()
        writer.join(timeout=60)
    assert writer.error is None, writer.error
    assert kills >= 3 and writer.writes >= 20
    head = query_one(master_db, HEAD)
    try:
        wait_for(lambda: query_one(worker_db, APPLIED, 0) == head, 60, f"the worker to reach the head {head}")
    finally:
        worker_code = worker.stop()
        master_code = master.stop()
    expected = master_rows(master_db)
    got = replicated_rows(worker_db)
    assert len(got) == len(expected), f"{len(got)} replicated rows, {len(expected)} written"
    assert got == expected
    assert worker_code == 0 and master_code == 0
