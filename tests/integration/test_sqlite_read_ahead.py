"""The master's live reads ahead on SQLite (``replication.read_ahead`` with the store's
``parallel_reads``): rows committed in one transaction, with batches larger than a read and single
rows, arrive once each, in token order, every batch whole; and so do rows committed by many small
transactions; and a stream marked out of rowid order (storage.sqlite_order) is read whole and in order."""

from __future__ import annotations

from storage.store import open_store
from tests.conftest import LineClient, MasterProcess
from tests.integration.procs import event_row, rdata_events
from tests.stores import sqlite_store

CONFIG = "master:\n  fanout_rows: 3\n"


def _append_mixed_in_one_transaction(database: str, steps: int, first: int) -> list[tuple[str, str]]:
    """Batches of 3 and more rows and single rows, all in one write transaction (one commit)."""
    expected: list[tuple[str, str]] = []
    n = first
    store = open_store(database)
    try:
        with store.writing("events", "writer") as txn:
            for step in range(steps):
                if step % 4 == 1:
                    rows = [event_row(n + i) for i in range(step + 2)]  # 3 rows and more in one token
                    (token,) = set(txn.append(rows, batch=True))
                    expected += [("batch", f"$r{n + i}") for i in range(len(rows) - 1)]
                    expected.append((str(token), f"$r{n + len(rows) - 1}"))
                else:
                    rows = [event_row(n + i) for i in range(step % 3 + 1)]
                    expected += [(str(t), f"$r{n + i}") for i, t in enumerate(txn.append(rows))]
                n += len(rows)
    finally:
        store.close()
    return expected


def _live_client(m: MasterProcess) -> LineClient:
    """A client subscribed live to ``events`` from the start (its POSITION taken)."""
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    client.expect("POSITION")
    return client


def test_rows_of_one_commit_are_read_ahead_in_order(master) -> None:
    m = master(CONFIG)
    client = _live_client(m)
    assert m.append("events", [event_row(0)]) == [1]
    assert client.expect("RDATA events writer 1 ").endswith('["$r0","!r","t",null,null]')
    expected = _append_mixed_in_one_transaction(m.database, 16, 1)
    assert rdata_events(client, len(expected)) == expected


def test_rows_of_many_commits_arrive_once_in_order(master) -> None:
    m = master(CONFIG)
    client = _live_client(m)
    expected = []
    for i in range(40):
        rows = [event_row(2 * i), event_row(2 * i + 1)]
        expected += [(str(t), f"$r{2 * i + j}") for j, t in enumerate(m.append("events", rows))]
    assert rdata_events(client, len(expected)) == expected


def test_a_stream_marked_out_of_order_is_still_delivered_whole_and_in_order(master) -> None:
    """A row written by hand below the head marks the stream (``storage.sqlite_order``): the master's
    live reads go on through the indexes its first read after the mark creates, and a master that
    reads the stream from storage gets every row in token order, the hand-written one in its token's
    batch."""
    m = master(CONFIG)
    client = _live_client(m)
    tokens = m.append("events", [event_row(i) for i in range(5)])
    assert rdata_events(client, 5) == [(str(t), f"$r{i}") for i, t in enumerate(tokens)]
    database = sqlite_store(open_store(m.database)).database
    try:
        database.write(
            lambda conn: conn.execute(
                "INSERT INTO stream_events (token, instance_name, ts, event_id, room_id, type, state_key, redacts) "
                "SELECT 3, 'hand', max(ts) + 1, '$hand', '!r', 't', NULL, NULL FROM stream_events"
            )
        )
        assert database.query("SELECT stream FROM tickline_unordered") == [("events",)]
        expected = _append_mixed_in_one_transaction(m.database, 8, 5)
        assert rdata_events(client, len(expected)) == expected
        indexes = database.query("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'stream_events'")
        assert sorted(indexes) == [("stream_events_token",), ("stream_events_ts",)]  # made by the master's read
    finally:
        database.close()
    # The first master's window never held the hand-written row (below its live token, as on any
    # stream); a second master warms its window and replays from storage.
    replay = master(CONFIG, database=m.database).connect()
    replay.handshake()
    replay.send("REPLICATE events 0")
    replay.expect("POSITION")
    got = rdata_events(replay, 5 + 1 + len(expected))
    assert got[:6] == [("1", "$r0"), ("2", "$r1"), ("batch", "$r2"), ("3", "$hand"), ("4", "$r3"), ("5", "$r4")]
    assert got[6:] == expected
