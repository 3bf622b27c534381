"""The non-blocking connections of the PostgreSQL pipeline killed again and again under writes.

``tickline master`` (its wake-up connection, ``tickline-wake``) and ``tickline
worker --replicate events`` (its small-apply connection, ``tickline-apply``)
lose those connections every 50-150 ms (``pg_terminate_backend``) while single
rows and small batches are written: each falls back to its database threads
and opens a new connection; every row arrives exactly once, in token order.
An apply whose connection is lost may or may not have committed: its retry
finds out (a stale token then means it had).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import psycopg2

from tests.integration.procs import Proc, accepts, free_port, query_pg, wait_for

COLUMNS = "token, instance_name, ts, event_id, room_id, type, state_key, redacts"


def _applied(url: str) -> int:
    try:
        found = query_pg(url, "SELECT token FROM tickline_applied WHERE stream = 'events'")
    except psycopg2.Error:
        return 0
    return int(found[0][0]) if found else 0


def _kill(urls: list[str], names: tuple[str, ...]) -> int:
    killed = 0
    for url in urls:
        conn = psycopg2.connect(url)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ANY(%s)",
                    (list(names),),
                )
                killed += len(cur.fetchall())
        finally:
            conn.close()
    return killed


def test_async_connections_killed_under_writes_lose_and_repeat_nothing(pg_server, tmp_path: Path) -> None:
    from replication.streams import EVENTS
    from storage.store import open_store

    source, target = pg_server.new_database(), pg_server.new_database()
    store = open_store(source)
    store.register_stream(EVENTS)
    port = free_port()
    master = Proc(tmp_path / "master.log", "master", "--database", source, "--listen", f"127.0.0.1:{port}")
    wait_for(lambda: accepts(port), 30, "the master to listen")
    worker = Proc(
        tmp_path / "worker.log",
        *("worker", "--name", "pg", "--master", f"127.0.0.1:{port}", "--database", target, "--replicate", "events"),
    )
    done = threading.Event()
    killed = [0]

    def kill() -> None:
        rng = random.Random(11)
        while not done.is_set():
            killed[0] += _kill([source, target], ("tickline-wake", "tickline-apply"))
            time.sleep(rng.uniform(0.05, 0.15))

    killer = threading.Thread(target=kill, daemon=True)
    try:
        wait_for(lambda: _applied(target) >= 0 and accepts(port), 30, "the worker")
        store.append("events", [["$first", "!r", "t", None, None]], "w")
        wait_for(lambda: _applied(target) == 1, 30, "the first row applied")
        killer.start()
        for i in range(800):
            if i % 10 == 9:
                store.append("events", [[f"$b{i}.{k}", "!r", "t", None, None] for k in range(3)], "w", batch=True)
            else:
                store.append("events", [[f"$e{i}", "!r", "t", None, None]], "w")
            time.sleep(0.004)
        head = query_pg(source, "SELECT max(token) FROM stream_events")[0][0]
        wait_for(lambda: _applied(target) == head, 60, f"the worker to reach the head {head}")
    finally:
        done.set()
        killer.join(10) if killer.is_alive() else None
        worker_code = worker.stop()
        master_code = master.stop()
        store.close()
    expected = query_pg(source, f"SELECT {COLUMNS} FROM stream_events ORDER BY token, seq")
    got = query_pg(target, f"SELECT {COLUMNS} FROM replicated_events ORDER BY token, ts")
    assert got == expected  # every row once, none missing
    assert killed[0] >= 4, killed[0]
    assert "the apply connection failed" in worker.output() and "the wake-up connection failed" in master.output()
    assert "small applies run on the reactor again" in worker.output()
    assert "wake-ups run on the reactor again" in master.output()
    assert "Traceback" not in worker.output() + master.output()
    assert worker_code == 0 and master_code == 0, (worker.output()[-2000:], master.output()[-2000:])
