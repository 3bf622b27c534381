"""storage.time_index on both backends: safe times (idle, in flight, no live writer) and the ts search."""

from __future__ import annotations

from replication.streams import EVENTS
from storage import time_index
from storage.store import open_store
from storage.tso import compose


def row(n: int) -> list:
    return [f"$e{n}", "!r", "t", None, None]


def stored_ts(store, token: int) -> int:
    return next(r[3] for r in store.read_rows("events", token - 1, token, 10))


def test_idle_streams_are_safe_up_to_a_fresh_oracle_time(db_url) -> None:
    store = open_store(db_url)
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


def test_ts_increases_with_the_token(db_url) -> None:
    store = open_store(db_url)
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
    store = open_store(pg_url)
    other = open_store(pg_url)
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
    store = open_store(pg_url)
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
    store = open_store(db_url)
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
    store = open_store(pg_url)
    other = open_store(pg_url)
    try:
        store.register_stream(EVENTS)
        other.schema("events")
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
    finally:
        store.close()
        other.close()
