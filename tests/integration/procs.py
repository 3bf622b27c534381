"""Processes for integration tests: masters, workers and writers as real programs."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import ROOT, free_port, sqlite_url, tickline_command

__all__ = ["Proc", "free_port", "peak_rss_kb", "query_one", "query_pg", "sqlite_url", "wait_for"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class Proc:
    """A ``tickline`` subcommand running in the background, its output in a log file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.args = args
        self.log = log
        self._file = open(log, "ab")
        self.popen = subprocess.Popen(
            [*tickline_command(), *args], stdout=self._file, stderr=subprocess.STDOUT, cwd=ROOT, env=_env()
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind."""
        self.popen.kill()
        self.popen.wait(timeout=10)
        self._file.close()

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM and wait for the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        code = self.popen.wait(timeout=timeout)
        self._file.close()
        return code

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def query_one(db: Path, sql: str, default=None):
    """One value from a SQLite file that another process writes (None-safe)."""
    if not db.exists():
        return default
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            row = conn.execute(sql).fetchone()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return default  # table not created yet
    return default if row is None or row[0] is None else row[0]


def query_pg(url: str, sql: str) -> list[tuple]:
    """All rows of one query on a PostgreSQL database that other processes write."""
    import psycopg2  # the postgres extra: only tests that use PostgreSQL need it

    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchall()
    finally:
        conn.close()


def peak_rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rdata_tokens(client, count: int, timeout: float = 15.0) -> list[int]:
    """Tokens of the next ``count`` ``RDATA events`` lines a test client reads (fewer at the timeout)."""
    tokens: list[int] = []
    deadline = time.monotonic() + timeout
    while len(tokens) < count and (left := deadline - time.monotonic()) > 0:
        line = client.try_line(left)
        if line is None:
            break
        if line.startswith("RDATA events "):
            tokens.append(int(line.split(" ", 4)[3]))
    return tokens


def event_row(i: int) -> list:
    """An ``events`` row whose event id names ``i`` (``$r<i>``)."""
    return [f"$r{i}", "!r", "t", None, None]


def append_mixed(master, pg_url: str, steps: int, first: int) -> tuple[list[tuple[str, str]], int]:
    """Appends through ``master`` on PostgreSQL: batches of 3 and more rows, single rows, burnt tokens.

    Returns the ``(token or "batch", event id)`` each ``RDATA events`` line
    must carry, in order, and the next row number.
    """
    import psycopg2  # the postgres extra, as in query_pg

    expected: list[tuple[str, str]] = []
    n = first
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    try:
        for step in range(steps):
            if step % 4 == 1:
                rows = [event_row(n + i) for i in range(step + 2)]  # 3 rows and more in one token
                (token,) = set(master.append("events", rows, batch=True))
                expected += [("batch", f"$r{n + i}") for i in range(len(rows) - 1)]
                expected.append((str(token), f"$r{n + len(rows) - 1}"))
            else:
                rows = [event_row(n + i) for i in range(step % 3 + 1)]
                expected += [(str(t), f"$r{n + i}") for i, t in enumerate(master.append("events", rows))]
            n += len(rows)
            if step % 5 == 2:
                with conn.cursor() as cur:  # tokens burnt: no rows will ever have them
                    cur.execute("SELECT nextval('stream_events_token_seq') FROM generate_series(1, 4)")
    finally:
        conn.close()
    return expected, n


def rdata_events(client, count: int, timeout: float = 20.0) -> list[tuple[str, str]]:
    """``(token or "batch", event id)`` of the next ``count`` ``RDATA events`` lines (fails at the timeout)."""
    got: list[tuple[str, str]] = []

    def arrived() -> bool:
        line = client.try_line(0.5)
        if line is not None and line.startswith("RDATA events "):
            parts = line.split(" ", 4)
            got.append((parts[3], parts[4].split('"')[1]))
        return len(got) >= count

    wait_for(arrived, timeout, "every row")
    return got
