"""The PostgreSQL pipeline end to end: ``tickline write -`` into the master's database,
``tickline master`` on it, ``tickline worker --replicate events`` into a second
database; the worker killed (SIGKILL) while rows keep coming; every row arrives
exactly once, in token order, with its instance and timestamp.

Exercises the PostgreSQL paths of issue 11 with real processes: COPY appends
(100 rows and more) and one-statement appends, batches, the master's wake-up
(safe point and first rows in one database hop, lines built by PostgreSQL),
and the worker's applies of rows as received (COPY from 50 rows, one statement
below).
"""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg2

from tests.conftest import run_tickline
from tests.integration.procs import Proc, accepts, free_port, query_pg, wait_for

COLUMNS = "token, instance_name, ts, event_id, room_id, type, state_key, redacts"


def _rows(n: int, count: int) -> str:
    lines = []
    for i in range(n, n + count):
        state_key = "null" if i % 3 else f'"@u{i}:x \\t ü"'
        lines.append(f'["$pg{i}", "!room{i % 5}", "m.room.message", {state_key}, null]')
    return "\n".join(lines) + "\n"


def _applied(url: str) -> int:
    try:
        found = query_pg(url, "SELECT token FROM tickline_applied WHERE stream = 'events'")
    except psycopg2.Error:
        return 0
    return int(found[0][0]) if found else 0


class Writer(threading.Thread):
    """``tickline write`` again and again: 150 rows from stdin (COPY), single rows, batches."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop_event = threading.Event()
        self.writes = 0
        self.error: str | None = None

    def run(self) -> None:
        n = 0
        while not self.stop_event.is_set():
            kind = self.writes % 4
            args = ["write", "--database", self.url, "--instance", f"w{self.writes % 2}", "events", "-"]
            count = (150, 1, 5, 60)[kind]
            if kind == 2:
                args.insert(-2, "--batch")
            result = run_tickline(*args, input=_rows(n, count))
            if result.returncode != 0:
                self.error = result.stderr
                return
            n += count
            self.writes += 1


def test_postgresql_pipeline_replicates_exactly_once_through_worker_kills(pg_server, tmp_path: Path) -> None:
    source, target = pg_server.new_database(), pg_server.new_database()
    port = free_port()
    master = Proc(tmp_path / "master.log", "master", "--database", source, "--listen", f"127.0.0.1:{port}")
    worker_args: tuple[str, ...] = ("worker", "--name", "pg", "--master", f"127.0.0.1:{port}", "--database", target)
    worker_args += ("--replicate", "events")
    wait_for(lambda: accepts(port), 30, "the master to listen")
    writer = Writer(source)
    writer.start()
    worker = Proc(tmp_path / "worker.log", *worker_args)
    try:
        for round_ in range(3):
            before = _applied(target)
            wait_for(lambda: _applied(target) > before, 60, f"the worker to apply more (round {round_})")
            worker.kill()
            worker = Proc(tmp_path / "worker.log", *worker_args)
        target_writes = writer.writes + 8
        wait_for(lambda: writer.writes >= target_writes or writer.error is not None, 60, "more writes")
    finally:
        writer.stop_event.set()
        writer.join(timeout=60)
    assert writer.error is None, writer.error
    head = query_pg(source, "SELECT max(token) FROM stream_events")[0][0]
    try:
        wait_for(lambda: _applied(target) == head, 60, f"the worker to reach the head {head}")
    finally:
        worker_code = worker.stop()
        master_code = master.stop()
    expected = query_pg(source, f"SELECT {COLUMNS} FROM stream_events ORDER BY token, seq")
    got = query_pg(target, f"SELECT {COLUMNS} FROM replicated_events ORDER BY token, ts")
    assert len(got) == len(expected), f"{len(got)} replicated rows, {len(expected)} written"
    assert got == expected
    assert any(count > 1 for (count,) in query_pg(source, "SELECT count(*) FROM stream_events GROUP BY token"))
    assert worker_code == 0 and master_code == 0, (worker.output()[-2000:], master.output()[-2000:])
