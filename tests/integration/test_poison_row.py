"""No poison row: refused where it is written; a client that receives one says so and never loops.

A row is only refused against the writer's own limit, so a master (and its
writers) configured with a larger ``protocol.max_line_bytes`` than a worker or
``tail`` can still send that client a line it cannot take. The client then
reports it as such (``tail``: exit code 1 naming the line; a worker: one log
line per try, retried with a growing backoff), not as a clean close.
"""

from __future__ import annotations

import re
import time

import orjson

from tests.conftest import run_tickline
from tests.integration.procs import Proc, accepts, free_port, query_one, sqlite_url, wait_for


def _config(tmp_path, name: str, max_line_bytes: int, port: int, database: str, worker_db: str = "") -> str:
    path = tmp_path / f"{name}.yaml"
    worker = f"worker:\n  name: w1\n  database: {worker_db}\n  replicate: [events]\n" if worker_db else ""
    path.write_text(
        f"listen: 127.0.0.1:{port}\ndatabase: {database}\nprotocol:\n  max_line_bytes: {max_line_bytes}\n{worker}"
    )
    return str(path)


def _event(n: int, pad: int = 0) -> str:
    return orjson.dumps([f"$e{n}" + "x" * pad, "!r", "t", None, None]).decode()


def test_write_refuses_a_row_over_the_configured_limit_naming_it(tmp_path) -> None:
    port = free_port()
    config = _config(tmp_path, "small", 2000, port, sqlite_url(tmp_path / "m.db"))
    rows = f"{_event(1)}\n{_event(2, pad=1800)}\n{_event(3)}\n"
    result = run_tickline("write", "-c", config, "events", "-", input=rows)
    assert result.returncode == 2 and result.stdout == ""
    assert "stdin line 2: stream 'events': the row's RDATA line could be" in result.stderr
    assert "over the line limit of 2000 (protocol.max_line_bytes" in result.stderr
    assert run_tickline("write", "-c", config, "events", _event(1), _event(3)).stdout == "1\n2\n"


def test_tail_and_worker_report_a_line_they_cannot_take(tmp_path) -> None:
    port = free_port()
    master_db = sqlite_url(tmp_path / "m.db")
    big = _config(tmp_path, "big", 200_000, port, master_db)
    small = _config(tmp_path, "small", 65536, port, master_db, worker_db=sqlite_url(tmp_path / "w.db"))
    rows = f"{_event(1)}\n{_event(2, pad=100_000)}\n{_event(3)}\n"
    assert run_tickline("write", "-c", big, "events", "-", input=rows).returncode == 0

    master = Proc(tmp_path / "master.log", "master", "-c", big)
    worker = None
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        tail = run_tickline("tail", "-c", small, "--from", "0", "events", timeout=30)
        assert tail.returncode == 1
        assert '"token":1' in tail.stdout and '"token":2' not in tail.stdout
        assert "cannot handle what the server sent: a line of" in tail.stderr
        assert "over the limit of 65536 (protocol.max_line_bytes)" in tail.stderr
        assert "closed cleanly" not in tail.stderr and len(tail.stderr.strip().splitlines()) == 1

        worker = Proc(tmp_path / "worker.log", "worker", "-c", small)
        wait_for(lambda: "cannot handle what the server sent" in worker.output(), 15, "the worker to report it")
        started = time.monotonic()
        time.sleep(6)  # the window in which the seed behaviour reconnected about 45 times
        elapsed = time.monotonic() - started
        closes = worker.output().count("closed the connection to the master: cannot handle")
        # Seed behaviour: about 45 in this window. With the backoff: 0.2, 0.4, 0.8, ... up to reconnect_max.
        assert 1 <= closes <= 10, worker.output()
        # The delay grew towards reconnect_max (5 s, with 25% jitter either way).
        delays = [float(d) for d in re.findall(r"\(reconnecting in about ([0-9.]+) s\)", worker.output())]
        assert delays and max(delays) >= 3.0, worker.output()
        assert elapsed < 10
        assert "Traceback" not in worker.output()
        # The good row before the poison one was applied, exactly once.
        assert query_one(tmp_path / "w.db", "SELECT COUNT(*) FROM replicated_events", 0) == 1
    finally:
        if worker is not None:
            worker.stop()
        master.stop()


def test_tail_into_a_reader_that_goes_away_ends_quietly(tmp_path) -> None:
    """``tickline tail ... | head -1``: no traceback, exit code 0, like other Unix tools."""
    import subprocess

    from tests.conftest import _env, tickline_command

    port = free_port()
    database = sqlite_url(tmp_path / "m.db")
    rows = "".join(_event(n, pad=200) + "\n" for n in range(20_000))
    assert run_tickline("write", "--database", database, "events", "-", input=rows).returncode == 0
    master = Proc(tmp_path / "master.log", "master", "--database", database, "--listen", f"127.0.0.1:{port}")
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        tail = subprocess.Popen(
            [*tickline_command(), "tail", "--master", f"127.0.0.1:{port}", "--from", "0", "events"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(),
        )
        assert tail.stdout is not None and tail.stderr is not None
        assert b'"token":1,' in tail.stdout.readline()
        tail.stdout.close()  # the reader goes away
        code = tail.wait(timeout=30)
        err = tail.stderr.read().decode()
        assert code == 0 and err == "", err
    finally:
        master.stop()
