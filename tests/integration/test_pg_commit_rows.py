"""PostgreSQL: a single-statement append's NOTIFY carries its rows and the writer's claim (docs/time.md).

The master sends such rows without reading them back only when the claim
covers them; a writer still in flight below them holds them back (they come
by a pass once it commits), so order and exactly-once hold.
"""

from __future__ import annotations

import functools
import select
import time

import psycopg2
import pytest

from replication.rows import encode_json_rows
from replication.streams import EVENTS
from storage.contracts import CommittedRows
from storage.pg_store import MAX_PAYLOAD_BYTES, PgNotifier, PgStreamStore
from storage.store import open_store
from tests.integration.procs import rdata_tokens as rdata
from tests.integration.procs import wait_for

ROW = ["$a", "!r", "m.room.message", None, None]


def drain(notifier: PgNotifier, want: int, timeout: float = 10.0):
    """Notifications until ``want`` carried rows arrived (or the timeout)."""
    plain: set[str] = set()
    committed: list[CommittedRows] = []
    deadline = time.monotonic() + timeout
    while len(committed) < want and time.monotonic() < deadline:
        select.select([notifier.fileno()], [], [], 0.05)
        more_plain, more = notifier.drain_committed()
        plain |= more_plain
        committed += more
    return plain, committed


@pytest.fixture
def store(pg_url):
    s = open_store(pg_url)
    assert isinstance(s, PgStreamStore)
    s.register_stream(EVENTS)
    yield s
    s.close()


def test_rows_and_claim_in_the_notification(store, pg_url) -> None:
    notifier = store.notifier()
    try:
        assert store.append("events", [ROW, ["$b", "!r", "t", "k", None]], "w1") == [1, 2]
        _, committed = drain(notifier, 1)
        (c,) = committed
        assert (c.stream, c.instance, c.safe) == ("events", "w1", 2)
        assert [token for token, _, _ in c.rows] == [1, 2]
        # The same lines the store's reads build.
        stored = [(0, token, b"w1", ts, values) for token, ts, values in c.rows]
        for with_ts in (False, True):
            lines, _, _ = store.read_lines_json("events", 0, 2, 10, "RDATA events ", with_ts)
            assert encode_json_rows("events", stored, with_ts)[0] == lines
    finally:
        notifier.close()


def test_claim_stays_below_a_writer_in_flight(store, pg_url) -> None:
    """A writer that allocated a lower token and has not committed holds the claim below it."""
    other = open_store(pg_url)
    notifier = store.notifier()
    try:
        store.append("events", [ROW], "w1")  # token 1
        with other.writing("events", "w2") as txn:
            assert txn.append([ROW]) == [2]  # in flight
            assert store.append("events", [ROW], "w1") == [3]
            _, committed = drain(notifier, 2)
            assert [c.rows[0][0] for c in committed] == [1, 3]
            assert committed[1].safe is not None and committed[1].safe < 2
    finally:
        notifier.close()
        other.close()


def test_large_or_batch_appends_notify_the_stream_only(store, pg_url) -> None:
    notifier = store.notifier()
    try:
        big = ["$" + "x" * (MAX_PAYLOAD_BYTES // 2), "!r", "t", None, None]
        store.append("events", [big, big], "w1")
        store.append("events", [ROW, ROW], "w1", batch=True)
        plain: set[str] = set()

        def notified() -> bool:
            plain.update(notifier.drain_committed()[0])
            return bool(plain)

        wait_for(notified, 10, "the notifications")
        assert plain == {"events"}
        select.select([notifier.fileno()], [], [], 0.2)
        assert notifier.drain_committed()[1] == []
    finally:
        notifier.close()


def subscribed(master, pg_url):
    """A master on ``pg_url`` and a client following ``events`` that has received the first row's RDATA."""
    m = master(database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    client.expect("POSITION")
    assert m.append("events", [ROW]) == [1]
    assert rdata(client, 1) == [1]
    return m, client


def test_master_sends_the_rows_of_a_notification_without_a_read(master, pg_url) -> None:
    """Rows arrive while every read of the master would wait for a lock: they came with the commit."""
    m, client = subscribed(master, pg_url)
    locker = psycopg2.connect(pg_url)
    try:
        with locker.cursor() as cur:
            # Every read of the master's (wake-up or threads) reads the positions of both streams.
            cur.execute("LOCK TABLE stream_caches IN ACCESS EXCLUSIVE MODE")
            assert m.append("events", [ROW]) == [2]
            assert m.append("events", [ROW, ROW]) == [3, 4]
            assert rdata(client, 3) == [2, 3, 4]
        locker.commit()
    finally:
        locker.close()
    assert m.append("events", [ROW]) == [5]
    assert rdata(client, 1) == [5]


def test_master_waits_for_a_writer_in_flight(master, pg_url) -> None:
    """A commit above a writer still in flight is sent only after it, by a pass: in order, once."""
    m, client = subscribed(master, pg_url)
    slow = open_store(pg_url)
    try:
        with slow.writing("events", "slow") as txn:
            assert txn.append([ROW]) == [2]
            assert m.append("events", [ROW]) == [3]
            assert rdata(client, 1, timeout=1.0) == []  # 3 waits for 2
        assert rdata(client, 2) == [2, 3]
        assert m.append("events", [ROW]) == [4]
        assert rdata(client, 1) == [4]
        assert rdata(client, 1, timeout=0.5) == []  # nothing twice
    finally:
        slow.close()


def test_a_report_of_the_position_an_append_notified_does_not_notify_again(store, pg_url) -> None:
    """The statement's own NOTIFY told the master; a report moving the position further still notifies.

    The writer's store reports only when the test calls ``report_positions``
    (its own thread would report every 0.2 s, and could send the second
    notification before the test asks for it).
    """
    quiet = open_store(pg_url, report_interval=3600)
    assert isinstance(quiet, PgStreamStore)
    notifier = store.notifier()
    other = open_store(pg_url)
    try:
        quiet.append("events", [ROW], "w1")
        assert len(drain(notifier, 1)[1]) == 1
        quiet.report_positions()  # the same position: nothing to tell
        select.select([notifier.fileno()], [], [], 0.2)
        assert notifier.drain_committed() == (set(), [])
        assert other.append("events", [ROW], "w2") == [2]
        assert len(drain(notifier, 1)[1]) == 1
        quiet.report_positions()  # w1 is idle: its position moves to the head, 2
        plain: set[str] = set()

        def notified() -> bool:
            plain.update(notifier.drain_committed()[0])
            return bool(plain)

        wait_for(notified, 10, "the report's notification")
        assert plain == {"events"}
    finally:
        quiet.close()
        other.close()
        notifier.close()


def test_a_report_after_a_bulk_append_does_not_notify_again(store, pg_url) -> None:
    """A ``COPY`` append's commit moved the position and notified (the stream's name): a report of
    that position tells nothing new, alone in its transaction or in one of several appends."""
    quiet = open_store(pg_url, report_interval=3600)
    assert isinstance(quiet, PgStreamStore)
    notifier = store.notifier()
    rows = [[f"$e{n}", "!r", "m.room.message", None, None] for n in range(1000)]
    try:

        def notified(plain: set[str]) -> bool:
            plain.update(notifier.drain_committed()[0])
            return bool(plain)

        for write in ("alone", "in a transaction"):
            if write == "alone":
                tokens = quiet.append("events", rows, "w1")
            else:
                with quiet.writing("events", "w1") as txn:
                    tokens = txn.append(rows) + txn.append(rows)  # the position moves with the COMMIT
            plain: set[str] = set()
            wait_for(functools.partial(notified, plain), 10, f"the {write} append's notification")
            assert plain == {"events"}
            assert quiet.safe_positions()["events"] == tokens[-1]
            quiet.report_positions()  # the same position: nothing to tell
            select.select([notifier.fileno()], [], [], 0.2)
            assert notifier.drain_committed() == (set(), []), write
    finally:
        quiet.close()
        notifier.close()


def test_a_report_while_appends_keep_the_writer_fresh_writes_nothing(store, pg_url) -> None:
    """An append sets the writer's position and heartbeat: a report just after it leaves the row as it
    is (no transaction of its own: the row's ``xmin`` is the append's), so it flushes no WAL and holds
    no lock the next append would wait for. A heartbeat older than a tenth of the report interval
    is refreshed (so it is never much older than one interval, as when every report wrote it),
    without a notification (the position did not move)."""
    quiet = open_store(pg_url, report_interval=3600)
    assert isinstance(quiet, PgStreamStore)
    notifier = store.notifier()
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True

    def row() -> tuple[str, int, int]:
        with conn.cursor() as cur:
            cur.execute("SELECT xmin::text, heartbeat_ms, position FROM tickline_writers WHERE stream = 'events'")
            return cur.fetchone()

    try:
        (token,) = quiet.append("events", [ROW], "w1")
        assert len(drain(notifier, 1)[1]) == 1
        after_append = row()
        assert after_append[2] == token
        quiet.report_positions()
        assert row() == after_append  # not written
        with conn.cursor() as cur:  # as if the append were a fifth of the report interval (3600 s) ago
            cur.execute("UPDATE tickline_writers SET heartbeat_ms = heartbeat_ms - 720 * 1000")
        stale = row()
        quiet.report_positions()
        refreshed = row()
        assert refreshed[0] != stale[0] and refreshed[1] > stale[1] and refreshed[2] == token
        select.select([notifier.fileno()], [], [], 0.2)
        assert notifier.drain_committed() == (set(), [])
    finally:
        quiet.close()
        notifier.close()
        conn.close()
