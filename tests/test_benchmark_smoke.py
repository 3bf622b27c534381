"""The benchmark runs end to end on a tiny row count and prints its ratio lines.

No timing is asserted: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from tests.conftest import ROOT, _env, run_tickline

RATIO_LINE = r"^{name}: tickline [\d,]+ rows/s, baseline [\d,]+ rows/s, ratio \d+\.\d\d$"


def test_wire_scenarios_print_a_ratio_line_each() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmark.py"),
            "wire",
            "wire-live",
            "--rows",
            "2000",
            "--repeat",
            "1",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("wire", "wire-live"):
        assert re.search(RATIO_LINE.format(name=name), proc.stdout, re.M), proc.stdout
    assert re.search(r"^  master alone \(.*\): [\d,]+ rows/s$", proc.stdout, re.M), proc.stdout


def test_bench_command_refuses_an_unknown_scenario() -> None:
    proc = run_tickline("bench", "nosuch", "--rows", "10")
    assert proc.returncode == 2
    assert "unknown scenario 'nosuch'" in proc.stderr
    assert "wire" in proc.stderr


def test_bench_command_takes_the_fanout_options() -> None:
    """``tickline bench fanout --db ... --variants ...`` as the docs show it; an unknown variant is one line, exit 2."""
    proc = run_tickline("bench", "fanout", "--db", "sqlite", "--variants", "live-1,live-7", "--rows", "10")
    assert proc.returncode == 2
    assert "unknown fanout variant 'live-7'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_tickline("bench", "fanout", "--variants", "live-1", "--rows", "2000", "--repeat", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(RATIO_LINE.format(name="fanout live-1"), proc.stdout, re.M), proc.stdout
    assert "fanout replay-1" not in proc.stdout
    assert re.search(r"^  live, timed from the COMMIT's return .*: [\d,]+ rows/s", proc.stdout, re.M), proc.stdout


def test_postgresql_scenarios_print_their_lines_against_logical_replication() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmark.py"),
            "end-to-end",
            "latency",
            "catch-up",
            "writer",
            "--rows",
            "3000",
            "--repeat",
            "1",
            "--rate",
            "100",
            "--seconds",
            "1",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("end-to-end", "catch-up"):
        assert re.search(RATIO_LINE.format(name=name), proc.stdout, re.M), proc.stdout
    assert re.search(
        r"^writer: tickline [\d,]+ commits/s, baseline [\d,]+ commits/s, ratio \d+\.\d\d$", proc.stdout, re.M
    )
    assert re.search(r"^latency: tickline [\d.]+ ms, baseline [\d.]+ ms, ratio \d+\.\d\d$", proc.stdout, re.M)
    assert re.search(r"^  tickline: commit -> applied p50 .* reached \((held|NOT held)\)$", proc.stdout, re.M)
    assert re.search(
        r"^  CPU per commit \(.*\): tickline [\d.]+ ms, baseline [\d.]+ ms; their wait for a CPU per commit "
        r"\(run queue\): tickline [\d.]+ ms, baseline [\d.]+ ms$",
        proc.stdout,
        re.M,
    ), proc.stdout
    assert re.search(
        # A commit's time is taken when the writer's COMMIT returns: on a busy machine the master
        # can send its RDATA before the writer runs again, so a delay may print negative.
        r"^  tickline master alone: commit -> RDATA at a bare TCP client p50 -?[\d.]+ ms, p99 -?[\d.]+ ms "
        r"\(runs of their own, with that client; commit -> applied in them p50 -?[\d.]+ ms, p99 -?[\d.]+ ms\)$",
        proc.stdout,
        re.M,
    ), proc.stdout
    assert re.search(r"written by execute_values it reached [\d,]+ rows/s", proc.stdout), proc.stdout


def test_a_postgresql_scenario_runs_as_many_times_as_repeat_asks() -> None:
    """``--repeat 4``: four interleaved runs of each side (the PostgreSQL scenarios once stopped at three)."""
    proc = run_tickline("bench", "end-to-end", "--rows", "2000", "--repeat", "4", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 runs per scenario" in proc.stdout and "median of 4 interleaved runs" in proc.stdout, proc.stdout


def test_each_benchmark_run_s_databases_are_dropped_once_it_is_over() -> None:
    """The PostgreSQL scenarios' runs each make databases on both clusters: gone after the run, so that
    the clusters do not grow with ``--repeat``."""
    import psycopg2

    from scripts.bench_pg import Clusters

    def databases(server) -> set[str]:
        conn = psycopg2.connect(server.url())
        with conn.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database WHERE datname LIKE 't%'")
            names = {name for (name,) in cur.fetchall()}
        conn.close()
        return names - {"template0", "template1"}

    with Clusters() as clusters:
        seen = []
        for _, which in clusters.runs(2, ["tickline", "baseline"]):
            made = {clusters.source.new_database().rsplit("/", 1)[1], clusters.target.new_database().rsplit("/", 1)[1]}
            live = databases(clusters.source) | databases(clusters.target)
            assert live == made, (which, live, made)  # the run's own, and none of an earlier run
            seen.append(made)
        assert len(seen) == 4 and not databases(clusters.source) | databases(clusters.target)


def test_fanout_scenario_prints_a_ratio_line_per_variant_and_a_plot(tmp_path) -> None:
    png = tmp_path / "fanout.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmark.py"),
            "fanout",
            "--rows",
            "2000",
            "--repeat",
            "1",
            "--plot",
            str(png),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mode in ("live", "replay"):
        for clients in (1, 10, 50):
            assert re.search(RATIO_LINE.format(name=f"fanout {mode}-{clients}"), proc.stdout, re.M), proc.stdout
    assert re.search(r"^  master CPU per delivered row [\d.]+ us .*peak memory \d+ MiB", proc.stdout, re.M)
    assert png.read_bytes().startswith(b"\x89PNG")


def test_ordered_scenario_is_ordered_and_exactly_once(tmp_path) -> None:
    """A short run of the "ordered" scenario (PostgreSQL, two writer processes, two workers)."""
    from scripts import bench_ordered

    r = bench_ordered.run_ordered(str(tmp_path), seconds=2.0)
    assert r["ordered"]["backwards"] == 0
    assert r["ordered"]["exactly_once"] and r["unordered"]["exactly_once"]
    assert r["replay-ordered"] > 0 and r["replay-unordered"] > 0
    bench_ordered.print_results(r)


def test_the_postgresql_plot_draws_every_ratio_against_its_target(tmp_path) -> None:
    from scripts.bench_pg import plot

    results: dict[str, dict[str, Any]] = {
        "writer": {"tickline": {"single": 900, "bulk": 90}, "plain": {"single": 1000, "bulk": 100}},
        "end-to-end": {"tickline": 80, "copy": 100, "execute_values": 40},
        "catch-up": {"tickline": 3, "baseline": 1},
        "latency": {
            "tickline": {"p50": 1.0, "p99": 6.0, "rdata_p50": 0.5, "rdata_p99": 5.0},
            "baseline": {"p50": 0.2, "p99": 2.0},
        },
    }
    path = tmp_path / "pg.png"
    plot(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fanout_clients_against(lines: list[int], rows: int, first: int) -> dict:
    """The bench's counting client (one connection) against a socket that sends RDATA lines with these tokens."""
    import json
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            data = b"".join(b'RDATA events master %d ["x",%d]\n' % (t, t) for t in lines)
            try:
                for i in range(0, len(data), 4096):  # many buffers, lines cut anywhere
                    conn.sendall(data[i : i + 4096])
                conn.recv(1)  # until the client closes
            except OSError:
                pass  # the client stopped reading (done, or found an error)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    args = ["_fanout-clients", "--port", str(server.getsockname()[1]), "--rows", str(rows), "--clients", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), *args, "--first", str(first), "--timeout", "20"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    server.close()
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fanout_clients_check_every_token_in_order() -> None:
    """The counting clients take consecutive tokens (from a given first token, or token by token
    from the first seen) and catch a repeat, a swap or a gap anywhere in a buffer."""
    rows = 3000
    ok = _fanout_clients_against(list(range(5, 5 + rows + 2000)), rows + 1500, 5)  # more rows than asked
    assert "error" not in ok and ok["rows"] >= rows + 1500
    assert "error" not in _fanout_clients_against(list(range(1, rows + 1)), rows, 0)  # first seen
    good = list(range(1, rows + 1))
    for bad in (
        [*good[:1000], 1000, *good[1000:]],  # a repeat
        [*good[:1000], good[1001], good[1000], *good[1002:]],  # a swap
        good[:1000] + good[1001:] + [rows + 1],  # a gap
        [10, *good[1:]],  # a wrong first token
    ):
        got = _fanout_clients_against(bad, rows, 1)
        assert "rows out of order" in got.get("error", ""), got


def test_the_catch_up_times_a_restart_of_a_worker_that_was_set_up_before(tmp_path, monkeypatch) -> None:
    """As the baseline's subscription (created, copied, disabled): the worker's first start, on its
    fresh database, comes before the rows are written and is not timed; the timed part starts the
    worker process again, which resumes from its stored token."""
    from scripts import bench_pg

    workdir = str(tmp_path)
    order: list[str] = []
    write = bench_pg._tickline_write

    def counting_write(t: bench_pg.Tickline, rows: int) -> int:
        order.append("write")
        return write(t, rows)

    clock = bench_pg.time.perf_counter

    def perf_counter() -> float:
        order.append("clock")
        return clock()

    start = bench_pg.Tickline.start_worker

    def counting_start(self: bench_pg.Tickline) -> None:
        order.append("start")
        start(self)

    stop = bench_pg.Tickline.stop_worker

    def stop_once_ready(self: bench_pg.Tickline) -> None:
        # The run ends when the rows are in the worker's table, which can be just before the
        # worker logs that it is ready: the log below is read once it has (after the timing).
        if self.worker is not None and self.worker.poll() is None:
            self.wait_worker_ready()
        stop(self)

    monkeypatch.setattr(bench_pg, "_tickline_write", counting_write)
    monkeypatch.setattr(bench_pg.Tickline, "start_worker", counting_start)
    monkeypatch.setattr(bench_pg.Tickline, "stop_worker", stop_once_ready)
    with bench_pg.Clusters() as clusters:
        monkeypatch.setattr(bench_pg.time, "perf_counter", perf_counter)
        rate = bench_pg.catch_up_once(clusters, workdir, 2000, "tickline")
        monkeypatch.setattr(bench_pg.time, "perf_counter", clock)
    assert rate > 0
    assert order[:5] == ["start", "write", "clock", "start", "clock"], order
    log = (tmp_path / "catchup-worker.log").read_text()
    # Two processes: the first caught up with nothing, the second resumed and applied every row.
    assert log.count("worker bench resumes caches@0, events@0") == 2, log
    assert "applied caches@0, events@0" in log and "events@2000" in log, log


def test_a_latency_run_s_trace_has_every_commit_and_the_path_s_tasks_by_role() -> None:
    """``latency_once(..., trace)``, what ``scripts.sched_waits record`` writes: both sides' paths named."""
    import tempfile

    from scripts.bench_pg import Clusters, latency_once

    with Clusters() as clusters, tempfile.TemporaryDirectory() as workdir:
        traces = {}
        for which in ("tickline", "baseline"):
            trace: dict[str, Any] = {}
            latency_once(clusters, workdir, 200, 0.2, which, trace)
            assert trace["committed"] and set(trace["committed"]) <= set(trace["applied"])
            traces[which] = set(trace["roles"].values())
    path = {"committer", "listeners", "listeners/1", "dst:listener", "src:writer"}
    assert path | {"src:listen", "master", "worker", "dst:apply"} <= traces["tickline"]
    assert path | {"src:walsender", "dst:apply-worker"} <= traces["baseline"]
