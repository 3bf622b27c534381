"""A PostgreSQL worker's catch-up (two groups copied at once on two connections) through failures.

200,000 rows are written while the worker is away; ``tickline worker
--replicate events`` then catches up in full groups: with
``worker.apply_connections: 2`` every other one copied on its second database
thread's connection while the one before commits, with 1 each queued on the
database thread behind the one before. Its
database connections are killed again and again (``pg_terminate_backend``),
the worker is killed (SIGKILL) and stopped (SIGTERM) in the middle of the
backlog and started again: every row arrives exactly once, in token order,
and the applied token is always the last committed group's.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import psycopg2
import pytest

from tests.integration.procs import Proc, accepts, free_port, query_pg, wait_for

COLUMNS = "token, instance_name, ts, event_id, room_id, type, state_key, redacts"
ROWS = 200_000


def _applied(url: str) -> int:
    try:
        found = query_pg(url, "SELECT token FROM tickline_applied WHERE stream = 'events'")
    except psycopg2.Error:
        return 0
    return int(found[0][0]) if found else 0


def _consistent(url: str) -> bool:
    """The applied token is the last committed row's: no row above it, none missing below it."""
    ((count, high, applied),) = query_pg(
        url,
        "SELECT count(*), COALESCE(max(token), 0), "
        "(SELECT COALESCE(max(token), 0) FROM tickline_applied WHERE stream = 'events') FROM replicated_events",
    )
    return count == applied and high == applied  # one row per token here, tokens 1..applied


def _kill_worker_connections(url: str) -> int:
    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE 'tickline%%'"
            )
            return len(cur.fetchall())
    finally:
        conn.close()


@pytest.mark.parametrize("connections", [2, 1])
def test_catch_up_through_killed_connections_and_worker_stops_is_exactly_once(
    pg_server, tmp_path: Path, connections: int
) -> None:
    from replication.streams import EVENTS
    from storage.store import open_store

    source, target = pg_server.new_database(), pg_server.new_database()
    store = open_store(source)
    store.register_stream(EVENTS)
    for start in range(0, ROWS, 5000):
        store.append("events", [[f"$e{n}", f"!r{n % 7}", "m.t", None, None] for n in range(start, start + 5000)], "w")
    store.close()
    port = free_port()
    master = Proc(tmp_path / "master.log", "master", "--database", source, "--listen", f"127.0.0.1:{port}")
    wait_for(lambda: accepts(port), 30, "the master to listen")
    config = tmp_path / "worker.yaml"
    config.write_text(f"worker:\n  apply_connections: {connections}\n")
    args = (
        "worker",
        "-c",
        str(config),
        "--name",
        "pg",
        "--master",
        f"127.0.0.1:{port}",
        "--database",
        target,
        "--replicate",
        "events",
    )
    done = threading.Event()
    killing = threading.Event()  # not while a worker starts: a connection lost there stops it (by design)
    killed = [0]
    inconsistent: list[int] = []

    def kill() -> None:
        rng = random.Random(5)
        while not done.is_set():
            if killing.wait(0.05):
                killed[0] += _kill_worker_connections(target)
                time.sleep(rng.uniform(0.02, 0.06))

    killer = threading.Thread(target=kill, daemon=True)
    worker = Proc(tmp_path / "worker.log", *args)
    codes = []

    def started(at_least: int) -> None:
        wait_for(lambda: _applied(target) >= at_least, 120, f"the worker to apply {at_least:,} rows")
        killing.set()

    try:
        killer.start()
        started(1)
        wait_for(lambda: _applied(target) >= 40_000, 120, "the worker to apply 40,000 rows")
        killing.clear()
        worker.kill()  # SIGKILL in the middle of the backlog
        if not _consistent(target):
            inconsistent.append(_applied(target))
        worker = Proc(tmp_path / "worker.log", *args)
        started(_applied(target) + 1)
        wait_for(lambda: _applied(target) >= 100_000, 120, "the worker to apply 100,000 rows")
        killing.clear()
        codes.append(worker.stop())  # SIGTERM: a clean stop in the middle of the backlog
        if not _consistent(target):
            inconsistent.append(_applied(target))
        worker = Proc(tmp_path / "worker.log", *args)
        started(_applied(target) + 1)
        wait_for(lambda: _applied(target) >= 150_000, 120, "the worker to apply 150,000 rows")
        done.set()
        killer.join(10)
        wait_for(lambda: _applied(target) == ROWS, 120, f"the worker to reach the head {ROWS}")
    finally:
        done.set()
        codes.append(worker.stop())
        codes.append(master.stop())
    assert not inconsistent, inconsistent
    expected = query_pg(source, f"SELECT {COLUMNS} FROM stream_events ORDER BY token, seq")
    got = query_pg(target, f"SELECT {COLUMNS} FROM replicated_events ORDER BY token")
    assert len(got) == len(expected) == ROWS
    assert got == expected  # every row once, in token order
    assert killed[0] >= 3, killed[0]
    assert "Traceback" not in worker.output() + master.output()
    assert codes == [0, 0, 0], (worker.output()[-3000:], master.output()[-2000:])
