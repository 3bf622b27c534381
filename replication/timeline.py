"""The master's timeline: scheduled messages pushed to consumers under leases.

The :class:`TimelineService` owns every timeline topic of a master. It keeps,
per topic, the time of the next due message and ONE timer (``callLater``) for
it: no polling. The timer is moved when a message is scheduled, moved or
released, and when a lease a consumer holds runs out (a lease *is* the
message's timestamp, so the storage's next due time covers it).

When messages are due, a pass leases them in storage for the consumers that
have free credit (at most ``batch`` each per pass, starting with a different
consumer each pass, so bursts are spread fairly and paced one reactor turn at
a time), and writes each ``LEASE`` as soon as the storage call returns. A
consumer whose connection is paused gets nothing; a lease taken for a
connection that went away meanwhile is released at once, so no lease waits in
a buffer. ``ACK`` is written only after the change has committed, and answers
keep the order of the commands on each connection.

Storage calls run on the timeline's own database threads.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet import defer, task
from twisted.python.failure import Failure

from replication.commands import (
    AckCommand,
    CancelCommand,
    Command,
    DeleteCommand,
    ErrorCommand,
    ExtendCommand,
    LeaseCommand,
    MoveCommand,
    NackCommand,
    ReleaseCommand,
    ScheduleCommand,
    TimelineCommand,
)
from replication.dbthreads import DatabaseThreads
from replication.reactor_types import Clock, DelayedCall, Transport
from replication.timeline_metrics import TimelineStats
from replication.timeline_settings import TimelineSettings
from storage.timeline_contract import LEASE_EXPIRED, NOT_HOLDER, UNKNOWN_MESSAGE, Outcome, TimelineStore

logger = logging.getLogger(__name__)

RETRY_AFTER_ERROR = 1.0  # seconds before a failed lease pass is tried again
PASSES_IN_FLIGHT = 2  # lease passes of one topic out at once (one commits while the next is planned)
RACE_RETRY_MS = 5  # due messages remain yet none could be leased (taken elsewhere): look again soon


class Connection(Protocol):
    """What the service needs of a master connection (``ServerProtocol``)."""

    conn_name: str
    read_closed: bool  # the peer half-closed (nc -q1): close once every answer is out
    transport: Transport | None

    @property
    def paused(self) -> bool:
        """The client stopped reading (flow control): it is given no leases."""
        ...

    def send(self, command: Command) -> None: ...

    def finish_after_half_close(self) -> None: ...


class TimelineHooks(Protocol):
    """What a master connection calls (``TimelineService``, or ``NoTimeline`` without a store)."""

    def command(self, conn: Connection, command: Command) -> None: ...

    def connection_lost(self, conn: Connection) -> None: ...

    def resumed(self, conn: Connection) -> None: ...

    def busy(self, conn: Connection) -> bool: ...


class DbRunner(Protocol):
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> defer.Deferred[Any]: ...


class Consumer:
    """One ``TIMELINE`` subscription: a consumer id on one connection for one topic."""

    __slots__ = (
        "asked",
        "conn",
        "consumer_id",
        "credit",
        "gone",
        "held",
        "lease_ms",
        "passed",
        "restoring",
        "topic",
    )

    def __init__(self, conn: Connection, topic: str, consumer_id: str, credit: int, lease_ms: int) -> None:
        self.conn = conn
        self.topic = topic
        self.consumer_id = consumer_id
        self.credit = credit
        self.lease_ms = lease_ms
        self.held: dict[str, int] = {}  # message id -> lease end (ms), as far as we know
        self.gone = False
        self.restoring = True  # sending the consumer id's active leases first
        self.passed = False  # a lease pass ran for it (a half-closed peer waits for that much)
        self.asked = 0  # leases asked for it by passes still out (reserved credit)

    def expire(self, now_ms: int) -> int:
        """Forget leases that ran out; returns how many."""
        expired = [mid for mid, until in self.held.items() if until <= now_ms]
        for mid in expired:
            del self.held[mid]
        return len(expired)

    def free(self) -> int:
        if self.gone or self.restoring or self.conn.paused:
            return 0
        return max(0, self.credit - len(self.held) - self.asked)


class TopicState:
    __slots__ = ("again", "consumers", "name", "next_due", "rotation", "running", "timer", "timer_at")

    def __init__(self, name: str) -> None:
        self.name = name
        self.consumers: list[Consumer] = []
        self.next_due: int | None = None  # earliest timestamp in storage, as last seen
        self.timer: DelayedCall | None = None
        self.timer_at: int | None = None
        self.running = 0  # lease passes out
        self.again = False  # something changed while it was out: pass again
        self.rotation = 0


class _ConnState:
    __slots__ = ("answers", "consumers", "paused_reading", "queues")

    def __init__(self) -> None:
        self.consumers: dict[str, Consumer] = {}  # topic -> subscription
        self.answers: deque[list[Command | None]] = deque()  # answers in command order
        self.paused_reading = False
        # Commands on one message run in the order they arrived (others run side by side).
        self.queues: dict[tuple[str, str], deque[Callable[[], defer.Deferred[Any]]]] = {}


class Batcher:
    """Group commit: changes wait while earlier batches are out, then go in one transaction.

    Changes submitted in one reactor turn (every command of the bytes just
    read) go into one batch; at most ``flights`` batches run at once, each
    with up to ``max_batch`` changes. An idle batcher adds no latency; under
    load, many changes share one commit. Each change is still its own
    conditional statement with its own outcome, answered after the commit.
    """

    def __init__(self, store: TimelineStore, db: DbRunner, clock: Clock, max_batch: int, flights: int) -> None:
        self.store = store
        self.db = db
        self.clock = clock
        self.max_batch = max_batch
        self.flights = flights
        self._queue: deque[tuple[str, tuple[Any, ...], defer.Deferred[Any]]] = deque()
        self._out = 0
        self._flush_call: DelayedCall | None = None

    def submit(self, name: str, args: tuple[Any, ...]) -> defer.Deferred[Any]:
        d: defer.Deferred[Any] = defer.Deferred()
        self._queue.append((name, args, d))
        if self._flush_call is None and self._out < self.flights:
            self._flush_call = self.clock.callLater(0, self._flush)
        return d

    def _flush(self) -> None:
        self._flush_call = None
        while self._queue and self._out < self.flights:
            take = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            self._out += 1
            batch = self.db.run(self.store.apply, [(name, args) for name, args, _ in take])
            batch.addCallbacks(self._done, self._failed, (take,), {}, (take,))

    def _done(self, results: list[Any], take: list) -> None:
        self._out -= 1
        for (_, _, d), result in zip(take, results, strict=True):
            d.callback(result)
        self._flush()

    def _failed(self, failure: Failure, take: list) -> None:
        self._out -= 1
        for _, _, d in take:
            d.errback(failure)
        self._flush()


class TimelineService:
    def __init__(
        self,
        store: TimelineStore,
        settings: TimelineSettings,
        db: DbRunner,
        clock: Clock,
        stats: TimelineStats | None = None,
        max_line_bytes: int = 65536,
    ) -> None:
        self.store = store
        self.settings = settings
        self.db = db
        self.clock = clock
        self.stats = stats if stats is not None else TimelineStats()
        self.max_line_bytes = max_line_bytes  # a LEASE line must fit the peers' line limit
        self.topics: dict[str, TopicState] = {name: TopicState(name) for name in settings.topics}
        self._conns: dict[Connection, _ConnState] = {}
        self._remover: task.LoopingCall | None = None
        self._stopped = False
        self._db_error: str | None = None
        self._threads: DatabaseThreads | None = None  # the master's own pool, started and stopped here
        self._batcher = Batcher(store, db, clock, settings.max_batch, settings.batch_flights)

    @classmethod
    def for_master(
        cls, master: Any, store: TimelineStore | None, settings: TimelineSettings
    ) -> TimelineService | NoTimeline:
        """The master's service, on its own database threads (or refusals, without a store)."""
        if store is None:
            return NoTimeline()
        db = DatabaseThreads(master.reactor, settings.db_threads, name="tickline-timeline-db")
        service = cls(store, settings, db, master.reactor, max_line_bytes=master.protocol_config.max_line_bytes)
        service._threads = db
        return service

    def now_ms(self) -> int:
        return int(self.clock.seconds() * 1000)

    # -- start and stop ----------------------------------------------------------------

    def start(self) -> None:
        """Learn each topic's next due time (arms the timers) and start the batch remover."""
        if self._threads is not None:
            self._threads.start()
        for st in self.topics.values():
            self._wake(st)
        self._remover = task.LoopingCall(self._remove_and_count)
        self._remover.clock = self.clock  # type: ignore[assignment]
        self._remover.start(self.settings.remove_interval, now=True).addErrback(
            lambda f: logger.error("timeline remover stopped: %s", f.getTraceback())
        )

    def stop(self) -> None:
        self._stopped = True
        if self._remover is not None and self._remover.running:
            self._remover.stop()
        for st in self.topics.values():
            self._cancel_timer(st)
        if self._threads is not None:
            self._threads.stop()

    def _remove_and_count(self) -> defer.Deferred[None]:
        topics = list(self.topics)
        now = self.now_ms()

        def run() -> dict[str, dict[str, int]]:
            if self.store.deleted_count() > 0:  # a read first: no write lock taken for nothing
                self.store.remove_deleted(self.settings.remove_batch)
            return {topic: self.store.counts(topic, now) for topic in topics}

        d = self.db.run(run)
        d.addCallback(self.stats.counts.update)
        d.addErrback(lambda f: logger.warning("timeline batch remover: %s", f.getErrorMessage()))
        return d

    # -- commands from connections ------------------------------------------------------

    def command(self, conn: Connection, command: Command) -> None:
        """Handle one timeline command from a connection (the server's ``on_<NAME>``)."""
        state = self._conns.get(conn)
        if state is None:
            state = self._conns[conn] = _ConnState()
            # Timeline traffic is small lines back and forth (LEASE, DELETE, ACK):
            # Nagle's algorithm would hold each for a delayed ACK (tens of ms).
            set_no_delay = getattr(conn.transport, "setTcpNoDelay", None)
            if set_no_delay is not None:
                set_no_delay(True)
        topic = getattr(command, "topic", "")
        st = self.topics.get(topic)
        if st is None:
            known = ", ".join(sorted(self.topics))
            self._answer_now(conn, state, ErrorCommand(f"unknown topic {topic!r} (topics: {known})"))
            return
        if isinstance(command, TimelineCommand):
            self._consume(conn, state, st, command)
            return
        if isinstance(command, ScheduleCommand):
            mid_len = len(command.id) if command.id is not None else 26
            # LEASE <topic> <id> <version> <until_ms> <body>: versions and times up to 19 digits.
            lease_len = len("LEASE ") + len(topic) + 1 + mid_len + 1 + 19 + 1 + 19 + 1 + len(command.body.encode())
            if lease_len > self.max_line_bytes:
                self._answer_now(
                    conn,
                    state,
                    ErrorCommand(
                        f"SCHEDULE {topic}: body too long: its LEASE line could be {lease_len} bytes, "
                        f"the line limit is {self.max_line_bytes}"
                    ),
                )
                return
        slot: list[Command | None] = [None]
        state.answers.append(slot)
        self._throttle(conn, state)
        mid = getattr(command, "id", None)

        def launch() -> defer.Deferred[Any]:
            d = self._call(state, topic, command)
            d.addCallbacks(self._done, self._failed, (conn, state, st, command, slot), {}, (conn, state, command, slot))
            return d

        if mid is None:
            launch()
        else:
            self._in_order(state, (topic, mid), launch)

    def _in_order(self, state: _ConnState, key: tuple[str, str], launch: Callable[[], defer.Deferred[Any]]) -> None:
        queue = state.queues.get(key)
        if queue is not None:
            queue.append(launch)
            return
        state.queues[key] = deque()
        self._launch(state, key, launch)

    def _launch(self, state: _ConnState, key: tuple[str, str], launch: Callable[[], defer.Deferred[Any]]) -> None:
        def next_one(result: Any) -> Any:
            queue = state.queues.get(key)
            if queue:
                self._launch(state, key, queue.popleft())
            else:
                state.queues.pop(key, None)
            return result

        launch().addBoth(next_one)

    def _call(self, state: _ConnState, topic: str, command: Command) -> defer.Deferred[Any]:
        """Run one command's storage operation off the reactor thread."""
        now = self.now_ms()
        submit = self._batcher.submit
        if isinstance(command, ScheduleCommand):
            at = now + command.at if command.relative else command.at
            return submit("schedule", (topic, command.group, command.id, at, command.body, now))
        if isinstance(command, MoveCommand):
            at = now + command.at if command.relative else command.at
            return submit("move", (topic, command.group, command.id, at, now))
        if isinstance(command, CancelCommand):
            return submit("cancel", (topic, command.group, command.id, now))
        assert isinstance(command, (ExtendCommand, ReleaseCommand, DeleteCommand))
        consumer = state.consumers.get(topic)
        if consumer is None:
            return defer.succeed(Outcome.refused(NOT_HOLDER))
        cid = consumer.consumer_id
        if isinstance(command, ExtendCommand):
            return submit("extend", (topic, command.id, cid, command.version, command.lease_ms, now))
        if isinstance(command, ReleaseCommand):
            return submit("release", (topic, command.id, cid, command.version, command.delay_ms, now))
        return submit("delete", (topic, command.id, cid, command.version, now))

    def _done(
        self, outcome: Outcome, conn: Connection, state: _ConnState, st: TopicState, command: Command, slot: list
    ) -> None:
        mid = getattr(command, "id", None)
        name = command.NAME
        consumer = state.consumers.get(st.name)
        if outcome.ok:
            message = outcome.message
            assert message is not None
            slot[0] = AckCommand(name, st.name, message.id, message.version, message.ts)
            if isinstance(command, (ScheduleCommand, MoveCommand)):
                self._poke(st, message.ts)
            elif isinstance(command, ExtendCommand) and consumer is not None:
                consumer.held[message.id] = message.ts
            elif isinstance(command, (ReleaseCommand, DeleteCommand)):
                if consumer is not None:
                    consumer.held.pop(message.id, None)
                if isinstance(command, ReleaseCommand):
                    self._poke(st, message.ts)
                self._credit_freed(st)
        else:
            reason = outcome.reason or UNKNOWN_MESSAGE
            slot[0] = NackCommand(name, st.name, mid or "-", reason)
            if isinstance(command, (ExtendCommand, ReleaseCommand, DeleteCommand)):
                self.stats.refused += 1
                gone = consumer is not None and reason in (NOT_HOLDER, UNKNOWN_MESSAGE, LEASE_EXPIRED)
                if gone and consumer is not None and mid and consumer.held.pop(mid, None) is not None:
                    self._credit_freed(st)
        self._flush(conn, state)

    def _failed(self, failure: Failure, conn: Connection, state: _ConnState, command: Command, slot: list) -> None:
        logger.error("[%s] %s failed: %s", conn.conn_name, command.NAME, failure.getErrorMessage())
        slot[0] = ErrorCommand(f"{command.NAME} failed: storage unavailable ({failure.getErrorMessage()}); retry")
        self._flush(conn, state)

    def _answer_now(self, conn: Connection, state: _ConnState, command: Command) -> None:
        state.answers.append([command])
        self._flush(conn, state)

    def _flush(self, conn: Connection, state: _ConnState) -> None:
        answers = state.answers
        while answers and answers[0][0] is not None:
            command = answers.popleft()[0]
            assert command is not None
            if conn in self._conns:
                conn.send(command)
        self._throttle(conn, state)
        if not answers:
            self._finish_half_closed(conn)

    def busy(self, conn: Connection) -> bool:
        """Answers are still owed to this connection."""
        state = self._conns.get(conn)
        if state is None:
            return False
        return bool(state.answers) or any(not c.passed and not c.gone for c in state.consumers.values())

    def _finish_half_closed(self, conn: Connection) -> None:
        if conn.read_closed and conn in self._conns and not self.busy(conn):
            conn.finish_after_half_close()

    def _throttle(self, conn: Connection, state: _ConnState) -> None:
        """Stop reading from a connection with too many commands in flight (bounded)."""
        transport = conn.transport
        if transport is None:
            return
        if not state.paused_reading and len(state.answers) >= self.settings.max_pending:
            state.paused_reading = True
            transport.pauseProducing()
        elif state.paused_reading and len(state.answers) <= self.settings.max_pending // 2:
            state.paused_reading = False
            transport.resumeProducing()

    # -- consumers -----------------------------------------------------------------------

    def _consume(self, conn: Connection, state: _ConnState, st: TopicState, command: TimelineCommand) -> None:
        old = state.consumers.get(st.name)
        if old is not None:
            if old.consumer_id != command.consumer:
                self._answer_now(
                    conn,
                    state,
                    ErrorCommand(
                        f"this connection already consumes {st.name!r} as {old.consumer_id!r}; "
                        "one consumer id per topic per connection"
                    ),
                )
                return
            old.credit, old.lease_ms = command.credit, command.lease_ms
            self._credit_freed(st)
            return
        consumer = Consumer(conn, st.name, command.consumer, command.credit, command.lease_ms)
        state.consumers[st.name] = consumer
        st.consumers.append(consumer)
        now = self.now_ms()
        d = self.db.run(self.store.active_leases, st.name, command.consumer, now)

        def restore(messages: list) -> None:
            consumer.restoring = False
            if consumer.gone:
                return
            for message in messages:
                # A consumer that comes back gets its active leases first.
                consumer.held[message.id] = message.ts
                conn.send(LeaseCommand(st.name, message.id, message.version, message.ts, message.body))
            if consumer.free() == 0:
                consumer.passed = True  # no credit left for a pass
                self._finish_half_closed(conn)
            if messages:
                logger.info(
                    "[%s] consumer %s got %d active leases back on %s",
                    conn.conn_name,
                    consumer.consumer_id,
                    len(messages),
                    st.name,
                )
            self._wake(st)

        def failed(failure: Failure) -> None:
            consumer.restoring = False
            logger.error("[%s] reading active leases failed: %s", conn.conn_name, failure.getErrorMessage())
            if not consumer.gone:
                self._answer_now(conn, state, ErrorCommand(f"TIMELINE {st.name} failed: storage unavailable; retry"))
                self._drop(consumer)

        d.addCallbacks(restore, failed)

    def _drop(self, consumer: Consumer) -> None:
        consumer.gone = True
        st = self.topics[consumer.topic]
        if consumer in st.consumers:
            st.consumers.remove(consumer)
        state = self._conns.get(consumer.conn)
        if state is not None and state.consumers.get(consumer.topic) is consumer:
            del state.consumers[consumer.topic]

    def connection_lost(self, conn: Connection) -> None:
        state = self._conns.pop(conn, None)
        if state is None:
            return
        for consumer in list(state.consumers.values()):
            self._drop(consumer)

    def resumed(self, conn: Connection) -> None:
        """The connection's transport drains again: its consumers may take leases."""
        state = self._conns.get(conn)
        if state is not None:
            for topic in state.consumers:
                self._credit_freed(self.topics[topic])

    # -- pushing due messages -----------------------------------------------------------

    def _poke(self, st: TopicState, at_ms: int) -> None:
        """A message is (now) at ``at_ms``: wake no later than then."""
        if st.next_due is None or at_ms < st.next_due:
            st.next_due = at_ms
        if st.running:
            st.again = True  # a pass out may have read the next due time before this
        if st.running < PASSES_IN_FLIGHT:
            self._arm(st)

    def _credit_freed(self, st: TopicState) -> None:
        if st.running >= PASSES_IN_FLIGHT:
            st.again = True
        elif st.next_due is not None and (now := self.now_ms()) >= st.next_due:
            # At the end of this reactor turn: one pass for every credit freed in it.
            self._set_timer(st, now)

    def _cancel_timer(self, st: TopicState) -> None:
        if st.timer is not None and st.timer.active():
            st.timer.cancel()
        st.timer = None
        st.timer_at = None

    def _set_timer(self, st: TopicState, at_ms: int) -> None:
        if st.timer is not None and st.timer.active():
            if st.timer_at == at_ms:
                return
            st.timer.cancel()
        delay = max(0.0, (at_ms - self.now_ms()) / 1000)
        st.timer_at = at_ms
        st.timer = self.clock.callLater(delay, self._timer_fired, st)

    def _timer_fired(self, st: TopicState) -> None:
        st.timer = None
        st.timer_at = None
        self._wake(st)

    def _arm(self, st: TopicState) -> None:
        """Set the one timer of a topic from what is known."""
        if self._stopped:
            return
        now = self.now_ms()
        if st.next_due is None:
            self._cancel_timer(st)
        elif st.next_due > now:
            self._set_timer(st, st.next_due)
        elif any(c.free() for c in st.consumers):
            self._set_timer(st, now)
        else:
            # Due messages wait for credit: wake when a held lease runs out
            # (DELETE, RELEASE, a new consumer or a resumed one wake us sooner).
            ends = [until for c in st.consumers if not c.gone for until in c.held.values()]
            if ends:
                self._set_timer(st, max(min(ends), now))
            else:
                self._cancel_timer(st)

    def _wake(self, st: TopicState) -> None:
        """Lease what is due to consumers with free credit, then re-arm."""
        if self._stopped:
            return
        if st.running >= PASSES_IN_FLIGHT:
            st.again = True
            return
        self._cancel_timer(st)
        now = self.now_ms()
        consumers = st.consumers
        plan: list[tuple[Consumer, int]] = []
        if consumers:
            start = st.rotation % len(consumers)
            st.rotation += 1
            for consumer in consumers[start:] + consumers[:start]:
                self.stats.expired += consumer.expire(now)
                free = consumer.free()
                if free > 0:
                    plan.append((consumer, min(free, self.settings.batch)))
        if not plan and st.running:
            st.again = True  # nothing to ask: the pass out re-arms
            return
        for consumer, n in plan:
            consumer.asked += n
        st.running += 1
        st.again = False
        requests = [(c.consumer_id, c.lease_ms, n) for c, n in plan]
        d = self.db.run(self._lease_pass, st.name, requests, now)
        d.addCallbacks(self._leased, self._lease_failed, (st, plan, now), {}, (st, plan))

    def _lease_pass(
        self, topic: str, requests: list[tuple[str, int, int]], now_ms: int
    ) -> tuple[list[list[Any]], int | None]:
        """On a database thread, one transaction: leases for the consumers, then the next due time."""
        return self.store.lease_pass(topic, requests, now_ms)

    def _leased(self, result: tuple[list[list[Any]], int | None], st: TopicState, plan: list, pass_ms: int) -> None:
        results, next_due = result
        st.running -= 1
        for consumer, n in plan:
            consumer.asked -= n
        if self._db_error is not None:
            logger.warning("timeline storage reachable again")
            self._db_error = None
        more = False
        orphans: list[tuple[str, Any]] = []
        sent_ms = self.now_ms()
        for (consumer, asked), leased in zip(plan, results, strict=True):
            if consumer.gone:
                orphans.extend((consumer.consumer_id, x.message) for x in leased)
                continue
            send = consumer.conn.send
            for x in leased:
                m = x.message
                consumer.held[m.id] = m.ts
                send(LeaseCommand(st.name, m.id, m.version, m.ts, m.body))
                self.stats.lease_sent(st.name, max(0, sent_ms - x.due_ms))
            if leased and len(leased) >= asked:
                more = True
            if not consumer.passed:
                consumer.passed = True
                self._finish_half_closed(consumer.conn)
        if orphans:
            self._release_orphans(st, orphans)
        st.next_due = next_due
        if self._stopped:
            return
        now = self.now_ms()
        if st.again or more:
            # Another pass on the next reactor turn: other connections go first.
            self._set_timer(st, now)
        elif st.next_due is not None and st.next_due <= pass_ms and any(c.free() for c in st.consumers):
            # Due at the pass's time yet not leased with room to spare (another pass,
            # master or connection holds it locked): look again soon, without spinning.
            self._set_timer(st, now + RACE_RETRY_MS)
        else:
            self._arm(st)  # due since the pass began: at once; else at the next due time

    def _lease_failed(self, failure: Failure, st: TopicState, plan: list) -> None:
        st.running -= 1
        for consumer, n in plan:
            consumer.asked -= n
        message = failure.getErrorMessage()
        if self._db_error is None:
            logger.error(
                "timeline lease pass on %s failed, retrying every %g s: %s", st.name, RETRY_AFTER_ERROR, message
            )
        self._db_error = message
        if not self._stopped:
            self._set_timer(st, self.now_ms() + int(RETRY_AFTER_ERROR * 1000))

    def _release_orphans(self, st: TopicState, orphans: list[tuple[str, Any]]) -> None:
        """Leases taken for a connection that went away meanwhile: give them back at once."""
        now = self.now_ms()

        def run() -> None:
            for consumer_id, m in orphans:
                self.store.release(st.name, m.id, consumer_id, m.version, 0, now)

        d = self.db.run(run)
        d.addCallbacks(
            lambda _: self._poke(st, now),
            lambda f: logger.warning("releasing unsent leases failed (they expire): %s", f.getErrorMessage()),
        )


class NoTimeline:
    """A master without a timeline store: timeline commands get ``ERROR``."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def command(self, conn: Connection, command: Command) -> None:
        conn.send(ErrorCommand(f"{command.NAME}: this master has no timeline"))

    def connection_lost(self, conn: Connection) -> None:
        pass

    def busy(self, conn: Connection) -> bool:
        return False

    def resumed(self, conn: Connection) -> None:
        pass
