"""Large appends on PostgreSQL take the window of tokens and timestamps their writer's last commit reserved.

The commit of a large append (``COPY``) also allocates the next one's window,
so the next append opens its transaction with its ``COPY``. While reserved,
the window is in flight: the writer's position stays below it until an
append takes it, another allocation of the writer drops it, or the next
report drops it (docs/time.md, "Reserved windows").
"""

from __future__ import annotations

import pytest

from replication.streams import EVENTS
from storage.pg_store import RESERVED, Fenced, PgStreamStore
from storage.store import open_store

ROW = ["$e", "!r", "m.room.message", None, None]


def rows(n: int) -> list[list[object]]:
    return [[f"$e{i}", "!r", "m.room.message", None, None] for i in range(n)]


@pytest.fixture
def store(pg_url):
    s = open_store(pg_url, report_interval=3600.0)  # reports only when a test asks
    s.register_stream(EVENTS)
    yield s
    s.close()


def _state(store: PgStreamStore, instance: str = "w"):
    return store._writers[("events", instance)]


def _stored(store: PgStreamStore) -> list[tuple[int, int]]:
    return [(r[1], r[3]) for r in store.read_rows("events", 0, 10**9, 10**6)]


def test_the_next_large_append_takes_the_window_its_last_commit_reserved(store) -> None:
    first = store.append("events", rows(1000), "w")
    assert first == list(range(1, 1001))
    reserved = _state(store).reserved
    assert reserved is not None and reserved[0] == 1001 and reserved[2] == 1000
    assert _state(store).inflight == {RESERVED: 1001}  # in flight until taken
    assert store.heads()["events"] == 2000  # allocated by the commit

    second = store.append("events", rows(1000), "w")
    assert second == list(range(1001, 2001))  # no allocation of its own: the head did not move first
    stored = _stored(store)
    assert [token for token, _ in stored] == first + second
    stamps = [ts for _, ts in stored]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert stored[1000][1] == reserved[1]  # the window's timestamps


def test_a_smaller_append_takes_part_of_the_window_and_a_larger_one_allocates(store) -> None:
    store.append("events", rows(1000), "w")
    part = store.append("events", rows(400), "w")
    assert part == list(range(1001, 1401))  # 1401..2000 skipped, as a rolled-back write's
    assert _state(store).reserved[2] == 400  # the next window has the last append's size
    larger = store.append("events", rows(500), "w")
    assert larger[0] > 2400  # above the window of 400 it dropped
    assert [token for token, _ in _stored(store)] == list(range(1, 1401)) + larger


def test_a_window_holds_the_position_below_it_until_a_report_drops_it(store, pg_url) -> None:
    other = open_store(pg_url, report_interval=3600.0)
    try:
        store.append("events", rows(1000), "w")  # reserves 1001..2000
        (late,) = other.append("events", [ROW], "w2")
        assert late == 2001
        # Tokens 1001..2000 may still be written by "w": the stream may not pass them.
        assert store.safe_positions(expire_writers=False)["events"] == 1000
        store.report_positions()  # an unused window is dropped at the next report
        assert _state(store).reserved is None and not _state(store).inflight
        assert store.safe_positions(expire_writers=False)["events"] == 2001
        again = store.append("events", rows(1000), "w")
        assert again[0] > 2001
        assert [token for token, _ in _stored(store)] == [*range(1, 1001), 2001, *again]
    finally:
        other.close()


def test_a_small_append_drops_the_window_and_claims_its_own_row(store) -> None:
    store.append("events", rows(1000), "w")
    (token,) = store.append("events", [ROW], "w")
    assert token == 2001
    assert _state(store).reserved is None
    # Not held below the dropped window: the writer's position is its own row.
    assert store.safe_positions(expire_writers=False)["events"] == 2001


def test_a_batch_append_drops_the_window(store) -> None:
    store.append("events", rows(1000), "w")
    batch = store.append("events", rows(300), "w", batch=True)
    assert set(batch) == {2001}
    assert _state(store).reserved is None  # a batch's commit reserves nothing
    assert store.safe_positions(expire_writers=False)["events"] == 2001


def test_a_writer_fenced_off_with_a_window_writes_its_rows_again_with_new_tokens(store, pg_url) -> None:
    master = open_store(pg_url)
    try:
        first = store.append("events", rows(1000), "w")  # reserves 1001..2000
        store.database.query("UPDATE tickline_writers SET heartbeat_ms = 0 RETURNING 1")
        master.safe_positions(expire_writers=True)  # the master's sweep: "w" is dead
        with pytest.raises(Fenced), store.writing("events", "w") as txn:
            doomed = txn.append(rows(1000))  # the window's tokens; the commit refuses
        assert doomed == list(range(1001, 2001))
        again = store.append("events", rows(1000), "w")  # registers again: new epoch, new tokens
        assert again[0] > 2000
        assert [token for token, _ in _stored(store)] == first + again
    finally:
        master.close()


def test_a_bad_row_in_an_append_with_a_window_commits_nothing(store) -> None:
    from storage.schema import RowError

    store.append("events", rows(1000), "w")
    bad = rows(1000)
    bad[700] = ["$e", "!r", 7, None, None]
    with pytest.raises(RowError):
        store.append("events", bad, "w")
    assert _state(store).reserved is None and not _state(store).inflight
    after = store.append("events", rows(1000), "w")
    assert after[0] > 2000
    assert [token for token, _ in _stored(store)] == list(range(1, 1001)) + after
