"""A replay from storage on PostgreSQL in small reads (lines built by the server, ``storage.pg_lines``):
batches larger than a read, burnt tokens and single rows arrive once each, in token order, every batch whole."""

from __future__ import annotations

from tests.integration.procs import append_mixed, rdata_events

CONFIG = "master:\n  recent_bytes: 1024\nprotocol:\n  catchup_rows: 4\n"


def test_a_replay_from_storage_in_small_reads_is_in_order(master, pg_url) -> None:
    m = master(CONFIG, database=pg_url)
    expected, _ = append_mixed(m, pg_url, 15, 0)
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    assert rdata_events(client, len(expected)) == expected
