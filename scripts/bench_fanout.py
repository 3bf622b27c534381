"""``tickline bench fanout``: one master feeding 1, 10 and 50 clients, live and replay.

Variants ``live-1``, ``live-10``, ``live-50``, ``replay-1``, ``replay-10``,
``replay-50``, ``replay-storage-1``, ``replay-storage-50``:

- *live*: the N clients send ``REPLICATE events <head>`` and wait for their
  ``POSITION``; then ``rows`` new rows are committed in one transaction (by
  this process); timed to the last row of the last client from just before
  the ``COMMIT`` (the headline rate) and from the moment the ``COMMIT``
  returned (the rows became visible: the master's delivery rate). The
  writer is the store's, with its own checkpoint policy: on SQLite the
  masters checkpoint the WAL after the pass that delivered the rows
  (``storage.sqlite_db``; the next run starts once the masters are idle).
  The master
  reads them from storage (``fanout_rows`` per read) and fans each chunk out
  once: what bounds it is the master's storage read (SQLite concatenates each
  row's stored JSON, about 0.5 µs per row; PostgreSQL's server builds the
  lines) plus the time until the master looks (SQLite: ``PRAGMA
  data_version`` every ``change_check_interval``, 5 ms).
- *replay*: the N clients connect at once and each replays the newest
  ``rows`` rows (``REPLICATE events <head - rows>``): rows inside the
  master's window of recent rows (put there by the live fan-out, or on start
  by the window's warm-up), served from memory; timed from the connects to
  the last row of the last client.
- *replay-storage*: the same N clients replay ``rows`` rows from token 0
  against a second master on the same database whose window is too small to
  hold them (``recent_bytes`` 1 MiB): storage reads in chunks of
  ``catchup_rows``, concurrent replays sharing each read.

The clients (one process holds all of them) count the ``RDATA`` lines and
check their order on whole buffers: one regular expression finds every
line's token, which must run on from the expected first token without a gap
or a repeat (no per-line Python dispatch, as the raw socket clients of the
issue's checks): a buffer's tokens, joined by spaces, must be the next part
of the expected tokens prepared before the clock starts (one C-level
compare; token by token past them). The baseline's clients check the same
way, from its first token (1). Baseline, in the same run and interleaved: a bare Twisted
server that writes the same pre-built bytes to each of the N connections (a
push producer), read by the same clients.

Reported per variant: rows/s delivered (all clients together; the median run, and the best),
master CPU per delivered row (the time its threads ran, from
``/proc/<pid>/task/*/schedstat``, in nanoseconds where ``/proc/<pid>/stat``
counts 10 ms ticks; median of the runs; steadier than wall time on a shared
machine), the
clients' CPU per row, master peak memory (``VmHWM``, reset before each run
through ``/proc/<pid>/clear_refs``; highest of the runs), and the spread of
the runs (slowest run / median). ``--db postgresql`` runs the same against a
throwaway PostgreSQL server (``scripts/pg_local.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from scripts.benchmark import (
    INSTANCE,
    STREAM,
    BenchError,
    Server,
    _cpu_seconds,
    _fmt,
    _free_port,
    _self_command,
    fill_database,
    make_rows,
    run_client,
)

CLIENT_COUNTS = (1, 10, 50)
MODES = ("live", "replay")
STORAGE_CLIENT_COUNTS = (1, 50)
# The replay-storage master's window: too small for the replayed rows.
STORAGE_RECENT_BYTES = 1 << 20


def variants() -> list[str]:
    names = [f"{mode}-{n}" for mode in MODES for n in CLIENT_COUNTS]
    return names + [f"replay-storage-{n}" for n in STORAGE_CLIENT_COUNTS]


def _memory_kib(pid: int, field: str = "VmHWM") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_time(pid: int) -> float:
    """CPU seconds of every thread of the process, in nanoseconds' resolution (``/proc/<pid>/task/*/schedstat``).

    ``/proc/<pid>/stat`` counts in clock ticks (10 ms): a whole replay from
    memory may take one or two. Falls back to it where schedstat is missing.
    """
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _cpu_seconds(pid)
    return total / 1e9


def _reset_peak(pid: int) -> None:
    """Reset the process's VmHWM to its current resident size (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _wait_quiet(pids: Sequence[int], bound: float = 5.0) -> None:
    """Until the masters are idle again (at most ``bound`` s): their WAL checkpoint after a live run never runs in the next.

    Outside every clock: the run's figures were taken. A master checkpoints
    after the pass that delivered the rows (``storage.sqlite_db``); idle, it
    uses well under 10% of a core (its looks for commits and passes), so two
    100 ms spans of less than that in a row mean it is done.
    """
    deadline = time.monotonic() + bound
    quiet = 0
    while time.monotonic() < deadline and quiet < 2:
        before = sum(_cpu_time(pid) for pid in pids)
        time.sleep(0.1)
        quiet = quiet + 1 if sum(_cpu_time(pid) for pid in pids) - before < 0.01 else 0


# -- the counting clients (their own process) ------------------------------------------


def role_fanout_clients(
    port: int, rows: int, clients: int, send: str, wait: bool, timeout: float, first: int = 0
) -> int:
    """N connections that count RDATA lines and check their tokens run on from ``first`` (0: the first seen).

    With ``wait``, READY once each saw its POSITION.
    """
    import re

    from twisted.internet.protocol import ClientFactory, Protocol

    from replication.reactor_types import global_reactor, transport_of

    reactor = global_reactor()

    # Every line is searched with the newline before it (the carried tail keeps it).
    token_re = re.compile(rb"\nRDATA \S+ \S+ (\d+) ")
    # The tokens every client must see, space-separated, prepared before the clock
    # starts (with room for rows past ``rows`` in the last buffer).
    expected = b" ".join(b"%d" % t for t in range(first, first + rows + rows // 4 + 1000)) if first else b""
    result: dict[str, Any] = {"rows": 0, "t_start": 0.0, "t_first": None, "t_last": None, "done": 0}
    ready = {"positioned": 0}

    class Counting(Protocol):
        def connectionMade(self) -> None:
            self.count = 0
            self.tail = b"\n"  # the newline before the next line, and a partial line
            self.next = first  # the token the next RDATA line must carry
            self.at = 0 if first else -1  # where this client is in ``expected`` (-1: token by token)
            self.positioned = False
            if send:
                transport_of(self).write(send.encode() + b"\n")

        def dataReceived(self, data: bytes) -> None:
            buf = self.tail + data
            end = buf.rfind(b"\n") + 1
            self.tail = buf[end - 1 :]
            if not self.positioned and b"POSITION " in buf:
                self.positioned = True
                ready["positioned"] += 1
                if wait and ready["positioned"] == clients:
                    print("READY", flush=True)
            found = token_re.findall(buf, 0, end)
            if not found:
                return
            if result["t_first"] is None:
                result["t_first"] = time.monotonic()
            if not self.next:
                self.next = int(found[0])
            n = len(found)
            # The tokens, joined, are the expected ones at this client's place (C-level
            # compare); anything else (also rows past the prepared tokens) is checked
            # token by token.
            joined = b" ".join(found)
            end_at = self.at + len(joined)
            if self.at >= 0 and expected.startswith(joined, self.at) and expected[end_at : end_at + 1] in b" ":
                self.at = end_at + 1
            elif list(map(int, found)) != list(range(self.next, self.next + n)):
                result["error"] = f"rows out of order: expected tokens from {self.next}, got {found[:3]}..."
                reactor.stop()
                return
            else:
                self.at = -1  # past the prepared tokens: token by token from here
            self.next += n
            self.count += n
            if self.count >= rows:
                result["rows"] += self.count
                result["done"] += 1
                transport_of(self).abortConnection()
                if result["done"] == clients:
                    result["t_last"] = time.monotonic()
                    reactor.stop()

    class Factory(ClientFactory):
        protocol = Counting

        def clientConnectionFailed(self, connector: Any, reason: Any) -> None:
            result["error"] = reason.getErrorMessage()
            reactor.stop()

    def timed_out() -> None:
        result["error"] = f"timed out after {timeout:g} s: {result['done']} of {clients} clients done"
        reactor.stop()

    timer = reactor.callLater(timeout, timed_out)
    result["t_start"] = time.monotonic()
    cpu = time.process_time()
    for _ in range(clients):
        reactor.connectTCP("127.0.0.1", port, Factory())
    reactor.run()
    result["cpu"] = time.process_time() - cpu
    if timer.active():
        timer.cancel()
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


# -- the scenario ------------------------------------------------------------------------


def run_fanout(
    rows: int,
    repeat: int,
    workdir: str,
    verbose: bool,
    chosen: Sequence[str] | None = None,
    db: str = "sqlite",
) -> dict[str, dict[str, Any]]:
    from storage.store import open_store

    names = list(chosen or variants())

    def log(text: str) -> None:
        if verbose:
            print(f"  {text}", file=sys.stderr, flush=True)

    timeout = 120.0 + rows / 5_000
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    base_runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    servers: list[Server] = []
    store = None
    pg = None
    try:
        if db == "postgresql":
            from scripts.pg_local import PostgresServer

            pg = PostgresServer()
            pg.start()
            url = pg.new_database()
        else:
            url = f"sqlite:///{os.path.join(workdir, 'fanout.db')}"
        head = fill_database(url, rows)
        base_port = _free_port()
        baseline = Server(
            _self_command("_baseline-server", "--port", str(base_port), "--rows", str(rows)),
            os.path.join(workdir, "fanout-baseline.log"),
            "baseline listening",
            "baseline server",
            timeout=30.0 + rows / 20_000,
        )
        servers.append(baseline)

        def start_master(tag: str, config: str | None = None) -> tuple[Server, int]:
            port = _free_port()
            cmd = [sys.executable, "-m", "scripts.cli", "master", "--database", url, "--listen", f"127.0.0.1:{port}"]
            if config is not None:
                path = os.path.join(workdir, f"fanout-{tag}.yaml")
                with open(path, "w") as f:
                    f.write(config)
                cmd += ["--config", path]
            server = Server(cmd, os.path.join(workdir, f"fanout-{tag}.log"), "listening on", f"master ({tag})")
            servers.append(server)
            return server, port

        master, port = start_master("master")
        cold = cold_port = None
        if any(name.startswith("replay-storage-") for name in names):
            cold, cold_port = start_master("storage", f"master:\n  recent_bytes: {STORAGE_RECENT_BYTES}\n")
        store = open_store(url)
        # SQLite: the store's own checkpoint policy (storage.sqlite_db): the
        # masters checkpoint after their passes, this writer only past the backstop.
        masters = [server.proc.pid for server in servers if server is not baseline]
        _wait_quiet(masters)  # the filled rows' checkpoint, by the masters once they started
        next_row = head

        def measure(
            kind: str, server: Server, port: int, clients: int, send: str, first: int, on_ready: Any = None
        ) -> dict[str, float]:
            """One run: N clients until each has ``rows`` rows in order; the server's CPU and peak memory."""
            pid = server.proc.pid
            _reset_peak(pid)
            cpu_before = _cpu_time(pid)
            args = ["_fanout-clients", "--port", str(port), "--first", str(first)]
            args += ["--rows", str(rows), "--clients", str(clients), "--send", send, "--timeout", str(timeout)]
            if on_ready is not None:
                args.append("--wait")
            r = run_client(args, timeout + 30, on_ready=on_ready)
            cpu_after = _cpu_time(pid)
            cpu = cpu_after - cpu_before
            if "error" in r:
                raise BenchError(f"{kind}: {r['error']}\n{server.log_tail()}")
            start = r.get("t_commit", r["t_start"])
            seconds = r["t_last"] - start
            visible = r["t_last"] - r.get("t_visible", start)
            run = {
                "rate": r["rows"] / seconds if seconds > 0 else float("inf"),
                "seconds": seconds,
                "rate_visible": r["rows"] / visible if visible > 0 else float("inf"),
                "commit_ms": 1000 * (r.get("t_visible", start) - start),
                "first_ms": 1000 * (r["t_first"] - start),
                "server_us": 1e6 * cpu / r["rows"],
                # live: the master's CPU from just before the COMMIT (its idle looks while the rows were written left out)
                "server_us_commit": 1e6 * (cpu_after - r.get("cpu_commit", cpu_before)) / r["rows"],
                "client_us": 1e6 * r["cpu"] / r["rows"],
                "peak_mib": _memory_kib(pid) / 1024,
            }
            log(
                f"{kind}: {_fmt(run['rate'])} rows/s delivered ({_fmt(run['rate_visible'])} from the COMMIT's return), "
                f"{run['seconds']:.3f} s "
                f"(first row after {run['first_ms']:.1f} ms), server CPU {run['server_us']:.3f} us/row "
                f"({run['server_us_commit']:.3f} from the COMMIT), "
                f"clients {run['client_us']:.3f} us/row, peak {run['peak_mib']:.0f} MiB"
            )
            return run

        for i in range(repeat):
            log(f"fanout run {i + 1} of {repeat}")
            for name in names:
                mode, _, n = name.rpartition("-")
                clients = int(n)
                base_runs[name].append(measure(f"baseline {name}", baseline, base_port, clients, "", 1))
                if mode == "replay-storage":
                    assert cold is not None and cold_port is not None
                    runs[name].append(measure(f"tickline {name}", cold, cold_port, clients, f"REPLICATE {STREAM} 0", 1))
                    continue
                if mode == "replay":
                    start = next_row - rows  # the newest rows: inside the window
                    send = f"REPLICATE {STREAM} {start}"
                    runs[name].append(measure(f"tickline {name}", master, port, clients, send, start + 1))
                    continue
                new_rows = make_rows(next_row, rows)
                live_head = next_row
                next_row += rows

                def commit(new_rows: list = new_rows) -> dict[str, float]:
                    # One transaction through the store, as any writer's. Two
                    # clocks start: just before its COMMIT (the rate as the
                    # writer sees it, the COMMIT's own write of the WAL
                    # included) and when the COMMIT returned (the rows are
                    # visible to the master from then: the master's delivery
                    # rate). SQLite: the WAL checkpoint of these rows is the
                    # master's, after its pass (storage.sqlite_db).
                    with store.writing(STREAM, INSTANCE) as txn:
                        txn.append(new_rows)
                        cpu_commit = _cpu_time(master.proc.pid)
                        t_commit = time.monotonic()
                    t_visible = time.monotonic()
                    return {"t_commit": t_commit, "t_visible": t_visible, "cpu_commit": cpu_commit}

                send = f"REPLICATE {STREAM} {live_head}"
                runs[name].append(
                    measure(f"tickline {name}", master, port, clients, send, live_head + 1, on_ready=commit)
                )
                _wait_quiet(masters)
    finally:
        if store is not None:
            store.close()
        for server in reversed(servers):
            server.stop()
        if pg is not None:
            pg.stop()
    results = {}
    for name in names:
        med = statistics.median(r["seconds"] for r in runs[name])
        results[name] = {
            "db": db,
            # The headline is the median run (the targets are medians); the best is printed too.
            "tickline": statistics.median(r["rate"] for r in runs[name]),
            "baseline": statistics.median(r["rate"] for r in base_runs[name]),
            "best_rate": max(r["rate"] for r in runs[name]),
            "master_us": statistics.median(r["server_us"] for r in runs[name]),
            "master_us_commit": statistics.median(r["server_us_commit"] for r in runs[name]),
            "client_us": statistics.median(r["client_us"] for r in runs[name]),
            "baseline_us": statistics.median(r["server_us"] for r in base_runs[name]),
            "peak_mib": max(r["peak_mib"] for r in runs[name]),
            "baseline_peak_mib": max(r["peak_mib"] for r in base_runs[name]),
            "first_ms": statistics.median(r["first_ms"] for r in runs[name]),
            "visible": statistics.median(r["rate_visible"] for r in runs[name]),
            "best_visible": max(r["rate_visible"] for r in runs[name]),
            "commit_ms": statistics.median(r["commit_ms"] for r in runs[name]),
            "spread": max(r["seconds"] for r in runs[name]) / med if med > 0 else 1.0,
            "runs": runs[name],
            "baseline_runs": base_runs[name],
        }
    return results


def print_results(results: dict[str, dict[str, Any]]) -> None:
    for name, r in results.items():
        label = name if r.get("db", "sqlite") == "sqlite" else f"{name} ({r['db']})"
        print(
            f"fanout {label}: tickline {_fmt(r['tickline'])} rows/s, baseline {_fmt(r['baseline'])} rows/s, "
            f"ratio {r['tickline'] / r['baseline']:.2f}",
            flush=True,
        )
        print(
            f"  master CPU per delivered row {r['master_us']:.3f} us (baseline server {r['baseline_us']:.3f} us); "
            f"master peak memory {r['peak_mib']:.0f} MiB (baseline {r['baseline_peak_mib']:.0f} MiB); "
            f"best run {_fmt(r['best_rate'])} rows/s, slowest run {r['spread']:.2f}x the median; "
            f"clients {r['client_us']:.3f} us/row, first row after {r['first_ms']:.1f} ms",
            flush=True,
        )
        if name.startswith("live-"):
            print(
                f"  live, timed from the COMMIT's return (rows visible) instead of before it: "
                f"{_fmt(r['visible'])} rows/s (best run {_fmt(r['best_visible'])}); "
                f"the COMMIT took {r['commit_ms']:.1f} ms; master CPU per row from just before the COMMIT "
                f"{r['master_us_commit']:.3f} us",
                flush=True,
            )
    for mode, counts in (("live", CLIENT_COUNTS), ("replay", CLIENT_COUNTS), ("replay-storage", STORAGE_CLIENT_COUNTS)):
        one = results.get(f"{mode}-1")
        if one is None:
            continue
        for n in counts[1:]:
            many = results.get(f"{mode}-{n}")
            if many is not None and one["master_us"] > 0:
                print(
                    f"  {mode}: master CPU per delivered row with {n} clients is "
                    f"{many['master_us'] / one['master_us']:.2f}x that with one",
                    flush=True,
                )


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    """Master CPU per delivered row against the number of clients (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for mode, style, label in (
        ("live", "o-", "tickline live"),
        ("replay", "s-", "tickline replay (window)"),
        ("replay-storage", "^:", "tickline replay (storage)"),
    ):
        points = [(n, results[f"{mode}-{n}"]["master_us"]) for n in CLIENT_COUNTS if f"{mode}-{n}" in results]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    base = [(n, results[f"live-{n}"]["baseline_us"]) for n in CLIENT_COUNTS if f"live-{n}" in results]
    if base:
        ax.plot([p[0] for p in base], [p[1] for p in base], "k--", label="bare Twisted sender")
    ax.set_xscale("log")
    ax.set_xticks(list(CLIENT_COUNTS), [str(n) for n in CLIENT_COUNTS])
    ax.set_xlabel("clients")
    ax.set_ylabel("master CPU per delivered row (µs)")
    ax.set_title("tickline fan-out: master CPU per delivered row")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fanout_cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="benchmark.py _fanout-clients")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--send", default="")
    p.add_argument("--wait", action="store_true", help="say READY once every client saw its POSITION")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--first", type=int, default=0, help="the first token expected (0: the first one seen)")
    a = p.parse_args(argv)
    return role_fanout_clients(a.port, a.rows, a.clients, a.send, a.wait, a.timeout, a.first)
