"""Logs: one line per event on stderr, the connection's name in it, the level from the config."""

from __future__ import annotations

import os
import re
import signal
import subprocess

from tests.conftest import ROOT, tickline_command
from tests.integration.procs import accepts, free_port, sqlite_url
from tests.ops.helpers import wait_for, wait_for_log

# asctime, level, logger: message (journald adds the time itself: see below).
LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: .+")
JOURNAL_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: .+")


def master_config(tmp_path, port: int, level: str) -> str:
    path = tmp_path / "master.yaml"
    path.write_text(
        f"database: {sqlite_url(tmp_path / 'm.db')}\nlisten: 127.0.0.1:{port}\nlogging:\n  level: {level}\n"
    )
    return str(path)


def test_master_logs_one_line_per_event_with_the_connection_name(tmp_path, procs, connect) -> None:
    port = free_port()
    master = procs("master", "master", "-c", master_config(tmp_path, port, "INFO"))
    wait_for(lambda: accepts(port), 15, "the master to listen")
    client = connect("127.0.0.1", port)
    client.handshake()
    local = client.sock.getsockname()[1]
    client.send("NAME c1", "FOO bar", "ERROR marker")
    log = wait_for_log(master, "sent ERROR marker")
    name = f"c1@127.0.0.1:{local}"
    assert f"INFO replication.server: [{name}] named itself" in log
    assert f"INFO replication.protocol: [{name}] bad input: " in log
    assert f"WARNING replication.protocol: [{name}] client sent ERROR marker" in log
    assert "INFO scripts.daemon: master ready: listening on" in log
    lines = log.splitlines()
    assert lines and all(LINE.fullmatch(line) for line in lines), lines
    assert master.stop() == 0


def test_worker_log_lines_name_its_connection(tmp_path, procs, fake_master) -> None:
    config = tmp_path / "worker.yaml"
    config.write_text(
        f"worker:\n  name: w1\n  master: {fake_master.address}\n  database: {sqlite_url(tmp_path / 'w.db')}\n"
    )
    worker = procs("worker", "worker", "-c", str(config))
    conn = fake_master.accept()
    fake_master.handshake(conn, ["caches"])
    conn.send("ERROR marker")
    log = wait_for_log(worker, "master refused: marker")
    assert f"WARNING replication.protocol: [w1->127.0.0.1:{fake_master.port}] server sent ERROR marker" in log
    assert "INFO workers.worker: connected to master fake" in log
    assert "INFO workers.worker: worker w1 resumes caches@0" in log
    assert all(LINE.fullmatch(line) for line in log.splitlines()), log
    assert worker.stop() == 0


def test_level_warning_suppresses_info_lines(tmp_path, procs, connect) -> None:
    port = free_port()
    master = procs("master", "master", "-c", master_config(tmp_path, port, "WARNING"))
    wait_for(lambda: accepts(port), 15, "the master to listen")
    client = connect("127.0.0.1", port)
    client.handshake()
    client.send("NAME c1", "FOO bar", "ERROR marker")  # INFO, INFO, then WARNING
    log = wait_for_log(master, "sent ERROR marker")
    assert "WARNING replication.protocol: [c1@127.0.0.1:" in log
    assert "named itself" not in log and "bad input" not in log and "ready" not in log
    assert not any(" INFO " in line or " DEBUG " in line for line in log.splitlines()), log
    assert master.stop() == 0


def test_logs_go_to_stderr_and_leave_the_time_to_journald(tmp_path) -> None:
    port = free_port()
    # Under systemd, JOURNAL_STREAM tells the process its stderr is the journal.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JOURNAL_STREAM="8:12345")
    proc = subprocess.Popen(
        [*tickline_command(), "master", "-c", master_config(tmp_path, port, "INFO")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
    )
    try:
        wait_for(lambda: accepts(port) or proc.poll() is not None, 15, "the master to listen")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=5)
    assert proc.returncode == 0
    assert out == b""  # nothing on stdout
    lines = err.decode().splitlines()
    assert lines[0].startswith("INFO replication.master: master tickline listening on 127.0.0.1:")
    assert all(JOURNAL_LINE.fullmatch(line) for line in lines), lines
