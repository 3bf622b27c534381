"""The timeline store on both backends: every operation's conditions, with an injected clock."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from storage.timeline_contract import (
    LEASE_EXPIRED,
    LEASED,
    NOT_HOLDER,
    NOT_OWNER,
    STALE_VERSION,
    UNKNOWN_MESSAGE,
    Outcome,
    new_message_id,
)
from storage.timeline_store import SqlTimelineStore, open_timeline_store

T0 = 1_700_000_000_000  # the injected clock's "now" (ms)


@pytest.fixture
def store(db_url: str):
    s = open_timeline_store(db_url)
    yield s
    s.close()


def _leased_one(store: SqlTimelineStore, consumer: str, now: int, lease: int = 1000, topic: str = "jobs"):
    leased = store.lease_due(topic, consumer, lease, 10, now)
    assert len(leased) == 1, leased
    return leased[0].message


def test_schedule_is_idempotent_by_id(store: SqlTimelineStore) -> None:
    first = store.schedule("jobs", "g", "a", T0 + 500, '{"x": 1}', T0)
    assert first.ok and first.created
    assert first.message is not None and first.message.version == 1 and first.message.ts == T0 + 500
    again = store.schedule("jobs", "g", "a", T0 + 9999, '{"x": 2}', T0 + 1)
    assert again.ok and not again.created
    assert again.message == first.message  # unchanged
    other = store.schedule("jobs", "other", "a", T0, "{}", T0)
    assert not other.ok and other.reason == NOT_OWNER
    # Same id in another topic is another message.
    assert store.schedule("mail", "g", "a", T0, "{}", T0).created


def test_generated_ids_are_sortable_and_unique(store: SqlTimelineStore) -> None:
    ids = [new_message_id(T0 + i // 3) for i in range(30)]
    assert len(set(ids)) == 30
    assert [i[:10] for i in ids] == sorted(i[:10] for i in ids)
    outcome = store.schedule("jobs", "g", None, T0, "null", T0)
    assert outcome.ok and outcome.message is not None and len(outcome.message.id) == 26


def test_lease_only_when_due_and_never_twice(store: SqlTimelineStore) -> None:
    store.schedule("jobs", "g", "a", T0 + 100, "1", T0)
    assert store.lease_due("jobs", "c1", 1000, 10, T0 + 99) == []
    leased = store.lease_due("jobs", "c1", 1000, 10, T0 + 100)
    assert len(leased) == 1
    m = leased[0].message
    assert (m.consumer, m.ts, m.version, leased[0].due_ms) == ("c1", T0 + 1100, 2, T0 + 100)
    assert m.status(T0 + 100) == "processing"
    # Active: nobody else gets it, not even the same consumer again.
    assert store.lease_due("jobs", "c2", 1000, 10, T0 + 1099) == []
    assert store.lease_due("jobs", "c1", 1000, 10, T0 + 1099) == []
    # Expired: the lease is the timestamp, the message is available again.
    again = _leased_one(store, "c2", T0 + 1100)
    assert again.consumer == "c2" and again.version == 3
    # The first holder is fenced.
    refused = store.delete("jobs", "a", "c1", 2, T0 + 1200)
    assert not refused.ok and refused.reason == NOT_HOLDER


def test_lease_due_earliest_first_and_bounded(store: SqlTimelineStore) -> None:
    for i in range(5):
        store.schedule("jobs", "g", f"m{i}", T0 - i, "{}", T0 - 10)
    leased = store.lease_due("jobs", "c", 100, 3, T0)
    assert [x.message.id for x in leased] == ["m4", "m3", "m2"]
    assert [x.message.id for x in store.lease_due("jobs", "c", 100, 3, T0)] == ["m1", "m0"]


def test_extend_conditions(store: SqlTimelineStore) -> None:
    assert store.extend("jobs", "nope", "c1", 1, 100, T0).reason == UNKNOWN_MESSAGE
    store.schedule("jobs", "g", "a", T0, "{}", T0)
    m = _leased_one(store, "c1", T0)
    assert store.extend("jobs", "a", "c2", m.version, 100, T0 + 1).reason == NOT_HOLDER
    assert store.extend("jobs", "a", "c1", m.version - 1, 100, T0 + 1).reason == STALE_VERSION
    ok = store.extend("jobs", "a", "c1", m.version, 5000, T0 + 500)
    assert ok.ok and ok.message is not None
    assert (ok.message.ts, ok.message.version) == (T0 + 5500, m.version + 1)
    # The old version is stale now.
    assert store.extend("jobs", "a", "c1", m.version, 100, T0 + 600).reason == STALE_VERSION
    assert store.extend("jobs", "a", "c1", m.version + 1, 100, T0 + 5500).reason == LEASE_EXPIRED


def test_release_conditions(store: SqlTimelineStore) -> None:
    store.schedule("jobs", "g", "a", T0, "{}", T0)
    m = _leased_one(store, "c1", T0)
    assert store.release("jobs", "a", "c2", m.version, 10, T0 + 1).reason == NOT_HOLDER
    assert store.release("jobs", "a", "c1", m.version + 5, 10, T0 + 1).reason == STALE_VERSION
    assert store.release("jobs", "a", "c1", m.version, 10, T0 + 1000).reason == LEASE_EXPIRED
    ok = store.release("jobs", "a", "c1", m.version, 300, T0 + 10)
    assert ok.ok and ok.message is not None
    assert (ok.message.consumer, ok.message.ts, ok.message.version) == (None, T0 + 310, m.version + 1)
    assert ok.message.status(T0 + 10) == "waiting"
    assert store.lease_due("jobs", "c2", 100, 10, T0 + 309) == []
    assert _leased_one(store, "c2", T0 + 310).consumer == "c2"


def test_delete_conditions_and_batch_remover(store: SqlTimelineStore) -> None:
    store.schedule("jobs", "g", "a", T0, "{}", T0)
    m = _leased_one(store, "c1", T0)
    assert store.delete("jobs", "a", "c1", m.version - 1, T0 + 1).reason == STALE_VERSION
    assert store.delete("jobs", "a", "c1", m.version, T0 + 1000).reason == LEASE_EXPIRED
    ok = store.delete("jobs", "a", "c1", m.version, T0 + 999)
    assert ok.ok and ok.message is not None and ok.message.version == m.version + 1
    assert store.get("jobs", "a") is None
    assert store.delete("jobs", "a", "c1", m.version + 1, T0 + 1000).reason == UNKNOWN_MESSAGE
    assert store.lease_due("jobs", "c1", 100, 10, T0 + 10_000) == []
    assert store.deleted_count() == 1
    assert store.remove_deleted(10) == 1
    assert store.deleted_count() == 0


def test_schedule_after_delete_is_a_new_message_with_a_higher_version(store: SqlTimelineStore) -> None:
    store.schedule("jobs", "g", "a", T0, "1", T0)
    m = _leased_one(store, "c1", T0)
    store.delete("jobs", "a", "c1", m.version, T0 + 1)
    again = store.schedule("jobs", "g", "a", T0 + 50, "2", T0 + 2)
    assert again.ok and again.created and again.message is not None
    assert again.message.version > m.version + 1 and again.message.body == "2"
    # The old holder's version does not reach the new message.
    assert store.delete("jobs", "a", "c1", m.version + 1, T0 + 3).reason == NOT_HOLDER


def test_move_and_cancel_conditions(store: SqlTimelineStore) -> None:
    assert store.move("jobs", "g", "a", T0, T0).reason == UNKNOWN_MESSAGE
    assert store.cancel("jobs", "g", "a", T0).reason == UNKNOWN_MESSAGE
    store.schedule("jobs", "g", "a", T0 + 100, "{}", T0)
    assert store.move("jobs", "h", "a", T0, T0).reason == NOT_OWNER
    assert store.cancel("jobs", "h", "a", T0).reason == NOT_OWNER
    moved = store.move("jobs", "g", "a", T0 + 50, T0)
    assert moved.ok and moved.message is not None and (moved.message.ts, moved.message.version) == (T0 + 50, 2)
    m = _leased_one(store, "c1", T0 + 50, lease=1000)
    assert store.move("jobs", "g", "a", T0 + 5000, T0 + 60).reason == LEASED
    assert store.cancel("jobs", "g", "a", T0 + 60).reason == LEASED
    # Once the lease expired the owner may move it again (the old lease is gone).
    late = store.move("jobs", "g", "a", T0 + 9000, T0 + 1050)
    assert late.ok and late.message is not None and late.message.consumer is None
    assert store.delete("jobs", "a", "c1", m.version, T0 + 1051).reason == NOT_HOLDER
    assert store.cancel("jobs", "g", "a", T0 + 1060).ok
    assert store.get("jobs", "a") is None


def test_counts_list_next_due_and_active_leases(store: SqlTimelineStore) -> None:
    assert store.next_due("jobs") is None
    store.schedule("jobs", "g", "past", T0 - 10, "{}", T0 - 20)
    store.schedule("jobs", "g", "soon", T0 + 100, "{}", T0)
    store.schedule("jobs", "g", "late", T0 + 100_000, "{}", T0)
    store.schedule("jobs", "g", "lease", T0, "{}", T0)
    assert store.next_due("jobs") == T0 - 10
    leased = store.lease_due("jobs", "c1", 500, 2, T0)
    assert {x.message.id for x in leased} == {"past", "lease"}
    assert store.next_due("jobs") == T0 + 100
    assert store.counts("jobs", T0) == {"available": 0, "waiting": 2, "processing": 2}
    assert store.counts("jobs", T0 + 500) == {"available": 3, "waiting": 1, "processing": 0}
    assert store.counts("jobs", T0, T0 + 50, T0 + 1000) == {"available": 0, "waiting": 1, "processing": 2}
    assert [m.id for m in store.list_messages("jobs", T0, "waiting")] == ["soon", "late"]
    assert [m.id for m in store.list_messages("jobs", T0, end_ms=T0 + 101)] == ["soon"]
    assert {m.id for m in store.active_leases("jobs", "c1", T0)} == {"past", "lease"}
    assert store.active_leases("jobs", "c1", T0 + 500) == []
    with pytest.raises(ValueError, match="unknown status"):
        store.list_messages("jobs", T0, "bogus")


def test_single_lease_conditions(store: SqlTimelineStore) -> None:
    assert store.lease("jobs", "a", "c", 100, T0).reason == UNKNOWN_MESSAGE
    store.schedule("jobs", "g", "a", T0 + 10, "{}", T0)
    assert not store.lease("jobs", "a", "c", 100, T0).ok
    assert store.lease("jobs", "a", "c", 100, T0 + 10).ok
    assert store.lease("jobs", "a", "d", 100, T0 + 20).reason == LEASED


def test_two_connections_race_for_one_message(db_url: str) -> None:
    stores = [open_timeline_store(db_url), open_timeline_store(db_url)]
    try:
        for round_ in range(20):
            mid = f"m{round_}"
            stores[0].schedule("jobs", "g", mid, T0, "{}", T0)
            barrier = threading.Barrier(2)
            results: dict[int, list] = {}

            def take(i: int, mid: str = mid, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                results[i] = [x.message.id for x in stores[i].lease_due("jobs", f"c{i}", 60_000, 10, T0 + 1)]

            threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            winners = [i for i in range(2) if mid in results[i]]
            assert len(winners) == 1, results
            holder = stores[0].get("jobs", mid)
            assert holder is not None and holder.consumer == f"c{winners[0]}"
    finally:
        for s in stores:
            s.close()


def test_lease_due_never_leases_more_than_asked(store: SqlTimelineStore) -> None:
    for i in range(200):
        store.schedule("jobs", "g", f"m{i:03}", T0 - 1000 + i, "{}", T0 - 2000)
    leased = store.lease_due("jobs", "c", 30_000, 10, T0)
    assert [x.message.id for x in leased] == [f"m{i:03}" for i in range(10)]
    assert store.counts("jobs", T0)["processing"] == 10


def test_a_batch_commits_together_and_each_change_keeps_its_own_condition(store: SqlTimelineStore) -> None:
    for i in range(5):
        store.schedule("jobs", "g", f"m{i}", T0, "{}", T0)
    leased = {x.message.id: x.message for x in store.lease_due("jobs", "c", 1000, 5, T0)}
    calls = [
        ("delete", ("jobs", "m0", "c", leased["m0"].version, T0 + 1)),
        ("delete", ("jobs", "m1", "c", leased["m1"].version - 1, T0 + 1)),  # stale
        ("delete", ("jobs", "m2", "other", leased["m2"].version, T0 + 1)),  # not the holder
        ("delete", ("jobs", "m0", "c", leased["m0"].version, T0 + 1)),  # the same message again: gone by then
        ("delete", ("jobs", "nope", "c", 1, T0 + 1)),
        ("delete", ("jobs", "m3", "c", leased["m3"].version, T0 + 1)),
        ("extend", ("jobs", "m4", "c", leased["m4"].version, 5000, T0 + 1)),
        ("schedule", ("jobs", "g", "new", T0 + 9, "[1]", T0 + 1)),
        ("next_due", ("jobs",)),
    ]
    results = store.apply(calls)
    assert [r.ok for r in results[:8]] == [True, False, False, False, False, True, True, True]
    assert [r.reason for r in results[1:5]] == [STALE_VERSION, NOT_HOLDER, UNKNOWN_MESSAGE, UNKNOWN_MESSAGE]
    assert results[8] == T0 + 9
    assert store.get("jobs", "m0") is None and store.get("jobs", "m3") is None
    assert store.get("jobs", "m1") is not None
    with pytest.raises(ValueError, match="cannot run in a batch"):
        store.apply([("remove_deleted", (10,))])


def test_an_expired_lease_goes_to_another_consumer_first(store: SqlTimelineStore) -> None:
    store.schedule("jobs", "g", "a", T0, "{}", T0)
    first = _leased_one(store, "A", T0, lease=100)
    assert first.consumer == "A"
    # A comes first in the pass and has room, yet B gets the message A abandoned.
    results, next_due = store.lease_pass("jobs", [("A", 100, 1), ("B", 100, 1)], T0 + 100)
    assert [[x.message.id for x in r] for r in results] == [[], ["a"]]
    assert next_due == T0 + 200
    # A lone consumer gets its own expired message back.
    results, _ = store.lease_pass("jobs", [("B", 100, 1)], T0 + 200)
    assert [x.message.consumer for x in results[0]] == ["B"]


def test_expired_leases_are_swapped_off_their_last_holders(store: SqlTimelineStore) -> None:
    store.schedule("jobs", "g", "a", T0, "{}", T0)
    store.schedule("jobs", "g", "b", T0 + 1, "{}", T0)
    (a,) = [x.message for x in store.lease_due("jobs", "A", 100, 1, T0 + 1)]
    (b,) = [x.message for x in store.lease_due("jobs", "B", 100, 1, T0 + 1)]
    assert (a.id, b.id) == ("a", "b")
    # Dealt in turn, A would get "a" back and B "b": each goes to the other.
    results, _ = store.lease_pass("jobs", [("A", 50, 1), ("B", 70, 1)], T0 + 200)
    assert [[(x.message.id, x.message.consumer, x.message.ts) for x in r] for r in results] == [
        [("b", "A", T0 + 250)],
        [("a", "B", T0 + 270)],
    ]
    stored = store.get("jobs", "a")
    assert stored is not None and stored.version == a.version + 1  # one change: one version step


def _lease_pass_one(store: SqlTimelineStore, consumer: str, n: int, now: int, lease: int = 1000) -> list[Any]:
    results, _ = store.lease_pass("jobs", [(consumer, lease, n)], now)
    return results[0]


def test_a_cycle_deletes_and_leases_the_credit_it_frees_in_one_transaction(store: SqlTimelineStore) -> None:
    for i in range(4):
        store.schedule("jobs", "g", f"m{i}", T0, "{}", T0)
    held = _lease_pass_one(store, "c", 2, T0)
    assert [x.message.id for x in held] == ["m0", "m1"]
    calls = [("delete", ("jobs", x.message.id, "c", x.message.version, T0 + 1, x.tid)) for x in held]
    # The consumer has no free credit before the cycle (asks 0): each successful DELETE frees one.
    results, passes = store.cycle(calls, [(0, 0), (0, 0)], [("jobs", [("c", 1000, 0)], T0 + 1)])
    assert [r.ok for r in results] == [True, True]
    assert [r.message.version for r in results] == [x.message.version + 1 for x in held]
    (result,) = passes
    assert [x.message.id for x in result.leased[0]] == ["m2", "m3"] and result.more
    assert store.get("jobs", "m0") is None and store.get("jobs", "m1") is None
    assert store.counts("jobs", T0 + 1)["processing"] == 2


def test_a_refused_change_in_a_cycle_changes_nothing_and_frees_no_credit(store: SqlTimelineStore) -> None:
    for i in range(5):
        store.schedule("jobs", "g", f"m{i}", T0, "{}", T0)
    held = {x.message.id: x for x in _lease_pass_one(store, "c", 3, T0)}
    m0, m1, m2 = held["m0"], held["m1"], held["m2"]
    calls = [
        ("delete", ("jobs", "m0", "c", m0.message.version - 1, T0 + 1, m0.tid)),  # stale version
        ("delete", ("jobs", "m1", "c", m1.message.version, T0 + 1, m1.tid)),  # ok
        ("delete", ("jobs", "m2", "other", m2.message.version, T0 + 1, m2.tid)),  # not the holder
        ("delete", ("jobs", "m0", "c", m0.message.version, T0 + 1, m0.tid)),  # the same message: done one by one
        ("extend", ("jobs", "m2", "c", m2.message.version, 5000, T0 + 1)),
    ]
    results, (result,) = store.cycle(calls, [(0, 0), (0, 0), (0, 0), None, None], [("jobs", [("c", 1000, 0)], T0 + 1)])
    assert [r.ok for r in results] == [False, True, False, True, True]
    assert [results[0].reason, results[2].reason] == [STALE_VERSION, NOT_HOLDER]
    # Only the one DELETE that counts as freeing and succeeded gave credit: one new lease.
    assert [x.message.id for x in result.leased[0]] == ["m3"]
    assert store.get("jobs", "m1") is None and store.get("jobs", "m0") is None
    extended = store.get("jobs", "m2")
    assert extended is not None and extended.consumer == "c" and extended.ts == T0 + 5001


def test_a_stale_row_hint_falls_back_to_the_primary_key(store: SqlTimelineStore) -> None:
    store.schedule("jobs", "g", "a", T0, "{}", T0)
    (x,) = _lease_pass_one(store, "c", 1, T0)
    moved = store.extend("jobs", "a", "c", x.message.version, 5000, T0 + 1)  # the row moves (a new version)
    assert moved.ok and moved.message is not None
    results, _ = store.cycle([("delete", ("jobs", "a", "c", moved.message.version, T0 + 2, x.tid))], [None], [])
    assert results[0].ok and store.get("jobs", "a") is None


def test_a_database_error_rolls_the_whole_cycle_back(store: SqlTimelineStore) -> None:
    for i in range(3):
        store.schedule("jobs", "g", f"m{i}", T0, "{}", T0)
    (x,) = _lease_pass_one(store, "c", 1, T0)

    def broken(topic: str, message_id: str, consumer: str, version: int, lease_ms: int, now_ms: int) -> Outcome:
        raise RuntimeError("disk on fire")

    store.extend = broken  # type: ignore[method-assign]
    calls = [
        ("delete", ("jobs", x.message.id, "c", x.message.version, T0 + 1, None)),
        ("schedule", ("jobs", "g", "new", T0, "{}", T0 + 1)),
        ("extend", ("jobs", "m1", "c", 1, 1000, T0 + 1)),
    ]
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.cycle(calls, [(0, 0), None, None], [("jobs", [("c", 1000, 2)], T0 + 1)])
    # Nothing of it happened: the delete, the schedule and the leases are all rolled back.
    assert store.get("jobs", x.message.id) == x.message
    assert store.get("jobs", "new") is None
    assert store.counts("jobs", T0 + 1) == {"available": 2, "waiting": 0, "processing": 1}


@pytest.mark.parametrize("mid", ['q"uote', "back\\slash", "com,ma", "{brace}", "ünï"])
def test_ids_with_array_syntax_go_through_a_cycle(store: SqlTimelineStore, mid: str) -> None:
    store.schedule("jobs", "g", mid, T0, "{}", T0)
    results, (result,) = store.cycle([], [], [("jobs", [('c"1\\', 1000, 1)], T0)])
    (x,) = result.leased[0]
    assert x.message.id == mid and x.message.consumer == 'c"1\\'
    results, _ = store.cycle([("delete", ("jobs", mid, 'c"1\\', x.message.version, T0 + 1, x.tid))], [None], [])
    assert results[0].ok and store.get("jobs", mid) is None


def test_two_cycles_racing_never_lease_one_message_twice(db_url: str) -> None:
    stores = [open_timeline_store(db_url), open_timeline_store(db_url)]
    try:
        for i in range(40):
            stores[0].schedule("jobs", "g", f"m{i:02}", T0, "{}", T0)
        barrier = threading.Barrier(2)
        taken: dict[int, list[str]] = {0: [], 1: []}

        def take(k: int) -> None:
            barrier.wait()
            for _ in range(10):
                _, (result,) = stores[k].cycle([], [], [("jobs", [(f"a{k}", 60_000, 2), (f"b{k}", 60_000, 1)], T0 + 1)])
                taken[k].extend(x.message.id for got in result.leased for x in got)

        threads = [threading.Thread(target=take, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ids = taken[0] + taken[1]
        assert len(ids) == len(set(ids)) == 40, taken
        for k in range(2):
            for mid in taken[k]:
                held = stores[0].get("jobs", mid)
                assert held is not None and held.consumer in (f"a{k}", f"b{k}")
    finally:
        for s in stores:
            s.close()
