"""What both floor drivers share: the benchmark's helpers, the floors' tables and their relay processes."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from scripts import bench_pg as b  # noqa: E402  (re-exported for the drivers)


def target_tables(cur, applied_trigger):
    """The worker side's table (indexed as tickline's replicated tables are) and its applied token."""
    cur.execute(f"CREATE TABLE replicated_events ({b.BASE_COLUMNS})")
    cur.execute(f"CREATE INDEX replicated_events_token ON replicated_events {b.replicated_token_index('postgresql')}")
    cur.execute("CREATE TABLE applied (token bigint)")
    cur.execute("INSERT INTO applied VALUES (0)")
    if applied_trigger:
        b._add_applied_trigger(cur, "replicated_events")


def floor_databases(clusters, applied_trigger):
    """A new source database with the writer's ``events`` table and a target with :func:`target_tables`:
    their URLs and an autocommit connection to each."""
    src, dst = clusters.source.new_database(), clusters.target.new_database()
    s, d = b._connect(src), b._connect(dst)
    with s.cursor() as cur:
        cur.execute(f"CREATE TABLE events ({b.BASE_COLUMNS})")
        cur.execute("CREATE INDEX events_token ON events (token)")
    with d.cursor() as cur:
        target_tables(cur, applied_trigger)
    return src, dst, s, d


def start_relays(scripts, src, dst):
    """The relay processes (``scripts``: role -> file name in this folder), each started once ready;
    the worker first, as it listens and the master connects to it."""
    port = b._free_port()
    relays = []
    for role, url in (("worker", dst), ("master", src)):
        p = subprocess.Popen(
            [sys.executable, os.path.join(HERE, scripts[role]), url, str(port)], stdout=subprocess.PIPE, text=True
        )
        relays.append(p)
        if p.stdout.readline().strip() != "ready":
            stop(relays)
            raise RuntimeError(f"{scripts[role]} did not start")
    return relays


def stop(processes):
    for p in processes:
        p.kill()
        p.wait()
