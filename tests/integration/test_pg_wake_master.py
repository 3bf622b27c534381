"""The master's wake-up connection (PostgreSQL) lost mid-call or idle: nothing lost, nothing repeated."""

from __future__ import annotations

import threading
import time

import psycopg2

from tests.integration.procs import query_pg, rdata_tokens, wait_for

CONFIG = "master:\n  writer_timeout: 2.0\n"
EVENT = '["$e{}", "!r", "t", null, null]'


def wake_backends(url: str, waiting: bool = False) -> list[int]:
    sql = "SELECT pid FROM pg_stat_activity WHERE application_name = 'tickline-wake'"
    if waiting:
        sql += " AND wait_event_type = 'Lock'"
    return [pid for (pid,) in query_pg(url, sql)]


def terminate(url: str, pids: list[int]) -> None:
    for pid in pids:
        query_pg(url, f"SELECT pg_terminate_backend({pid})")


def test_wake_connection_terminated_during_a_call(master, pg_url) -> None:
    """A call blocked on a lock loses its connection: the threads read instead, the reactor stays free."""
    m = master(CONFIG, database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    client.expect("POSITION")
    assert m.append("events", [["$a", "!r", "t", None, None]]) == [1]
    assert rdata_tokens(client, 1) == [1]
    wait_for(lambda: bool(wake_backends(pg_url)), 10, "the wake-up connection")

    # Hold a lock the wake-up needs (it reads every stream's position; the
    # writer of events does not touch caches) so that its next call waits.
    locker = psycopg2.connect(pg_url)
    try:
        with locker.cursor() as cur:
            cur.execute("LOCK TABLE stream_caches IN ACCESS EXCLUSIVE MODE")
            assert m.append("events", [["$b", "!r", "t", None, None]]) == [2]
            wait_for(lambda: bool(wake_backends(pg_url, waiting=True)), 10, "the wake-up call to wait for the lock")
            terminate(pg_url, wake_backends(pg_url))
            m.wait_for_log("the wake-up connection failed", timeout=10)
            # The reactor is not blocked: a new connection is served at once.
            other = m.connect()
            other.handshake()
            other.send("PING 1")
            other.expect("PING", timeout=5)
        locker.commit()  # the threaded read of token 2 goes on
    finally:
        locker.close()
    assert rdata_tokens(client, 1) == [2]
    m.wait_for_log("wake-ups run on the reactor again", timeout=10)
    assert m.append("events", [["$c", "!r", "t", None, None]]) == [3]
    assert rdata_tokens(client, 1) == [3]
    # The passes use the new connection (one follows every tick_interval at the latest;
    # token 3 itself went out from its commit's notification, maybe before any pass).
    wait_for(
        lambda: any(
            app == "tickline-wake" and "tickline_wake_" in query
            for app, query in query_pg(pg_url, "SELECT application_name, query FROM pg_stat_activity")
        ),
        10,
        "a wake-up call on the new connection",
    )


def test_wake_connection_killed_repeatedly_under_writes(master, pg_url) -> None:
    """Rows written while the wake-up connection is killed again and again arrive once each, in order."""
    m = master(CONFIG, database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    client.expect("POSITION")
    total = 300
    done = threading.Event()

    def write() -> None:
        for i in range(total):
            m.append("events", [[f"$e{i}", "!r", "t", None, None]])
            time.sleep(0.005)
        done.set()

    def kill() -> None:
        while not done.is_set():
            terminate(pg_url, wake_backends(pg_url))
            time.sleep(0.15)

    threads = [threading.Thread(target=write), threading.Thread(target=kill)]
    for t in threads:
        t.start()
    tokens = rdata_tokens(client, total, timeout=60)
    for t in threads:
        t.join(30)
    assert tokens == list(range(1, total + 1))
    assert rdata_tokens(client, 1, timeout=0.5) == []  # no token twice
    log = m.log()
    assert "the wake-up connection failed" in log
    assert "Traceback" not in log
