"""The master's timeline service with an injected clock (task.Clock) and a real store (both backends).

Storage calls go through a runner the test drives, so the interleavings
(a connection lost while a lease pass is out) are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from twisted.internet import defer, task
from twisted.internet.base import DelayedCall

from replication.commands import (
    Command,
    parse_line,
)
from replication.reactor_types import Transport
from replication.timeline import TimelineService
from replication.timeline_commands import (
    DeleteCommand,
    ExtendCommand,
    LeaseCommand,
    ReleaseCommand,
    ScheduleCommand,
    TimelineCommand,
)
from replication.timeline_settings import TimelineSettings
from storage.timeline_contract import PassResult
from storage.timeline_store import open_timeline_store

T0 = 1_700_000_000.0  # seconds


class Runner:
    """Storage calls queue here until the test runs them (one by one, in order)."""

    def __init__(self) -> None:
        self.queue: list[tuple[Callable[..., Any], tuple, defer.Deferred]] = []

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> defer.Deferred[Any]:
        d: defer.Deferred[Any] = defer.Deferred()
        self.queue.append((lambda: fn(*args, **kwargs), (), d))
        return d

    def step(self) -> bool:
        if not self.queue:
            return False
        fn, _, d = self.queue.pop(0)
        try:
            result = fn()
        except Exception as e:  # pragma: no cover
            d.errback(e)
        else:
            d.callback(result)
        return True


class Conn:
    def __init__(self, name: str) -> None:
        self.conn_name = name
        self.paused = False
        self.read_closed = False
        self.transport: Transport | None = None
        self.sent: list[Command] = []

    def send(self, command: Command) -> None:
        self.sent.append(command)

    def send_lines(self, name: str, data: bytes, count: int) -> None:
        lines = data.decode().splitlines()
        assert len(lines) == count and all(line.startswith(name + " ") for line in lines)
        self.sent.extend(parse_line(line) for line in lines)

    def finish_after_half_close(self) -> None:
        pass

    def leases(self) -> list[LeaseCommand]:
        return [c for c in self.sent if isinstance(c, LeaseCommand)]

    def answers(self) -> list[str]:
        return [c.to_line() for c in self.sent if not isinstance(c, LeaseCommand)]


@pytest.fixture
def env(db_url: str):
    clock = task.Clock()
    clock.advance(T0)
    runner = Runner()
    store = open_timeline_store(db_url)
    service = TimelineService(store, TimelineSettings(batch=4, remove_interval=3600), runner, clock)

    def settle(advance: float = 0.0) -> None:
        clock.advance(advance)
        while runner.step() or any(c.getTime() <= clock.seconds() for c in delayed_calls(clock)):
            clock.advance(0)

    service.start()
    settle()
    yield service, clock, runner, settle
    service.stop()
    store.close()


def delayed_calls(clock: task.Clock) -> Sequence[DelayedCall]:
    """The clock's pending calls (``base.DelayedCall``s; Twisted types them as the zope interface)."""
    return cast("Sequence[DelayedCall]", clock.getDelayedCalls())


def ms(seconds: float) -> int:
    return int(seconds * 1000)


def timers(clock: task.Clock) -> list[float]:
    return sorted(round(c.getTime() - clock.seconds(), 3) for c in delayed_calls(clock))


def test_sleeps_until_the_next_due_message_without_polling(env) -> None:
    service, clock, _, settle = env
    producer, worker = Conn("p"), Conn("w")
    service.command(worker, TimelineCommand("jobs", "w", 5, 10_000))
    settle()
    assert timers(clock) == [3600.0]  # only the batch remover: no polling
    service.command(producer, ScheduleCommand("jobs", "g", "a", 5000, True, "{}"))
    settle()
    assert producer.answers()[0].startswith("ACK SCHEDULE jobs a 1 ")
    assert timers(clock) == [5.0, 3600.0]  # one timer, at the due time
    settle(4.999)
    assert worker.leases() == []
    settle(0.001)
    (lease,) = worker.leases()
    assert (lease.id, lease.version, lease.until_ms) == ("a", 2, ms(T0 + 5) + 10_000)
    assert service.stats.lateness_count == 1 and service.stats.lateness_sum == 0


def test_moving_a_message_earlier_moves_the_timer(env) -> None:
    service, clock, _, settle = env
    p, w = Conn("p"), Conn("w")
    service.command(w, TimelineCommand("jobs", "w", 5, 10_000))
    service.command(p, ScheduleCommand("jobs", "g", "a", 60_000, True, "{}"))
    settle()
    assert timers(clock)[0] == 60.0
    service.command(p, ScheduleCommand("jobs", "g", "b", 2_000, True, "{}"))
    settle()
    assert timers(clock)[0] == 2.0
    settle(2.0)
    assert [x.id for x in w.leases()] == ["b"]


def test_an_expired_lease_wakes_the_master_and_goes_out_again(env) -> None:
    service, _clock, _, settle = env
    p, a = Conn("p"), Conn("a")
    service.command(p, ScheduleCommand("jobs", "g", "a", 0, True, "{}"))
    service.command(a, TimelineCommand("jobs", "A", 1, 1_000))
    settle()
    assert [x.version for x in a.leases()] == [2]
    b = Conn("b")
    service.command(b, TimelineCommand("jobs", "B", 1, 1_000))
    settle(0.999)
    assert b.leases() == [] and len(a.leases()) == 1
    settle(0.001)
    # Re-delivered to the other consumer (A had room too, but abandoned it).
    assert [x.version for x in b.leases()] == [3] and len(a.leases()) == 1
    assert service.stats.expired == 1
    # The first holder is fenced.
    service.command(a, DeleteCommand("jobs", "a", 2))
    settle()
    assert a.answers()[-1] == "NACK DELETE jobs a not the holder"


def test_credit_bounds_active_leases_and_delete_frees_it(env) -> None:
    service, _, _, settle = env
    p, w = Conn("p"), Conn("w")
    for i in range(5):
        service.command(p, ScheduleCommand("jobs", "g", f"m{i}", 0, True, "{}"))
    service.command(w, TimelineCommand("jobs", "w", 2, 10_000))
    settle()
    assert [x.id for x in w.leases()] == ["m0", "m1"]
    service.command(w, DeleteCommand("jobs", "m0", 2))
    settle()
    assert w.answers()[-1].startswith("ACK DELETE jobs m0 3 ")
    assert [x.id for x in w.leases()] == ["m0", "m1", "m2"]
    service.command(w, ReleaseCommand("jobs", "m1", 2, 500))
    settle()
    assert [x.id for x in w.leases()] == ["m0", "m1", "m2", "m3"]
    service.command(w, ExtendCommand("jobs", "m2", 2, 20_000))
    settle()
    assert w.answers()[-1] == f"ACK EXTEND jobs m2 3 {ms(T0) + 20_000}"


def test_bursts_are_paced_and_spread_fairly(env) -> None:
    service, _clock, _runner, settle = env
    p = Conn("p")
    for i in range(60):
        service.command(p, ScheduleCommand("jobs", "g", f"m{i:02}", 0, True, "{}"))
    settle()
    passes: list[list[int]] = []
    cycle = service.store.cycle

    def recording(calls: list, frees: list, requests: list) -> Any:
        passes.extend([n for _, _, n in reqs] for _, reqs, _ in requests)
        return cycle(calls, frees, requests)

    service.store.cycle = recording
    workers = [Conn(f"w{i}") for i in range(3)]
    for i, w in enumerate(workers):
        service.command(w, TimelineCommand("jobs", f"w{i}", 100, 10_000))
    settle()
    # Each pass asks at most `batch` (4) leases per consumer; the reactor turns between passes.
    assert passes and all(n <= 4 for asked in passes for n in asked)
    assert len(passes) >= 60 // 12
    counts = [len(w.leases()) for w in workers]
    assert sum(counts) == 60 and min(counts) >= 12, counts  # w0 started a pass earlier
    ids = [x.id for w in workers for x in w.leases()]
    assert len(set(ids)) == 60


def test_paused_connection_gets_nothing_until_it_resumes(env) -> None:
    service, _, _, settle = env
    p, w = Conn("p"), Conn("w")
    w.paused = True
    service.command(w, TimelineCommand("jobs", "w", 5, 10_000))
    service.command(p, ScheduleCommand("jobs", "g", "a", 0, True, "{}"))
    settle()
    assert w.leases() == []
    w.paused = False
    service.resumed(w)
    settle()
    assert [x.id for x in w.leases()] == ["a"]


def test_a_lease_taken_for_a_connection_that_went_away_is_released_at_once(env) -> None:
    service, clock, runner, settle = env
    p, w, other = Conn("p"), Conn("w"), Conn("o")
    service.command(p, ScheduleCommand("jobs", "g", "a", 0, True, "{}"))
    settle()
    service.command(w, TimelineCommand("jobs", "w", 5, 60_000))
    runner.step()  # w's active leases (none); a cycle with the lease pass at the end of the turn
    clock.advance(0)
    assert len(runner.queue) == 1
    service.connection_lost(w)  # ... and w goes away before the pass runs
    runner.step()  # the pass leases "a" for w in storage, finds w gone, queues the release
    held = service.store.get("jobs", "a")
    assert held is not None and held.consumer == "w"
    settle()
    released = service.store.get("jobs", "a")
    assert released is not None and released.consumer is None and released.ts <= ms(T0)
    service.command(other, TimelineCommand("jobs", "o", 5, 60_000))
    settle()
    assert [x.id for x in other.leases()] == ["a"]
    assert w.leases() == []


def test_answers_keep_command_order_and_commands_on_one_id_run_in_order(env) -> None:
    service, _, _, settle = env
    p = Conn("p")
    service.command(p, ScheduleCommand("jobs", "g", "a", 1000, True, '{"v":1}'))
    service.command(p, ScheduleCommand("jobs", "g", "a", 9000, True, '{"v":2}'))
    service.command(p, ScheduleCommand("jobs", "g", "b", 1000, True, "{}"))
    settle()
    a1, a2, b = p.answers()
    assert a1 == a2 and a1.startswith("ACK SCHEDULE jobs a 1 ") and b.startswith("ACK SCHEDULE jobs b 1 ")
    stored = service.store.get("jobs", "a")
    assert stored is not None and stored.body == '{"v":1}'


def test_a_returning_consumer_gets_its_leases_first(env) -> None:
    service, _, _, settle = env
    p, w = Conn("p"), Conn("w")
    for i in range(3):
        service.command(p, ScheduleCommand("jobs", "g", f"m{i}", 0, True, "{}"))
    service.command(w, TimelineCommand("jobs", "w", 2, 60_000))
    settle()
    first = [(x.id, x.version) for x in w.leases()]
    service.connection_lost(w)
    w2 = Conn("w2")
    service.command(w2, TimelineCommand("jobs", "w", 2, 60_000))
    settle()
    assert [(x.id, x.version) for x in w2.leases()] == first


def test_a_body_whose_lease_line_would_not_fit_is_refused(tmp_path: Path) -> None:
    clock = task.Clock()
    store = open_timeline_store(f"sqlite:///{tmp_path}/t.db")
    runner = Runner()
    service = TimelineService(store, TimelineSettings(), runner, clock, max_line_bytes=100)
    p = Conn("p")
    service.command(p, ScheduleCommand("jobs", "g", "b", 0, True, '"' + "x" * 60 + '"'))
    assert p.answers() == [
        "ERROR SCHEDULE jobs: body too long: its LEASE line could be 115 bytes, the line limit is 100"
    ]
    service.command(p, ScheduleCommand("jobs", "g", "a", 0, True, '"' + "x" * 40 + '"'))
    clock.advance(0)
    while runner.step():
        pass
    assert p.answers()[-1].startswith("ACK SCHEDULE jobs a 1 ")
    assert store.get("jobs", "b") is None
    store.close()


def _record_cycles(service: TimelineService) -> list[tuple[list[str], list[list[tuple[str, int, int]]]]]:
    """Each storage transaction of the service: the changes' names and the lease requests."""
    seen: list[tuple[list[str], list[list[tuple[str, int, int]]]]] = []
    cycle = service.store.cycle

    def recording(
        calls: Sequence[tuple[str, tuple[Any, ...]]],
        frees: Sequence[tuple[int, int] | None],
        passes: Sequence[tuple[str, Sequence[tuple[str, int, int]], int]],
    ) -> tuple[list[Any], list[PassResult]]:
        seen.append(([name for name, _ in calls], [list(reqs) for _, reqs, _ in passes]))
        return cycle(calls, frees, passes)

    service.store.cycle = recording  # type: ignore[method-assign]  # a deliberate wrapper
    return seen


def test_a_delete_and_the_lease_it_frees_share_one_transaction_and_ack_waits_for_its_commit(env) -> None:
    service, clock, runner, settle = env
    p, w = Conn("p"), Conn("w")
    for i in range(2):
        service.command(p, ScheduleCommand("jobs", "g", f"m{i}", 0, True, "{}"))
    service.command(w, TimelineCommand("jobs", "w", 1, 10_000))
    settle()
    assert [x.id for x in w.leases()] == ["m0"]
    cycles = _record_cycles(service)
    service.command(w, DeleteCommand("jobs", "m0", 2))
    clock.advance(0)  # the cycle goes out at the end of the reactor turn
    assert len(runner.queue) == 1 and w.answers() == []  # not committed yet: no ACK
    runner.step()  # the one transaction commits
    assert w.answers() == [f"ACK DELETE jobs m0 3 {ms(T0) + 10_000}"]
    assert [x.id for x in w.leases()] == ["m0", "m1"]  # the credit it freed, in the same commit
    assert cycles == [(["delete"], [[("w", 10_000, 0)]])]
    settle()
    assert len(w.leases()) == 2  # never more than the credit


def test_a_refused_change_does_not_fail_the_others_in_its_transaction(env) -> None:
    service, _clock, _runner, settle = env
    p, a, b = Conn("p"), Conn("a"), Conn("b")
    for i in range(3):
        service.command(p, ScheduleCommand("jobs", "g", f"m{i}", 0, True, "{}"))
    service.command(a, TimelineCommand("jobs", "A", 1, 10_000))
    service.command(b, TimelineCommand("jobs", "B", 1, 10_000))
    settle()
    (la,), (lb,) = a.leases(), b.leases()
    cycles = _record_cycles(service)
    service.command(a, DeleteCommand("jobs", la.id, la.version - 1))  # stale version
    service.command(b, DeleteCommand("jobs", lb.id, lb.version))
    settle()
    assert cycles[0][0] == ["delete", "delete"]  # one transaction
    assert a.answers() == [f"NACK DELETE jobs {la.id} stale version"]
    assert b.answers() == [f"ACK DELETE jobs {lb.id} {lb.version + 1} {lb.until_ms}"]
    kept = service.store.get("jobs", la.id)
    assert kept is not None and kept.consumer == "A" and kept.version == la.version  # unchanged
    assert len(a.leases()) == 1 and [x.id for x in b.leases()] == [lb.id, "m2"]


def test_a_failed_transaction_answers_error_and_sends_no_lease(env) -> None:
    service, _clock, _runner, settle = env
    p, w = Conn("p"), Conn("w")
    for i in range(2):
        service.command(p, ScheduleCommand("jobs", "g", f"m{i}", 0, True, "{}"))
    service.command(w, TimelineCommand("jobs", "w", 1, 10_000))
    settle()
    (lease,) = w.leases()
    cycle = service.store.cycle

    def broken(calls: list, frees: list, passes: list) -> Any:
        service.store.cycle = cycle
        raise RuntimeError("connection reset")

    service.store.cycle = broken
    service.command(w, DeleteCommand("jobs", lease.id, lease.version))
    settle()
    assert w.answers() == ["ERROR DELETE failed: storage unavailable (connection reset); retry"]
    assert len(w.leases()) == 1
    stored = service.store.get("jobs", lease.id)
    assert stored is not None and stored.consumer == "w"  # nothing changed
    service.command(w, DeleteCommand("jobs", lease.id, lease.version))
    settle()
    assert w.answers()[-1].startswith(f"ACK DELETE jobs {lease.id} ")
    assert [x.id for x in w.leases()] == [lease.id, "m1"]


def test_the_remover_takes_batches_while_they_come_full(db_url: str) -> None:
    clock = task.Clock()
    clock.advance(T0)
    store = open_timeline_store(db_url)
    for i in range(5):
        store.schedule("jobs", "g", f"m{i}", ms(T0), "{}", ms(T0))
    for x in store.lease_due("jobs", "c", 1000, 5, ms(T0)):
        assert store.delete("jobs", x.message.id, "c", x.message.version, ms(T0)).ok
    assert store.deleted_count() == 5
    runner = Runner()
    service = TimelineService(store, TimelineSettings(remove_batch=2, remove_interval=3600), runner, clock)
    service.start()
    clock.advance(0)
    while runner.step() or (delayed_calls(clock) and min(c.getTime() for c in delayed_calls(clock)) <= clock.seconds()):
        clock.advance(0)
    assert store.deleted_count() == 0  # 2 + 2 + 1 in one run, each batch its own transaction
    assert service.stats.counts["jobs"] == {"available": 0, "waiting": 0, "processing": 0}
    service.stop()
    store.close()


def test_the_timer_fires_at_the_due_ms_not_a_fraction_later(env) -> None:
    service, clock, _, settle = env
    p, w = Conn("p"), Conn("w")
    service.command(w, TimelineCommand("jobs", "w", 5, 10_000))
    settle(0.0004)  # the clock is 0.4 ms into a millisecond
    service.command(p, ScheduleCommand("jobs", "g", "a", ms(T0) + 5, False, "{}"))
    settle()
    settle(0.0045)  # T0 + 4.9 ms: not yet
    assert w.leases() == []
    settle((ms(T0) + 5) / 1000 - clock.seconds())  # T0 + 5.0 ms: due now, leased now (not at T0 + 5.4 ms)
    assert [x.id for x in w.leases()] == ["a"]
    assert service.stats.lateness_sum == 0
