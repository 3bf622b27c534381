"""The worker at the protocol level: lines in, exactly-once effects out.

The worker is driven with real command lines through ``ClientProtocol`` on a
``StringTransport``, with Twisted's ``Clock`` for timers, and applies into a
real worker database (SQLite and PostgreSQL). The only difference from
production is the injected database runner: applies run synchronously instead
of on a database thread, so every step is deterministic.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import psycopg2
import pytest
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from replication.protocol import ProtocolConfig
from replication.streams import all_streams
from storage.worker_store import open_worker_store
from tests.integration.procs import wait_for
from tests.stores import backend_worker_store
from workers.caches import CacheRegistry
from workers.consumer import ApplySettings
from workers.handlers import HandlerRegistry
from workers.worker import Worker, WorkerConfig

TS = 470_000_000_000_000_000


class SyncDB:
    """The worker's database runner, injected: runs each call at once in the
    calling thread, or holds it (``hold``) to test flow control."""

    def __init__(self) -> None:
        self.hold: list | None = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> defer.Deferred:
        if self.hold is not None:
            d: defer.Deferred = defer.Deferred()
            self.hold.append((d, fn, args, kwargs))
            return d
        return defer.maybeDeferred(fn, *args, **kwargs)


def ev(n: int) -> str:
    return f'["$e{n}", "!r", "m.t", null, null, {TS + n}]'


class Harness:
    """Plays a tickline master: ``SERVER`` is followed by the answer to the
    worker's ``OPTIONS`` (``acknowledge``; None plays a seed-protocol master
    that never answers it)."""

    def __init__(self, url: str, acknowledge: str | None = "live ts", **config: Any) -> None:
        self.acknowledge = acknowledge
        self.clock = Clock()
        self.handlers = config.pop("handlers", HandlerRegistry())
        self.caches = config.pop("caches", CacheRegistry({"room_caches": ["members", "state"]}))
        second_db = config.pop("second_db", None)  # the worker's second lane (PostgreSQL); None: the SyncDB
        defaults = dict(name="w1", replicate=("events",), apply=ApplySettings(retry_initial=1.0))
        self.config = WorkerConfig(**{**defaults, **config})
        self.store = backend_worker_store(open_worker_store(url))
        self.db = SyncDB()
        self.worker = Worker(
            self.config,
            ProtocolConfig(),
            self.store,
            all_streams(),
            self.clock,
            self.handlers,
            self.caches,
            db=self.db,
            second_db=second_db,
        )
        self.worker.prepare()
        self.connect()

    def connect(self) -> None:
        self.transport = StringTransport()
        self.proto = self.worker.client_protocol()
        self.proto.makeConnection(self.transport)

    def disconnect(self) -> None:
        from twisted.internet.error import ConnectionLost
        from twisted.python.failure import Failure

        self.proto.connectionLost(Failure(ConnectionLost()))

    def send(self, *lines: str) -> None:
        if self.acknowledge is not None:
            lines = tuple(
                x
                for line in lines
                for x in ([line, f"OPTIONS {self.acknowledge}"] if line.startswith("SERVER ") else [line])
            )
        self.proto.dataReceived("".join(line + "\n" for line in lines).encode())

    def sent(self) -> list[str]:
        out = self.transport.value().decode().splitlines()
        self.transport.clear()
        return [line for line in out if not line.startswith("PING ")]

    def rows(self) -> list[tuple]:
        return [
            tuple(row)
            for row in self.store.database.read(
                lambda c: c.execute(
                    "SELECT token, instance_name, ts, event_id FROM replicated_events ORDER BY token, event_id"
                ).fetchall()
            )
        ]

    def applied(self, stream: str = "events") -> int:
        return self.store.applied_tokens().get(stream, 0)


@pytest.fixture
def url(db_url: str) -> str:
    """The worker's database: every rule is checked on both backends."""
    return db_url


@pytest.fixture
def h(url) -> Harness:
    return Harness(url)


def test_handshake_waits_for_server_then_resumes_every_stream(h) -> None:
    assert h.sent() == ["NAME w1", "OPTIONS live tick ts"]
    h.send("SERVER tickline")
    assert h.sent() == ["REPLICATE caches 0", "REPLICATE events 0"]


def test_wrong_server_name_is_refused_before_any_replicate(url, caplog) -> None:
    h = Harness(url, server_name="prod")
    h.sent()
    with caplog.at_level(logging.ERROR):
        h.send("SERVER staging")
    assert h.sent() == ["ERROR wrong server: expected 'prod', got 'staging'"]
    assert h.transport.disconnecting
    assert "expected 'prod'" in caplog.text


def test_rows_are_applied_with_token_instance_and_ts(h) -> None:
    h.send("SERVER s", "POSITION events m 0 0", f"RDATA events w1 1 {ev(1)}", f"RDATA events w2 2 {ev(2)}")
    assert h.rows() == [(1, "w1", TS + 1, "$e1"), (2, "w2", TS + 2, "$e2")]
    assert h.applied() == 2


def test_a_block_of_only_rdata_lines_is_applied_with_its_exact_tokens(h) -> None:
    """A buffer holding nothing but RDATA lines is one run (the client's fast path), its tokens
    integers however long (up to 18 digits), in order."""
    h.send("SERVER s", "POSITION events m 0 0")
    big = 10**17
    h.send(
        *(f"RDATA events w1 {token} {ev(n)}" for n, token in enumerate([big + 1, big + 2, 999_999_999_999_999_999], 1))
    )
    assert h.rows() == [
        (big + 1, "w1", TS + 1, "$e1"),
        (big + 2, "w1", TS + 2, "$e2"),
        (999_999_999_999_999_999, "w1", TS + 3, "$e3"),
    ]
    assert h.applied() == 999_999_999_999_999_999


def test_rdata_before_its_position_is_dropped(h) -> None:
    h.send("SERVER s", f"RDATA events m 1 {ev(1)}")
    h.send("POSITION events m 0 0", f"RDATA events m 2 {ev(2)}")
    assert h.rows() == [(2, "m", TS + 2, "$e2")]


def test_batch_is_held_until_its_real_token_then_applied_together(h) -> None:
    h.send("SERVER s", "POSITION events m 0 0", f"RDATA events m batch {ev(1)}", f"RDATA events m batch {ev(2)}")
    assert h.rows() == [] and h.applied() == 0
    h.send(f"RDATA events m 1 {ev(3)}")
    assert [r[0] for r in h.rows()] == [1, 1, 1] and h.applied() == 1


def test_batch_cut_by_a_disconnect_is_never_applied(h) -> None:
    h.send("SERVER s", "POSITION events m 0 0", f"RDATA events m batch {ev(1)}")
    h.disconnect()
    h.connect()
    h.sent()
    h.send("SERVER s")
    assert "REPLICATE events 0" in h.sent()
    h.send("POSITION events m 0 0", f"RDATA events m 1 {ev(3)}")
    assert [r[3] for r in h.rows()] == ["$e3"]


def test_stale_rows_at_or_below_the_applied_token_are_dropped(h) -> None:
    h.send("SERVER s", "POSITION events m 0 0", f"RDATA events m 1 {ev(1)}", f"RDATA events m 2 {ev(2)}")
    h.send(f"RDATA events m 2 {ev(20)}", f"RDATA events m 1 {ev(10)}", f"RDATA events m 3 {ev(3)}")
    assert [r[3] for r in h.rows()] == ["$e1", "$e2", "$e3"]


def test_position_with_a_gap_asks_for_the_missed_rows(h) -> None:
    h.send("SERVER s", "POSITION events m 0 0", f"RDATA events m 1 {ev(1)}")
    h.sent()
    h.send("POSITION events m 5 7")
    assert h.sent() == ["REPLICATE events 1"]
    assert h.applied() == 1  # did not move past the gap
    h.send("POSITION events m 1 1", *(f"RDATA events m {n} {ev(n)}" for n in range(2, 8)))
    assert h.applied() == 7 and len(h.rows()) == 7


def test_position_at_or_below_the_applied_token_moves_without_fetching(h) -> None:
    h.send("SERVER s", "POSITION events m 0 0", f"RDATA events m 1 {ev(1)}")
    h.sent()
    h.send("POSITION events m 1 10")
    assert h.sent() == []
    assert h.applied() == 10
    h.send(f"RDATA events m 9 {ev(9)}", f"RDATA events m 11 {ev(11)}")
    assert [r[0] for r in h.rows()] == [1, 11]


def test_resume_after_a_crash_from_the_applied_token(url) -> None:
    first = Harness(url)
    first.send("SERVER s", "POSITION events m 0 0", f"RDATA events m 1 {ev(1)}", f"RDATA events m 2 {ev(2)}")
    first.send(f"RDATA events m batch {ev(3)}")  # never completed: lost with the process
    again = Harness(url)  # a new process on the same database
    again.sent()
    again.send("SERVER s")
    assert "REPLICATE events 2" in again.sent()
    again.send("POSITION events m 2 2", f"RDATA events m 3 {ev(3)}")
    assert [r[0] for r in again.rows()] == [1, 2, 3]


def test_failing_handler_stops_the_stream_and_is_retried_never_skipped(url, caplog) -> None:
    handlers = HandlerRegistry()
    broken = {"on": True}
    seen: list[int] = []

    @handlers.handler("events")
    def picky(ctx, rows) -> None:
        for row in rows:
            if row.values[0] == "$e2" and broken["on"]:
                raise RuntimeError("handler refuses $e2")
            seen.append(row.token)

    h = Harness(url, handlers=handlers)
    with caplog.at_level(logging.WARNING):
        h.send("SERVER s", "POSITION events m 0 0", *(f"RDATA events m {n} {ev(n)}" for n in (1, 2, 3)))
        h.clock.advance(0)  # the grouped apply failed: retry token by token
    assert h.applied() == 1
    assert [r[0] for r in h.rows()] == [1]  # the failed transaction left nothing behind
    assert "handler refuses $e2" in caplog.text and "$e2" in caplog.text
    h.clock.advance(1.0)
    h.clock.advance(2.0)
    assert h.applied() == 1  # still failing, still not skipped
    broken["on"] = False
    h.clock.advance(4.0)
    assert h.applied() == 3
    assert [r[0] for r in h.rows()] == [1, 2, 3]


def test_too_many_pending_rows_pause_reading(url) -> None:
    h = Harness(url, max_pending_rows=4)
    h.db.hold = []
    h.send("SERVER s", "POSITION events m 0 0", *(f"RDATA events m {n} {ev(n)}" for n in range(1, 7)))
    assert h.transport.producerState == "paused"
    stats = h.worker.stats()
    assert [(s.stream, s.pending_rows) for s in stats.streams] == [("caches", 0), ("events", 6)]
    while h.db.hold:
        d, fn, args, kwargs = h.db.hold.pop(0)
        d.callback(fn(*args, **kwargs))
    assert h.transport.producerState == "producing"
    assert h.applied() == 6


def test_worker_commands_to_the_master(h) -> None:
    h.send("SERVER s")
    h.sent()
    h.worker.user_sync("@u:x", True, 5)
    h.worker.federation_ack(42)
    h.worker.remove_pusher("app", "key with space", "@u:x")
    h.worker.remote_server_up("other.example")
    assert h.sent() == [
        "USER_SYNC w1 @u:x start 5",
        "FEDERATION_ACK w1 42",
        "REMOVE_PUSHER app key with space @u:x",
        "REMOTE_SERVER_UP other.example",
    ]
    # After a reconnect the syncing users and the last ack are sent again.
    h.disconnect()
    h.connect()
    h.sent()
    h.send("SERVER s")
    assert h.sent()[-2:] == ["USER_SYNC w1 @u:x start 5", "FEDERATION_ACK w1 42"]


# -- caches ---------------------------------------------------------------------


def cache_row(token: int, name: str, keys: str) -> str:
    return f'RDATA caches m {token} ["{name}", {keys}, 1, {TS + token}]'


@pytest.fixture
def cached(h):
    calls: list[str] = []

    @h.caches.cached("members")
    def members(room: str) -> str:
        calls.append(room)
        return f"members of {room}"

    state = h.caches.cache("state")
    state.set(("!a",), "s")
    members("!a"), members("!b")
    h.send("SERVER s", "POSITION caches m 0 0")
    return members, state, calls


def test_one_key_is_invalidated(h, cached) -> None:
    members, _state, calls = cached
    h.send(cache_row(1, "members", '["!a"]'))
    assert ("!a",) not in members.cache and ("!b",) in members.cache
    members("!a")
    assert calls == ["!a", "!b", "!a"]
    assert h.applied("caches") == 1


def test_null_keys_invalidate_the_whole_cache(h, cached) -> None:
    members, state, _calls = cached
    h.send(cache_row(1, "members", "null"))
    assert len(members.cache) == 0 and len(state) == 1


def test_special_name_invalidates_several_caches(h, cached) -> None:
    members, state, _calls = cached
    h.send(cache_row(1, "room_caches", '["!a"]'))
    assert ("!a",) not in members.cache and ("!a",) not in state
    assert ("!b",) in members.cache
    h.send(cache_row(2, "room_caches", "null"))
    assert len(members.cache) == 0 and len(state) == 0


def test_invalidation_batch_applies_at_its_token(h, cached) -> None:
    members, state, _calls = cached
    h.send(f'RDATA caches m batch ["members", ["!a"], 1, {TS}]')
    assert ("!a",) in members.cache
    h.send(cache_row(1, "state", "null"))
    assert ("!a",) not in members.cache and len(state) == 0


def test_lru_size_limit() -> None:
    registry = CacheRegistry(default_max_size=2)
    cache = registry.cache("c")
    cache.set("a", 1)
    cache.set("b", 2)
    cache.get("a")
    cache.set("c", 3)
    assert "a" in cache and "c" in cache and "b" not in cache
    with pytest.raises(ValueError):
        CacheRegistry({"x": ["a"]}).cache("x")


def test_caught_up_only_after_the_replay_reaches_live(h) -> None:
    h.send("SERVER s", "POSITION caches m 0 0", "POSITION caches m 0 0")  # caches: answered, then live
    h.send("POSITION events m 0 0", f"RDATA events m 1 {ev(1)}")  # the answer, then replayed rows
    assert not h.worker.caught_up()
    h.send(f"RDATA events m 2 {ev(2)}", "POSITION events m 2 2")  # OPTIONS live: the replay is done
    assert h.worker.caught_up()
    assert h.applied() == 2


# -- a seed-protocol master (no OPTIONS acknowledgment) ---------------------------------


def seed_ev(n: int) -> str:
    return f'["$e{n}", "!r", "m.t", null, null]'


@pytest.mark.parametrize("answer", [None, "ERROR unknown command 'OPTIONS'", "ERROR Unknown command"])
def test_seed_master_rows_are_applied_with_their_arrival_time(url, answer) -> None:
    h = Harness(url, acknowledge=None, replicate_retry=1.0)
    h.clock.advance(1_700_000_000)
    assert h.sent() == ["NAME w1", "OPTIONS live tick ts"]
    h.send("SERVER seed")
    if answer is not None:
        h.send(answer)
    assert h.sent() == ["REPLICATE caches 0", "REPLICATE events 0"]
    h.send("POSITION caches m 0 0", f"RDATA events m 1 {seed_ev(1)}")  # before its POSITION: dropped
    h.send("POSITION events m 0 0", f"RDATA events m batch {seed_ev(2)}")
    assert h.applied() == 0
    h.send(f"RDATA events m 2 {seed_ev(3)}", f"RDATA events m 2 {seed_ev(4)}")  # the batch, then a stale row
    arrived = 1_700_000_000_000 << 18
    assert h.rows() == [(2, "m", arrived, "$e2"), (2, "m", arrived, "$e3")]
    assert h.worker.caught_up()  # no live marker: the answers are applied
    assert h.worker.consumers["events"].lag_ms(1_700_000_000_500) == 500
    h.clock.advance(5)
    assert h.sent() == []  # an ERROR answering OPTIONS refused no REPLICATE


def test_seed_master_gap_and_caught_up_after_what_was_announced(url) -> None:
    h = Harness(url, acknowledge=None)
    h.sent()
    h.send("SERVER seed", "POSITION caches m 0 0", "POSITION events m 0 0", f"RDATA events m 1 {seed_ev(1)}")
    h.sent()
    h.send("POSITION events m 4 6")  # rows (1, 4] missed
    assert h.sent() == ["REPLICATE events 1"]
    assert not h.worker.caught_up()
    h.send("POSITION events m 1 1", *(f"RDATA events m {n} {seed_ev(n)}" for n in range(2, 5)))
    assert h.worker.caught_up() and h.applied() == 4
    h.send("POSITION events m 4 6")
    assert h.applied() == 6 and h.sent() == []


def test_worker_stats_are_a_typed_snapshot(h) -> None:
    h.clock.advance(1_700_000_000)
    h.send("SERVER s", "POSITION caches m 0 0", "POSITION events m 0 0", f"RDATA events m 1 {ev(1)}")
    stats = h.worker.stats()
    events = stats.streams[1]
    assert (events.stream, events.applied, events.received, events.pending_rows, events.applied_rows) == (
        "events",
        1,
        1,
        0,
        1,
    )
    assert events.lag_ms == 0  # nothing waits
    assert stats.reconnects == 0 and stats.connection is not None
    assert stats.connection.name.startswith("w1->") and stats.connection.bytes_received > 0
    assert dict(stats.protocol.received)["RDATA"] >= 1
    h.disconnect()
    after = h.worker.stats()
    assert after.reconnects == 1 and after.connection is None


def test_row_length_settles_what_the_acknowledgment_cannot(url) -> None:
    # A master that appends timestamps without acknowledging OPTIONS ts: a row
    # one value longer than the columns, ending in an integer, carries its ts.
    h = Harness(url, acknowledge=None)
    h.clock.advance(1_700_000_000)
    h.send("SERVER s", "POSITION events m 0 0", f"RDATA events m 1 {ev(1)}", f"RDATA events m 2 {seed_ev(2)}")
    assert h.rows() == [(1, "m", TS + 1, "$e1"), (2, "m", 1_700_000_000_000 << 18, "$e2")]
    # Acknowledged, but a row without its timestamp: the arrival time stands in.
    acked = Harness(url, acknowledge="live ts")
    acked.clock.advance(1_700_000_001)
    acked.send("SERVER s", "POSITION events m 2 2", f"RDATA events m 3 {seed_ev(3)}")
    assert acked.rows()[-1] == (3, "m", 1_700_000_001_000 << 18, "$e3")


def test_a_run_of_rows_with_a_stale_start_applies_only_the_new_tokens(h) -> None:
    """Rows arriving as one run (one read, parsed as a block) after some were applied."""
    h.send("SERVER s", "POSITION events m 0 0", *(f"RDATA events m {n} {ev(n)}" for n in (1, 2, 3)))
    h.send(*(f"RDATA events m {n} {ev(n)}" for n in range(2, 80)))  # 2, 3 again, then 76 new ones
    assert h.applied() == 79
    assert [r[0] for r in h.rows()] == list(range(1, 80))


@pytest.mark.parametrize("count", [3, 70])  # one statement; COPY (PostgreSQL)
def test_a_mistyped_row_in_a_run_stops_the_stream_at_its_token_named(url, caplog, count) -> None:
    """The table replicator alone: rows go to the store as received; a row that does not fit
    the declared columns is named, nothing after it is applied, and nothing is skipped."""
    h = Harness(url)
    bad = count // 2 + 1
    lines = [f"RDATA events m {n} {ev(n)}" for n in range(1, count + 1)]
    lines[bad - 1] = f'RDATA events m {bad} [12345, "!r", "m.t", null, null, {TS + bad}]'
    with caplog.at_level(logging.WARNING):
        h.send("SERVER s", "POSITION events m 0 0", *lines)
        h.clock.advance(0)  # the grouped apply failed: retried token by token
        h.clock.advance(0)
    assert h.applied() == bad - 1
    assert [r[0] for r in h.rows()] == list(range(1, bad))
    assert "'event_id' expects text" in caplog.text
    h.clock.advance(1.0)
    assert h.applied() == bad - 1  # still stopped there, never skipped


def _held(h: Harness) -> list:
    assert h.db.hold is not None
    return h.db.hold


def _release(h: Harness) -> None:
    """The database thread takes the first held call (in the order handed) and runs it."""
    d, fn, args, kwargs = _held(h).pop(0)
    defer.maybeDeferred(fn, *args, **kwargs).chainDeferred(d)


def _queue_three_groups(h: Harness, lines: list[str]) -> None:
    """Token 1 applied alone (held), then six runs of 30 rows queue behind it (apply_rows 60)."""
    h.db.hold = []
    h.send("SERVER s", "POSITION events m 0 0", lines[0])
    for start in range(1, 181, 30):
        h.send(*lines[start : start + 30])
    assert len(_held(h)) == 1  # only token 1 so far: a group that is not full waits for no other
    _release(h)


def test_a_full_group_queues_behind_the_one_applied_and_rows_stay_in_order(url) -> None:
    """During a backlog a second full group waits on the database side behind the one applied
    (at most one), and is applied once the first committed: every row once, in token order."""
    h = Harness(url, apply=ApplySettings(apply_rows=60))
    _queue_three_groups(h, [f"RDATA events m {n} {ev(n)}" for n in range(1, 182)])
    assert h.applied() == 1
    assert len(_held(h)) == 2  # tokens 2..61 handed, 62..121 queued behind them; no third
    _release(h)
    assert h.applied() == 61
    assert len(_held(h)) == 2  # 62..121 next, 122..181 queued behind
    while h.db.hold:
        _release(h)
    assert h.applied() == 181
    assert [r[0] for r in h.rows()] == list(range(1, 182))
    assert h.worker.stats().streams[1].pending_rows == 0


def test_a_group_queued_behind_a_failed_one_is_not_applied(url, caplog) -> None:
    """The group before it fails: the queued group finds its predecessor not committed and applies
    nothing; the stream stops at the bad row, named, and nothing after it is applied or skipped."""
    h = Harness(url, apply=ApplySettings(apply_rows=60))
    lines = [f"RDATA events m {n} {ev(n)}" for n in range(1, 182)]
    lines[29] = f'RDATA events m 30 [12345, "!r", "m.t", null, null, {TS + 30}]'
    with caplog.at_level(logging.WARNING):
        _queue_three_groups(h, lines)
        assert len(_held(h)) == 2
        _release(h)  # tokens 2..61: refused
        assert h.applied() == 1
        _release(h)  # 62..121, queued behind them: not applied
        assert h.applied() == 1 and [r[0] for r in h.rows()] == [1]
        for _ in range(40):  # retried token by token
            h.clock.advance(0)
            while h.db.hold:
                _release(h)
    assert h.applied() == 29
    assert [r[0] for r in h.rows()] == list(range(1, 30))
    assert "'event_id' expects text" in caplog.text
    h.clock.advance(1.0)
    while h.db.hold:
        _release(h)
    assert h.applied() == 29  # still stopped there, never skipped


class ThreadLane:
    """The second lane's runner (PostgreSQL): each call at once on a thread of its own, as the worker's
    second database thread runs it; its answer delivered to the worker by :meth:`deliver` (this thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple[threading.Thread, defer.Deferred, dict[str, Any]]] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = fn(*args, **kwargs)
            except BaseException:
                box["failure"] = Failure()

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self.calls.append((thread, d, box))
        return d

    def wait_until_copied(self, url: str) -> None:
        """The call's group is copied and its transaction left open, waiting for the group before it
        (its backend idle in a transaction, seen in pg_stat_activity), and its thread still running."""

        def copied_and_open() -> bool:
            conn = psycopg2.connect(url)
            try:
                with conn.cursor() as cur:
                    cur.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND state = 'idle in transaction'"
                    )
                    (count,) = cur.fetchone()
                    return bool(count == 1)
            finally:
                conn.close()

        wait_for(copied_and_open, 30.0, "the second lane's group to be copied and wait")
        assert any(thread.is_alive() for thread, _, _ in self.calls)

    def deliver(self) -> None:
        calls, self.calls = self.calls, []
        for thread, d, box in calls:
            thread.join(30)
            assert not thread.is_alive()
            if "failure" in box:
                d.errback(box["failure"])
            else:
                d.callback(box.get("result"))


def _settle(h: Harness, lane: ThreadLane) -> None:
    """Run what both lanes were handed, the first lane's in the order handed, until nothing is left
    (a group on the second lane may wait for one held on the first: the first lane goes first)."""
    while h.db.hold or lane.calls:
        while h.db.hold:
            _release(h)
        lane.deliver()


def test_a_full_group_is_copied_beside_the_one_before_and_commits_after_it(pg_url) -> None:
    """PostgreSQL: the group behind the one applied is copied at once on the second lane, and waits
    for the first's commit before its token moves; the third goes to the first lane: every row once."""
    lane = ThreadLane()
    h = Harness(pg_url, apply=ApplySettings(apply_rows=60), second_db=lane)
    _queue_three_groups(h, [f"RDATA events m {n} {ev(n)}" for n in range(1, 182)])
    assert len(_held(h)) == 1 and len(lane.calls) == 1  # 2..61 on the first lane, 62..121 on the second
    lane.wait_until_copied(pg_url)  # copied, waiting for 2..61 to commit
    assert h.applied() == 1
    _release(h)  # 2..61 commit; 122..181 queued on the first lane behind 62..121
    lane.deliver()
    assert h.applied() == 121
    while h.db.hold:
        _release(h)
    assert not lane.calls
    assert h.applied() == 181
    assert [r[0] for r in h.rows()] == list(range(1, 182))
    assert h.worker.stats().streams[1].pending_rows == 0


def test_a_group_copied_beside_a_failed_one_commits_nothing(pg_url, caplog) -> None:
    """The group before it fails: the group copied beside it finds that out and rolls back; the stream
    stops at the bad row, named, and nothing after it is applied or skipped."""
    lane = ThreadLane()
    h = Harness(pg_url, apply=ApplySettings(apply_rows=60), second_db=lane)
    lines = [f"RDATA events m {n} {ev(n)}" for n in range(1, 182)]
    lines[29] = f'RDATA events m 30 [12345, "!r", "m.t", null, null, {TS + 30}]'
    with caplog.at_level(logging.WARNING):
        _queue_three_groups(h, lines)
        lane.wait_until_copied(pg_url)
        _release(h)  # tokens 2..61: refused
        lane.deliver()  # 62..121: rolled back
        assert h.applied() == 1 and [r[0] for r in h.rows()] == [1]
        for _ in range(40):  # retried token by token
            h.clock.advance(0)
            _settle(h, lane)
    assert h.applied() == 29
    assert [r[0] for r in h.rows()] == list(range(1, 30))
    assert "'event_id' expects text" in caplog.text


def test_a_group_whose_commit_answer_was_lost_is_applied_again_once(pg_url, caplog) -> None:
    """The connection of the group on the second lane fails as its COMMIT is sent (here after it
    committed): the worker applies the same group again on the first lane, finds it applied (a stale
    token), and goes on; every row once."""
    from storage.store import CommitUnknown

    lane = ThreadLane()
    h = Harness(pg_url, apply=ApplySettings(apply_rows=60), second_db=lane)
    real = h.store.apply_after
    lost: list[int] = []

    def apply_after(*args: Any) -> bool:
        committed = real(*args)
        if not lost:
            lost.append(args[1])
            raise CommitUnknown("the server closed the connection unexpectedly")
        return committed

    h.store.apply_after = apply_after  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.INFO):
        _queue_three_groups(h, [f"RDATA events m {n} {ev(n)}" for n in range(1, 182)])
        _release(h)
        lane.deliver()  # 62..121 committed, its answer lost: applied again on the first lane
        for _ in range(10):
            _settle(h, lane)
            h.clock.advance(1)
    assert lost == [121]
    assert "the connection was lost while token 121 committed" in caplog.text
    assert "token 121 was applied before its connection was lost" in caplog.text
    assert h.applied() == 181
    assert [r[0] for r in h.rows()] == list(range(1, 182))


def test_an_apply_whose_commit_answer_was_lost_is_settled_not_retried_token_by_token(pg_url, caplog) -> None:
    """The database thread's connection fails as an ordinary apply's COMMIT is sent (here after it
    committed): the same group is applied again, found applied (a stale token), and the stream goes
    on; retried token by token it would have met a stale token on every retry."""
    from storage.store import CommitUnknown

    h = Harness(pg_url)
    real = h.store.apply_replicated
    lost: list[int] = []

    def apply_replicated(*args: Any) -> None:
        real(*args)
        if not lost:
            lost.append(args[1])
            raise CommitUnknown("the server closed the connection unexpectedly")

    h.store.apply_replicated = apply_replicated  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.INFO):
        h.send("SERVER s", "POSITION events m 0 0", *[f"RDATA events m {n} {ev(n)}" for n in range(1, 101)])
        h.send(*[f"RDATA events m {n} {ev(n)}" for n in range(101, 201)])
    assert lost == [100]
    assert "token 100 was applied before its connection was lost" in caplog.text
    assert h.applied() == 200
    assert [r[0] for r in h.rows()] == list(range(1, 201))


def test_a_handled_apply_whose_commit_answer_was_lost_is_settled_not_retried_token_by_token(url, caplog) -> None:
    """As above, for the general apply (a stream with a handler: the handler's transaction): the
    same group is applied again, found applied, and the handler's rows are not seen twice."""
    from storage.store import CommitUnknown

    handlers = HandlerRegistry()
    seen: list[int] = []

    @handlers.handler("events")
    def record(ctx, rows) -> None:
        seen.extend(row.token for row in rows)

    h = Harness(url, handlers=handlers)
    real = h.store.apply
    lost: list[int] = []

    def apply(stream: str, token: int, effects: Any) -> None:
        real(stream, token, effects)
        if not lost:
            lost.append(token)
            raise CommitUnknown("the server closed the connection unexpectedly")

    h.store.apply = apply  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        h.send("SERVER s", "POSITION events m 0 0", *[f"RDATA events m {n} {ev(n)}" for n in range(1, 4)])
        h.send(*[f"RDATA events m {n} {ev(n)}" for n in range(4, 6)])
    assert lost == [3]
    assert "token 3 was applied before its connection was lost" in caplog.text
    assert h.applied() == 5
    assert [r[0] for r in h.rows()] == [1, 2, 3, 4, 5]
    assert seen == [1, 2, 3, 4, 5]


def _commit_lost_then_unreachable(h: Harness, name: str) -> list[int]:
    """The store's ``name`` apply: the first call commits and loses its answer (CommitUnknown), the
    second finds the database unreachable, the rest apply; the tokens of the calls."""
    from storage.store import CommitUnknown, DatabaseUnavailable

    real = getattr(h.store, name)
    calls: list[int] = []

    def apply(*args: Any) -> None:
        calls.append(args[1])
        if len(calls) == 1:
            real(*args)
            raise CommitUnknown("the server closed the connection unexpectedly")
        if len(calls) == 2:
            raise DatabaseUnavailable("cannot connect to PostgreSQL")
        real(*args)

    setattr(h.store, name, apply)
    return calls


@pytest.mark.parametrize("path", ["handled", "replicated"])
def test_a_lost_commit_then_an_unreachable_database_applies_every_row_once(url, path) -> None:
    """The group 1..3 commits but its answer is lost; applied again at once, the database cannot be
    reached; the consumer then retries token by token: token 1 meets the stale token 3, which the
    consumer takes as applied whole (rows 2 and 3 are not applied again by the next group)."""

    handlers = HandlerRegistry()
    seen: list[int] = []
    if path == "handled":

        @handlers.handler("events")
        def record(ctx, rows) -> None:
            seen.extend(row.token for row in rows)

    h = Harness(url, handlers=handlers)
    calls = _commit_lost_then_unreachable(h, "apply" if path == "handled" else "apply_replicated")
    h.send("SERVER s", "POSITION events m 0 0", *[f"RDATA events m {n} {ev(n)}" for n in range(1, 4)])
    h.send(*[f"RDATA events m {n} {ev(n)}" for n in range(4, 6)])
    for _ in range(10):
        h.clock.advance(5)
    assert calls[:2] == [3, 3]
    assert h.applied() == 5
    assert [r[0] for r in h.rows()] == [1, 2, 3, 4, 5]
    if path == "handled":
        assert seen == [1, 2, 3, 4, 5]


def test_commits_lost_again_and_again_are_applied_again_at_once_only_a_few_times(url, caplog) -> None:
    """A connection lost at every commit: three applies again at once, then the consumer's backoff
    (no loop without end); once commits get through, every row once."""
    from storage.store import CommitUnknown

    h = Harness(url)
    real = h.store.apply_replicated
    calls: list[int] = []

    def apply_replicated(*args: Any) -> None:
        calls.append(args[1])
        if len(calls) <= 6:
            raise CommitUnknown("the server closed the connection unexpectedly")
        real(*args)

    h.store.apply_replicated = apply_replicated  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.WARNING):
        h.send("SERVER s", "POSITION events m 0 0", *[f"RDATA events m {n} {ev(n)}" for n in range(1, 4)])
    assert len(calls) == 4  # the first and three at once; then the backoff's timer
    for _ in range(20):
        h.clock.advance(5)
    assert h.applied() == 3
    assert [r[0] for r in h.rows()] == [1, 2, 3]


def test_a_lost_commit_then_a_reconnect_to_the_master_applies_every_row_once(url) -> None:
    """As above, and the master's connection drops too: the worker asks again from its own applied
    token (behind the database's), the rows come again as one run across the database's token; the
    retry meets the stale token, the consumer takes the database's token and drops the run up to it."""

    h = Harness(url)
    _commit_lost_then_unreachable(h, "apply_replicated")
    h.send("SERVER s", "POSITION events m 0 0", *[f"RDATA events m {n} {ev(n)}" for n in range(1, 4)])
    h.disconnect()
    h.connect()
    h.send("SERVER s")
    assert "REPLICATE events 0" in h.sent()
    h.send("POSITION events m 0 0", *[f"RDATA events m {n} {ev(n)}" for n in range(1, 6)])
    for _ in range(10):
        h.clock.advance(5)
    assert h.applied() == 5
    assert [r[0] for r in h.rows()] == [1, 2, 3, 4, 5]


class _SocketTransport(StringTransport):
    """A ``StringTransport`` whose handle is a real socket: the bytes the test leaves unread on it
    are what ``bytes_waiting`` sees (a read with more to follow at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.sock, self._peer = socket.socketpair()

    def getHandle(self) -> socket.socket:
        return self.sock

    def more_waits(self, waiting: bool) -> None:
        if waiting:
            self._peer.sendall(b"x")
        else:
            self.sock.setblocking(False)
            try:
                while self.sock.recv(4096):
                    pass
            except BlockingIOError:
                pass

    def close_sockets(self) -> None:
        self.sock.close()
        self._peer.close()


def _socket_harness(url: str, **config: Any) -> tuple[Harness, _SocketTransport]:
    h = Harness(url, **config)
    transport = _SocketTransport()
    h.transport = transport
    h.proto = h.worker.client_protocol()
    h.proto.makeConnection(transport)
    h.send("SERVER s", "POSITION events m 0 0")
    h.db.hold = []
    return h, transport


def test_a_commit_read_in_pieces_is_applied_as_one_group_once_no_byte_waits(url) -> None:
    """Rows whose read ends while more bytes wait on the socket are held for the next read (which
    follows at once): a commit split over several reads is one apply, not one per read."""
    h, transport = _socket_harness(url, apply=ApplySettings(apply_linger=None, apply_linger_rows=20))
    try:
        lines = [f"RDATA events m {n} {ev(n)}" for n in range(1, 61)]
        transport.more_waits(True)
        h.send(*lines[:20])
        h.send(*lines[20:40])
        assert _held(h) == []  # nothing handed while the rest is on its way
        transport.more_waits(False)
        h.send(*lines[40:])
        assert len(_held(h)) == 1  # the three reads' rows: one group
        _release(h)
        assert h.applied() == 60
        assert [r[0] for r in h.rows()] == list(range(1, 61))
    finally:
        transport.close_sockets()


def test_held_rows_are_applied_when_a_full_group_waits_or_reading_pauses(url) -> None:
    """Bytes waiting hold back no full group (a backlog keeps its database busy), nothing once
    reading is paused (the next read would never come), and no fewer rows than
    ``apply_linger_rows`` (a single row's latency is not worth the wait)."""
    h, transport = _socket_harness(url, apply=ApplySettings(apply_linger_rows=5))
    try:
        transport.more_waits(True)
        h.send(*(f"RDATA events m {n} {ev(n)}" for n in range(1, 5)))
        assert len(_held(h)) == 1  # 4 rows: at once although bytes wait
        _release(h)
    finally:
        transport.close_sockets()
    h, transport = _socket_harness(url, apply=ApplySettings(apply_rows=30, apply_linger_rows=20))
    try:
        transport.more_waits(True)
        h.send(*(f"RDATA events m {n} {ev(n)}" for n in range(5, 35)))
        assert len(_held(h)) == 1  # a full group: handed at once
        _release(h)
        assert h.applied() == 34
    finally:
        transport.close_sockets()
    h, transport = _socket_harness(url, max_pending_rows=4, apply=ApplySettings(apply_linger=None, apply_linger_rows=1))
    try:
        transport.more_waits(True)
        h.send(*(f"RDATA events m {n} {ev(n)}" for n in range(35, 41)))  # the same database: after 34
        assert transport.producerState == "paused"
        assert len(_held(h)) == 1  # paused: applied although bytes wait
        while h.db.hold:
            _release(h)
        assert transport.producerState == "producing"
        assert h.applied() == 40
    finally:
        transport.close_sockets()


def test_the_socket_is_asked_for_waiting_bytes_only_after_a_read_that_holds_rows(url) -> None:
    """A read of fewer rows than ``apply_linger_rows`` (a single-row commit) applies them at once and
    does not ask the socket whether more bytes wait (a system call per read on the latency path); a
    read that holds a bulk commit's rows does, and holds them while bytes wait."""
    h, transport = _socket_harness(url, apply=ApplySettings(apply_linger=None, apply_linger_rows=20))
    asked = []
    handle = transport.getHandle

    def counted() -> socket.socket:
        asked.append(1)
        return handle()

    transport.getHandle = counted  # type: ignore[method-assign]
    try:
        transport.more_waits(True)
        h.send(*_lines(1, 3))
        assert asked == []
        assert len(_held(h)) == 1  # at once, although bytes wait
        _release(h)
        h.send(*_lines(4, 30))
        assert asked == [1]
        assert _held(h) == []  # bytes wait: held for the next read
        transport.more_waits(False)
        h.send(*_lines(31, 40))
        assert len(asked) == 2
        assert len(_held(h)) == 1
        _release(h)
        assert h.applied() == 40
    finally:
        transport.close_sockets()


def test_held_rows_are_applied_once_a_read_brings_none_of_their_streams_lines(url) -> None:
    """Bytes that keep waiting (another stream's catch-up, PINGs) hold a stream's rows only while
    its own rows keep coming: the first read without any ends the hold, however busy the socket."""
    h, transport = _socket_harness(url, apply=ApplySettings(apply_linger=None, apply_linger_rows=20))
    try:
        transport.more_waits(True)
        h.send(*_lines(1, 30))
        assert _held(h) == []  # the commit may go on in the next read
        h.send(*_lines(31, 40))
        assert _held(h) == []
        h.send("PING 1")  # a read without an events row, and bytes still waiting
        assert len(_held(h)) == 1
        _release(h)
        for i in range(2, 50):
            h.send(f"PING {i}")
        assert _held(h) == []  # nothing more to apply, nothing applied twice
        assert h.applied() == 40
    finally:
        transport.close_sockets()


def test_rows_held_for_a_read_that_never_came_are_asked_for_again_after_a_reconnect(url) -> None:
    """The connection is lost while rows are held (bytes waited): nothing of them is applied, and
    the worker resumes from its applied token, so every row arrives again and is applied once."""
    h, transport = _socket_harness(url, apply=ApplySettings(apply_linger=None, apply_linger_rows=5))
    try:
        transport.more_waits(True)
        h.send(*(f"RDATA events m {n} {ev(n)}" for n in range(1, 11)))
        assert _held(h) == []
        h.disconnect()
        h.db.hold = None
        h.connect()
        h.sent()
        h.send("SERVER s")
        assert h.sent() == ["REPLICATE caches 0", "REPLICATE events 0"]
        h.send("POSITION events m 0 0", *(f"RDATA events m {n} {ev(n)}" for n in range(1, 11)))
        assert h.applied() == 10
        assert [r[0] for r in h.rows()] == list(range(1, 11))
    finally:
        transport.close_sockets()


def _lines(first: int, last: int) -> list[str]:
    return [f"RDATA events m {n} {ev(n)}" for n in range(first, last + 1)]


def test_a_group_not_full_waits_apply_linger_for_more_rows_then_applies_them_as_one(url) -> None:
    """At least ``apply_linger_rows`` rows but not a full group: the apply waits ``apply_linger``
    for more, rows that arrive meanwhile join the group, and then one group is applied."""
    settings = ApplySettings(apply_rows=100, apply_linger=0.01, apply_linger_rows=20)
    h = Harness(url, apply=settings)
    h.db.hold = []
    h.send("SERVER s", "POSITION events m 0 0", *_lines(1, 30))
    assert _held(h) == []
    h.clock.advance(0.005)
    h.send(*_lines(31, 50))
    assert _held(h) == []
    h.clock.advance(0.005)
    assert len(_held(h)) == 1  # 1..50: one group
    _release(h)
    assert h.applied() == 50
    h.send(*_lines(51, 80))  # the next group waits again
    assert _held(h) == []
    h.send(*_lines(81, 150))  # a full group (51..150): at once, without waiting
    assert len(_held(h)) == 1
    _release(h)
    assert h.applied() == 150
    h.send(*_lines(151, 180))  # the group after a full one (a backlog's tail): at once too
    assert len(_held(h)) == 1
    _release(h)
    assert h.applied() == 180
    h.send(*_lines(181, 210))  # after a group that was not full, a group waits again
    assert _held(h) == []
    h.clock.advance(0.01)
    _release(h)
    assert h.applied() == 210
    assert [r[0] for r in h.rows()] == list(range(1, 211))


def test_few_rows_and_a_worker_without_apply_linger_are_applied_at_once(url) -> None:
    h = Harness(url, apply=ApplySettings(apply_rows=100, apply_linger=0.01, apply_linger_rows=20))
    h.db.hold = []
    h.send("SERVER s", "POSITION events m 0 0", *_lines(1, 19))  # fewer than apply_linger_rows
    assert len(_held(h)) == 1
    _release(h)
    assert h.applied() == 19
    h = Harness(url, apply=ApplySettings(apply_rows=100, apply_linger=None, apply_linger_rows=20))
    h.db.hold = []
    h.send("SERVER s", "POSITION events m 19 19", *_lines(20, 69))
    assert len(_held(h)) == 1
    _release(h)
    assert h.applied() == 69


def test_a_stop_or_a_lost_connection_ends_the_wait_and_applies_nothing_of_it(url) -> None:
    """Rows waiting for a fuller group are dropped with the connection (the worker asks for them
    again from its applied token) and by a stop; the wait's timer goes with them."""
    h = Harness(url, apply=ApplySettings(apply_rows=100, apply_linger=0.01, apply_linger_rows=20))
    h.db.hold = []
    h.send("SERVER s", "POSITION events m 0 0", *_lines(1, 30))
    calls: list[Any] = list(h.clock.getDelayedCalls())  # DelayedCall (the interface lacks active's self)
    waiting = [c for c in calls if c.active()]
    assert waiting
    h.disconnect()
    assert not any(c.active() for c in waiting)
    h.clock.advance(1.0)
    assert _held(h) == [] and h.applied() == 0  # asked for again after the reconnect
    h.connect()
    h.send("SERVER s", "POSITION events m 0 0", *_lines(1, 30))
    assert _held(h) == []
    h.worker.consumers["events"].stop()
    h.clock.advance(1.0)
    assert _held(h) == []  # stopped: the wait ended without an apply
