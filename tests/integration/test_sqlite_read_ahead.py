"""The master's live reads ahead on SQLite (``replication.read_ahead`` with the store's
``parallel_reads``): rows committed in one transaction, with batches larger than a read and single
rows, arrive once each, in token order, every batch whole; and so do rows committed by many small
transactions."""

from __future__ import annotations

from storage.store import open_store
from tests.conftest import LineClient, MasterProcess
from tests.integration.procs import event_row, rdata_events

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
