"""One stream of one worker: receive rows in token order, apply them exactly once.

``applied`` is the token committed in the worker's database together with the
effects of every row up to it. ``known`` is the highest token received on
this connection (queued or applied). Rows at or below ``known`` are stale and
dropped; a ``POSITION`` whose ``prev_token`` is above ``known`` means rows
were missed, and the worker asks for them again (``REPLICATE <stream>
<known>``) before moving on.

Applying takes whole tokens from the front of the queue (many at once, up to
``apply_rows`` rows) and runs the handlers and the token update in one
transaction on the database thread. A failure rolls back, is logged with the
failing token's rows, and is retried with exponential backoff, one token at a
time, until it succeeds: rows are never skipped.

Rows carry their oracle timestamp when the master acknowledged ``OPTIONS
ts``. From a master that did not (a seed-protocol master), a row's ``ts`` is
its arrival time at this worker, in the oracle's shape (Unix milliseconds
shifted left by the logical bits, logical part 0): the replicated table's
``ts`` column then holds when the worker received the row, and the lag
measures only how long rows wait to be applied here.
"""

from __future__ import annotations

import bisect
import collections
import logging
import operator
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attr
from twisted.internet import defer
from twisted.python.failure import Failure

from replication.reactor_types import Clock
from storage.contracts import ApplyTransaction, Effects, ReceivedRows
from storage.schema import StreamSchema
from storage.tso import compose, physical_ms
from workers.handlers import ApplyContext, Handler, ReplicatedRow
from workers.replicator import TableReplicator
from workers.settings import ApplySettings

if TYPE_CHECKING:
    from workers.ordering import OrderedDelivery

logger = logging.getLogger(__name__)
# (stream, token, schema, rows as received, the same apply as effects) -> applied
ReplicateInDb = Callable[[str, int, StreamSchema, list[ReceivedRows], Effects], defer.Deferred[None]]
# As ReplicateInDb for a full group of a backlog: its link, and the link of the group before it
# (None: it waits for no other); None: not offered now (the caller goes the usual way).
ChainInDb = Callable[
    [str, int, StreamSchema, list[ReceivedRows], Effects, "ChainLink", "ChainLink | None"],
    "defer.Deferred[None] | None",
]


class NotApplied(Exception):
    """A group queued behind another was not applied, because the one before it had not committed.

    Nothing of it ran; it is applied again once the group before it is.
    """


class ChainLink:
    """A full group of a backlog handed to the database, as the database threads see it.

    ``token``: its last token; ``lane``: the database thread (and connection)
    it runs on, set by whoever runs it. The thread that applies it calls
    :meth:`finish` once it committed or failed, and the group queued behind
    it waits for that (:meth:`wait`) before it moves the token: the commits
    follow the token order even when two groups are copied at once.
    """

    __slots__ = ("_done", "committed", "lane", "token")

    def __init__(self, token: int) -> None:
        self.token = token
        self.lane = 0
        self.committed = False
        self._done = threading.Event()

    def finish(self, committed: bool) -> None:
        """On the database thread: the group committed (True) or will not (False)."""
        self.committed = committed
        self._done.set()

    def wait(self, timeout: float) -> bool:
        """Block until the group finished; whether it committed (False too after ``timeout`` s)."""
        return self._done.wait(timeout) and self.committed


def _replicator_only(handlers: list[Handler], schema: StreamSchema) -> bool:
    """The stream's only handler copies its rows into ``replicated_<stream>`` (``workers.replicator``)."""
    return len(handlers) == 1 and isinstance(handlers[0], TableReplicator) and handlers[0].schema == schema


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ConsumerStats:
    """One stream of a worker."""

    stream: str
    applied: int  # token committed in the worker's database
    received: int  # highest token received on this connection (queued or applied)
    pending_rows: int  # received, waiting to be applied
    applied_rows: int  # since the process started
    # now minus the time up to which the stream is complete here (None: not known yet)
    lag_ms: int | None
    # Ordered delivery (workers.ordering), for ordered streams only:
    ordered: bool = False
    held_rows: int = 0  # received, held back for timestamp order
    blocking: bool = False  # the lowest waiting row of another stream waits for this one
    released_rows: int = 0  # handed on in timestamp order


class _Item:
    """One token's rows as received (``raw``), made :class:`ReplicatedRow` s only when something needs them.

    The table replicator on PostgreSQL takes the received lists as they are
    (``apply_replicated``): no object per row on that path.
    """

    __slots__ = (
        "_rows",
        "arrived",
        "count",
        "instance",
        "raw",
        "seq",
        "stream",
        "token",
        "tokens",
        "width",
        "with_ts",
    )

    def __init__(
        self,
        token: int,
        raw: list[list[Any]] | None = None,
        stream: str = "",
        instance: str = "",
        width: int = 0,
        with_ts: bool = True,
        arrived: float = 0.0,
        tokens: list[int] | None = None,
    ) -> None:
        self.token = token  # the last token
        # Several single-row tokens (a run from the connection): each row's token; None: all rows are ``token``'s.
        self.tokens = tokens
        self.raw: list[list[Any]] = raw or []  # empty: a POSITION moved the token without rows
        self.count = len(self.raw)
        self.stream = stream
        self.instance = instance
        self.width = width  # the stream's columns
        self.with_ts = with_ts  # the master acknowledged OPTIONS ts
        self.arrived = arrived  # arrival (seconds), the ts of rows that carry none
        self.seq = 0  # ordered delivery: the release order across streams (workers.ordering)
        self._rows: list[ReplicatedRow] | None = None

    @property
    def rows(self) -> list[ReplicatedRow]:
        if self._rows is None:
            if self.tokens is None:
                self._rows = [self._row(row, self.token) for row in self.raw]
            else:
                self._rows = [self._row(row, token) for row, token in zip(self.raw, self.tokens, strict=True)]
        return self._rows

    def split(self) -> list[_Item]:
        """One item per token (a failed apply is retried one token at a time)."""
        if self.tokens is None:
            return [self]
        return [
            _Item(token, [row], self.stream, self.instance, self.width, self.with_ts, self.arrived)
            for token, row in zip(self.tokens, self.raw, strict=True)
        ]

    def _split(self, row: list[Any]) -> tuple[int, tuple[Any, ...]]:
        """A row's timestamp and values. A row exactly one value longer than the
        stream's columns, ending in an integer, carries its timestamp (it fits
        no other reading), and a row of exactly the stream's columns carries
        none (stamped with its arrival time); a row of neither width is split
        as acknowledged, so the check names the misfit."""
        width = self.width
        if len(row) == width + 1 and (self.with_ts or (type(row[-1]) is int and row[-1] >= 0)):
            return row[-1], tuple(row[:-1])
        if len(row) != width and self.with_ts and row:
            return row[-1], tuple(row[:-1])
        return compose(int(self.arrived * 1000)), tuple(row)

    def _row(self, row: list[Any], token: int) -> ReplicatedRow:
        ts, values = self._split(row)
        return ReplicatedRow(self.stream, token, self.instance, ts, values)

    def first_ts(self) -> int | None:
        return self._split(self.raw[0])[0] if self.raw else None

    def last_ts(self) -> int | None:
        return self._split(self.raw[-1])[0] if self.raw else None

    def received(self) -> list[ReceivedRows]:
        """The rows as received: a run of single-row tokens as one entry (its tokens' list), no object per row."""
        if self.tokens is None:
            return [(self.token, self.instance, self.raw)]
        return [(self.tokens, self.instance, self.raw)]


# A group handed to the database: (items, last token, generation, chain link or None, rows).
_Entry = tuple[list[_Item], int, int, "ChainLink | None", int]


class StreamConsumer:
    def __init__(
        self,
        stream: str,
        schema: StreamSchema,
        applied: int,
        handlers: list[Handler],
        apply_in_db: Callable[[str, int, Effects], defer.Deferred[None]],
        worker_name: str,
        clock: Clock,
        settings: ApplySettings = ApplySettings(),
        on_progress: Callable[[StreamConsumer], None] | None = None,
        replicate_in_db: ReplicateInDb | None = None,
        nudge: Callable[[], None] | None = None,
        chain_in_db: ChainInDb | None = None,
    ) -> None:
        self.stream = stream
        self.schema = schema
        self._width = len(schema.columns)
        self.applied = applied
        self.known = applied
        self.handlers = handlers
        self._apply_in_db = apply_in_db
        # The table replicator alone: received rows go to the store as they are.
        self._replicate_in_db = replicate_in_db if _replicator_only(handlers, schema) else None
        # A second full group queued behind the one being applied (see _kick_chained).
        self._chain_in_db = chain_in_db if self._replicate_in_db is not None else None
        self._worker_name = worker_name
        self._clock = clock
        self.settings = settings
        self._on_progress = on_progress
        # Asks for the answer of an apply in flight now (a lazy one: replication.pg_async):
        # called when something waits behind it; may finish it, and kick again, at once.
        self._nudge = nudge
        self._queue: collections.deque[_Item] = collections.deque()
        self.queued_rows = 0
        # Groups handed to the database, in token order: (items, last token, generation, link of a
        # full group of a backlog or None, rows). At most two: the one being applied and one full
        # group behind it (applied at the same time on a second connection, or queued).
        self._inflight: list[_Entry] = []
        self._generation = 0
        self._failures = 0
        self._retry_call: Any = None
        self.applied_ts: int | None = None
        self.rows_applied = 0
        # Ordered delivery across streams: received tokens pass through the gate.
        self.gate: OrderedDelivery | None = None
        # The latest TICK (safe token, safe ts) and the start time of a new stream.
        self.tick_token: int | None = None
        self.tick_ts: int | None = None
        self.start_at_ms: int | None = None
        # While a read's lines are handled (hold/release): what they queue is applied at its end.
        self._held = False
        self._kick_due = False
        self._arrived = False  # rows were accepted during the read now held (hold/release)
        # The wait for a fuller group (settings.apply_linger), whether it is over, and whether the
        # last group handed was full (the tail of a backlog is applied at once).
        self._linger_call: Any = None
        self._lingered = False
        self._after_full = False

    # -- input from the connection ---------------------------------------------------

    def hold(self) -> None:
        """Queue what arrives without applying it, until :meth:`release`.

        The worker holds its streams while the lines of one read are
        handled, and past its end while more bytes already wait on the
        socket: a commit's rows that arrive in several reads (64 KiB each)
        are applied as one group, not as a first group of the first read's
        rows and then the rest. Each ``COPY`` costs its backend about 0.35
        ms beyond its rows (docs/benchmarks.md, e2e7), so the fewer groups
        the less CPU per row. No time is waited for: the next read follows
        at once, and a read that brings none of this stream's rows ends the
        hold (other streams' lines may keep the socket from draining).
        """
        self._held = True
        self._arrived = False

    @property
    def kick_due(self) -> bool:
        """Rows queued while held wait to be applied at a read's end (:meth:`release`); still so
        after a release that kept holding them (more bytes waited)."""
        return self._kick_due

    def release(self, kick: bool) -> None:
        """Stop holding; apply what was queued meanwhile if ``kick``, if a full group waits, or if
        fewer rows than ``apply_linger_rows`` do (single rows and small commits are not held: their
        apply is no ``COPY``, and a commit's latency is not worth a wait for the next read), or if
        none of this stream's rows came in the read just ended (its commit has stopped arriving)."""
        self._held = False
        queued = self.queued_rows
        if self._kick_due and (
            kick or not self._arrived or queued >= self.settings.apply_rows or queued < self.settings.apply_linger_rows
        ):
            self._kick_due = False
            self.kick()

    def reset(self) -> None:
        """The connection is gone: forget what was received but not applied."""
        self._held = self._kick_due = False
        self._stop_lingering()
        self._generation += 1
        self._queue.clear()
        self.queued_rows = 0
        self.known = self.applied

    def resume_token(self) -> int:
        """The token to ask the master to replay after."""
        return self.known

    def rows_received(self, instance: str, token: int, rows: list[list[Any]], with_ts: bool = True) -> None:
        """Rows of one token: each ``[*values, ts]`` with ``with_ts`` (the ``ts``
        option acknowledged), else ``[*values]`` stamped with their arrival time.

        A row's length settles what the acknowledgment cannot (see ``_Item``).
        The rows are kept as received; nothing per row is done here.
        """
        if token <= self.known:
            logger.debug("%s: dropped stale rows at token %s (known %s)", self.stream, token, self.known)
            return
        item = _Item(token, rows, self.stream, instance, self._width, with_ts, self._clock.seconds())
        self.queued_rows += item.count
        self.known = token
        self._enqueue(item)

    def rows_run(self, instance: str, tokens: list[int], rows: list[list[Any]], with_ts: bool = True) -> None:
        """Single rows of consecutive tokens, as :meth:`rows_received` of each, queued as one item.

        Stale tokens (at or below ``known``) are dropped. Tokens out of order,
        or a stream delivered in timestamp order across streams (the gate
        orders tokens one by one), go token by token.
        """
        if self.gate is not None or not all(map(operator.lt, tokens, tokens[1:])):
            for token, row in zip(tokens, rows, strict=True):
                self.rows_received(instance, token, [row], with_ts)
            return
        if tokens[0] <= self.known:
            start = bisect.bisect_right(tokens, self.known)
            stale = str(tokens[0]) if start == 1 else f"{tokens[0]}..{tokens[start - 1]}"
            logger.debug("%s: dropped stale rows at token %s (known %s)", self.stream, stale, self.known)
            tokens, rows = tokens[start:], rows[start:]
            if not tokens:
                return
        item = _Item(tokens[-1], rows, self.stream, instance, self._width, with_ts, self._clock.seconds(), tokens)
        self.queued_rows += item.count
        self.known = item.token
        self._enqueue(item)

    def position(self, prev_token: int, new_token: int) -> int | None:
        """Handle ``POSITION``; returns the token to replay after if rows were missed."""
        if prev_token > self.known:
            logger.info("%s: rows missed in (%s, %s]; catching up", self.stream, self.known, prev_token)
            return self.known
        if new_token > self.known:
            self.known = new_token
            self._enqueue(_Item(new_token, []))
        return None

    def started_at(self, token: int) -> None:
        """The answer to ``REPLICATE <stream> @<ms>``: the stream starts after ``token``."""
        if token > self.known:
            self.known = token
            self._enqueue(_Item(token, []))  # applied (without rows), so a restart resumes here

    def tick(self, safe_token: int, safe_ts: int) -> None:
        """``TICK``: every row with a timestamp up to ``safe_ts`` has a token up to ``safe_token``."""
        if self.tick_ts is None or safe_ts > self.tick_ts:
            self.tick_token, self.tick_ts = safe_token, safe_ts
        if self.gate is not None:
            self.gate.tick(self, safe_token, safe_ts)

    def complete_ts(self) -> int | None:
        """The timestamp up to which this stream is complete in the worker's database.

        Every row with a timestamp at or below it is applied: the last applied
        row's, the safe time of a TICK whose token is applied, or just below
        the first row still waiting (all before it is applied).
        """
        best = self.applied_ts
        if self.tick_ts is not None and self.tick_token is not None and self.applied >= self.tick_token:
            best = self.tick_ts if best is None else max(best, self.tick_ts)
        for item in self._queue:
            if item.token > self.applied and item.raw:
                first = item.first_ts()
                if first is not None:
                    waiting = first - 1
                    best = waiting if best is None else max(best, waiting)
                break
        return best

    # -- the queue ------------------------------------------------------------------------

    def _enqueue(self, item: _Item) -> None:
        if self.gate is not None:
            self.gate.offer(self, item)  # released in timestamp order across streams
        else:
            self.accept(item)

    def accept(self, item: _Item) -> None:
        """A token may be applied (at once, or as released by the ordering gate)."""
        self._queue.append(item)
        self._arrived = True
        if self._held and self.queued_rows >= self.settings.apply_linger_rows:
            self._kick_due = True  # a bulk commit's rows: applied at the read's end (release)
        else:
            self.kick()  # a single row's at once, before the rest of the read (its TICK) is handled

    def front_seq(self) -> int | None:
        """The release number of the first unapplied token (ordered delivery)."""
        for item in self._queue:
            if item.token > self.applied:
                return item.seq
        return None

    # -- applying ----------------------------------------------------------------------

    @property
    def applying(self) -> bool:
        return bool(self._inflight)

    @property
    def busy(self) -> bool:
        held = self.gate is not None and self.gate.holds(self)
        return bool(self._inflight) or bool(self._queue) or held

    def kick(self) -> None:
        if self._inflight:
            self._kick_chained()
            if self._queue and self._nudge is not None and self._inflight and not self._inflight[-1][3]:
                self._nudge()  # a lazy small apply: its answer, if it came, kicks again
            return
        if not self._queue:
            return
        if self._retry_call is not None and self._retry_call.active():
            return
        self._drop_through(self.applied)
        if not self._queue:
            return
        if self._linger():
            return
        limit = None
        if self.gate is not None and self.gate.enabled:
            # Ordered delivery: apply only in release order across streams.
            limit = self.gate.apply_limit(self)
            if limit is None:
                return
        if self._failures and self._queue[0].tokens is not None and len(self._queue[0].tokens) > 1:
            # Retried one token at a time, so the next failure names the row.
            self._queue.extendleft(reversed(self._queue.popleft().split()))
        group = [self._queue[0]]
        count = group[0].count
        full = count >= self.settings.apply_rows  # more rows queued than one group takes
        if self._failures == 0:
            queue = self._queue
            for index in range(1, len(queue)):
                item = queue[index]
                if count + item.count > self.settings.apply_rows:
                    full = True
                    break
                if limit is not None and item.seq >= limit:
                    break
                group.append(item)
                count += item.count
        token = group[-1].token

        def effects(txn: ApplyTransaction) -> None:
            self._run_handlers(txn, group)

        d = None
        link = None
        if self._replicate_in_db is not None and count and self._failures == 0 and all(i.with_ts for i in group):
            # One statement with the rows as received (PostgreSQL); retries go the general way.
            received = [rows for item in group if item.count for rows in item.received()]
            if (full or count == self.settings.apply_rows) and limit is None:
                # A full group: a backlog. Applied so that a next full group may queue behind it.
                link = ChainLink(token)
                d = self._chain(token, received, effects, link, None)
                if d is None:
                    link = None
            if d is None:
                d = self._replicate_in_db(self.stream, token, self.schema, received, effects)
        else:
            d = self._apply_in_db(self.stream, token, effects)
        self._lingered = False  # the next group may wait again
        self._after_full = full or count == self.settings.apply_rows
        self._handed(d, group, token, count, link)
        if link is not None:
            self._kick_chained()

    def _linger(self) -> bool:
        """Whether to wait (``apply_linger``) before applying what is queued: a group as large as
        ``apply_linger_rows`` but not full, of the table replicator's applies, waits once for more.

        A ``COPY`` costs its backend about 0.35 ms beyond its rows, and a
        1,000-row commit's rows were applied in one or two groups of their
        own; waiting 10 ms gathers two or three commits per group at 170,000
        rows/s (docs/benchmarks.md, e2e7). Single rows and small commits
        (fewer than ``apply_linger_rows`` queued) and a backlog (full groups,
        and the group after a full one: a catch-up's last) are applied at
        once, as before.
        """
        linger = self.settings.apply_linger
        if (
            linger is None
            or self._after_full
            or self._replicate_in_db is None
            or self.gate is not None
            or self._failures
            or not self.settings.apply_linger_rows <= self.queued_rows < self.settings.apply_rows
        ):
            self._stop_lingering()
            return False
        if self._lingered:
            return False  # waited once: applied now
        if self._linger_call is None:
            self._linger_call = self._clock.callLater(linger, self._lingering_over)
        return True

    def _lingering_over(self) -> None:
        self._linger_call = None
        self._lingered = True
        self.kick()

    def _stop_lingering(self) -> None:
        _cancel(self._linger_call)
        self._linger_call = None
        self._lingered = False

    def _chain(
        self, token: int, received: list[ReceivedRows], effects: Effects, link: ChainLink, before: ChainLink | None
    ) -> defer.Deferred[None] | None:
        if self._chain_in_db is None:
            return None
        return self._chain_in_db(self.stream, token, self.schema, received, effects, link, before)

    def _handed(
        self, d: defer.Deferred[None], group: list[_Item], token: int, count: int, link: ChainLink | None
    ) -> None:
        entry = (group, token, self._generation, link, count)
        self._inflight.append(entry)
        d.addCallbacks(self._applied, self._failed, callbackArgs=(entry,), errbackArgs=(entry,))

    def _kick_chained(self) -> None:
        """While a full group is applied, hand the next full group to the database behind it.

        The worker applies it at the same time on a second connection (its
        token moves only once the group before committed, see
        ``Worker._chain_in_db``), or queues it on the database thread, which
        takes it as soon as the first commits, with no wait for the reactor
        in between. Either way it commits only if the group before it
        committed (known on the database threads first: its
        :class:`ChainLink`); otherwise nothing of it commits
        (:class:`NotApplied`) and it is applied again the usual way, so a
        failed group is never skipped. At most one group is handed so.
        """
        if len(self._inflight) != 1 or self._failures or self.gate is not None:
            return
        if self._retry_call is not None and self._retry_call.active():
            return
        before, before_token, generation, before_link, before_rows = self._inflight[0]
        if before_link is None or generation != self._generation:
            return
        limit = self.settings.apply_rows
        if self.queued_rows - before_rows < limit:
            return  # not a full group behind it yet (known without walking the queue)
        queue = self._queue
        start = len(before)
        if len(queue) <= start or queue[start - 1].token != before_token:
            return
        group: list[_Item] = []
        count = 0
        full = False
        for index in range(start, len(queue)):
            item = queue[index]
            if count + item.count > limit:
                full = True
                break
            group.append(item)
            count += item.count
        if not (full or count == limit) or not count or not all(i.with_ts for i in group):
            return
        token = group[-1].token
        received = [rows for item in group if item.count for rows in item.received()]

        def effects(txn: ApplyTransaction) -> None:
            self._run_handlers(txn, group)

        link = ChainLink(token)
        d = self._chain(token, received, effects, link, before_link)
        if d is not None:
            self._handed(d, group, token, count, link)

    def _run_handlers(self, transaction: ApplyTransaction, group: list[_Item]) -> None:
        """On the database thread, inside the apply transaction."""
        rows = [row for item in group for row in item.rows]
        if not rows:
            return
        ctx = ApplyContext(transaction, self.stream, self.schema, self._worker_name)
        for handler in self.handlers:
            handler(ctx, rows)

    def _applied(self, _: None, entry: _Entry) -> None:
        group, token, _generation, _link, count = entry
        self._inflight.remove(entry)
        # Two groups' answers (two apply connections) may come back in either order: the
        # applied time follows the newest token only, so the lag never jumps backwards.
        newest = token >= self.applied
        self.applied = max(self.applied, token)
        self.known = max(self.known, token)
        self.rows_applied += count
        last = next((item for item in reversed(group) if item.count), None) if newest else None
        if last is not None:
            last_ts = last.last_ts()
            if last_ts is not None:
                self.applied_ts = last_ts
        if self._failures:
            logger.info("%s: applied token %s after %d failed attempts", self.stream, token, self._failures)
        self._failures = 0
        # Whatever is queued up to the token is applied (the group's items, unless the
        # connection was lost since: then rows received again up to it).
        self._drop_through(token)
        if self._on_progress is not None:
            self._on_progress(self)
        self.kick()
        if self.gate is not None:
            self.gate.applied(self)

    def _drop_through(self, token: int) -> None:
        """Drop what is queued up to ``token`` (applied); a run that it cuts keeps only its later tokens."""
        queue = self._queue
        while queue and queue[0].token <= token:
            self.queued_rows -= queue.popleft().count
        head = queue[0] if queue else None
        if head is not None and head.tokens is not None and head.tokens[0] <= token:
            # Rows received again after a reconnect may come as a run across the applied token.
            queue.popleft()
            rest = [item for item in head.split() if item.token > token]
            queue.extendleft(reversed(rest))
            self.queued_rows -= head.count - sum(item.count for item in rest)

    def found_applied(self, token: int) -> None:
        """The worker's database holds ``token`` as applied, beyond what this consumer knew (an apply
        whose commit answer was lost had committed): take it as applied, drop what is queued up to it.
        Without this, the next group could start below it and its rows be applied twice."""
        if token <= self.applied:
            return
        self.applied = token
        self.known = max(self.known, token)
        self._drop_through(token)

    def _failed(self, failure: Failure, entry: _Entry) -> None:
        group = entry[0]
        self._inflight.remove(entry)
        if failure.check(NotApplied):
            # Behind a group that did not commit: nothing of it committed. Applied again
            # once the group before is settled (its own answer kicks, if still to come).
            if not self._inflight:
                self.kick()
            return
        self._failures += 1
        delay = min(self.settings.retry_max, self.settings.retry_initial * 2 ** (self._failures - 1))
        if len(group) == 1 and (group[0].tokens is None or len(group[0].tokens) == 1):
            logger.error(
                "%s: applying token %s failed (attempt %d), retrying in %.1f s: %s; rows: %s",
                self.stream,
                group[0].token,
                self._failures,
                delay,
                failure.getErrorMessage() or getattr(failure.type, "__name__", "error"),
                [list(r.values) for r in group[0].rows[:20]],
            )
        else:
            # Retried one token at a time, so the next failure names the row.
            logger.warning(
                "%s: applying tokens %s..%s failed, retrying token by token: %s",
                self.stream,
                group[0].token,
                group[-1].token,
                failure.getErrorMessage(),
            )
            delay = 0
        self._retry_call = self._clock.callLater(delay, self._retry)

    def _retry(self) -> None:
        self._retry_call = None
        self.kick()

    def stop(self) -> None:
        _cancel(self._retry_call)
        self._retry_call = None
        self._stop_lingering()

    def stats(self, now_ms: int) -> ConsumerStats:
        lag = self.lag_ms(now_ms)
        stats = ConsumerStats(self.stream, self.applied, self.known, self.queued_rows, self.rows_applied, lag)
        if self.gate is not None:
            stats = self.gate.stats_of(self, stats)
        return stats

    def lag_ms(self, now_ms: int) -> int | None:
        """``now_ms`` minus the time up to which the stream is complete here (None: not known yet).

        About zero for an idle stream whose TICKs are applied; growing for a
        stream whose rows wait, or whose worker stopped applying.
        """
        complete = self.complete_ts()
        if complete is None:
            return None
        return max(0, now_ms - physical_ms(complete))


def _cancel(call: Any) -> None:
    """Cancel a timer (``callLater``'s) that has not run yet; one that ran or was cancelled is left."""
    if call is not None and call.active():
        call.cancel()
