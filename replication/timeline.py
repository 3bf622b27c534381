"""The master's timeline: scheduled messages pushed to consumers under leases.

The :class:`TimelineService` owns every timeline topic of a master. It keeps,
per topic, the time of the next due message and ONE timer (``callLater``) for
it: no polling. The timer is moved when a message is scheduled, moved or
released, and when a lease a consumer holds runs out (a lease *is* the
message's timestamp, so the storage's next due time covers it).

The master works in *cycles*: ONE transaction per reactor turn for the whole
timeline: the changes that arrived (``SCHEDULE``, ``DELETE``, ``EXTEND``, ...;
each still its own conditional statement with its own outcome) and, for each
topic with due messages, one lease pass for the consumers with free credit,
including the credit the cycle's own ``DELETE``s and ``RELEASE``s free when
they succeed. One durable commit covers the whole cycle; then the ``ACK``s and
the ``LEASE`` lines go out. At most ``batch_flights`` cycles are out at once
(the next one gathers while one commits), each with at most ``max_batch``
changes and ``batch`` new leases per consumer (bursts are spread fairly over
consumers and paced one reactor turn at a time). A consumer whose connection
is paused gets nothing; a lease taken for a connection that went away
meanwhile is released at once, so no lease waits in a buffer. ``ACK`` is
written only after the change has committed, and answers keep the order of
the commands on each connection.

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
    Command,
    ErrorCommand,
)
from replication.dbthreads import DatabaseThreads
from replication.reactor_types import Clock, DelayedCall, Transport
from replication.timeline_commands import (
    CancelCommand,
    DeleteCommand,
    ExtendCommand,
    MoveCommand,
    NackCommand,
    ReleaseCommand,
    ScheduleCommand,
    TimelineCommand,
)
from replication.timeline_metrics import TimelineStats
from replication.timeline_settings import TimelineSettings
from storage.timeline_contract import (
    LEASE_EXPIRED,
    NOT_HOLDER,
    UNKNOWN_MESSAGE,
    Outcome,
    PassResult,
    TimelineMessage,
    TimelineStore,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_ERROR = 1.0  # seconds before a failed lease pass is tried again
REMOVE_ROUNDS = 20  # batches of remove_batch the remover takes at most per remove_interval
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

    def send_lines(self, name: str, data: bytes, count: int) -> None:
        """``count`` encoded ``name`` lines at once (bounded like ``send`` for a client that does not read)."""
        ...

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
        "freeing",
        "gone",
        "held",
        "lease_ms",
        "passed",
        "restoring",
        "tids",
        "topic",
    )

    def __init__(self, conn: Connection, topic: str, consumer_id: str, credit: int, lease_ms: int) -> None:
        self.conn = conn
        self.topic = topic
        self.consumer_id = consumer_id
        self.credit = credit
        self.lease_ms = lease_ms
        self.held: dict[str, int] = {}  # message id -> lease end (ms), as far as we know
        self.tids: dict[str, str] = {}  # message id -> where its leased row is (a hint for DELETE)
        self.freeing: set[str] = set()  # held ids whose DELETE/RELEASE a cycle out counts as freed credit
        self.gone = False
        self.restoring = True  # sending the consumer id's active leases first
        self.passed = False  # a lease pass ran for it (a half-closed peer waits for that much)
        self.asked = 0  # leases asked for it by passes still out (reserved credit)

    def expire(self, now_ms: int) -> int:
        """Forget leases that ran out; returns how many (not those a cycle out counts on)."""
        expired = [mid for mid, until in self.held.items() if until <= now_ms and mid not in self.freeing]
        for mid in expired:
            del self.held[mid]
            self.tids.pop(mid, None)
        return len(expired)

    def forget(self, mid: str) -> bool:
        self.tids.pop(mid, None)
        return self.held.pop(mid, None) is not None

    def free(self) -> int:
        if self.gone or self.restoring or self.conn.paused:
            return 0
        return max(0, self.credit - len(self.held) - self.asked)


class TopicState:
    __slots__ = ("again", "consumers", "name", "next_due", "rotation", "running", "timer", "timer_at", "wanted")

    def __init__(self, name: str) -> None:
        self.name = name
        self.consumers: list[Consumer] = []
        self.next_due: int | None = None  # earliest timestamp in storage, as last seen
        self.timer: DelayedCall | None = None
        self.timer_at: int | None = None
        self.running = 0  # lease passes out
        self.again = False  # something changed while a pass was out: pass again
        self.wanted = False  # the next cycle makes a lease pass for this topic
        self.rotation = 0


# An answer ready to write: the command's name and its encoded line.
_Answer = tuple[str, bytes]


class _ConnState:
    __slots__ = ("answers", "consumers", "paused_reading", "queues")

    def __init__(self) -> None:
        self.consumers: dict[str, Consumer] = {}  # topic -> subscription
        self.answers: deque[list[_Answer | None]] = deque()  # answers in command order
        self.paused_reading = False
        # Commands on one message run in the order they arrived (others run side by side).
        self.queues: dict[tuple[str, str], deque[_Change]] = {}


class _Change:
    """One client command on its way through a cycle: its storage call and where its answer goes."""

    __slots__ = ("args", "command", "conn", "consumer", "key", "name", "slot", "st", "state")

    def __init__(
        self,
        conn: Connection,
        state: _ConnState,
        st: TopicState,
        command: Command,
        slot: list[_Answer | None],
        key: tuple[str, str] | None,
    ) -> None:
        self.conn = conn
        self.state = state
        self.st = st
        self.command = command
        self.slot = slot
        self.key = key
        self.name = ""
        self.args: tuple[Any, ...] = ()
        self.consumer: Consumer | None = None  # the holder, for EXTEND / RELEASE / DELETE


# A lease pass in a cycle: the topic, its plan (consumer, leases asked before frees), the pass's now.
_Pass = tuple[TopicState, list[tuple[Consumer, int]], int]


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
        self._queue: deque[_Change] = deque()  # changes waiting for the next cycle
        self._out = 0  # cycles out
        self._cycle_call: DelayedCall | None = None

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
        if self._cycle_call is not None and self._cycle_call.active():
            self._cycle_call.cancel()
        self._cycle_call = None
        if self._threads is not None:
            self._threads.stop()

    def _remove_and_count(self) -> defer.Deferred[None]:
        topics = list(self.topics)
        now = self.now_ms()

        def run() -> dict[str, dict[str, int]]:
            if self.store.deleted_count() > 0:  # a read first: no write lock taken for nothing
                # Batches, each its own short transaction, while they come full
                # (bounded): under sustained load the marks do not pile up.
                batch = self.settings.remove_batch
                for _ in range(REMOVE_ROUNDS):
                    if self.store.remove_deleted(batch) < batch:
                        break
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
        slot: list[_Answer | None] = [None]
        state.answers.append(slot)
        self._throttle(conn, state)
        mid = getattr(command, "id", None)
        key = None if mid is None else (topic, mid)
        change = _Change(conn, state, st, command, slot, key)
        if key is not None:
            queue = state.queues.get(key)
            if queue is not None:
                queue.append(change)  # after the command on this message that is out
                return
            state.queues[key] = deque()
        self._submit(change)

    def _submit(self, change: _Change) -> None:
        """Prepare a change's storage call (at its turn: now is read here) and queue it for a cycle."""
        command = change.command
        topic = change.st.name
        now = self.now_ms()
        if isinstance(command, ScheduleCommand):
            at = now + command.at if command.relative else command.at
            change.name, change.args = "schedule", (topic, command.group, command.id, at, command.body, now)
        elif isinstance(command, MoveCommand):
            at = now + command.at if command.relative else command.at
            change.name, change.args = "move", (topic, command.group, command.id, at, now)
        elif isinstance(command, CancelCommand):
            change.name, change.args = "cancel", (topic, command.group, command.id, now)
        else:
            assert isinstance(command, (ExtendCommand, ReleaseCommand, DeleteCommand))
            consumer = change.state.consumers.get(topic)
            if consumer is None:
                self._change_done(change, Outcome.refused(NOT_HOLDER))
                return
            change.consumer = consumer
            cid = consumer.consumer_id
            if isinstance(command, ExtendCommand):
                change.name = "extend"
                change.args = (topic, command.id, cid, command.version, command.lease_ms, now)
            elif isinstance(command, ReleaseCommand):
                change.name = "release"
                change.args = (topic, command.id, cid, command.version, command.delay_ms, now)
            else:
                change.name = "delete"
                change.args = (topic, command.id, cid, command.version, now, consumer.tids.get(command.id))
        self._queue.append(change)
        self._schedule()

    def _change_done(self, change: _Change, outcome: Outcome) -> None:
        """A change's outcome after its cycle committed: its answer, the master's view of leases."""
        command = change.command
        st = change.st
        name = command.NAME
        consumer = change.consumer
        mid = getattr(command, "id", None)
        if consumer is not None and mid is not None:
            consumer.freeing.discard(mid)
        if outcome.ok:
            message = outcome.message
            assert message is not None
            # ACK <COMMAND> <topic> <id> <version> <timestamp_ms> (AckCommand's line, written directly)
            change.slot[0] = ("ACK", f"ACK {name} {st.name} {message.id} {message.version} {message.ts}\n".encode())
            if isinstance(command, (ScheduleCommand, MoveCommand)):
                self._poke(st, message.ts)
            elif isinstance(command, ExtendCommand):
                if consumer is not None:
                    consumer.held[message.id] = message.ts
                    consumer.tids.pop(message.id, None)  # the row moved
            elif isinstance(command, (ReleaseCommand, DeleteCommand)):
                if consumer is not None:
                    consumer.forget(message.id)
                if isinstance(command, ReleaseCommand):
                    self._poke(st, message.ts)
        else:
            reason = outcome.reason or UNKNOWN_MESSAGE
            change.slot[0] = ("NACK", NackCommand(name, st.name, mid or "-", reason).encode())
            if isinstance(command, (ExtendCommand, ReleaseCommand, DeleteCommand)):
                self.stats.refused += 1
                if consumer is not None and mid and reason in (NOT_HOLDER, UNKNOWN_MESSAGE, LEASE_EXPIRED):
                    consumer.forget(mid)
        self._answered(change)

    def _change_failed(self, change: _Change, message: str) -> None:
        if change.consumer is not None:
            change.consumer.freeing.discard(getattr(change.command, "id", ""))
        name = change.command.NAME
        logger.error("[%s] %s failed: %s", change.conn.conn_name, name, message)
        change.slot[0] = ("ERROR", ErrorCommand(f"{name} failed: storage unavailable ({message}); retry").encode())
        self._answered(change)

    def _answered(self, change: _Change) -> None:
        """Write the answers that are ready; start the next command on the same message."""
        self._flush(change.conn, change.state)
        key = change.key
        if key is None:
            return
        queue = change.state.queues.get(key)
        if queue:
            self._submit(queue.popleft())
        else:
            change.state.queues.pop(key, None)

    def _answer_now(self, conn: Connection, state: _ConnState, command: Command) -> None:
        state.answers.append([(command.NAME, command.encode())])
        self._flush(conn, state)

    def _flush(self, conn: Connection, state: _ConnState) -> None:
        """Write the answers that are ready, in command order; a run of one kind in one write."""
        answers = state.answers
        live = conn in self._conns
        run: list[bytes] = []
        run_name = ""
        while answers and (ready := answers[0][0]) is not None:
            answers.popleft()
            name, line = ready
            if name != run_name and run:
                if live:
                    conn.send_lines(run_name, b"".join(run), len(run))
                run = []
            run_name = name
            run.append(line)
        if run and live:
            conn.send_lines(run_name, b"".join(run), len(run))
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

    # -- cycles: the changes and the lease passes, one transaction ------------------------

    def _schedule(self) -> None:
        """Run a cycle at the end of this reactor turn (everything that arrived in it goes in)."""
        if self._cycle_call is None and self._out < self.settings.batch_flights and not self._stopped:
            self._cycle_call = self.clock.callLater(0, self._run_cycles)

    def _run_cycles(self) -> None:
        self._cycle_call = None
        while self._out < self.settings.batch_flights and not self._stopped:
            if not self._start_cycle():
                break

    def _start_cycle(self) -> bool:
        """Take the waiting changes and the topics that want a pass into one storage call."""
        take = [self._queue.popleft() for _ in range(min(self.settings.max_batch, len(self._queue)))]
        now = self.now_ms()
        # Credit this cycle's own DELETEs and RELEASEs may free, by topic.
        freeing: dict[TopicState, set[Consumer]] = {}
        for change in take:
            consumer = change.consumer
            if consumer is not None and change.name != "extend" and not consumer.gone:
                freeing.setdefault(change.st, set()).add(consumer)
        passes: list[_Pass] = []
        for st in self.topics.values():
            due = st.next_due is not None and st.next_due <= now
            if not (st.wanted or (st in freeing and due)):
                continue
            plan = self._plan(st, now, freeing.get(st, set()))
            if not plan and st.running:
                st.again = True  # nothing to ask: the pass out re-arms
                st.wanted = False
                continue
            st.wanted = False
            st.again = False
            passes.append((st, plan, now))
        if not take and not passes:
            return False
        # Which request a successful DELETE / RELEASE frees credit for.
        slots: dict[Consumer, tuple[int, int]] = {}
        for p, (_, plan, _) in enumerate(passes):
            for r, (consumer, _) in enumerate(plan):
                slots[consumer] = (p, r)
        frees: list[tuple[int, int] | None] = []
        for change in take:
            consumer = change.consumer
            slot = slots.get(consumer) if consumer is not None and change.name != "extend" else None
            mid = change.args[1] if slot is not None else None
            if slot is not None and consumer is not None and mid in consumer.held and mid not in consumer.freeing:
                consumer.freeing.add(mid)
                frees.append(slot)
            else:
                frees.append(None)
        for st, plan, _ in passes:
            st.running += 1
            for consumer, n in plan:
                consumer.asked += n
        self._out += 1
        calls = [(change.name, change.args) for change in take]
        requests = [(st.name, [(c.consumer_id, c.lease_ms, n) for c, n in plan], now) for st, plan, now in passes]
        d = self.db.run(self.store.cycle, calls, frees, requests)
        d.addCallbacks(self._cycle_done, self._cycle_failed, (take, passes), {}, (take, passes))
        return True

    def _plan(self, st: TopicState, now: int, freeing: set[Consumer]) -> list[tuple[Consumer, int]]:
        """The consumers a pass asks for, starting with a different one each pass (fair)."""
        consumers = st.consumers
        plan: list[tuple[Consumer, int]] = []
        if consumers:
            start = st.rotation % len(consumers)
            st.rotation += 1
            for consumer in consumers[start:] + consumers[:start]:
                self.stats.expired += consumer.expire(now)
                n = min(consumer.free(), self.settings.batch)
                if n > 0 or (consumer in freeing and not consumer.gone and not consumer.restoring):
                    plan.append((consumer, n))
        return plan

    def _cycle_done(self, result: tuple[list[Any], list[PassResult]], take: list[_Change], passes: list[_Pass]) -> None:
        self._out -= 1
        outcomes, pass_results = result
        if self._db_error is not None:
            logger.warning("timeline storage reachable again")
            self._db_error = None
        for change, outcome in zip(take, outcomes, strict=True):
            self._change_done(change, outcome)
        for (st, plan, pass_ms), pr in zip(passes, pass_results, strict=True):
            self._leased(st, plan, pass_ms, pr)
        # Credit freed by this cycle's changes and not used by its pass: another pass.
        for st in {change.st for change in take if change.consumer is not None}:
            self._credit_freed(st)
        self._schedule()

    def _cycle_failed(self, failure: Failure, take: list[_Change], passes: list[_Pass]) -> None:
        self._out -= 1
        message = failure.getErrorMessage()
        for change in take:
            self._change_failed(change, message)
        for st, plan, _ in passes:
            st.running -= 1
            for consumer, n in plan:
                consumer.asked -= n
            if self._db_error is None:
                logger.error(
                    "timeline lease pass on %s failed, retrying every %g s: %s", st.name, RETRY_AFTER_ERROR, message
                )
            if not self._stopped:
                self._set_timer(st, self.now_ms() + int(RETRY_AFTER_ERROR * 1000))
        if passes:
            self._db_error = message
        self._schedule()

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
            if messages:
                conn.send_lines("LEASE", b"".join(_lease_line(st.name, m) for m in messages), len(messages))
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
        self._arm(st)

    def _credit_freed(self, st: TopicState) -> None:
        """Credit may be free: a pass in the next cycle if messages are due."""
        if st.next_due is not None and self.now_ms() >= st.next_due and any(c.free() for c in st.consumers):
            self._want(st)

    def _want(self, st: TopicState) -> None:
        self._cancel_timer(st)
        st.wanted = True
        self._schedule()

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
        # From the clock itself (not whole ms): the timer never fires before the ms it is for.
        delay = max(0.0, at_ms / 1000 - self.clock.seconds())
        st.timer_at = at_ms
        st.timer = self.clock.callLater(delay, self._timer_fired, st)

    def _timer_fired(self, st: TopicState) -> None:
        at_ms = st.timer_at
        st.timer = None
        st.timer_at = None
        if at_ms is not None and self.now_ms() < at_ms:
            self._set_timer(st, at_ms)  # a hair early (float seconds): nothing is due yet
            return
        self._wake(st)

    def _arm(self, st: TopicState) -> None:
        """Set the one timer of a topic from what is known."""
        if self._stopped or st.wanted:
            return
        now = self.now_ms()
        if st.next_due is None:
            self._cancel_timer(st)
        elif st.next_due > now:
            self._set_timer(st, st.next_due)
        elif any(c.free() for c in st.consumers):
            self._want(st)
        else:
            # Due messages wait for credit: wake when a held lease runs out
            # (DELETE, RELEASE, a new consumer or a resumed one wake us sooner).
            ends = [until for c in st.consumers if not c.gone for until in c.held.values()]
            if ends:
                self._set_timer(st, max(min(ends), now))
            else:
                self._cancel_timer(st)

    def _wake(self, st: TopicState) -> None:
        """Lease what is due to consumers with free credit (in the next cycle), then re-arm."""
        if self._stopped:
            return
        self._want(st)

    def _leased(self, st: TopicState, plan: list[tuple[Consumer, int]], pass_ms: int, result: PassResult) -> None:
        """A pass committed: send its leases, then decide when to look again."""
        st.running -= 1
        for consumer, n in plan:
            consumer.asked -= n
        orphans: list[tuple[str, Any]] = []
        sent_ms = self.now_ms()
        lease_sent = self.stats.lease_sent
        name = st.name
        for (consumer, _), leased in zip(plan, result.leased, strict=True):
            if consumer.gone:
                orphans.extend((consumer.consumer_id, x.message) for x in leased)
                continue
            held = consumer.held
            tids = consumer.tids
            lines = []
            for x in leased:
                m = x.message
                held[m.id] = m.ts
                if x.tid is not None:
                    tids[m.id] = x.tid
                lines.append(_lease_line(name, m))
                lease_sent(name, max(0, sent_ms - x.due_ms))
            if lines:
                consumer.conn.send_lines("LEASE", b"".join(lines), len(lines))
            if not consumer.passed:
                consumer.passed = True
                self._finish_half_closed(consumer.conn)
        if orphans:
            self._release_orphans(st, orphans)
        st.next_due = result.next_due
        if self._stopped:
            return
        if st.again or result.more:
            # Another pass in the next cycle (other connections' bytes are read first).
            again, st.again = st.again, False
            if again or any(c.free() for c in st.consumers):
                self._want(st)
            else:
                self._arm(st)
        elif st.next_due is not None and st.next_due <= pass_ms and any(c.free() for c in st.consumers):
            # Due at the pass's time yet not leased with room to spare (another pass,
            # master or connection holds it locked): look again soon, without spinning.
            self._set_timer(st, self.now_ms() + RACE_RETRY_MS)
        else:
            self._arm(st)  # due since the pass began: at once; else at the next due time

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


def _lease_line(topic: str, m: TimelineMessage) -> bytes:
    """``LEASE <topic> <id> <version> <until_ms> <body_json>`` (LeaseCommand's line, written directly)."""
    return f"LEASE {topic} {m.id} {m.version} {m.ts} {m.body}\n".encode()


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
