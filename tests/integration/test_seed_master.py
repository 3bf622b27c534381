"""A real ``tickline worker`` (and ``tickline tail``) against a master that speaks only the seed protocol.

The master is played by hand on a plain listening socket: it sends ``SERVER``,
``PING``, ``POSITION`` and ``RDATA`` (tokens and ``batch``) and never
acknowledges ``OPTIONS`` (it ignores it, or answers ``ERROR`` as a master that
does not know the command). Rows therefore carry no timestamp, and there is no
end-of-replay ``POSITION``.
"""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import HOST, LineClient, tickline_command
from tests.integration.procs import Proc, _env, query_one, sqlite_url, wait_for
from tests.ops.helpers import NotifySocket


class Accepted(LineClient):
    """The master's side of one accepted connection (LineClient's bounded reads)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:  # no connect: already connected
        self.sock = sock
        self.timeout = timeout
        self._buffer = b""
        self.closed = False

    def commands(self, until: str, timeout: float = 10.0) -> list[str]:
        """Lines the worker sent (without PINGs), up to and including one starting with ``until``."""
        lines = self.read_until(lambda line: line.startswith(until), timeout)
        return [line for line in lines if not line.startswith("PING ")]


class SeedMaster:
    """A listening socket; each connection is answered line by line by the test."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((HOST, 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.accepted: list[Accepted] = []

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def accept(self, name: str = "seed", timeout: float = 15.0) -> Accepted:
        self.listener.settimeout(timeout)
        sock, _ = self.listener.accept()
        conn = Accepted(sock, 10.0)
        self.accepted.append(conn)
        conn.send(f"SERVER {name}", f"PING {int(time.time() * 1000)}")
        return conn

    def close(self) -> None:
        for conn in self.accepted:
            conn.close()
        self.listener.close()


@pytest.fixture
def seed() -> Iterator[SeedMaster]:
    master = SeedMaster()
    yield master
    master.close()


def row(n: int) -> str:
    """An ``events`` row as the seed protocol has it: the columns only."""
    return f'["$e{n}", "!r", "m.t", null, null]'


def replicated(db: Path) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(
            "SELECT token, instance_name, ts, event_id FROM replicated_events ORDER BY rowid"
        ).fetchall()
    finally:
        conn.close()


def applied(db: Path) -> int:
    return query_one(db, "SELECT token FROM tickline_applied WHERE stream = 'events'", 0) or 0


def start_worker(tmp_path: Path, seed: SeedMaster, *extra: str) -> Proc:
    return Proc(
        tmp_path / "worker.log",
        "worker",
        "--name",
        "w1",
        "--master",
        seed.address,
        "--database",
        sqlite_url(tmp_path / "w.db"),
        "--replicate",
        "events",
        *extra,
    )


@pytest.mark.parametrize("options_answer", [None, "ERROR unknown command 'OPTIONS'"], ids=["silent", "error"])
def test_worker_follows_a_seed_protocol_master(tmp_path, seed, monkeypatch, options_answer) -> None:
    db = tmp_path / "w.db"
    notify = NotifySocket()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.address)
    worker = start_worker(tmp_path, seed, "--server-name", "seed")
    try:
        conn = seed.accept()
        opening = conn.commands("REPLICATE events")
        assert opening == ["NAME w1", "OPTIONS live tick ts", "REPLICATE caches 0", "REPLICATE events 0"]
        if options_answer is not None:
            conn.send(options_answer)
        # Early: RDATA before the stream's POSITION is dropped.
        conn.send(f"RDATA events m 1 {row(1)}")
        conn.send("POSITION caches seed 0 0", "POSITION events seed 0 0")
        # A batch: nothing of it is applied before the line with its token.
        conn.send(f"RDATA events m batch {row(2)}", f"RDATA events m batch {row(3)}")
        conn.send(f"RDATA events m 2 {row(4)}")
        # Stale rows (at or below the token received) are dropped.
        conn.send(f"RDATA events m 2 {row(20)}", f"RDATA events m 1 {row(10)}", f"RDATA events x 3 {row(5)}")
        wait_for(lambda: applied(db) == 3, 20, "tokens 2 and 3 applied")
        # Caught up without the live marker: READY=1 once the answers are applied.
        notify.wait("READY", "1", timeout=15, alive=lambda: worker.popen.poll() is None)
        rows = replicated(db)
        assert [(t, i, e) for t, i, _, e in rows] == [
            (2, "m", "$e2"),
            (2, "m", "$e3"),
            (2, "m", "$e4"),
            (3, "x", "$e5"),
        ]
        now_ms = time.time() * 1000
        for _, _, ts, _ in rows:  # no timestamp on the wire: the arrival time, in the oracle's shape
            assert abs((ts >> 18) - now_ms) < 60_000 and ts & ((1 << 18) - 1) == 0
        # A gapped POSITION: rows (3, 6] were missed, the worker asks for them.
        conn.send("POSITION events seed 6 8")
        assert conn.commands("REPLICATE") == ["REPLICATE events 3"]
        assert applied(db) == 3
        conn.send("POSITION events seed 3 3", *(f"RDATA events m {n} {row(n)}" for n in range(4, 7)))
        conn.send("POSITION events seed 6 8")
        wait_for(lambda: applied(db) == 8, 20, "the missed rows and the POSITION applied")
        # The master restarts: the worker reconnects and resumes from its applied token.
        conn.close()
        again = seed.accept()
        assert again.commands("REPLICATE events") == [
            "NAME w1",
            "OPTIONS live tick ts",
            "REPLICATE caches 0",
            "REPLICATE events 8",
        ]
        again.send("POSITION events seed 8 8", f"RDATA events m 9 {row(9)}")
        wait_for(lambda: applied(db) == 9, 20, "a row after the restart")
        assert [(t, e) for t, _, _, e in replicated(db)] == [
            (2, "$e2"),
            (2, "$e3"),
            (2, "$e4"),
            (3, "$e5"),
            (4, "$e4"),
            (5, "$e5"),
            (6, "$e6"),
            (9, "$e9"),
        ]
        assert "master refused" not in worker.output()  # the ERROR answering OPTIONS refused nothing
    finally:
        code = worker.stop()
        notify.close()
    assert code == 0, worker.output()[-3000:]


def test_worker_refuses_a_seed_master_with_another_name(tmp_path, seed) -> None:
    worker = start_worker(tmp_path, seed, "--server-name", "prod")
    try:
        conn = seed.accept(name="staging")
        lines = conn.wait_closed(timeout=10)
        assert "ERROR wrong server: expected 'prod', got 'staging'" in lines
        assert not any(line.startswith("REPLICATE") for line in lines)
        seed.accept(name="staging")  # and it keeps trying
        wait_for(lambda: worker.output().count("expected 'prod'") >= 2, 20, "two refusals in the log")
        assert applied(tmp_path / "w.db") == 0
    finally:
        assert worker.stop() == 0


@pytest.mark.parametrize("options_answer", [None, "ERROR unknown command 'OPTIONS'"], ids=["silent", "error"])
def test_tail_reads_a_seed_protocol_master(seed, options_answer) -> None:
    tail = subprocess.Popen(
        [*tickline_command(), "tail", "--master", seed.address, "--from", "0", "--count", "3", "--ts", "events"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        conn = seed.accept()
        assert conn.commands("REPLICATE") == ["NAME tail", "OPTIONS ts", "REPLICATE events 0"]
        if options_answer is not None:
            conn.send(options_answer)
        conn.send(f"RDATA events m 1 {row(1)}", "POSITION events seed 0 0")
        conn.send(f"RDATA events m batch {row(2)}", f"RDATA events m 2 {row(3)}", f"RDATA events m 3 {row(4)}")
        out, err = tail.communicate(timeout=30)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    assert tail.returncode == 0, err
    lines = out.decode().splitlines()
    assert lines == [
        '{"stream":"events","instance":"m","token":2,"row":["$e2","!r","m.t",null,null],"ts":null,"ts_iso":null}',
        '{"stream":"events","instance":"m","token":2,"row":["$e3","!r","m.t",null,null],"ts":null,"ts_iso":null}',
        '{"stream":"events","instance":"m","token":3,"row":["$e4","!r","m.t",null,null],"ts":null,"ts_iso":null}',
    ]
