"""``tickline bench``: throughput of tickline beside a bare Twisted baseline.

Scenarios (``tickline bench [SCENARIO...] [--rows N]``, default: all):

``wire``
    Replay: a temporary SQLite database holds N rows of the ``events`` stream;
    a real master (``tickline master`` in its own process) serves it on
    127.0.0.1; a client process using ``replication.client.ClientProtocol``
    with a handler that counts rows sends ``REPLICATE events 0`` and is timed
    from connect to the last row received.
``wire-live``
    Live: the same client sends ``REPLICATE`` (live from the head), then N rows
    are committed in one transaction; timed from the commit to the last row
    received.

``fanout``
    One master feeding 1, 10 and 50 raw counting clients, live and replay:
    rows/s delivered, master CPU per delivered row, master peak memory
    (``scripts/bench_fanout.py``; ``--plot FILE.png`` draws CPU per row
    against the number of clients).

Baseline, measured in the same run: a server process that writes the same N
``RDATA`` lines (pre-built, byte for byte what the master sends) as fast as
the transport takes them (a push producer writing chunks of 5,000 lines), and
a client process whose ``LineOnlyReceiver`` counts lines. Every side runs in
its own process, so master and client each get a core as in production.

Baseline and tickline runs alternate, each measurement is repeated
(``--repeat``, default 3) and the best run of each is reported (other load on
the machine only ever slows a run down), per scenario, as one line::

    wire: tickline 412,000 rows/s, baseline 1,630,000 rows/s, ratio 0.25

followed by the CPU time per row of each process (median of the runs; steadier
than wall time on a busy machine, and it shows which side is saturated) and,
for ``wire``, the master alone: its replay read by the bare line client.

Absolute numbers vary between machines and runs; the ratio is what to compare.
Run as ``tickline bench`` or ``python scripts/benchmark.py`` (which also takes
``--repeat`` and ``--profile DIR``: sample master and client with py-spy).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    # Run as a file (python scripts/benchmark.py): make the project importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import orjson

from scripts.bench_options import DEFAULT_REPEAT, add_bench_arguments, fanout_variants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIRE_SCENARIOS = ("wire", "wire-live")
PG_SCENARIOS = ("end-to-end", "latency", "catch-up", "writer")  # against logical replication: scripts/bench_pg.py
SCENARIOS: tuple[str, ...] = (
    *WIRE_SCENARIOS,
    *PG_SCENARIOS,
    "snapshot",  # Spark JDBC snapshots: scripts/bench_snapshot.py
    "ordered",  # timestamp order across streams: scripts/bench_ordered.py
    "timeline",  # timeline leases/s on PostgreSQL: scripts/bench_timeline.py
    "fanout",  # 1, 10 and 50 clients, live and replay: scripts/bench_fanout.py
)
DEFAULT_ROWS = 200_000
# catch-up without --rows: issue 11's table measures the catch-up of 500,000 rows (the other
# scenarios 200,000); a smaller backlog is mostly the worker's process start (docs/benchmarks.md).
CATCH_UP_DEFAULT_ROWS = 500_000
STREAM = "events"
INSTANCE = "master"
APPEND_CHUNK = 10_000
BASELINE_CHUNK_LINES = 5_000
CLIENT_NAME = "bench"

# -- the rows ------------------------------------------------------------------


def _ident(n: int, length: int) -> str:
    """A deterministic, random-looking identifier (like Matrix event ids)."""
    digest = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=48).digest()
    return base64.urlsafe_b64encode(digest)[:length].decode("ascii")


def make_rows(first: int, count: int) -> list[tuple[Any, ...]]:
    """Rows ``first .. first+count-1`` of the ``events`` stream, deterministic.

    About 80% messages, 15% memberships (with a state key), 5% redactions;
    an RDATA line is about 140 bytes.
    """
    rows: list[tuple[Any, ...]] = []
    for n in range(first, first + count):
        event_id = "$" + _ident(n, 43)
        room_id = f"!{_ident(n % 997 + 10_000_000, 18)}:example.org"
        kind = n % 20
        if kind < 16:
            rows.append((event_id, room_id, "m.room.message", None, None))
        elif kind < 19:
            rows.append((event_id, room_id, "m.room.member", f"@user{n % 5000}:example.org", None))
        else:
            rows.append((event_id, room_id, "m.room.redaction", None, "$" + _ident(n - 7, 43)))
    return rows


def rdata_lines(first: int, count: int) -> list[bytes]:
    """The RDATA lines the master sends for rows ``first..`` (token = row number + 1)."""
    return [
        b"RDATA %s %s %d %s\n" % (STREAM.encode(), INSTANCE.encode(), first + i + 1, orjson.dumps(list(row)))
        for i, row in enumerate(make_rows(first, count))
    ]


def fill_database(url: str, rows: int) -> int:
    """Append ``rows`` rows (one token each) in chunks; returns the head token."""
    from replication.streams import EVENTS
    from storage.store import open_store

    store = open_store(url)
    store.register_stream(EVENTS)
    head = 0
    for start in range(0, rows, APPEND_CHUNK):
        tokens = store.append(STREAM, make_rows(start, min(APPEND_CHUNK, rows - start)), INSTANCE)
        head = tokens[-1]
    store.close()
    return head


# -- processes -----------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    return env


def _self_command(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


class BenchError(Exception):
    pass


class Server:
    """A server subprocess (master or baseline) that says when it listens."""

    def __init__(self, command: list[str], log_path: str, ready_text: str, what: str, timeout: float = 30.0) -> None:
        self.what = what
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while True:
            with open(log_path, "rb") as f:
                if ready_text.encode() in f.read():
                    return
            if self.proc.poll() is not None:
                raise BenchError(f"{what} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"{what} did not start within {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Profiler:
    """py-spy sampling a process until stopped (``--profile``)."""

    def __init__(self, pyspy: str, pid: int, out: str) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [
                pyspy,
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--rate",
                "500",
                "--threads",
                "--nonblocking",
                "--output",
                out,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # let it attach

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_client(
    args: list[str], timeout: float, on_ready=None, profile: tuple[str, str] | None = None
) -> dict[str, Any]:
    """Run a client subprocess; it prints ``READY`` (live mode) and then one JSON result.

    The client stops itself after its own timeout; a watchdog kills it if it does not.
    """
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            _self_command(*args),
            cwd=ROOT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        profiler = None
        extra: dict[str, Any] = {}
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                text = line.decode().strip()
                if text == "WAITING" and profile is not None:
                    profiler = Profiler(profile[0], proc.pid, profile[1])
                    proc.send_signal(signal.SIGUSR1)
                elif text == "READY" and on_ready is not None:
                    extra.update(on_ready())
                elif text.startswith("{"):
                    result = json.loads(text)
                    result.update(extra)
                    proc.wait()
                    return result
            proc.wait()
            err.seek(0)
            message = err.read().decode("utf-8", "replace")[-2000:]
            raise BenchError(f"client {args[0]} exited with {proc.returncode} and no result:\n{message}")
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            if profiler is not None:
                profiler.stop()


# -- the client and baseline roles (run in their own processes) ---------------------


def _wait_for_profiler() -> None:
    """With ``--profile``: say WAITING, block until the parent's SIGUSR1 (py-spy attached)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print("WAITING", flush=True)
    signal.sigwait({signal.SIGUSR1})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


def role_tickline_client(port: int, rows: int, mode: str, timeout: float, profiled: bool) -> int:
    from twisted.internet.protocol import ClientFactory

    from replication.client import ClientProtocol, ReplicationHandler
    from replication.protocol import ProtocolConfig
    from replication.reactor_types import global_reactor, transport_of

    reactor = global_reactor()

    if profiled:
        _wait_for_profiler()

    result: dict[str, Any] = {"rows": 0, "t_start": 0.0, "t_first": None, "t_last": None}

    class Counting(ReplicationHandler):
        def connected(self, client: ClientProtocol) -> None:
            if mode == "replay":
                client.replicate(STREAM, 0)
            else:
                client.replicate()

        def on_position(self, client: ClientProtocol, command: Any) -> None:
            if mode == "live" and command.stream == STREAM:
                print("READY", flush=True)

        def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, batch: list) -> None:
            if stream != STREAM:
                return
            if result["t_first"] is None:
                result["t_first"] = time.monotonic()
            result["rows"] += len(batch)
            if result["rows"] >= rows:
                result["t_last"] = time.monotonic()
                transport_of(client).abortConnection()
                reactor.stop()

        def on_error(self, client: ClientProtocol, message: str) -> None:
            result["error"] = message
            reactor.stop()

    handler = Counting()

    class Factory(ClientFactory):
        def buildProtocol(self, addr: Any) -> ClientProtocol:
            return ClientProtocol(handler, CLIENT_NAME, ProtocolConfig(), reactor)

        def clientConnectionFailed(self, connector: Any, reason: Any) -> None:
            result["error"] = reason.getErrorMessage()
            reactor.stop()

    def timed_out() -> None:
        result["error"] = f"timed out after {timeout:g} s with {result['rows']} rows"
        reactor.stop()

    timer = reactor.callLater(timeout, timed_out)
    result["t_start"] = time.monotonic()
    cpu = time.process_time()
    reactor.connectTCP("127.0.0.1", port, Factory())
    reactor.run()
    result["cpu"] = time.process_time() - cpu
    if timer.active():
        timer.cancel()
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


def role_baseline_client(port: int, rows: int, timeout: float, profiled: bool, send: str | None = None) -> int:
    """A bare ``LineOnlyReceiver`` counting ``RDATA`` lines; with ``send``, it first sends that line
    (``REPLICATE events 0`` makes it a client of the master that parses nothing)."""
    from twisted.internet.protocol import ClientFactory
    from twisted.protocols.basic import LineOnlyReceiver

    from replication.reactor_types import global_reactor, transport_of

    reactor = global_reactor()

    if profiled:
        _wait_for_profiler()

    result: dict[str, Any] = {"rows": 0, "t_start": 0.0, "t_first": None, "t_last": None}

    class Counting(LineOnlyReceiver):
        delimiter = b"\n"
        MAX_LENGTH = 65536

        def connectionMade(self) -> None:
            if send:
                transport_of(self).write(send.encode() + b"\n")

        def lineReceived(self, line: bytes) -> None:
            if line[:6] != b"RDATA ":
                return
            count = result["rows"] = result["rows"] + 1
            if count == 1:
                result["t_first"] = time.monotonic()
            if count == rows:
                result["t_last"] = time.monotonic()
                transport_of(self).abortConnection()
                reactor.stop()

    class Factory(ClientFactory):
        protocol = Counting

        def clientConnectionFailed(self, connector: Any, reason: Any) -> None:
            result["error"] = reason.getErrorMessage()
            reactor.stop()

    def timed_out() -> None:
        result["error"] = f"timed out after {timeout:g} s with {result['rows']} lines"
        reactor.stop()

    timer = reactor.callLater(timeout, timed_out)
    result["t_start"] = time.monotonic()
    cpu = time.process_time()
    reactor.connectTCP("127.0.0.1", port, Factory())
    reactor.run()
    result["cpu"] = time.process_time() - cpu
    if timer.active():
        timer.cancel()
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


def role_baseline_server(port: int, rows: int) -> int:
    """Write the N pre-built lines to every connection, as fast as the transport takes them."""
    from twisted.internet.interfaces import IPushProducer
    from twisted.internet.protocol import Factory, Protocol
    from zope.interface import implementer

    from replication.reactor_types import global_reactor, transport_of

    reactor = global_reactor()

    lines = rdata_lines(0, rows)
    chunks = [b"".join(lines[i : i + BASELINE_CHUNK_LINES]) for i in range(0, rows, BASELINE_CHUNK_LINES)]
    del lines

    @implementer(IPushProducer)
    class Blast(Protocol):
        def connectionMade(self) -> None:
            self.next = 0
            self.paused = False
            transport_of(self).registerProducer(self, True)
            self.resumeProducing()

        def resumeProducing(self) -> None:
            self.paused = False
            while not self.paused and self.next < len(chunks):
                self.next += 1
                transport_of(self).write(chunks[self.next - 1])  # may call pauseProducing

        def pauseProducing(self) -> None:
            self.paused = True

        def stopProducing(self) -> None:
            self.paused = True
            self.next = len(chunks)

    reactor.listenTCP(port, Factory.forProtocol(Blast), interface="127.0.0.1")
    print(f"baseline listening on 127.0.0.1:{port} with {rows} lines", flush=True)
    reactor.run()
    return 0


# -- the scenarios -----------------------------------------------------------------


def _rate(rows: int, seconds: float) -> float:
    return rows / seconds if seconds > 0 else float("inf")


def _fmt(rate: float) -> str:
    return f"{rate:,.0f}"


def _client_timeout(rows: int) -> float:
    return 60.0 + rows / 10_000


def run_wire(
    scenarios: Sequence[str], rows: int, repeat: int, workdir: str, profile_dir: str | None, verbose: bool
) -> dict[str, dict[str, Any]]:
    """Baseline and tickline runs interleaved, so that both see the same load."""
    from storage.store import open_store

    pyspy = None
    if profile_dir:
        pyspy = os.environ.get("PYSPY") or shutil.which("py-spy")
        if not pyspy:
            raise BenchError("--profile needs py-spy (on PATH or in $PYSPY)")
        os.makedirs(profile_dir, exist_ok=True)

    def log(text: str) -> None:
        if verbose:
            print(f"  {text}", file=sys.stderr, flush=True)

    db_path = os.path.join(workdir, "bench.db")
    url = f"sqlite:///{db_path}"
    started = time.monotonic()
    head = fill_database(url, rows)
    log(f"filled {rows:,} rows in {time.monotonic() - started:.1f} s")
    timeout = _client_timeout(rows)
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "wire": [], "wire-live": [], "master-alone": []}
    servers: list[Server] = []
    profilers: list[Profiler] = []
    store = None

    def measure(
        kind: str,
        server: Server,
        args: list[str],
        start: str = "t_start",
        on_ready=None,
        profile: tuple[str, str] | None = None,
    ) -> dict[str, float]:
        """One client run: rows/s and CPU microseconds per row of server and client."""
        cpu_before = _cpu_seconds(server.proc.pid)
        r = run_client([*args, "--timeout", str(timeout)], timeout + 30, on_ready=on_ready, profile=profile)
        server_cpu = _cpu_seconds(server.proc.pid) - cpu_before
        if "error" in r:
            raise BenchError(f"{kind} client: {r['error']}\n{server.log_tail()}")
        run = {
            "rate": _rate(r["rows"], r["t_last"] - r[start]),
            "server_us": 1e6 * server_cpu / r["rows"],
            "client_us": 1e6 * r["cpu"] / r["rows"],
        }
        log(
            f"{kind}: {_fmt(run['rate'])} rows/s, CPU per row: server {run['server_us']:.2f} us, "
            f"client {run['client_us']:.2f} us"
        )
        return run

    try:
        base_port = _free_port()
        baseline = Server(
            _self_command("_baseline-server", "--port", str(base_port), "--rows", str(rows)),
            os.path.join(workdir, "baseline.log"),
            "baseline listening",
            "baseline server",
            timeout=30.0 + rows / 20_000,
        )
        servers.append(baseline)
        port = _free_port()
        master_cmd = [sys.executable, "-m", "scripts.cli", "master", "--database", url, "--listen", f"127.0.0.1:{port}"]
        master = Server(master_cmd, os.path.join(workdir, "master.log"), "listening on", "master")
        servers.append(master)
        store = open_store(url)
        next_row = rows
        replay_args = ["_tickline-client", "--port", str(port), "--rows", str(head), "--mode", "replay"]

        for i in range(repeat):
            log(f"run {i + 1} of {repeat}")
            runs["baseline"].append(
                measure("baseline", baseline, ["_baseline-client", "--port", str(base_port), "--rows", str(rows)])
            )
            if "wire" in scenarios:
                runs["wire"].append(measure("tickline replay", master, replay_args))
                # The master alone: the same replay read by the bare line client, which parses nothing.
                runs["master-alone"].append(
                    measure(
                        "master to bare client",
                        master,
                        [
                            "_baseline-client",
                            "--port",
                            str(port),
                            "--rows",
                            str(head),
                            "--send",
                            f"REPLICATE {STREAM} 0",
                        ],
                    )
                )
            if "wire-live" in scenarios:
                new_rows = make_rows(next_row, rows)
                next_row += rows

                def commit(new_rows: list = new_rows) -> dict[str, float]:
                    store.append(STREAM, new_rows, INSTANCE)  # one transaction
                    return {"t_commit": time.monotonic()}

                live_args = ["_tickline-client", "--port", str(port), "--rows", str(rows), "--mode", "live"]
                runs["wire-live"].append(measure("tickline live", master, live_args, "t_commit", commit))

        if pyspy and profile_dir:
            # One more replay run under py-spy; sampling takes a core, so it does not count.
            profilers.append(Profiler(pyspy, master.proc.pid, os.path.join(profile_dir, "master-wire.txt")))
            profile = (pyspy, os.path.join(profile_dir, "client-wire.txt"))
            measure("profiled tickline replay", master, [*replay_args, "--profiled"], profile=profile)
            while profilers:
                profilers.pop().stop()
    finally:
        while profilers:
            profilers.pop().stop()
        if store is not None:
            store.close()
        for server in reversed(servers):
            server.stop()
    if profile_dir:
        for name in ("master-wire", "client-wire"):
            path = os.path.join(profile_dir, name + ".txt")
            if os.path.exists(path):
                print(f"\nprofile {name} ({path}):")
                print(summarize_profile(path))
    best_baseline = max(runs["baseline"], key=lambda r: r["rate"])
    results = {}
    for name in scenarios:
        best = max(runs[name], key=lambda r: r["rate"])
        results[name] = {
            "tickline": best["rate"],
            "baseline": best_baseline["rate"],
            # CPU per row (median of the runs) is steadier than wall time on a busy machine.
            "master_us": statistics.median(r["server_us"] for r in runs[name]),
            "client_us": statistics.median(r["client_us"] for r in runs[name]),
            "baseline_server_us": statistics.median(r["server_us"] for r in runs["baseline"]),
            "baseline_client_us": statistics.median(r["client_us"] for r in runs["baseline"]),
            "runs": runs[name],
            "baseline_runs": runs["baseline"],
        }
        if name == "wire":
            results[name]["master_alone"] = max(r["rate"] for r in runs["master-alone"])
    return results


def summarize_profile(path: str, top: int = 12) -> str:
    """Where the samples went, from py-spy's raw (collapsed) output.

    Each line is ``thread (tid): name;frame;frame... count`` with frames like
    ``func (file.py:123)``; idle samples are not recorded (no ``--idle``).
    """
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            head, _, rest = stack.partition(";")
            thread = head.partition(": ")[2] or head
            thread = thread.rstrip("0123456789-").rstrip("-") or thread  # pool threads as one
            frames = []
            for frame in filter(None, rest.split(";")):
                name, _, where = frame.partition(" (")
                frames.append(f"{name} ({where.rsplit(':', 1)[0]})" if where else name)
            if not frames:
                continue
            samples += count
            threads[thread] += count
            own[frames[-1]] += count
            for frame in set(frames):
                total[frame] += count
    if not samples:
        return "  no samples"
    out = [
        f"  {samples} samples; by thread: "
        + ", ".join(f"{name} {100 * n / samples:.0f}%" for name, n in threads.most_common())
    ]
    out.append("  self (the function itself):")
    out += [f"    {100 * n / samples:5.1f}%  {name}" for name, n in own.most_common(top)]
    out.append("  total (the function and what it calls), below the event loop:")
    skip = (
        "<module>",
        "_cli",
        "role_",
        "Thread.",
        "ThreadWorker",
        "Team.",
        "ThreadPool.",
        "ReactorBase.",
        "EPollReactor.doPoll",
        "callWithLogger",
        "callWithContext",
        "ThreadedContextTracker",
        "ContextTracker",
        "_PollLikeMixin",
        "run (",
        "main (",
        "_run_module",
        "_run_code",
    )
    shown = [(name, n) for name, n in total.most_common() if not name.startswith(skip)]
    out += [f"    {100 * n / samples:5.1f}%  {name}" for name, n in shown[:top]]
    return "\n".join(out)


# -- entry points --------------------------------------------------------------------


def main(
    scenarios: list[str] | None = None,
    rows: int | None = None,
    repeat: int = DEFAULT_REPEAT,
    profile_dir: str | None = None,
    verbose: bool = False,
    rate: int = 1000,
    seconds: float = 10.0,
    plot_path: str | None = None,
    db: str = "sqlite",
    fanout_variants: list[str] | None = None,
) -> int:
    """Run the scenarios (default: all); print one result line each. Returns an exit code."""
    chosen = list(scenarios or SCENARIOS)
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        print(
            f"tickline bench: error: unknown scenario {unknown[0]!r} (known: {', '.join(SCENARIOS)})", file=sys.stderr
        )
        return 2
    requested_rows = rows  # the snapshot's default is its own (1,000,000), the catch-up's too (500,000)
    rows = DEFAULT_ROWS if rows is None else rows
    if rows < 1 or repeat < 1 or rate < 1 or not seconds > 0:
        print("tickline bench: error: --rows, --repeat, --rate and --seconds must be positive", file=sys.stderr)
        return 2
    catch_up_rows = CATCH_UP_DEFAULT_ROWS if requested_rows is None else rows
    counted = f"{rows:,} rows" + (
        f" (catch-up {catch_up_rows:,})" if catch_up_rows != rows and "catch-up" in chosen else ""
    )
    print(
        f"tickline bench: {counted}, {repeat} runs per scenario (wire scenarios: the best run; fanout: the "
        f"best and the median; PostgreSQL scenarios: the median of interleaved runs), {os.cpu_count()} cores",
        flush=True,
    )
    workdir = tempfile.mkdtemp(prefix="tickline-bench-")
    wire = [s for s in chosen if s in WIRE_SCENARIOS]
    try:
        results = run_wire(wire, rows, repeat, workdir, profile_dir, verbose) if wire else {}
        if "fanout" in chosen:
            from scripts.bench_fanout import print_results as print_fanout
            from scripts.bench_fanout import run_fanout

            fanout = run_fanout(rows, repeat, workdir, verbose, fanout_variants, db)
            print_fanout(fanout)
            if plot_path:
                from scripts.bench_fanout import plot as plot_fanout

                # With PostgreSQL scenarios too, their plot takes the path given.
                path = plot_path
                if any(s in PG_SCENARIOS for s in chosen):
                    path = os.path.splitext(plot_path)[0] + "-fanout.png"
                plot_fanout(fanout, path)
                print(f"  plot: {path}", flush=True)
        if any(s in PG_SCENARIOS for s in chosen):
            from scripts.bench_pg import run as run_pg

            # --repeat runs of each side, as asked (each starts and replicates whole databases: a
            # run of end-to-end takes a few seconds, of latency about seconds + 2 per side).
            pg_results = run_pg(
                chosen,
                rows,
                workdir,
                repeat,
                rate,
                seconds,
                catch_up_rows=catch_up_rows,
                verbose=verbose,
            )
            if plot_path:
                from scripts.bench_pg import plot

                plot(pg_results, plot_path)
                print(f"  plot: {plot_path}", flush=True)
        if "snapshot" in chosen:
            from scripts.bench_snapshot import print_results, run_snapshot_bench

            print_results(run_snapshot_bench(requested_rows, repeat, workdir, verbose))
        if "ordered" in chosen:
            from scripts import bench_ordered

            bench_ordered.print_results(bench_ordered.run_ordered(workdir))
        if "timeline" in chosen:
            from scripts import bench_timeline

            bench_timeline.print_results(bench_timeline.run_timeline_bench(requested_rows, workdir, rounds=repeat))
    except BenchError as e:
        print(f"tickline bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for name in wire:
        r = results[name]
        print(
            f"{name}: tickline {_fmt(r['tickline'])} rows/s, baseline {_fmt(r['baseline'])} rows/s, "
            f"ratio {r['tickline'] / r['baseline']:.2f}",
            flush=True,
        )
        print(
            f"  CPU per row: master {r['master_us']:.2f} us, client {r['client_us']:.2f} us; "
            f"baseline server {r['baseline_server_us']:.2f} us, client {r['baseline_client_us']:.2f} us",
            flush=True,
        )
        if "master_alone" in r:
            print(
                f"  master alone (its replay read by the bare line client): {_fmt(r['master_alone'])} rows/s",
                flush=True,
            )
    return 0


def _cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_fanout-clients":
        from scripts.bench_fanout import fanout_cli

        return fanout_cli(argv[1:])
    if argv and argv[0].startswith("_"):
        role = argv.pop(0)
        p = argparse.ArgumentParser(prog=f"benchmark.py {role}")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--rows", type=int, required=True)
        p.add_argument("--mode", default="replay", choices=("replay", "live"))
        p.add_argument("--timeout", type=float, default=120.0)
        p.add_argument("--profiled", action="store_true")
        p.add_argument("--send", default=None)
        a = p.parse_args(argv)
        if role == "_tickline-client":
            return role_tickline_client(a.port, a.rows, a.mode, a.timeout, a.profiled)
        if role == "_baseline-client":
            return role_baseline_client(a.port, a.rows, a.timeout, a.profiled, a.send)
        if role == "_baseline-server":
            return role_baseline_server(a.port, a.rows)
        p.error(f"unknown role {role}")
    p = argparse.ArgumentParser(prog="benchmark.py", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p, scenarios_help=f"default: all ({', '.join(SCENARIOS)})")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after the timed runs, one more replay sampled by py-spy (master and client); print where time goes",
    )
    a = p.parse_args(argv)
    chosen = fanout_variants(p, a)
    return main(
        a.scenarios,
        a.rows,
        a.repeat,
        a.profile,
        a.verbose,
        a.rate,
        a.seconds,
        a.plot,
        a.db,
        chosen,
    )


if __name__ == "__main__":
    sys.exit(_cli())
