"""``tickline bench timeline``: leases per second end to end, beside a SKIP LOCKED job loop.

On one throwaway PostgreSQL server (durable: ``fsync=on``,
``synchronous_commit=on``):

- **tickline**: N messages due now in topic ``jobs``; a real master
  (``tickline master``); 4 consumer processes, each ``TIMELINE jobs cK 100
  60000``, answering every ``LEASE`` with ``DELETE`` and counting the ``ACK``s.
  Rate: N / (first LEASE .. last ACK DELETE).
- **baseline**: the River / pg-boss method: N jobs due now in a plain table;
  4 processes each loop: one transaction fetches 10 due jobs (``FOR UPDATE SKIP
  LOCKED``) and marks them running, the next deletes them (completes).
- **lateness**: M messages due at 1,000 per second (one per ms) while the 4
  consumers are connected; lateness = LEASE received - due time; p50 / p99.

The rounds (``--repeat``) interleave: baseline, tickline, lateness, again;
the medians are reported (other work on the machine moves single runs a
lot), with every run and the load average. Printed as::

    timeline: tickline 12,400 leases/s, baseline 11,100 jobs/s, ratio 1.12 (median of 5 interleaved runs, ...)
      runs: tickline 12,442 11,900 ...; baseline 11,090 12,104 ...; load average 1.2 .. 2.4
      target (above the baseline and at least 12,000 leases/s): met
      lateness at 1,000 msgs/s: p50 6.7 ms, p99 18.0 ms, max 26.3 ms (15,000 messages): target p99 < 20 ms met
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONSUMERS = 4
CREDIT = 100
BASELINE_BATCH = 10
TARGET_RATE = 12_000  # leases/s (issue 13), and above the baseline
TARGET_P99_MS = 20.0  # lateness at 1,000 msgs/s due
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def _self(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- roles (separate processes) ----------------------------------------------------------


def role_consumer(port: int, consumer: str, idle: float, lateness: bool) -> int:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(f"NAME {consumer}\nTIMELINE jobs {consumer} {CREDIT} 60000\n".encode())
    sock.settimeout(0.2)
    buffer = b""
    acks = 0
    first_lease = last_ack = None
    late: list[float] = []
    last_activity = time.time()
    while time.time() - last_activity < idle or (first_lease is None and time.time() - last_activity < 60):
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            continue
        if not data:
            break
        now = time.time()
        buffer += data
        lines = buffer.split(b"\n")
        buffer = lines.pop()
        out = []
        for line in lines:
            if line.startswith(b"LEASE "):
                _, _, mid, version, _until, body = line.split(b" ", 5)
                if first_lease is None:
                    first_lease = now
                if lateness:
                    late.append(now * 1000 - json.loads(body)["due"])
                out.append(b"DELETE jobs %s %s\n" % (mid, version))
            elif line.startswith(b"ACK DELETE"):
                acks += 1
                last_ack = now
        if out:
            sock.sendall(b"".join(out))
        if out or any(line.startswith(b"ACK ") for line in lines):
            last_activity = now  # PINGs do not count
    print(json.dumps({"acks": acks, "first": first_lease, "last": last_ack, "late": late}))
    return 0


def role_skiplocked(url: str, batch: int) -> int:
    import psycopg2

    conn = psycopg2.connect(url)
    done = 0
    start = time.time()
    with conn.cursor() as cur:
        while True:
            cur.execute(
                "UPDATE bench_jobs SET state = 'running', attempted_at = now() WHERE id IN ("
                "SELECT id FROM bench_jobs WHERE state = 'available' AND run_at <= now() "
                "ORDER BY run_at, id LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id, args",
                (batch,),
            )
            jobs = cur.fetchall()
            conn.commit()
            if not jobs:
                break
            cur.execute("DELETE FROM bench_jobs WHERE id = ANY(%s)", ([j[0] for j in jobs],))
            conn.commit()
            done += len(jobs)
    print(json.dumps({"done": done, "start": start, "end": time.time()}))
    return 0


# -- the harness ---------------------------------------------------------------------------


def _durable_pg() -> Any:
    from scripts.pg_local import PostgresServer

    pg = PostgresServer()
    pg.start()
    pg._options = (
        pg._options.replace("fsync=off", "fsync=on")
        .replace("synchronous_commit=off", "synchronous_commit=on")
        .replace("full_page_writes=off", "full_page_writes=on")
    )
    pg.restart()
    return pg


def _preload(url: str, count: int, due_of: Any) -> None:
    import psycopg2
    import psycopg2.extras

    from storage.timeline_store import open_timeline_store

    open_timeline_store(url).close()  # the table
    now = int(time.time() * 1000)
    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute("TRUNCATE tickline_timeline")  # a clean table each run, as the baseline's
        rows = [
            ("jobs", f"m{i:08}", due_of(i, now), json.dumps({"n": i, "due": due_of(i, now)}), "bench", 0, 1, now)
            for i in range(count)
        ]
        psycopg2.extras.execute_values(
            cur,
            "INSERT INTO tickline_timeline (topic, id, ts, body, producer_group, bucket, version, created_ms) VALUES %s",
            rows,
            page_size=5000,
        )
    conn.commit()
    conn.close()


def _run_consumers(port: int, lateness: bool, idle: float) -> list[dict]:
    procs = [
        subprocess.Popen(
            _self("_consumer", str(port), f"c{k}", str(idle), "1" if lateness else "0"),
            stdout=subprocess.PIPE,
            env=_env(),
        )
        for k in range(CONSUMERS)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def _tickline_rate(url: str, count: int, workdir: str) -> tuple[float, int]:
    _preload(url, count, lambda i, now: now - 1000)
    port = _free_port()
    log = open(os.path.join(workdir, "timeline-master.log"), "wb")
    master = subprocess.Popen(
        [sys.executable, "-m", "scripts.cli", "master", "--listen", f"127.0.0.1:{port}", "--database", url],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=_env(),
    )
    try:
        _wait_port(port)
        results = _run_consumers(port, False, 2.0)
    finally:
        master.terminate()
        master.wait(30)
        log.close()
    acks = sum(r["acks"] for r in results)
    first = min(r["first"] for r in results if r["first"])
    last = max(r["last"] for r in results if r["last"])
    return acks / (last - first), acks


def _lateness(url: str, count: int, workdir: str) -> list[float]:
    start_in = 3000
    _preload(url, 0, lambda i, now: now)
    port = _free_port()
    log = open(os.path.join(workdir, "timeline-master-late.log"), "wb")
    master = subprocess.Popen(
        [sys.executable, "-m", "scripts.cli", "master", "--listen", f"127.0.0.1:{port}", "--database", url],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=_env(),
    )
    try:
        _wait_port(port)
        # Schedule over the wire while the consumers are connected: one message per ms.
        sched = socket.create_connection(("127.0.0.1", port))
        t0 = int(time.time() * 1000) + start_in
        lines = b"".join(b'SCHEDULE jobs bench m%d %d {"due":%d}\n' % (i, t0 + i, t0 + i) for i in range(count))
        sched.sendall(lines)
        results = _run_consumers(port, True, 2.0)
        sched.close()
    finally:
        master.terminate()
        master.wait(30)
        log.close()
    return sorted(x for r in results for x in r["late"])


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the master did not start") from None
            time.sleep(0.05)


def _baseline_rate(url: str, count: int) -> float:
    import psycopg2

    conn = psycopg2.connect(url)
    with conn.cursor() as cur:
        cur.execute(
            "CREATE TABLE IF NOT EXISTS bench_jobs (id BIGSERIAL PRIMARY KEY, state TEXT NOT NULL DEFAULT 'available', "
            "run_at TIMESTAMPTZ NOT NULL DEFAULT now(), attempted_at TIMESTAMPTZ, args TEXT NOT NULL)"
        )
        cur.execute("CREATE INDEX IF NOT EXISTS bench_jobs_due ON bench_jobs (state, run_at, id)")
        cur.execute("TRUNCATE bench_jobs")
        cur.execute(
            "INSERT INTO bench_jobs (args, run_at) SELECT json_build_object('n', g)::text, now() - interval '1 s' "
            "FROM generate_series(1, %s) g",
            (count,),
        )
    conn.commit()
    conn.close()
    procs = [
        subprocess.Popen(_self("_skiplocked", url, str(BASELINE_BATCH)), stdout=subprocess.PIPE, env=_env())
        for _ in range(CONSUMERS)
    ]
    results = [json.loads(p.communicate(timeout=600)[0].decode().strip().splitlines()[-1]) for p in procs]
    done = sum(r["done"] for r in results)
    return done / (max(r["end"] for r in results) - min(r["start"] for r in results))


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_timeline_bench(rows: int | None, workdir: str, late_count: int = 3000, rounds: int = 3) -> dict[str, Any]:
    """``rounds`` interleaved rounds of baseline, tickline and lateness on one durable server."""
    count = rows or 20_000
    pg = _durable_pg()
    tickline: list[float] = []
    baseline: list[float] = []
    loads: list[float] = []
    late: list[float] = []
    acks = 0
    try:
        url = pg.new_database()
        for _ in range(max(1, rounds)):
            loads.append(_loadavg())
            baseline.append(_baseline_rate(url, count))
            rate, acks = _tickline_rate(url, count, workdir)
            tickline.append(rate)
            late.extend(_lateness(url, late_count, workdir))
            loads.append(_loadavg())
    finally:
        pg.stop()
    return {
        "tickline": statistics.median(tickline),
        "baseline": statistics.median(baseline),
        "tickline_runs": tickline,
        "baseline_runs": baseline,
        "loads": loads,
        "acks": acks,
        "count": count,
        "late": sorted(late),
    }


def print_results(r: dict[str, Any]) -> None:
    late = r["late"]
    runs = len(r.get("tickline_runs", [r["tickline"]]))
    print(
        f"timeline: tickline {r['tickline']:,.0f} leases/s, baseline {r['baseline']:,.0f} jobs/s, "
        f"ratio {r['tickline'] / r['baseline']:.2f} (median of {runs} interleaved runs; {r['acks']:,} of "
        f"{r['count']:,} messages, PostgreSQL durable, {CONSUMERS} consumers)",
        flush=True,
    )
    if "tickline_runs" in r:
        loads = r["loads"]
        print(
            f"  runs: tickline {' '.join(f'{x:,.0f}' for x in r['tickline_runs'])}; "
            f"baseline {' '.join(f'{x:,.0f}' for x in r['baseline_runs'])}; "
            f"load average {min(loads):.1f} .. {max(loads):.1f}",
            flush=True,
        )
    met = r["tickline"] > r["baseline"] and r["tickline"] >= TARGET_RATE
    print(
        f"  target (above the baseline and at least {TARGET_RATE:,} leases/s): {'met' if met else 'NOT met'}",
        flush=True,
    )
    if late:
        p50 = statistics.median(late)
        p99 = late[min(len(late) - 1, int(len(late) * 0.99))]
        print(
            f"  lateness at 1,000 msgs/s: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {late[-1]:.1f} ms "
            f"({len(late):,} messages): target p99 < {TARGET_P99_MS:g} ms {'met' if p99 < TARGET_P99_MS else 'NOT met'}",
            flush=True,
        )


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_consumer":
        return role_consumer(int(argv[1]), argv[2], float(argv[3]), argv[4] == "1")
    if argv and argv[0] == "_skiplocked":
        return role_skiplocked(argv[1], int(argv[2]))
    import shutil
    import tempfile

    rows = int(argv[0]) if argv else None
    rounds = int(argv[1]) if len(argv) > 1 else 3
    workdir = tempfile.mkdtemp(prefix="tickline-bench-")
    try:
        print_results(run_timeline_bench(rows, workdir, rounds=rounds))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
