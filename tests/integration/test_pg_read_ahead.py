"""The master's live reads ahead on PostgreSQL (two chunks read at once, ``replication.read_ahead``):
rows that become visible together, with batches larger than a read, burnt tokens and single rows,
arrive once each, in token order, every batch whole."""

from __future__ import annotations

from tests.integration.procs import append_mixed, event_row, rdata_events

CONFIG = "master:\n  fanout_rows: 3\n"


def test_rows_seen_at_once_are_read_ahead_in_order(master, pg_url) -> None:
    m = master(CONFIG, database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    client.expect("POSITION")
    # A second writer alive below the rows holds the safe position: everything after comes at once.
    assert m.append("events", [event_row(0)], instance="slow") == [1]
    assert client.expect("RDATA events slow 1 ").endswith('["$r0","!r","t",null,null]')
    expected, n = append_mixed(m, pg_url, 12, 1)
    token = m.append("events", [event_row(n)], instance="slow")[0]
    expected.append((str(token), f"$r{n}"))
    assert rdata_events(client, len(expected)) == expected
