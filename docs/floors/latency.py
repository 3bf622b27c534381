"""The latency floor: tickline's four-process path with do-nothing relays, beside tickline and logical replication.

    flock /work/bench.lock .venv/bin/python docs/floors/latency.py 3

Per round, on one pair of the benchmark's clusters, 1,000 single-row commits/s
for 5 s after the benchmark's warm-up: ``floor`` (relays in a select loop),
``floor-twisted`` (the same relays on Twisted's epoll reactor),
``floor-twisted-blocking`` (its worker applying by a blocking statement in
``dataReceived``: one reactor wake-up per commit), ``tickline``
and ``baseline`` (``bench_pg.latency_once``); with ``seed-worker`` as the
second argument also ``seed-worker``: tickline's master with a minimal
seed-protocol worker (``latency_seed_worker.py``) instead of tickline's. The floor's writer commits
``INSERT ... RETURNING`` and ``pg_notify`` (the row as the payload) in one
statement; its applied rows fire the benchmark's ``bench_applied`` trigger,
as tickline's and the subscription's do. Prints p50 / p99 commit -> applied
and the CPU per commit of the Python processes of the path. An experiment of
the twentieth session (docs/benchmarks.md), kept to be run again; it uses
``scripts.bench_pg``'s helpers as they were then.
"""

import os
import subprocess
import sys
import tempfile
import time

from floors_common import HERE, b, floor_databases, start_relays, stop, target_tables


def python_cpu(before, after, commits):
    """µs of CPU per commit of each Python process of the path (not this one)."""
    out = []
    for pid in after:
        if pid in before and pid != os.getpid():
            try:
                cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            except OSError:
                continue
            if "python" in cmd and "listen_main" not in cmd:
                words = cmd.split()
                script = [w for w in words if w.endswith(".py")]
                name = os.path.basename(script[0])[:-3] if script else words[words.index("scripts.cli") + 1]
                out.append(f"{name} {(after[pid][0] - before[pid][0]) / 1e3 / commits:.0f}")
    return ", ".join(sorted(out))


def paced_delays(clusters, dst_url, commit, rate, seconds):
    """The benchmark's warm-up, then paced single-row commits: commit -> applied p50 / p99 and the
    CPU per commit of the path's Python processes (the applied rows seen by the benchmark's listener)."""
    with b._listeners(dst_url, None) as collect:
        first = b._warm_up(commit, rate)
        before = b._scheduled(clusters)
        committed, reached = b._paced(commit, rate, seconds, first)
        after = b._scheduled(clusters)
        seen, _ = collect(max(committed))
    result = b._delays(committed, seen, reached)
    result["cpu"] = python_cpu(before, after, len(committed))
    return result


def floor_once(clusters, twisted, rate=1000, seconds=5.0, worker_suffix=None):
    src, dst, s, d = floor_databases(clusters, applied_trigger=True)
    suffix = "_twisted" if twisted else ""
    worker = worker_suffix if worker_suffix is not None else suffix
    relays = start_relays({"worker": f"latency_worker{worker}.py", "master": f"latency_master{suffix}.py"}, src, dst)
    writer = b._connect(src)
    cur = writer.cursor()
    now = int(time.time() * 1000) << 18
    sql = (
        f"WITH i AS (INSERT INTO events ({b.NAMES}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING *) "
        "SELECT pg_notify('ch', concat_ws(E'\\t', token, instance_name, ts, event_id, room_id, type, "
        "coalesce(state_key, '\\N'), coalesce(redacts, '\\N'))) FROM i"
    )
    try:

        def commit(n):
            cur.execute(sql, (n + 1, "floor", now + n, *b.make_rows(n, 1)[0]))
            return n + 1

        return paced_delays(clusters, dst, commit, rate, seconds)
    finally:
        stop(relays)
        writer.close()
        s.close()
        d.close()


def seed_worker_once(clusters, workdir, rate=1000, seconds=5.0):
    t = b.Tickline(clusters, workdir, "seed-worker")
    with t.dst.cursor() as cur:
        target_tables(cur, applied_trigger=True)
    worker = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "latency_seed_worker.py"), t.dst_url, str(t.port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "ready"
        t.store.append("events", b.make_rows(0, 1), "bench-latency")

        def commit(n):
            return t.store.append("events", b.make_rows(n, 1), "bench-latency")[0]

        return paced_delays(clusters, t.dst_url, commit, rate, seconds)
    finally:
        worker.kill()
        worker.wait()
        t.close()


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    paced = b._paced
    with tempfile.TemporaryDirectory() as workdir, b.Clusters() as clusters:
        cpu = {}

        def measured(commit, rate, seconds, first=0):
            before = b._scheduled(clusters)
            out = paced(commit, rate, seconds, first)
            cpu["text"] = python_cpu(before, b._scheduled(clusters), len(out[0]))
            return out

        for _ in range(rounds):
            for which in ("floor", "floor-twisted", "floor-twisted-blocking", "seed-worker", "tickline", "baseline"):
                if which == "seed-worker" and sys.argv[2:3] != ["seed-worker"]:
                    continue
                if which == "floor-twisted-blocking":
                    r = floor_once(clusters, True, worker_suffix="_twisted_blocking")
                elif which.startswith("floor"):
                    r = floor_once(clusters, which == "floor-twisted")
                elif which == "seed-worker":
                    r = seed_worker_once(clusters, workdir)
                else:
                    b._paced = measured
                    try:
                        r = b.latency_once(clusters, workdir, 1000, 5, which)
                    finally:
                        b._paced = paced
                    r["cpu"] = cpu.pop("text", "")
                print(
                    f"{which:14s} p50 {r['p50']:.3f} ms, p99 {r['p99']:.3f} ms, {r['reached']:.0f}/s; CPU µs/commit: {r['cpu']}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
