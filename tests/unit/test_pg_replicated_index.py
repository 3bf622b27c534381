"""The replicated table on PostgreSQL: a BRIN index on ``token`` (cheap to insert into), read by token range."""

from __future__ import annotations

from typing import Any

import psycopg2

from replication.streams import EVENTS
from storage.worker_store import open_snapshot_reader, open_worker_store
from tests.stores import pg_worker_store

TS = 470_000_000_000_000_000


def _received(first: int, last: int) -> list[Any]:
    return [
        ([*range(first, last + 1)], "m", [[f"$e{n}", "!r", "m.t", None, None, TS + n] for n in range(first, last + 1)])
    ]


def _no_effects(txn: Any) -> None:
    raise AssertionError("the rows go by COPY")


def test_the_token_index_is_brin_and_ranges_read_by_it(pg_url: str) -> None:
    store = pg_worker_store(open_worker_store(pg_url))
    try:
        store.create_replicated_table(EVENTS)
        store.create_replicated_table(EVENTS)  # again at every start: nothing changes
        for first in range(1, 3001, 1000):
            store.apply_replicated("events", first + 999, EVENTS, _received(first, first + 999), _no_effects)
    finally:
        store.close()
    conn = psycopg2.connect(pg_url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'replicated_events'")
            assert [d for (d,) in cur.fetchall()] == [
                "CREATE INDEX replicated_events_token ON public.replicated_events USING brin (token) WITH (autosummarize='on')"
            ]
            cur.execute("SET enable_seqscan = off")  # the index answers a range, exactly
            cur.execute(
                "SELECT min(token), max(token), count(*) FROM replicated_events WHERE token > 1500 AND token <= 2600"
            )
            assert cur.fetchone() == (1501, 2600, 1100)
    finally:
        conn.close()
    reader = open_snapshot_reader(pg_url)
    try:
        assert reader.read(lambda view: view.token_bounds("replicated_events", 1500, 2600)) == (1501, 2600)
        assert reader.read(lambda view: view.token_bounds("replicated_events", None, 3000)) == (1, 3000)
    finally:
        reader.close()
