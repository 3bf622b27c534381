"""Ordered delivery across streams, TICK, start at a time and lag, at the protocol level.

Driven like ``test_worker_protocol``: real command lines into the worker's
``ClientProtocol``, a real worker database, applies held or run at once so
every interleaving is chosen by the test.
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from replication.protocol import ProtocolConfig
from replication.streams import all_streams
from storage.schema import Column, StreamSchema
from storage.tso import compose
from storage.worker_store import open_worker_store
from tests.workers.test_worker_protocol import SyncDB
from workers.handlers import HandlerRegistry
from workers.worker import Worker, WorkerConfig

NOTES = StreamSchema("notes", (Column("body", "text"),))
BASE_MS = 1_790_000_000_000


def ts(ms: int, logical: int = 0) -> int:
    return compose(BASE_MS + ms, logical)


class Harness:
    def __init__(self, url: str, **config: Any) -> None:
        self.clock = Clock()
        self.got: list[tuple[str, int, int]] = []  # (stream, token, ts) as handlers saw them
        handlers = HandlerRegistry()
        for stream in ("events", "notes"):
            handlers.register(stream, self._record)
        self.store = open_worker_store(url)
        self.db = SyncDB()
        self.worker = Worker(
            WorkerConfig(name="w", invalidate_caches=False, **config),
            ProtocolConfig(),
            self.store,
            all_streams([NOTES]),
            self.clock,
            handlers,
            db=self.db,
        )
        self.worker.prepare()
        self.transport = StringTransport()
        self.proto = self.worker.client_protocol()
        self.proto.makeConnection(self.transport)

    def _record(self, ctx: Any, rows: list) -> None:
        self.got.extend((r.stream, r.token, r.ts) for r in rows)

    def send(self, *lines: str) -> None:
        # A tickline master answers OPTIONS right after SERVER.
        lines = tuple(x for line in lines for x in ([line, self.acknowledge] if line.startswith("SERVER ") else [line]))
        self.proto.dataReceived("".join(line + "\n" for line in lines).encode())

    acknowledge = "OPTIONS live tick ts"

    def release(self) -> tuple[str, int]:
        """Run the oldest held apply; returns its (stream, token)."""
        assert self.db.hold is not None, "the test holds applies (db.hold = [])"
        d, fn, args, kwargs = self.db.hold.pop(0)
        d.callback(fn(*args, **kwargs))
        return args[0], args[1]

    def sent(self) -> list[str]:
        out = self.transport.value().decode().splitlines()
        self.transport.clear()
        return [line for line in out if not line.startswith("PING ")]

    def start(self) -> None:
        self.send("SERVER s", "POSITION events m 0 0", "POSITION notes m 0 0")

    def tokens(self) -> list[tuple[str, int]]:
        return [(s, t) for s, t, _ in self.got]


def ev(token: int, t: int) -> str:
    return f'RDATA events m {token} ["$e{token}", "!r", "t", null, null, {t}]'


def note(token: int, t: int) -> str:
    return f'RDATA notes m {token} ["n{token}", {t}]'


@pytest.fixture
def h(db_url: str) -> Harness:
    return Harness(db_url)


def test_ordered_by_default_with_two_handled_streams(db_url: str) -> None:
    assert Harness(db_url).worker.ordering is not None
    assert Harness(db_url, ordered=False).worker.ordering is None


def test_rows_wait_for_the_other_streams_safe_time_then_go_lowest_first(h) -> None:
    h.start()
    h.send(ev(1, ts(10)), ev(2, ts(30)))
    assert h.got == []  # notes has said nothing: it may still have older rows
    h.send(note(1, ts(20)))
    # notes is complete up to 20: events 1 (10) and notes 1 (20) go; events 2 (30) waits.
    assert h.tokens() == [("events", 1), ("notes", 1)]
    h.send(f"TICK notes 1 {ts(40)}")
    assert h.tokens() == [("events", 1), ("notes", 1), ("events", 2)]
    stamps = [t for _, _, t in h.got]
    assert stamps == sorted(stamps)


def test_an_idle_stream_holds_nothing_back_beyond_its_tick(h) -> None:
    h.start()
    h.send(f"TICK notes 0 {ts(5)}", f"TICK events 0 {ts(5)}")
    h.send(ev(1, ts(10)))
    assert h.got == []
    h.send(f"TICK notes 0 {ts(11)}")
    assert h.tokens() == [("events", 1)]


def test_a_tick_counts_only_once_its_token_is_received(h) -> None:
    h.start()
    h.send(ev(1, ts(10)))
    h.send(f"TICK notes 3 {ts(50)}")  # notes rows up to 3 are not here yet
    assert h.got == []
    h.send(note(3, ts(8)))
    h.send(f"TICK notes 3 {ts(50)}")
    assert h.tokens() == [("notes", 3), ("events", 1)]


def test_a_stream_that_is_behind_holds_the_others_back_and_shows_it(h) -> None:
    h.start()
    h.send(f"TICK notes 0 {ts(1)}")
    h.send(ev(1, ts(10)), ev(2, ts(20)))
    assert h.worker.ordering.blocking() == {"notes"}
    assert h.worker.ordering.lanes["events"].pending_rows == 2
    h.send(note(1, ts(15)), f"TICK notes 1 {ts(25)}")
    assert h.tokens() == [("events", 1), ("notes", 1), ("events", 2)]
    assert h.worker.ordering.blocking() == set()


def test_applies_keep_the_release_order_across_streams(db_url: str) -> None:
    h = Harness(db_url)
    h.db.hold = []
    h.start()
    h.send(ev(1, ts(10)), note(1, ts(20)), ev(2, ts(30)), f"TICK notes 1 {ts(40)}", f"TICK events 2 {ts(40)}")
    # One apply at a time, in release order, although both streams have work.
    for expected in [("events", 1), ("notes", 1), ("events", 2)]:
        assert len(h.db.hold) == 1
        assert h.release() == expected
    assert h.tokens() == [("events", 1), ("notes", 1), ("events", 2)]


def test_batches_and_positions_keep_token_order_within_a_stream(h) -> None:
    h.start()
    h.send(f"TICK notes 0 {ts(100)}")
    h.send(
        f'RDATA events m batch ["$a", "!r", "t", null, null, {ts(10, 0)}]',
        f'RDATA events m 4 ["$b", "!r", "t", null, null, {ts(10, 1)}]',
        "POSITION events m 4 6",
        ev(7, ts(20)),
    )
    assert h.tokens() == [("events", 4), ("events", 4), ("events", 7)]
    assert h.store.applied_tokens()["events"] == 7


def test_reconnect_drops_what_waits_and_replays_exactly_once(h) -> None:
    h.start()
    h.send(ev(1, ts(10)), f"TICK notes 0 {ts(11)}")
    assert h.tokens() == [("events", 1)]
    h.send(ev(2, ts(20)))
    from twisted.internet.error import ConnectionLost
    from twisted.python.failure import Failure

    h.proto.connectionLost(Failure(ConnectionLost()))
    assert h.worker.ordering.lanes["events"].pending_rows == 0
    h.transport = StringTransport()
    h.proto = h.worker.client_protocol()
    h.proto.makeConnection(h.transport)
    h.send("SERVER s")
    assert "REPLICATE events 1" in h.sent()
    h.send("POSITION events m 1 1", "POSITION notes m 0 0", ev(2, ts(20)), f"TICK notes 0 {ts(30)}")
    assert h.tokens() == [("events", 1), ("events", 2)]


def test_lag_is_about_zero_for_an_idle_stream_and_grows_while_rows_wait(db_url: str) -> None:
    h = Harness(db_url, ordered=False)
    h.start()
    now = BASE_MS + 1000
    assert h.worker.consumers["notes"].lag_ms(now) is None  # nothing known yet
    h.send(f"TICK notes 0 {ts(999)}")
    assert h.worker.consumers["notes"].lag_ms(now) == 1
    h.db.hold = []
    h.send(ev(1, ts(500)), f"TICK events 1 {ts(999)}")
    events = h.worker.consumers["events"]
    assert events.lag_ms(now) == 501  # row 1 waits: complete just below it
    assert events.lag_ms(now + 5000) == 5501  # and it grows while nothing is applied
    h.release()
    assert events.lag_ms(now) == 1  # applied, and the tick above it counts


def test_start_at_a_time_for_a_new_stream(db_url: str) -> None:
    h = Harness(db_url, start_at_ms=BASE_MS, ordered=False)
    h.sent()
    h.send("SERVER s")
    assert sorted(h.sent()) == [f"REPLICATE events @{BASE_MS}", f"REPLICATE notes @{BASE_MS}"]
    h.send("POSITION events m 41 41", ev(42, ts(1)), "POSITION notes m 0 0")
    assert h.tokens() == [("events", 42)]
    assert h.store.applied_tokens()["events"] == 42
    # After a restart the applied token is used, not the time.
    h2 = Harness(db_url, start_at_ms=BASE_MS, ordered=False)
    h2.sent()
    h2.send("SERVER s")
    assert sorted(h2.sent()) == ["REPLICATE events 42", f"REPLICATE notes @{BASE_MS}"]


def test_the_start_position_itself_is_applied(db_url: str) -> None:
    h = Harness(db_url, start_at_ms=BASE_MS, ordered=False)
    h.send("SERVER s", "POSITION events m 41 41", "POSITION notes m 0 0")
    assert h.store.applied_tokens()["events"] == 41


def test_rows_held_for_a_stream_that_is_behind_are_bounded_and_asked_for_again(db_url: str) -> None:
    h = Harness(db_url, max_pending_rows=2)  # at most 4 rows held back
    h.start()
    h.sent()
    h.send(f"TICK notes 0 {ts(5)}")
    h.send(*(ev(i, ts(10 * i)) for i in range(1, 6)))
    # notes is behind: events rows 1..5 would pile up; past 4 they are dropped.
    assert h.worker.ordering is not None  # worker.ordered
    lanes = h.worker.ordering.lanes
    assert lanes["events"].parked and lanes["events"].pending_rows == 0
    assert h.worker.consumers["events"].queued_rows == 0
    assert h.transport.producerState != "paused"
    h.send(ev(6, ts(60)))  # still arriving live: dropped while parked
    assert h.got == []
    # notes catches up past the first dropped row: events is asked for again.
    h.send(note(1, ts(15)), f"TICK notes 1 {ts(100)}")
    assert h.sent() == ["REPLICATE events 0"]
    h.send(ev(3, ts(30)))  # before the answer's POSITION: dropped by the protocol
    h.send("POSITION events m 0 0", *(ev(i, ts(10 * i)) for i in range(1, 7)))
    assert h.tokens() == [("events", 1), ("notes", 1), *(("events", i) for i in range(2, 7))]
    stamps = [t for _, _, t in h.got]
    assert stamps == sorted(stamps)


def test_handlers_read_the_raw_timestamp_and_its_milliseconds() -> None:
    from workers.handlers import ReplicatedRow

    row = ReplicatedRow("events", 1, "w", ts(7, 3), ("x",))
    assert row.ts == ts(7, 3) and row.ts_ms == BASE_MS + 7
    assert ReplicatedRow("events", 1, "w", None, ()).ts_ms is None


@pytest.mark.parametrize("answer", ["OPTIONS live ts", "ERROR unknown command 'OPTIONS'"])
def test_without_tick_acknowledged_the_streams_go_unordered(db_url: str, answer: str) -> None:
    h = Harness(db_url)
    h.acknowledge = answer
    h.start()
    h.send(ev(1, ts(10)))  # no TICK will ever come: nothing may wait for one
    assert h.tokens() == [("events", 1)]
    assert h.worker.ordering is not None and not h.worker.ordering.enabled
