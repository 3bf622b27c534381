"""Several writer processes on PostgreSQL: no gap, no row out of order, no stall past the timeout."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from collections import Counter

import orjson

from tests.conftest import ROOT, _env
from tests.integration.procs import Proc, query_pg, wait_for
from tests.stores import pg_store

WRITER_TIMEOUT = 2.0
CONFIG = f"master:\n  writer_timeout: {WRITER_TIMEOUT}\n"


def writer(url: str, instance: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.writer_proc", url, instance, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )


def rdata_tokens(client, timeout: float) -> list[int]:
    """Tokens of the RDATA lines that arrive within ``timeout`` (PINGs skipped)."""
    tokens = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        line = client.try_line(left)
        if line is None:
            break
        if line.startswith("RDATA "):
            tokens.append(line.split(" ", 4)[3])
    return tokens


def test_row_waits_for_an_earlier_open_transaction(master, pg_url) -> None:
    m = master(CONFIG, database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    assert client.expect("POSITION").startswith("POSITION events")
    a = writer(pg_url, "A", "hold")
    assert a.stdin is not None and a.stdout is not None  # both pipes
    try:
        assert a.stdout.readline().strip() == "HOLDING 1"
        assert m.write("events", '["$b", "!r", "t", null, null]', instance="B") == [2]
        # B committed, but A's token 1 is still open: nothing may be sent.
        assert rdata_tokens(client, 1.5) == []
        a.stdin.write("commit\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "COMMITTED"
        first = client.expect("RDATA", timeout=5)
        second = client.expect("RDATA", timeout=5)
        assert first.startswith("RDATA events A 1 ")
        assert second.startswith("RDATA events B 2 ")
    finally:
        a.kill()
        a.wait()


def test_a_writer_killed_mid_transaction_stalls_the_stream_only_until_the_timeout(master, pg_url) -> None:
    m = master(CONFIG, database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("OPTIONS ts", "REPLICATE events 0")
    client.expect("OPTIONS ts")
    client.expect("POSITION")
    a = writer(pg_url, "A", "hold")
    assert a.stdout is not None  # a pipe
    assert a.stdout.readline().strip() == "HOLDING 1"
    assert m.write("events", '["$b", "!r", "t", null, null]', instance="B") == [2]
    killed = time.monotonic()
    a.kill()
    a.wait()
    line = client.expect("RDATA", timeout=WRITER_TIMEOUT + 5)
    waited = time.monotonic() - killed
    assert line.startswith("RDATA events B 2 "), line  # A's row never committed
    assert waited <= WRITER_TIMEOUT + 3, f"the stream stalled {waited:.1f} s"
    assert re.search(r"writer A/\S+ of stream events stopped reporting", m.log())
    # The stream goes on normally afterwards.
    assert m.write("events", '["$c", "!r", "t", null, null]', instance="C") == [3]
    assert client.expect("RDATA", timeout=5).startswith("RDATA events C 3 ")


def test_a_fenced_writer_retries_with_new_tokens_and_loses_nothing(pg_url, caplog) -> None:
    from replication.streams import EVENTS
    from storage.store import open_store

    store = pg_store(open_store(pg_url, writer_timeout=0.5))
    store.register_stream(EVENTS)
    store._stop_reporting.set()  # a writer that went silent, as if stalled
    store.append("events", [["$a", "!r", "t", None, None]], "slow")
    other = pg_store(open_store(pg_url, writer_timeout=0.5))

    def slow_is_dead() -> bool:
        other.safe_positions()  # what the master does: expire silent writers
        alive = other.database.read(
            lambda c: c.execute("SELECT instance_name FROM tickline_writers WHERE alive").fetchall()
        )
        return not any(name.startswith("slow/") for (name,) in alive)

    wait_for(slow_is_dead, 10, "the silent writer to be declared dead")
    # Its next commit fails the epoch check (token 2 is rolled back); it
    # registers again under a new epoch and writes the row with a new token.
    with caplog.at_level(logging.WARNING):
        assert store.append("events", [["$b", "!r", "t", None, None]], "slow") == [3]
    assert "writer slow of events was declared dead" in caplog.text
    rows = other.read_rows("events", 0, 10, 10)
    assert [(r[1], r[4]) for r in rows] == [(1, "$a"), (3, "$b")]
    other.close()


def test_four_writers_5000_rows_each_reach_a_worker_and_a_tail_once_in_order(
    master, pg_url, pg_server, tmp_path
) -> None:
    m = master(CONFIG, database=pg_url)
    worker_db = pg_server.new_database()
    worker = Proc(
        tmp_path / "worker.log",
        "worker",
        "--name",
        "w",
        "--master",
        m.address,
        "--database",
        worker_db,
        "--replicate",
        "events",
    )
    tail = subprocess.Popen(
        [
            *__import__("tests.conftest", fromlist=["tickline_command"]).tickline_command(),
            "tail",
            "--master",
            m.address,
            "--from",
            "0",
            "--count",
            "20000",
            "events",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    # Drain the tail while the writers run: a full stdout pipe would block its
    # reactor, and the master would drop it for not answering PINGs.
    output: list[tuple[bytes, bytes]] = []
    reader = threading.Thread(target=lambda: output.append(tail.communicate(timeout=240)), daemon=True)
    reader.start()
    writers = [writer(pg_url, f"w{i}", "5000") for i in range(4)]
    try:
        for w in writers:
            assert w.stdout is not None  # a pipe
            assert w.stdout.readline().strip() == "DONE"
            assert w.wait(timeout=120) == 0
        reader.join(timeout=240)
        out, err = output[0]
        assert tail.returncode == 0, err
        records = [orjson.loads(line) for line in out.splitlines()]
        assert len(records) == 20000
        ids = Counter(r["row"][0] for r in records)
        assert len(ids) == 20000 and max(ids.values()) == 1
        tokens = [r["token"] for r in records]
        assert tokens == sorted(tokens)
        # A token is shared only by the rows of one batch of one writer.
        by_token: dict[int, set] = {}
        for r in records:
            by_token.setdefault(r["token"], set()).add(r["instance"])
        assert all(len(instances) == 1 for instances in by_token.values())

        def worker_rows() -> int:
            return query_one_pg(worker_db, "SELECT COUNT(*) FROM replicated_events") or 0

        wait_for(lambda: worker_rows() == 20000, 120, "the worker to apply 20,000 rows")
        distinct = query_one_pg(worker_db, "SELECT COUNT(DISTINCT event_id) FROM replicated_events")
        assert distinct == 20000
    finally:
        for w in writers:
            w.kill()
        tail.kill()
        assert worker.stop() == 0


def query_one_pg(url: str, sql: str):
    import psycopg2

    try:
        rows = query_pg(url, sql)
    except psycopg2.errors.UndefinedTable:
        return None
    return rows[0][0] if rows else None


def test_two_processes_with_one_instance_name_do_not_fence_each_other(pg_url, caplog) -> None:
    from replication.streams import EVENTS
    from storage.store import open_store

    first, second = pg_store(open_store(pg_url)), open_store(pg_url)  # as two processes would
    first.register_stream(EVENTS)
    with caplog.at_level(logging.WARNING):
        tokens = []
        for i in range(20):
            store = first if i % 2 else second
            tokens += store.append("events", [[f"$e{i}", "!r", "t", None, None]], "writer")
    assert tokens == list(range(1, 21))  # no transaction was fenced off and retried
    assert "declared dead" not in caplog.text
    alive = first.database.read(
        lambda c: c.execute("SELECT instance_name FROM tickline_writers WHERE alive").fetchall()
    )
    assert len(alive) == 2 and all(name.startswith("writer/") for (name,) in alive)
    first.close()
    second.close()


def test_master_listens_again_after_postgresql_restarts(master, tmp_path) -> None:
    from scripts.pg_local import PostgresServer

    server = PostgresServer()  # a server of its own: this test restarts it
    server.start()
    try:
        url = server.new_database()
        m = master(CONFIG, database=url)
        client = m.connect()
        client.handshake()
        client.send("REPLICATE events 0")
        client.expect("POSITION")
        assert m.write("events", '["$a", "!r", "t", null, null]') == [1]
        assert client.expect("RDATA", timeout=5).startswith("RDATA events writer 1 ")
        server.restart()
        assert m.write("events", '["$b", "!r", "t", null, null]') == [2]
        assert client.expect("RDATA", timeout=15).startswith("RDATA events writer 2 ")
        m.wait_for_log("listening for database notifications again", timeout=15)
        # Notifications wake the master again: well within the slow loop's period.
        started = time.monotonic()
        assert m.write("events", '["$c", "!r", "t", null, null]') == [3]
        assert client.expect("RDATA", timeout=5).startswith("RDATA events writer 3 ")
        assert time.monotonic() - started < 5
    finally:
        server.stop()
