"""Benchmark scenarios against PostgreSQL's own logical replication.

``end-to-end``, ``latency`` and ``catch-up`` run tickline (a ``tickline
master`` on the source database, a ``tickline worker --replicate events`` on
the target database, rows appended through the Python API) and, as the
baseline in the same invocation, PostgreSQL logical replication (a
publication on the source, a subscription on the target) between the same two
throwaway PostgreSQL clusters, started here: the source with
``wal_level=logical``, both durable (``fsync`` and ``synchronous_commit``
on). Same rows (the ``events`` stream's), same transaction sizes, same
durability: the tickline worker applies with ``synchronous_commit=off``, as
PostgreSQL's apply worker does (``worker.synchronous_commit``, its default).
Runs alternate (tickline, baseline, tickline, ...) and the median of
``repeat`` runs is reported.

end-to-end  rows/s from the first commit on the source to the last row
            applied on the target, 1000-row transactions. The primary line
            compares with the baseline written by ``COPY`` (what a tickline
            append of 1000 rows uses); a second line with ``execute_values``.
latency     single-row commits paced at a requested rate (default 1,000/s)
            for a few seconds; commit -> applied on the target (seen by a
            ``LISTEN`` of a trigger's ``NOTIFY`` on the target table, for
            both); the line compares p99 (ratio = baseline p99 / tickline
            p99), followed by p50/p99 of both and the rate each reached, and
            tickline's commit -> RDATA at a bare TCP client of the master
            (the master's part alone), taken in a third run per repeat: that
            client costs the master a second send and the listeners' process
            a second wake-up per commit, which the baseline would not pay,
            so the compared runs go without it. A commit's time is taken when
            its COMMIT returns: on a busy machine the master may send the
            RDATA before the committing process runs again, so a commit ->
            RDATA delay can be negative. Also the CPU per commit and
            the wait for a CPU (run queue) per commit of the run's processes
            (this one and its children, both clusters' servers) during the
            paced commits, from /proc/<pid>/task/*/schedstat. The listeners (the target's
            NOTIFY, the bare client) run in a process of their own, for
            both, and the committing process runs with its garbage collector
            off: neither's reads wait for the other's GIL or collections.
writer      the writer alone on the durable source: single-row appends
            against a plain INSERT + COMMIT of the same row (commits/s),
            and 1000-row appends against the same rows by COPY without
            tickline (rows/s).
catch-up    a consumer that was down while rows were written comes back.
            Both consumers are set up and caught up before the timed part:
            the subscription is created (its initial copy done) and
            disabled; the tickline worker is started once on its fresh
            database (it creates its tables and reaches the master, caught
            up: its ``ready`` log line) and stopped cleanly. Then rows are
            written (1000-row transactions, ``COPY``; 500,000 rows unless
            ``--rows`` is given), and rows/s are timed
            from enabling the subscription, or from starting the worker
            process again (its interpreter start, imports, database and
            master connections are timed), to the last row applied. The
            subscription is enabled only once wal_retrieve_retry_interval has
            passed since its worker started (PostgreSQL 15's launcher starts
            workers at most once per interval), as for one disabled a while.
"""

from __future__ import annotations

import gc
import io
import os
import select
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from scripts.benchmark import ROOT, BenchError, Server, _env, _fmt, _free_port, make_rows
from scripts.pg_local import PostgresServer
from storage.schema import replicated_token_index

TXN_ROWS = 1000
DONE_TABLE = "bench_done"  # the baseline's "whole write applied" row (Baseline.applied)
BASE_COLUMNS = "token BIGINT NOT NULL, instance_name TEXT NOT NULL, ts BIGINT NOT NULL, event_id TEXT NOT NULL, "
BASE_COLUMNS += "room_id TEXT NOT NULL, type TEXT NOT NULL, state_key TEXT, redacts TEXT"
NAMES = "token, instance_name, ts, event_id, room_id, type, state_key, redacts"
WAIT_SECONDS = 600.0
WARM_UP_SECONDS = 0.5  # a latency run's paced commits before the measured ones (_warm_up)


def _connect(url: str, autocommit: bool = True) -> Any:
    import psycopg2

    conn = psycopg2.connect(url)
    conn.autocommit = autocommit
    return conn


def _scalar(conn: Any, sql: str) -> Any:
    with conn.cursor() as cur:
        cur.execute(sql)
        row = cur.fetchone()
    return None if row is None else row[0]


def _wait(condition: Callable[[], bool], what: str, timeout: float = WAIT_SECONDS, interval: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def _copy_text(first: int, rows: list[tuple[Any, ...]], instance: str) -> str:
    now = int(time.time() * 1000) << 18
    out = []
    for i, row in enumerate(rows):
        values = [str(first + i), instance, str(now + i)] + ["\\N" if v is None else v for v in row]
        out.append("\t".join(values))
    out.append("")
    return "\n".join(out)


class Clusters:
    """Two durable throwaway clusters on loopback; the source with ``wal_level=logical``."""

    def __init__(self) -> None:
        self.source = PostgresServer(durable=True, logical=True)
        self.target = PostgresServer(durable=True)

    def __enter__(self) -> Clusters:
        self.source.start()
        try:
            self.target.start()
        except BaseException:
            self.source.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.target.stop()
        self.source.stop()

    def runs(self, repeat: int, sides: Iterable[str]) -> Iterator[tuple[int, str]]:
        """(run number, side) for ``repeat`` interleaved runs of each side; each run's databases are
        dropped once it is over (the target's first: its subscriptions hold slots on the source)."""
        for i in range(repeat):
            for which in sides:
                yield i, which
                self.target.drop_databases()
                self.source.drop_databases()


class Baseline:
    """A table ``events`` published on the source and subscribed on the target."""

    def __init__(self, clusters: Clusters, applied_trigger: bool = False) -> None:
        self.src_url = clusters.source.new_database()
        self.dst_url = clusters.target.new_database()
        self.name = self.src_url.rsplit("/", 1)[1]
        src = _connect(self.src_url)
        with src.cursor() as cur:
            cur.execute(f"CREATE TABLE events ({BASE_COLUMNS})")
            cur.execute("CREATE INDEX events_token ON events (token)")
            cur.execute(f"CREATE TABLE {DONE_TABLE} (id INT PRIMARY KEY, token BIGINT NOT NULL)")
            cur.execute(f"CREATE PUBLICATION p FOR TABLE events, {DONE_TABLE}")
        src.close()
        dst = _connect(self.dst_url)
        with dst.cursor() as cur:
            cur.execute(f"CREATE TABLE events ({BASE_COLUMNS})")
            # The replica indexed as tickline's worker indexes its replicated table (the same
            # statement's index clause), so neither side's apply pays for a different index.
            cur.execute(f"CREATE INDEX events_token ON events {replicated_token_index('postgresql')}")
            cur.execute(f"CREATE TABLE {DONE_TABLE} (id INT PRIMARY KEY, token BIGINT NOT NULL)")
            if applied_trigger:
                _add_applied_trigger(cur, "events", always=True)
            port = clusters.source.port
            cur.execute(
                f"CREATE SUBSCRIPTION s_{self.name} CONNECTION "
                f"'host=127.0.0.1 port={port} dbname={self.name} user=postgres' PUBLICATION p"
            )
        self.dst = dst
        _wait(self._ready, "the subscription's initial copy", 60, 0.02)
        # The launcher started the subscription's worker before its initial copy ended (maybe
        # later than CREATE SUBSCRIPTION: it waits out the interval since its last start).
        self.created = time.monotonic()

    def _ready(self) -> bool:
        states = _scalar(self.dst, "SELECT string_agg(srsubstate::text, '') FROM pg_subscription_rel")
        return bool(states) and set(states) == {"r"}

    def applied(self) -> int:
        """The last token of a write once its last transaction is applied (``_baseline_write``'s
        ``done`` row: a key lookup, as tickline's applied token is; ``max(token)`` of the replica
        would scan it under its BRIN index), else 0."""
        return int(_scalar(self.dst, f"SELECT COALESCE(max(token), 0) FROM {DONE_TABLE} WHERE id = 1"))

    def enable(self, on: bool) -> None:
        with self.dst.cursor() as cur:
            cur.execute(f"ALTER SUBSCRIPTION s_{self.name} {'ENABLE' if on else 'DISABLE'}")

    def close(self) -> None:
        with self.dst.cursor() as cur:
            cur.execute(f"DROP SUBSCRIPTION s_{self.name}")  # before the source goes: no lingering slot
        self.dst.close()


def _add_applied_trigger(cur: Any, table: str, always: bool = False) -> None:
    cur.execute(
        "CREATE OR REPLACE FUNCTION bench_applied() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_notify('bench_applied', NEW.token::text); RETURN NULL; END $$"
    )
    cur.execute(f"CREATE TRIGGER bench_applied AFTER INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION bench_applied()")
    if always:  # the apply worker fires only ALWAYS (or REPLICA) triggers
        cur.execute(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER bench_applied")


class Tickline:
    """``tickline master`` on the source database and ``tickline worker --replicate events`` on the target."""

    def __init__(self, clusters: Clusters, workdir: str, tag: str) -> None:
        from replication.streams import CACHES, EVENTS
        from storage.store import open_store

        self.src_url = clusters.source.new_database()
        self.dst_url = clusters.target.new_database()
        self.workdir, self.tag = workdir, tag
        prepared = open_store(self.src_url)
        prepared.register_stream(EVENTS)
        prepared.register_stream(CACHES)
        prepared.close()
        self.port = _free_port()
        self.master = Server(
            [*_tickline(), "master", "--database", self.src_url, "--listen", f"127.0.0.1:{self.port}"],
            os.path.join(workdir, f"{tag}-master.log"),
            "listening on",
            "tickline master",
        )
        self.worker: subprocess.Popen[bytes] | None = None
        self._worker_log: Any = None
        self._log_from = 0
        self.dst = _connect(self.dst_url)
        self.store = open_store(self.src_url)

    def start_worker(self) -> None:
        self._worker_log = open(os.path.join(self.workdir, f"{self.tag}-worker.log"), "ab")
        self._log_from = self._worker_log.tell()  # this start's lines follow (the log is shared by runs)
        self.worker = subprocess.Popen(
            [
                *_tickline(),
                "worker",
                "--name",
                "bench",
                "--master",
                f"127.0.0.1:{self.port}",
                "--database",
                self.dst_url,
                "--replicate",
                "events",
            ],
            cwd=ROOT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=self._worker_log,
            stderr=subprocess.STDOUT,
        )
        _wait(self._table_ready, "the tickline worker to start", 60, 0.02)

    def wait_worker_ready(self) -> None:
        """Until the worker logs that it is connected and caught up (``worker ready: ...``)."""
        path = os.path.join(self.workdir, f"{self.tag}-worker.log")

        def ready() -> bool:
            if self.worker is not None and self.worker.poll() is not None:
                raise BenchError(f"tickline worker exited with {self.worker.returncode} (log in {self.workdir})")
            with open(path, "rb") as f:
                f.seek(self._log_from)
                return b"worker ready:" in f.read()

        _wait(ready, "the tickline worker to be caught up", 60, 0.02)

    def _table_ready(self) -> bool:
        if self.worker is not None and self.worker.poll() is not None:
            raise BenchError(f"tickline worker exited with {self.worker.returncode} (log in {self.workdir})")
        return bool(_scalar(self.dst, "SELECT to_regclass('tickline_applied') IS NOT NULL"))

    def stop_worker(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(15)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        self.worker = None
        if self._worker_log is not None:
            self._worker_log.close()
            self._worker_log = None

    def applied(self) -> int:
        found = _scalar(self.dst, "SELECT token FROM tickline_applied WHERE stream = 'events'")
        return int(found or 0)

    def close(self) -> None:
        self.stop_worker()
        self.store.close()
        self.master.stop()
        self.dst.close()


def _tickline() -> list[str]:
    import sys

    return [sys.executable, "-m", "scripts.cli"]


# -- writers ------------------------------------------------------------------------------


def _baseline_write(url: str, rows: int, method: str, first_token: int = 1, done: bool = False) -> int:
    """Insert ``rows`` rows into ``events`` in 1000-row transactions; the last token.

    ``done``: the last transaction also inserts the last token into ``DONE_TABLE`` (one row,
    published with ``events``), so the subscriber's side can tell the whole write applied.
    """
    from psycopg2.extras import execute_values

    conn = _connect(url, autocommit=False)
    token = first_token
    with conn.cursor() as cur:
        for start in range(0, rows, TXN_ROWS):
            chunk = make_rows(start, min(TXN_ROWS, rows - start))
            if method == "copy":
                cur.copy_expert(
                    f"COPY events ({NAMES}) FROM STDIN", io.BytesIO(_copy_text(token, chunk, "base").encode())
                )
            else:
                now = int(time.time() * 1000) << 18
                execute_values(
                    cur,
                    f"INSERT INTO events ({NAMES}) VALUES %s",
                    [(token + i, "base", now + i, *row) for i, row in enumerate(chunk)],
                    page_size=TXN_ROWS,
                )
            token += len(chunk)
            if done and start + TXN_ROWS >= rows:
                cur.execute(f"INSERT INTO {DONE_TABLE} (id, token) VALUES (1, %s)", (token - 1,))
            conn.commit()
    conn.close()
    return token - 1


def _tickline_write(t: Tickline, rows: int) -> int:
    last = 0
    for start in range(0, rows, TXN_ROWS):
        last = t.store.append("events", make_rows(start, min(TXN_ROWS, rows - start)), "bench-writer")[-1]
    return last


# -- scenarios ------------------------------------------------------------------------------


def end_to_end_once(clusters: Clusters, workdir: str, rows: int, which: str) -> float:
    """One run: rows/s from the first commit to the last row applied."""
    if which == "tickline":
        t = Tickline(clusters, workdir, "e2e")
        try:
            t.start_worker()
            started = time.perf_counter()
            last = _tickline_write(t, rows)
            _wait(lambda: t.applied() >= last, f"the tickline worker to apply {rows:,} rows")
            return rows / (time.perf_counter() - started)
        finally:
            t.close()
    b = Baseline(clusters)
    try:
        started = time.perf_counter()
        last = _baseline_write(b.src_url, rows, which, done=True)
        _wait(lambda: b.applied() >= last, f"logical replication to apply {rows:,} rows")
        return rows / (time.perf_counter() - started)
    finally:
        b.close()


def catch_up_once(clusters: Clusters, workdir: str, rows: int, which: str) -> float:
    if which == "tickline":
        t = Tickline(clusters, workdir, "catchup")
        try:
            # As the subscription (created, initial copy done, then disabled): the
            # worker's first start, on a fresh database, is not timed; it is stopped
            # cleanly once connected and caught up.
            t.start_worker()
            t.wait_worker_ready()
            t.stop_worker()
            last = _tickline_write(t, rows)
            started = time.perf_counter()  # the process start is timed
            t.start_worker()
            _wait(lambda: t.applied() >= last, f"the tickline worker to catch up {rows:,} rows")
            return rows / (time.perf_counter() - started)
        finally:
            t.close()
    b = Baseline(clusters)
    try:
        b.enable(False)
        last = _baseline_write(b.src_url, rows, "copy", done=True)
        # PostgreSQL 15's launcher starts apply workers at most once per
        # wal_retrieve_retry_interval (5 s): enabled right away, the new
        # subscription's worker would wait out the rest of that since its
        # first start, which a subscription disabled for a while does not.
        interval = float(
            _scalar(b.dst, "SELECT setting::float / 1000 FROM pg_settings WHERE name = 'wal_retrieve_retry_interval'")
        )
        time.sleep(max(0.0, b.created + interval + 0.2 - time.monotonic()))
        started = time.perf_counter()
        b.enable(True)
        _wait(lambda: b.applied() >= last, f"logical replication to catch up {rows:,} rows")
        return rows / (time.perf_counter() - started)
    finally:
        b.close()


def writer_once(clusters: Clusters, rows: int, single: int, which: str) -> dict[str, float]:
    """The writer alone on the (durable) source: single-row commits and 1000-row transactions.

    ``which`` is ``tickline`` (``append``) or ``plain`` (INSERT + COMMIT per row;
    COPY per 1000 rows, the method a tickline append of 1000 rows uses).
    """
    url = clusters.source.new_database()
    if which == "tickline":
        from replication.streams import EVENTS
        from storage.store import open_store

        store = open_store(url)
        store.register_stream(EVENTS)
        store.append("events", make_rows(0, 1), "bench-writer")  # registers the writer
        started = time.perf_counter()
        for n in range(single):
            store.append("events", make_rows(n, 1), "bench-writer")
        one = single / (time.perf_counter() - started)
        started = time.perf_counter()
        for start in range(0, rows, TXN_ROWS):
            store.append("events", make_rows(start, min(TXN_ROWS, rows - start)), "bench-writer")
        bulk = rows / (time.perf_counter() - started)
        store.close()
        return {"single": one, "bulk": bulk}
    conn = _connect(url, autocommit=False)
    with conn.cursor() as cur:
        cur.execute(f"CREATE TABLE events ({BASE_COLUMNS})")
        cur.execute("CREATE INDEX events_token ON events (token)")
        conn.commit()
        now = int(time.time() * 1000) << 18
        started = time.perf_counter()
        for n in range(single):
            row = make_rows(n, 1)[0]
            cur.execute(
                f"INSERT INTO events ({NAMES}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", (n + 1, "base", now + n, *row)
            )
            conn.commit()
        one = single / (time.perf_counter() - started)
    conn.close()
    started = time.perf_counter()
    _baseline_write(url, rows, "copy", single + 1)
    bulk = rows / (time.perf_counter() - started)
    return {"single": one, "bulk": bulk}


@contextmanager
def _rdata_listener(port: int, stream: str = "events") -> Iterator[dict[int, float]]:
    """token -> when an ``RDATA`` line of it reached a bare TCP client of the master (read by a thread).

    The client speaks the seed protocol (``NAME``, ``REPLICATE``): it is live on
    every stream from the master's current positions and records the first
    arrival of each token, so commit -> RDATA is the master's part alone.
    """
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"NAME bench-rdata\nREPLICATE\n")
    seen: dict[int, float] = {}
    positioned = threading.Event()
    stop = threading.Event()
    prefix = f"RDATA {stream} ".encode()
    ready = f"POSITION {stream} ".encode()

    def run() -> None:
        buffer = b""
        pinged = time.monotonic()
        while not stop.is_set():
            if time.monotonic() - pinged >= 1.0:
                # A command every second of our own: the master sends rows rather than PING
                # while it has rows to send, and closes a peer silent for ping_timeout.
                sock.sendall(b"PING 0\n")
                pinged = time.monotonic()
            if not select.select([sock], [], [], 0.05)[0]:
                continue
            data = sock.recv(1 << 16)
            if not data:
                return
            now = time.perf_counter()
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(prefix):
                    token = line[len(prefix) :].split(b" ", 2)[1]
                    if token != b"batch":
                        seen.setdefault(int(token), now)
                elif line.startswith(ready):
                    positioned.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        if not positioned.wait(30):
            raise BenchError("the bare client got no POSITION from the master")
        yield seen
    finally:
        stop.set()
        thread.join(5)
        sock.close()


@contextmanager
def _applied_listener(url: str) -> Iterator[dict[int, float]]:
    """token -> when the target said it was applied (a trigger's NOTIFY, read by a thread)."""
    conn = _connect(url)
    with conn.cursor() as cur:
        cur.execute("LISTEN bench_applied")
    seen: dict[int, float] = {}
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            if select.select([conn], [], [], 0.05)[0]:
                conn.poll()
                now = time.perf_counter()
                for n in conn.notifies:
                    seen[int(n.payload)] = now
                conn.notifies.clear()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)
        conn.close()


def listen_main() -> None:
    """The listeners' process (``_listeners``): ``argv``: target URL, master port (0: none).

    Prints ``ready`` once listening, reads the last token from stdin, waits
    until it was seen, prints ``{"applied": {token: time}, "rdata": {...}}``.
    """
    import json
    import sys
    from contextlib import nullcontext

    url, port = sys.argv[1], int(sys.argv[2])
    rdata: Any = _rdata_listener(port) if port else nullcontext({})
    with _applied_listener(url) as seen, rdata as sent:
        print("ready", flush=True)
        last = int(sys.stdin.readline())
        _wait(lambda: last in seen, "the last row to be applied", 60)
        if port:
            _wait(lambda: last in sent, "the last row's RDATA at the bare client", 60)
        print(json.dumps({"applied": seen, "rdata": sent}), flush=True)


@contextmanager
def _listeners(url: str, port: int | None) -> Iterator[Callable[[int], tuple[dict[int, float], dict[int, float]]]]:
    """The applied listener (and, with ``port``, the bare RDATA client) in a process of their own.

    Apart from the committing process, so their reads never wait for its
    GIL or its garbage collector, the same for tickline and the baseline
    (``time.perf_counter`` is the system's monotonic clock: one clock for
    both processes). Yields ``collect(last token)`` -> (applied, RDATA) times.
    """
    import json
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", "from scripts.bench_pg import listen_main; listen_main()", url, str(port or 0)],
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            raise BenchError("the listeners' process did not start")

        def collect(last: int) -> tuple[dict[int, float], dict[int, float]]:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{last}\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise BenchError("the listeners' process ended without its figures (the last row was not seen)")
            data = json.loads(line)
            return (
                {int(k): v for k, v in data["applied"].items()},
                {int(k): v for k, v in data["rdata"].items()},
            )

        yield collect
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (from ``/proc/<pid>/stat``'s parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _scheduled(clusters: Clusters) -> dict[int, tuple[int, int]]:
    """Per process of this run (this process and its children, both clusters' postmasters and theirs):
    nanoseconds on a CPU and waiting on a run queue, summed over its threads (``/proc/.../schedstat``)."""
    roots = {os.getpid()}
    for server in (clusters.source, clusters.target):
        try:
            roots.add(int((server.datadir / "data" / "postmaster.pid").read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    times: dict[int, tuple[int, int]] = {}
    for pid in _descendants(roots):
        cpu = waited = 0
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    fields = f.read().split()
                cpu += int(fields[0])
                waited += int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        times[pid] = (cpu, waited)
    return times


def _scheduled_per_commit(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], commits: int
) -> dict[str, float]:
    """CPU and run-queue wait (ms per commit) of the processes present before and after the paced commits."""
    cpu = sum(after[p][0] - before[p][0] for p in after if p in before)
    waited = sum(after[p][1] - before[p][1] for p in after if p in before)
    return {"cpu_ms": cpu / 1e6 / max(commits, 1), "runq_ms": waited / 1e6 / max(commits, 1)}


def _warm_up(commit: Callable[[int], int], rate: int) -> int:
    """Paced commits for ``WARM_UP_SECONDS``, not measured; the next row number.

    Both sides run it before their measured commits, so that what a side does
    once when it starts falls outside the measured window: tickline's writer
    opens its reporter's connection on its first report (``report_interval``,
    0.2 s after its first append), a backend start of some 3-4 ms of CPU that
    otherwise delayed 10-20 of the measured commits (a scheduler trace,
    nineteenth session).
    """
    committed, _ = _paced_run(commit, rate, WARM_UP_SECONDS)
    return len(committed)


def _paced(commit: Callable[[int], int], rate: int, seconds: float, first: int = 0) -> tuple[dict[int, float], float]:
    """Commit single rows ``first``, ``first + 1``, ... at ``rate``/s for ``seconds``: token -> commit
    time, and the rate reached.

    The collector is off meanwhile (what start-up built frozen first): a
    full collection of the committing process would stop it for milliseconds,
    the same for tickline and the baseline.
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        return _paced_run(commit, rate, seconds, first)
    finally:
        gc.enable()
        gc.unfreeze()


def _paced_run(
    commit: Callable[[int], int], rate: int, seconds: float, first: int = 0
) -> tuple[dict[int, float], float]:
    committed: dict[int, float] = {}
    interval = 1.0 / rate
    started = time.perf_counter()
    next_at = started
    n = first
    end = started + seconds
    while next_at < end:
        token = commit(n)
        committed[token] = time.perf_counter()
        n += 1
        next_at += interval
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    return committed, (n - first) / (time.perf_counter() - started)


def _roles(clusters: Clusters) -> dict[int, str]:
    """Thread id -> role of every task on a latency run's path (``scripts.sched_waits`` names them).

    The servers' backends by ``pg_stat_activity`` (the writer's, the master's
    ``LISTEN``, the apply, the walsender, ...), the Python processes below this
    one by their command line, each thread of theirs apart (``/<n>`` from the
    second on), and this process (the committer) itself.
    """
    roles: dict[int, str] = {}
    for side, server in (("src", clusters.source), ("dst", clusters.target)):
        conn = _connect(server.url())
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pid, backend_type, application_name, query FROM pg_stat_activity")
                for pid, kind, app, query in cur.fetchall():
                    role = _backend_role(kind or "", app or "", query or "")
                    if role:
                        roles[pid] = f"{side}:{role}"
        finally:
            conn.close()
    own = os.getpid()
    for pid in sorted(_descendants({own})):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
        role = _process_role(command) if pid != own else "committer"
        if role:
            for i, tid in enumerate(threads):
                roles[tid] = role if i == 0 else f"{role}/{i}"
    return roles


# Server processes by pg_stat_activity's backend_type; client backends by what they run.
_SERVER_ROLES = {"walsender": "walsender", "logical replication worker": "apply-worker", "walwriter": "walwriter"}
_CLIENT_ROLES = (  # (application_name, query prefix) -> role; "" matches any
    ("tickline-apply", "", "apply"),
    ("tickline-wake", "", "wake"),
    ("", "LISTEN tickline", "listen"),
    ("", "LISTEN bench_applied", "listener"),
    ("", "EXECUTE tickline_", "writer"),
    ("", "INSERT INTO events", "writer"),
)


def _backend_role(kind: str, app: str, query: str) -> str:
    if kind != "client backend":
        return _SERVER_ROLES.get(kind, "")
    for name, prefix, role in _CLIENT_ROLES:
        if (not name or app == name) and query.startswith(prefix):
            return role
    return ""


def _process_role(command: str) -> str:
    if "listen_main" in command:
        return "listeners"
    if "scripts.cli" in command:
        for role in ("master", "worker"):
            if f" {role} " in command:
                return role
    return ""


def latency_once(
    clusters: Clusters, workdir: str, rate: int, seconds: float, which: str, trace: dict[str, Any] | None = None
) -> dict[str, float]:
    """One paced run: ``tickline``, ``rdata`` (tickline with the bare RDATA client too) or ``baseline``.

    The bare client is in ``rdata`` runs only: it costs the master a second
    send and the listeners' process a second wake-up per commit, on the
    worker's path, which the baseline's runs do not pay. ``trace``, if
    given, receives each commit's time (``committed``: token -> time), when
    it was seen applied (``applied``) and the path's tasks (``roles``:
    thread id -> role, read just before the paced commits), on the clock of
    ``perf record -k CLOCK_MONOTONIC`` (``scripts.sched_waits``).
    """
    if which in ("tickline", "rdata"):
        t = Tickline(clusters, workdir, "latency")
        try:
            t.start_worker()
            with t.dst.cursor() as cur:
                _wait(lambda: bool(_scalar(t.dst, "SELECT to_regclass('replicated_events') IS NOT NULL")), "table")
                _add_applied_trigger(cur, "replicated_events")
            t.store.append("events", make_rows(0, 1), "bench-latency")  # warm up
            with _listeners(t.dst_url, t.port if which == "rdata" else None) as collect:

                def commit(n: int) -> int:
                    return t.store.append("events", make_rows(n, 1), "bench-latency")[0]

                first = _warm_up(commit, rate)
                if trace is not None:
                    trace["roles"] = _roles(clusters)
                before = _scheduled(clusters)
                committed, reached = _paced(commit, rate, seconds, first)
                after = _scheduled(clusters)
                seen, sent = collect(max(committed))
            if trace is not None:
                trace["committed"], trace["applied"] = committed, seen
            result = _delays(committed, seen, reached)
            result.update(_scheduled_per_commit(before, after, len(committed)))
            if which == "rdata":
                rdata = _delays(committed, sent, reached)
                result["rdata_p50"], result["rdata_p99"] = rdata["p50"], rdata["p99"]
            return result
        finally:
            t.close()
    b = Baseline(clusters, applied_trigger=True)
    conn = _connect(b.src_url, autocommit=False)
    try:
        with _listeners(b.dst_url, None) as collect, conn.cursor() as cur:
            now = int(time.time() * 1000) << 18

            def commit(n: int) -> int:
                row = make_rows(n, 1)[0]
                cur.execute(
                    f"INSERT INTO events ({NAMES}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    (n + 1, "base", now + n, *row),
                )
                conn.commit()
                return n + 1

            first = _warm_up(commit, rate)
            if trace is not None:
                # The baseline writer's backend, named by its pid (no application_name tells it apart).
                trace["roles"] = {**_roles(clusters), conn.get_backend_pid(): "src:writer"}
            before = _scheduled(clusters)
            committed, reached = _paced(commit, rate, seconds, first)
            after = _scheduled(clusters)
            seen, _ = collect(max(committed))
        if trace is not None:
            trace["committed"], trace["applied"] = committed, seen
        result = _delays(committed, seen, reached)
        result.update(_scheduled_per_commit(before, after, len(committed)))
        return result
    finally:
        conn.close()
        b.close()


def _delays(committed: dict[int, float], seen: dict[int, float], reached: float) -> dict[str, float]:
    delays = sorted((seen[t] - c) * 1000 for t, c in committed.items() if t in seen)
    if not delays:
        raise BenchError("no row was seen applied")
    return {
        "p50": statistics.median(delays),
        "p99": delays[min(len(delays) - 1, int(0.99 * len(delays)))],
        "reached": reached,
        "samples": float(len(delays)),
    }


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run(
    chosen: list[str],
    rows: int,
    workdir: str,
    repeat: int = 3,
    rate: int = 1000,
    seconds: float = 10.0,
    catch_up_rows: int | None = None,
    verbose: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run the chosen scenarios, interleaved, and print their lines; returns the figures."""
    results: dict[str, dict[str, Any]] = {}

    def log(text: str) -> None:
        if verbose:
            print(f"  {text}", flush=True)

    with Clusters() as clusters:
        if "writer" in chosen:
            single = max(200, min(2000, rows // 10))
            wr: dict[str, list[dict[str, float]]] = {"tickline": [], "plain": []}
            for i, which in clusters.runs(repeat, wr):
                value = writer_once(clusters, rows, single, which)
                wr[which].append(value)
                log(f"writer run {i + 1} {which}: {value}")
            w = {k: {m: _median([v[m] for v in runs_]) for m in ("single", "bulk")} for k, runs_ in wr.items()}
            results["writer"] = w
            t, p = w["tickline"], w["plain"]
            print(
                f"writer: tickline {_fmt(t['single'])} commits/s, baseline {_fmt(p['single'])} commits/s, "
                f"ratio {t['single'] / p['single']:.2f}",
                flush=True,
            )
            print(
                f"  single-row appends against INSERT + COMMIT of the same row ({single:,} each, durable); "
                f"bulk ({rows:,} rows, {TXN_ROWS}-row transactions): tickline {_fmt(t['bulk'])} rows/s, "
                f"the same rows by COPY without tickline {_fmt(p['bulk'])} rows/s, ratio {t['bulk'] / p['bulk']:.2f}",
                flush=True,
            )
        if "end-to-end" in chosen:
            runs: dict[str, list[float]] = {"tickline": [], "copy": [], "execute_values": []}
            for i, which in clusters.runs(repeat, runs):
                got = end_to_end_once(clusters, workdir, rows, which)
                runs[which].append(got)
                log(f"end-to-end run {i + 1} {which}: {_fmt(got)} rows/s")
            r = {k: _median(v) for k, v in runs.items()}
            results["end-to-end"] = r
            print(
                f"end-to-end: tickline {_fmt(r['tickline'])} rows/s, baseline {_fmt(r['copy'])} rows/s, "
                f"ratio {r['tickline'] / r['copy']:.2f}",
                flush=True,
            )
            print(
                f"  {rows:,} rows in {TXN_ROWS}-row transactions, durable, median of {repeat} interleaved runs; "
                f"baseline: PostgreSQL logical replication written by COPY (tickline's append of {TXN_ROWS} rows "
                f"uses COPY); written by execute_values it reached {_fmt(r['execute_values'])} rows/s "
                f"(ratio {r['tickline'] / r['execute_values']:.2f})",
                flush=True,
            )
        if "latency" in chosen:
            lat: dict[str, list[dict[str, float]]] = {"tickline": [], "baseline": [], "rdata": []}
            for i, which in clusters.runs(repeat, lat):
                value = latency_once(clusters, workdir, rate, seconds, which)
                lat[which].append(value)
                log(f"latency run {i + 1} {which}: {value}")
            agg = {w: {k: _median([v[k] for v in runs_]) for k in runs_[0]} for w, runs_ in lat.items()}
            results["latency"] = agg
            t, b, r = agg["tickline"], agg["baseline"], agg.pop("rdata")
            t["rdata_p50"], t["rdata_p99"] = r["rdata_p50"], r["rdata_p99"]
            print(
                f"latency: tickline {t['p99']:.2f} ms, baseline {b['p99']:.2f} ms, ratio {b['p99'] / t['p99']:.2f}",
                flush=True,
            )
            for name, a in (("tickline", t), ("baseline", b)):
                held = "held" if a["reached"] >= 0.95 * rate else "NOT held"
                print(
                    f"  {name}: commit -> applied p50 {a['p50']:.2f} ms, p99 {a['p99']:.2f} ms; "
                    f"{rate:,} single-row commits/s requested, {_fmt(a['reached'])}/s reached ({held})",
                    flush=True,
                )
            print(
                f"  CPU per commit (the run's processes: benchmark, master, worker, listeners, both clusters): "
                f"tickline {t['cpu_ms']:.2f} ms, baseline {b['cpu_ms']:.2f} ms; their wait for a CPU per commit "
                f"(run queue): tickline {t['runq_ms']:.2f} ms, baseline {b['runq_ms']:.2f} ms",
                flush=True,
            )
            print(
                f"  tickline master alone: commit -> RDATA at a bare TCP client p50 {t['rdata_p50']:.2f} ms, "
                f"p99 {t['rdata_p99']:.2f} ms (runs of their own, with that client; commit -> applied in them "
                f"p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms)",
                flush=True,
            )
        if "catch-up" in chosen:
            n = catch_up_rows or rows
            cu: dict[str, list[float]] = {"tickline": [], "baseline": []}
            for i, which in clusters.runs(repeat, cu):
                got = catch_up_once(clusters, workdir, n, which)
                cu[which].append(got)
                log(f"catch-up run {i + 1} {which}: {_fmt(got)} rows/s")
            c = {k: _median(v) for k, v in cu.items()}
            results["catch-up"] = c
            print(
                f"catch-up: tickline {_fmt(c['tickline'])} rows/s, baseline {_fmt(c['baseline'])} rows/s, "
                f"ratio {c['tickline'] / c['baseline']:.2f}",
                flush=True,
            )
            print(
                f"  {n:,} rows written while the consumer was away; baseline: logical replication, "
                "subscription disabled then enabled",
                flush=True,
            )
    return results


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    """A PNG: throughput ratios (left) and commit -> applied / RDATA percentiles (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    # Each ratio with issue 11's target for it: green where met, red where not.
    names, ratios, targets = [], [], []
    if "writer" in results:
        w = results["writer"]
        names += ["writer\nsingle row", "writer\nbulk (COPY)"]
        ratios += [w["tickline"]["single"] / w["plain"]["single"], w["tickline"]["bulk"] / w["plain"]["bulk"]]
        targets += [0.8, 1.0]
    if "end-to-end" in results:
        r = results["end-to-end"]
        names += ["end-to-end\nvs COPY", "end-to-end\nvs execute_values"]
        ratios += [r["tickline"] / r["copy"], r["tickline"] / r["execute_values"]]
        targets += [1.0, 1.0]
    if "catch-up" in results:
        c = results["catch-up"]
        names.append("catch-up")
        ratios.append(c["tickline"] / c["baseline"])
        targets.append(1.0)
    if "latency" in results:
        t, b = results["latency"]["tickline"], results["latency"]["baseline"]
        names.append("latency\n(p99 ratio)")
        ratios.append(b["p99"] / t["p99"])
        targets.append(0.5)
        width = 0.27
        xs = range(2)
        right.bar([x - width for x in xs], [t["p50"], t["p99"]], width, label="tickline, commit -> applied")
        if "rdata_p50" in t:
            right.bar(xs, [t["rdata_p50"], t["rdata_p99"]], width, label="tickline, commit -> RDATA (master)")
        right.bar([x + width for x in xs], [b["p50"], b["p99"]], width, label="logical replication")
        right.set_xticks(list(xs), ["p50", "p99"])
        right.set_ylabel("commit -> applied (ms)")
        right.set_title("single-row commits, paced")
        right.legend()
    left.bar(names, ratios, color=["tab:green" if r >= t else "tab:red" for r, t in zip(ratios, targets, strict=True)])
    left.scatter(names, targets, marker="_", s=900, color="black", label="target", zorder=3)
    left.legend(loc="upper left")
    left.tick_params(axis="x", labelsize=8)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("tickline / logical replication (>1: tickline better)")
    left.set_title("ratios, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
