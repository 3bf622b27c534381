"""A replay from storage on PostgreSQL in small reads (lines built by the server, ``storage.pg_lines``):
batches larger than a read, burnt tokens and single rows arrive once each, in token order, every batch whole."""

from __future__ import annotations

import psycopg2

from tests.integration.procs import wait_for

CONFIG = "master:\n  recent_bytes: 1024\nprotocol:\n  catchup_rows: 4\n"


def _row(i: int) -> list:
    return [f"$r{i}", "!r", "t", None, None]


def test_a_replay_from_storage_in_small_reads_is_in_order(master, pg_url) -> None:
    m = master(CONFIG, database=pg_url)
    expected: list[tuple[str, str]] = []  # (token or batch, event id)
    n = 0
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    for step in range(15):
        if step % 4 == 1:
            rows = [_row(n + i) for i in range(step + 2)]  # 3 to 15 rows in one token
            (token,) = set(m.append("events", rows, batch=True))
            expected += [("batch", f"$r{n + i}") for i in range(len(rows) - 1)]
            expected.append((str(token), f"$r{n + len(rows) - 1}"))
        else:
            rows = [_row(n + i) for i in range(step % 3 + 1)]
            expected += [(str(t), f"$r{n + i}") for i, t in enumerate(m.append("events", rows))]
        n += len(rows)
        if step % 5 == 2:
            with conn.cursor() as cur:  # tokens burnt: no rows will ever have them
                cur.execute("SELECT nextval('stream_events_token_seq') FROM generate_series(1, 4)")
    conn.close()
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    got: list[tuple[str, str]] = []

    def arrived() -> bool:
        line = client.try_line(0.5)
        if line is not None and line.startswith("RDATA events "):
            parts = line.split(" ", 4)
            got.append((parts[3], parts[4].split('"')[1]))
        return len(got) >= len(expected)

    wait_for(arrived, 20, "every row")
    assert got == expected
