"""systemd integration of ``tickline master`` and ``tickline worker``, on real processes.

systemd is not PID 1 here, so the notify protocol is checked on a unix
datagram socket the test binds and passes as ``NOTIFY_SOCKET`` (with the
sender's pid, as systemd checks it for ``NotifyAccess=main``); the unit files
are checked with ``systemd-analyze verify``.
"""

from __future__ import annotations

import configparser
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_tickline
from tests.integration.procs import accepts, free_port, query_one, sqlite_url
from tests.ops.conftest import WATCHDOG_USEC
from tests.ops.helpers import EVENT_ROW, NotifySocket, wait_for, wait_for_log

UNITS = ROOT / "scripts" / "systemd"
APPLIED = "SELECT token FROM tickline_applied WHERE stream = 'events'"


class UnitParser(configparser.ConfigParser):
    def optionxform(self, optionstr: str) -> str:
        return optionstr  # keys are case-sensitive in units


def unit_setting(unit: str, key: str, section: str = "Service") -> str:
    parser = UnitParser(interpolation=None, strict=False)
    parser.read(UNITS / unit)
    return parser[section][key]


def stop_timeout(unit: str) -> float:
    """The unit's ``TimeoutStopSec`` in seconds: how long systemd waits before SIGKILL."""
    return float(unit_setting(unit, "TimeoutStopSec"))


def shared_config(tmp_path: Path, port: int, level: str = "INFO") -> Path:
    """One file for a master on ``port`` and a worker w1 following it, with short intervals."""
    path = tmp_path / "tickline.yaml"
    path.write_text(
        f"database: {sqlite_url(tmp_path / 'master.db')}\n"
        f"listen: 127.0.0.1:{port}\n"
        "protocol:\n  ping_interval: 0.5\n"
        f"logging:\n  level: {level}\n"
        "worker:\n"
        "  name: w1\n"
        f"  database: {sqlite_url(tmp_path / 'worker.db')}\n"
        "  replicate: [events]\n"
        "  reconnect_initial: 0.05\n"
        "  reconnect_max: 0.2\n",
        encoding="utf-8",
    )
    return path


def fake_master_config(tmp_path: Path, address: str, level: str = "INFO") -> Path:
    path = tmp_path / "worker.yaml"
    path.write_text(
        f"logging:\n  level: {level}\n"
        "worker:\n"
        "  name: w1\n"
        f"  master: {address}\n"
        f"  database: {sqlite_url(tmp_path / 'worker.db')}\n"
        "  replicate: [events]\n",
        encoding="utf-8",
    )
    return path


def watchdog_kicks(notify: NotifySocket, pid: int, count: int, after: int, timeout: float) -> list[float]:
    """Wait for ``count`` WATCHDOG=1 from ``pid`` after message ``after``; their arrival times."""
    times = []
    index = after
    for _ in range(count):
        index, _ = notify.wait("WATCHDOG", "1", timeout=timeout, after=index, pid=pid)
        times.append(notify.times[index])
        index += 1
    return times


# -- the master ------------------------------------------------------------------


def test_master_is_ready_once_listening_then_kicks_the_watchdog_and_stops_cleanly(tmp_path, notify, procs) -> None:
    port = free_port()
    master = procs("master", "master", "--listen", f"127.0.0.1:{port}", "--database", sqlite_url(tmp_path / "m.db"))
    pid = master.pid

    ready_at, ready = notify.wait("READY", "1", pid=pid, alive=lambda: master.popen.poll() is None)
    # READY=1 means listening: a connect right now must succeed, with no retry.
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert ready["STATUS"].startswith(f"listening on 127.0.0.1:{port}; 0 connections; streams caches@0, events@0")
    before = notify.of(pid, 0, ready_at)
    assert {"STATUS": "master starting"} in before
    assert not any("READY" in m for m in before)
    # Every message came from the main process (NotifyAccess=main in the unit).
    assert set(notify.pids) == {pid}

    # WATCHDOG_USEC=200000: a kick every 0.1 s, from the reactor.
    kicks = watchdog_kicks(notify, pid, 5, ready_at, timeout=3)
    assert kicks[-1] - kicks[0] < 4 * WATCHDOG_USEC / 1e6 * 2, kicks

    master.popen.send_signal(signal.SIGTERM)
    stop_at, stopping = notify.wait("STOPPING", "1", pid=pid, after=ready_at)
    assert stopping["STATUS"] == "master stopping"
    assert master.popen.wait(timeout=stop_timeout("tickline-master.service")) == 0
    notify.drain()
    assert not any("READY" in m for m in notify.messages[stop_at:])


def test_watchdog_is_only_kicked_for_its_own_pid_and_abstract_sockets_work(tmp_path, monkeypatch, procs) -> None:
    abstract = NotifySocket(abstract=True)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", abstract.address)  # "@name": the abstract namespace
        monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
        monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process: no kicks
        port = free_port()
        master = procs("master", "master", "--listen", f"127.0.0.1:{port}", "--database", sqlite_url(tmp_path / "m.db"))
        ready_at, _ = abstract.wait("READY", "1", pid=master.pid, alive=lambda: master.popen.poll() is None)
        # A watched master sends its first kick before READY=1 and one every 0.1 s
        # after it: observe for three intervals, then stop.

        def observed() -> bool:
            abstract.drain()
            return time.monotonic() - abstract.times[ready_at] > 0.3

        wait_for(observed, 5, "0.3 s after READY")
        assert master.stop(timeout=stop_timeout("tickline-master.service")) == 0
        abstract.drain()
        assert any("STOPPING" in m for m in abstract.messages)
        assert not any("WATCHDOG" in m for m in abstract.messages), abstract.messages
    finally:
        abstract.close()


# -- the worker ----------------------------------------------------------------------


def test_worker_is_not_ready_until_connected_then_watchdog_and_clean_stop(tmp_path, notify, procs) -> None:
    port = free_port()
    config = shared_config(tmp_path, port)

    # The master is not up yet: the worker starts, retries, and is not ready.
    worker = procs("worker", "worker", "-c", str(config))
    wait_for_log(worker, "cannot connect to the master")
    notify.drain()
    assert {"STATUS": "worker starting"} in notify.of(worker.pid)
    assert not any("READY" in m for m in notify.of(worker.pid))

    master = procs("master", "master", "-c", str(config))
    ready_at, ready = notify.wait("READY", "1", pid=worker.pid, timeout=30, alive=lambda: worker.popen.poll() is None)
    assert ready["STATUS"] == "caught up; connected; applied caches@0, events@0"
    assert "connected to master tickline" in worker.output()
    # The master sent its own READY=1, from its own pid.
    notify.wait("READY", "1", pid=master.pid)
    assert set(notify.pids) == {worker.pid, master.pid}

    watchdog_kicks(notify, worker.pid, 3, ready_at, timeout=3)

    worker.popen.send_signal(signal.SIGTERM)
    _, stopping = notify.wait("STOPPING", "1", pid=worker.pid, after=ready_at)
    assert stopping["STATUS"] == "worker stopping"
    assert worker.popen.wait(timeout=stop_timeout("tickline-worker@.service")) == 0
    assert master.stop() == 0


def test_worker_ready_waits_until_the_rows_written_before_it_started_are_applied(tmp_path, notify, procs) -> None:
    port = free_port()
    config = shared_config(tmp_path, port)
    rows = "\n".join(EVENT_ROW.format(n=n) for n in range(1, 3001))
    written = run_tickline("write", "-c", str(config), "events", "-", input=rows + "\n")
    assert written.returncode == 0, written.stderr
    master = procs("master", "master", "-c", str(config))
    wait_for(lambda: accepts(port), 15, "the master to listen")

    worker = procs("worker", "worker", "-c", str(config))
    _, ready = notify.wait("READY", "1", pid=worker.pid, timeout=30, alive=lambda: worker.popen.poll() is None)
    applied_at_ready = query_one(tmp_path / "worker.db", APPLIED, 0)
    assert worker.stop() == 0 and master.stop() == 0
    # Caught up: what READY=1 reports, and the worker's database, reach the 3000 rows.
    assert ready["STATUS"] == "caught up; connected; applied caches@0, events@3000"
    assert applied_at_ready == 3000


def test_worker_sends_clear_user_sync_on_sigterm_and_exits_0_in_time(tmp_path, notify, procs, fake_master) -> None:
    config = fake_master_config(tmp_path, fake_master.address)
    worker = procs("worker", "worker", "-c", str(config))
    conn = fake_master.accept()
    opening = fake_master.handshake(conn, ["caches", "events"])
    assert opening[:3] == ["NAME w1", opening[1], "OPTIONS live tick ts"] and opening[1].startswith("PING ")
    ready_at, _ = notify.wait("READY", "1", pid=worker.pid, alive=lambda: worker.popen.poll() is None)

    started = time.monotonic()
    worker.popen.send_signal(signal.SIGTERM)
    lines = conn.wait_closed(timeout=10)
    assert "CLEAR_USER_SYNC w1" in lines, lines
    code = worker.popen.wait(timeout=stop_timeout("tickline-worker@.service"))
    assert code == 0
    assert time.monotonic() - started < stop_timeout("tickline-worker@.service")
    notify.wait("STOPPING", "1", pid=worker.pid, after=ready_at)


# -- SIGHUP: systemctl reload ------------------------------------------------------------


def test_sighup_reloads_the_worker_log_level_from_the_config_file(tmp_path, procs, fake_master) -> None:
    config = fake_master_config(tmp_path, fake_master.address, level="INFO")
    worker = procs("worker", "worker", "-c", str(config))
    conn = fake_master.accept()
    fake_master.handshake(conn, ["caches", "events"])
    wait_for_log(worker, "worker ready")

    # A stale row makes the worker log at DEBUG; the ERROR after it (logged at
    # ERROR) shows the row was handled.
    conn.send("RDATA events fake 0 []", "ERROR marker-1")
    log = wait_for_log(worker, "master refused: marker-1")
    assert "dropped stale rows" not in log
    assert " DEBUG " not in log

    config.write_text(config.read_text().replace("level: INFO", "level: DEBUG"))
    mark = len(log)
    worker.popen.send_signal(signal.SIGHUP)
    wait_for_log(worker, "SIGHUP: log configuration reloaded (level DEBUG)", after=mark)
    conn.send("RDATA events fake 0 []", "ERROR marker-2")
    log = wait_for_log(worker, "master refused: marker-2", after=mark)
    assert "DEBUG workers.consumer: events: dropped stale rows at token 0 (known 0)" in log[mark:]

    assert worker.stop() == 0


def test_sighup_reloads_the_master_log_level_and_keeps_it_when_the_file_is_broken(tmp_path, procs, connect) -> None:
    port = free_port()
    config = tmp_path / "master.yaml"
    config.write_text(
        f"database: {sqlite_url(tmp_path / 'm.db')}\nlisten: 127.0.0.1:{port}\nlogging:\n  level: WARNING\n"
    )
    master = procs("master", "master", "-c", str(config))
    wait_for(lambda: accepts(port), 15, "the master to listen")

    # At WARNING, "named itself" (INFO) is not logged; the client's ERROR (WARNING) is.
    client = connect("127.0.0.1", port)
    client.handshake()
    client.send("NAME quiet", "ERROR marker-1")
    log = wait_for_log(master, "sent ERROR marker-1")
    assert "named itself" not in log and " INFO " not in log

    config.write_text(config.read_text().replace("level: WARNING", "level: INFO"))
    mark = len(log)
    master.popen.send_signal(signal.SIGHUP)
    wait_for_log(master, "INFO scripts.daemon: SIGHUP: log configuration reloaded (level INFO)", after=mark)
    client2 = connect("127.0.0.1", port)
    client2.handshake()
    client2.send("NAME loud")
    wait_for_log(master, "] named itself", after=mark)
    assert "[loud@127.0.0.1:" in master.output()[mark:]

    # A broken file: the master says so, keeps its level and keeps serving.
    config.write_text("logging:\n  level: LOUD\n")
    mark = len(master.output())
    master.popen.send_signal(signal.SIGHUP)
    wait_for_log(master, "SIGHUP: keeping the log configuration: logging.level: expected one of", after=mark)
    client3 = connect("127.0.0.1", port)
    client3.handshake()
    client3.send("NAME still")
    wait_for_log(master, "[still@127.0.0.1:", after=mark)
    assert master.popen.poll() is None
    assert master.stop() == 0


def test_sighup_without_a_config_file_does_not_kill_the_master(tmp_path, procs) -> None:
    port = free_port()
    master = procs("master", "master", "--listen", f"127.0.0.1:{port}", "--database", sqlite_url(tmp_path / "m.db"))
    wait_for_log(master, "master ready")
    master.popen.send_signal(signal.SIGHUP)  # the default action of SIGHUP is to terminate
    wait_for_log(master, "SIGHUP: no config file (-c) to reload the log configuration from")
    assert master.popen.poll() is None and accepts(port)
    assert master.stop() == 0


# -- the unit files --------------------------------------------------------------------


@pytest.fixture
def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not installed")
    return path


def test_unit_files_pass_systemd_analyze_verify(systemd_analyze) -> None:
    units = sorted(p.name for p in UNITS.iterdir())
    assert units == ["tickline-master.service", "tickline-worker@.service", "tickline.target"]
    # The template is verified as itself and through an instance, beside the others.
    for files in (
        [UNITS / "tickline-master.service", UNITS / "tickline.target", UNITS / "tickline-worker@a.service"],
        [UNITS / "tickline-worker@.service"],
    ):
        result = subprocess.run(
            [systemd_analyze, "verify", *map(str, files)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stderr == "", result.stderr  # unknown keys only warn, on stderr


def test_unit_files_match_what_the_processes_do() -> None:
    for unit, command in (
        ("tickline-master.service", "tickline master -c /etc/tickline/master.yaml"),
        ("tickline-worker@.service", "tickline worker -c /etc/tickline/worker-%i.yaml --name %i"),
    ):
        assert unit_setting(unit, "Type") == "notify"  # READY=1 from the process
        assert unit_setting(unit, "NotifyAccess") == "main"
        assert float(unit_setting(unit, "WatchdogSec")) > 0  # WATCHDOG=1 from the reactor
        assert unit_setting(unit, "ExecReload") == "/bin/kill -HUP $MAINPID"  # SIGHUP: reload the log level
        assert unit_setting(unit, "ExecStart").endswith(command)
        assert unit_setting(unit, "PartOf", "Unit") == "tickline.target"
        assert unit_setting(unit, "WantedBy", "Install") == "tickline.target"
    assert unit_setting("tickline.target", "Wants", "Unit") == "tickline-master.service"
