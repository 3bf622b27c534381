"""storage.time_index on both backends: safe times (idle, in flight, no live writer) and the ts search."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from replication.streams import EVENTS
from storage import time_index
from storage.store import open_store
from storage.tso import compose
from tests.stores import backend_store

if TYPE_CHECKING:
    from storage.pg_store import PgStreamStore
    from storage.sqlite_store import SqliteStreamStore

    Store = SqliteStreamStore | PgStreamStore


def row(n: int) -> list[Any]:
    return [f"$e{n}", "!r", "t", None, None]


@contextlib.contextmanager
def two_stores(url: str) -> Iterator[tuple[Store, Store]]:
    """Two processes' stores on one database, the events stream registered by the first."""
    store = backend_store(open_store(url))
    other = backend_store(open_store(url))
    try:
        store.register_stream(EVENTS)
        other.schema("events")
        yield store, other
    finally:
        store.close()
        other.close()


def stored_ts(store: Store, token: int) -> int:
    return next(r[3] for r in store.read_rows("events", token - 1, token, 10))


def test_idle_streams_are_safe_up_to_a_fresh_oracle_time(db_url) -> None:
    store = backend_store(open_store(db_url))
    try:
        store.register_stream(EVENTS)
        (token,) = store.append("events", [row(1)], "w")
        first, positions = time_index.safe_point(store)
        assert positions["events"] == token
        assert first["events"] > stored_ts(store, token)
        second, _ = time_index.safe_point(store)
        assert second["events"] > first["events"]  # it advances while nothing is written
        # The high-water mark (no commit) is as safe, and does not move by itself.
        read, _ = time_index.safe_point(store, allocate=False)
        assert read["events"] == second["events"]
    finally:
        store.close()


class WriteBeforeThePositions:
    """A store whose positions are read just after another process committed a row (a real write)."""

    def __init__(self, store, writer) -> None:
        self._store, self._writer = store, writer
        self.written: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def safe_positions(self, expire_writers: bool = True) -> dict[str, int]:
        self.written += self._writer.append("events", [row(len(self.written))], "other")
        return self._store.safe_positions(expire_writers)


def test_a_write_between_the_time_and_the_positions_lifts_the_safe_time(db_url) -> None:
    """The TICK after a row covers it: the safe time is never below the last row up to the position."""
    with two_stores(db_url) as (store, writer):
        racing = WriteBeforeThePositions(store, writer)
        for allocate in (False, True):
            t = time_index.oracle_last(store)
            times, positions = time_index.safe_point(racing, expire_writers=False, allocate=allocate)
            token = racing.written[-1]
            assert positions["events"] == token
            assert times["events"] == stored_ts(store, token) > t  # t alone would be below the row
            writer.retire_writers()


def test_ts_increases_with_the_token(db_url) -> None:
    store = backend_store(open_store(db_url))
    try:
        store.register_stream(EVENTS)
        for n in range(5):
            store.append("events", [row(n), row(n + 100)], f"w{n % 2}", batch=n % 2 == 0)
        rows = store.read_rows("events", 0, 10**9, 1000)
        keys = [(r[1], r[0]) for r in rows]
        assert keys == sorted(keys)
        stamps = [r[3] for r in rows]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    finally:
        store.close()


def test_a_row_in_flight_keeps_the_safe_time_below_it_on_postgresql(pg_url) -> None:
    store = backend_store(open_store(pg_url))
    other = backend_store(open_store(pg_url))
    try:
        store.register_stream(EVENTS)
        (first,) = store.append("events", [row(1)], "A")
        with store.writing("events", "A") as txn:
            (held,) = txn.append([row(2)])
            (after,) = other.append("events", [row(3)], "B")  # commits above the open row
            times, positions = time_index.safe_point(other)
            assert positions["events"] == first
            # Safe up to the last committed row at or below the position, not beyond.
            assert times["events"] == stored_ts(other, first)
        assert after == held + 1
        assert stored_ts(other, held) > times["events"]
        # Committed: the position passes it (A reports its head within 0.2 s), and so does the time.
        times, positions = time_index.safe_point(other)
        assert positions["events"] >= held and times["events"] >= stored_ts(other, held)
    finally:
        store.close()
        other.close()


def test_burned_tokens_without_a_live_writer_do_not_hold_the_safe_time_on_postgresql(pg_url) -> None:
    store = backend_store(open_store(pg_url))
    try:
        store.register_stream(EVENTS)
        (token,) = store.append("events", [row(1)], "A")
        try:
            with store.writing("events", "A") as txn:
                txn.append([row(2)])
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        store.retire_writers()
        times, positions = time_index.safe_point(store)
        assert positions["events"] == token
        assert times["events"] > stored_ts(store, token)
    finally:
        store.close()


def test_first_token_at(db_url) -> None:
    store = backend_store(open_store(db_url))
    try:
        store.register_stream(EVENTS)
        tokens = [store.append("events", [row(n)], "w")[0] for n in range(4)]
        stamps = [stored_ts(store, t) for t in tokens]
        at = time_index.first_token_at(store, "events", stamps[2])
        assert (at.token, at.ts, at.before) == (tokens[2], stamps[2], tokens[2] - 1)
        assert time_index.first_token_at(store, "events", stamps[2] + 1).token == tokens[3]
        assert time_index.first_token_at(store, "events", 0).token == tokens[0]
        assert time_index.first_token_at(store, "events", stamps[3] + 1).token is None
        assert time_index.ts_at_ms(1234) == compose(1234)
    finally:
        store.close()


def test_the_wake_up_safe_point_agrees_with_the_full_one_on_postgresql(pg_url) -> None:
    """PgStreamStore.safe_point without the sweep (one statement after t) answers as time_index.safe_point."""
    with two_stores(pg_url) as (store, other):
        (first,) = store.append("events", [row(1)], "A")
        with store.writing("events", "A") as txn:
            txn.append([row(2)])
            other.append("events", [row(3)], "B")
            fast_times, fast_positions = other.safe_point(expire_writers=False, allocate=False)
            slow_times, slow_positions = time_index.safe_point(other, expire_writers=False, allocate=False)
            assert fast_positions == slow_positions == {"events": first}
            assert fast_times == slow_times == {"events": stored_ts(other, first)}
        store.retire_writers()
        other.retire_writers()
        fast_times, fast_positions = other.safe_point(expire_writers=False, allocate=False)
        slow_times, slow_positions = time_index.safe_point(other, expire_writers=False, allocate=False)
        assert fast_positions == slow_positions and fast_times == slow_times
        assert fast_times["events"] >= stored_ts(other, fast_positions["events"])


def test_first_token_at_inside_a_batch_and_across_gaps(db_url) -> None:
    """The search lands on the exact row: inside a token of many rows, past gaps in the tokens."""
    store = backend_store(open_store(db_url))
    try:
        store.register_stream(EVENTS)
        before = store.append("events", [row(0)], "w")[0]
        try:
            with store.writing("events", "w") as txn:  # rolled back: a gap in the tokens
                txn.append([row(1), row(2)])
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        batch = store.append("events", [row(n) for n in range(300)], "w", batch=True)
        after = store.append("events", [row(n) for n in range(150)], "w")
        stamps = [r[3] for r in store.read_rows("events", 0, after[-1], 10_000)]
        assert stamps == sorted(stamps) and len(stamps) == 1 + 300 + 150
        batch_stamps = [r[3] for r in store.read_rows("events", batch[0] - 1, batch[0], 1000)]
        for i in (0, 1, 137, 299):
            at = time_index.first_token_at(store, "events", batch_stamps[i])
            assert (at.token, at.ts) == (batch[0], batch_stamps[i])
            at = time_index.first_token_at(store, "events", batch_stamps[i] - 1 if i else batch_stamps[0])
            assert at.token == batch[0] and at.queries <= 2
        at = time_index.first_token_at(store, "events", batch_stamps[-1] + 1)
        assert (at.token, at.before) == (after[0], after[0] - 1)
        assert time_index.first_token_at(store, "events", 0).token == before
        for i, token in enumerate(after):
            stamp = stored_ts(store, token)
            assert time_index.first_token_at(store, "events", stamp).token == token, i
        assert time_index.first_token_at(store, "events", stored_ts(store, after[-1]) + 1).token is None
    finally:
        store.close()


def test_first_token_at_on_an_empty_stream(db_url) -> None:
    store = backend_store(open_store(db_url))
    try:
        store.register_stream(EVENTS)
        assert time_index.first_token_at(store, "events", 0) == time_index.TokenAt(None, None, 1)
    finally:
        store.close()


def test_postgresql_stream_tables_have_only_the_token_index(pg_url) -> None:
    """Only the (token, seq) index; a table made with the old ts index loses it on migrate; lookups still exact."""
    store = backend_store(open_store(pg_url))
    try:
        store.register_stream(EVENTS)
        tokens = store.append("events", [row(n) for n in range(200)], "w")

        def indexes() -> list[str]:
            return [
                r[0]
                for r in store.database.query(
                    "SELECT indexname FROM pg_indexes WHERE tablename = 'stream_events' ORDER BY 1"
                )
            ]

        assert indexes() == ["stream_events_token"]
        store.database.write(lambda cur: cur.execute("CREATE INDEX stream_events_ts ON stream_events (ts)"))
        assert indexes() == ["stream_events_token", "stream_events_ts"]
    finally:
        store.close()
    store = backend_store(open_store(pg_url))  # opening migrates
    try:
        assert indexes() == ["stream_events_token"]
        stamp = stored_ts(store, tokens[57])
        assert time_index.first_token_at(store, "events", stamp).token == tokens[57]
    finally:
        store.close()
