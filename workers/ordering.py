"""Ordered delivery across streams: handlers see rows in timestamp order.

From the seed document PDP 28 (the reader takes the lowest time first) and
Milvus timeticks (act on everything below a tick). Each ordered stream is a
*lane*: rows received from the master wait in the lane until they are
*released* to the stream's consumer, which applies them as before (token
order, one transaction per group of tokens, exactly once).

Release rule: take the lane whose first waiting row has the lowest timestamp
``h``; release that token once every other lane is *complete* up to ``h``,
i.e. every row of that stream with a timestamp at or below ``h`` has been
received. A lane is complete up to

* the timestamp of the last row it received (a stream's timestamps increase
  with its tokens, and rows arrive in token order), and
* the ``safe_ts`` of a ``TICK <stream> <safe_token> <safe_ts>`` once every
  token up to ``safe_token`` has been received.

So an idle stream holds the others back by at most one tick (the master's
TICK after a commit carries a safe time above that commit's rows), and a
stream that is behind (catching up, or whose master connection is gone)
holds them back until it has caught up: this is never guessed from a timeout.

Applying keeps the release order across streams: each released token gets a
sequence number, and a consumer may apply only tokens whose numbers are below
the first unapplied token of every other ordered stream. The worker's
database thread runs one transaction at a time, so handlers are called in
release order.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import attr

if TYPE_CHECKING:
    from workers.consumer import ConsumerStats, StreamConsumer, _Item

logger = logging.getLogger(__name__)


class _Lane:
    __slots__ = (
        "complete_ts",
        "consumer",
        "park_ts",
        "pending",
        "pending_rows",
        "released_rows",
        "released_token",
    )

    def __init__(self, consumer: StreamConsumer) -> None:
        self.consumer = consumer
        self.pending: collections.deque[_Item] = collections.deque()
        self.pending_rows = 0
        self.released_rows = 0
        self.released_token = consumer.known  # the last token handed to the consumer
        self.complete_ts: int | None = consumer.complete_ts()
        self.park_ts: int | None = None  # parked: rows from this timestamp on were dropped

    @property
    def parked(self) -> bool:
        return self.park_ts is not None

    def head_ts(self) -> int | None:
        if not self.pending:
            return None
        rows = self.pending[0].rows
        return rows[0].ts if rows else None


class OrderedDelivery:
    """The gate between receiving and applying for the ordered streams of one worker."""

    def __init__(
        self,
        consumers: list[StreamConsumer],
        max_held_rows: int = 100_000,
        resubscribe: Callable[[str, int], None] | None = None,
    ) -> None:
        self.lanes: dict[str, _Lane] = {}
        self._seq = 0
        # Rows held back are bounded: past max_held_rows the lanes holding them
        # are *parked* (their rows dropped, to be asked for again with
        # REPLICATE <stream> <token> once the stream they wait for has caught
        # up), since pausing the connection would also stop the rows and ticks
        # they wait for.
        self.max_held_rows = max_held_rows
        self._resubscribe = resubscribe
        self.parks = 0
        # Off while the master does not acknowledge OPTIONS tick and ts (a
        # seed-protocol master): without safe times nothing could be released.
        self.enabled = True
        for consumer in consumers:
            self.lanes[consumer.stream] = _Lane(consumer)
            consumer.gate = self

    # -- input ------------------------------------------------------------------------------

    def offer(self, consumer: StreamConsumer, item: _Item) -> None:
        """A token received (rows, or a POSITION's move without rows): hold it in its lane."""
        lane = self.lanes[consumer.stream]
        if not self.enabled:
            consumer.accept(item)
            return
        if lane.parked:
            consumer.queued_rows -= len(item.rows)  # asked for again when unparked
            return
        lane.pending.append(item)
        lane.pending_rows += len(item.rows)
        if item.rows and item.rows[-1].ts is not None:
            lane.complete_ts = _max(lane.complete_ts, item.rows[-1].ts)
        self.release()
        if sum(other.pending_rows for other in self.lanes.values()) > self.max_held_rows:
            self._park()

    def tick(self, consumer: StreamConsumer, safe_token: int, safe_ts: int) -> None:
        """``TICK``: the stream is complete up to ``safe_ts`` once ``safe_token`` is received."""
        lane = self.lanes[consumer.stream]
        if consumer.known >= safe_token and not lane.parked:
            lane.complete_ts = _max(lane.complete_ts, safe_ts)
            self.release()

    def reset(self) -> None:
        """The connection is gone (every consumer was reset): drop what waits, start again."""
        for lane in self.lanes.values():
            lane.pending.clear()
            lane.pending_rows = 0
            lane.park_ts = None
            lane.released_token = lane.consumer.known
            lane.complete_ts = lane.consumer.complete_ts()

    def _park(self) -> None:
        for stream, lane in self.lanes.items():
            if not lane.pending or lane.parked:
                continue
            head = lane.head_ts()
            dropped = lane.pending_rows
            lane.park_ts = head if head is not None else 0
            lane.consumer.queued_rows -= dropped
            lane.pending.clear()
            lane.pending_rows = 0
            lane.consumer.known = lane.released_token
            lane.complete_ts = None if head is None else head - 1
            self.parks += 1
            logger.warning(
                "ordered delivery: %s rows of %s held back for a stream that is behind; "
                "dropped them, asking again after token %s once it has caught up",
                dropped,
                stream,
                lane.released_token,
            )

    def _unpark(self) -> None:
        for stream, lane in self.lanes.items():
            park_ts = lane.park_ts
            if park_ts is None:
                continue
            others = [other for other in self.lanes.values() if other is not lane]
            if all(other.complete_ts is not None and other.complete_ts >= park_ts for other in others):
                lane.park_ts = None
                lane.consumer.known = lane.released_token  # rows dropped meanwhile come again
                logger.info("ordered delivery: asking for %s again after token %s", stream, lane.released_token)
                if self._resubscribe is not None:
                    self._resubscribe(stream, lane.released_token)

    # -- release ----------------------------------------------------------------------------

    def release(self) -> None:
        self._unpark()
        released: set[StreamConsumer] = set()
        lanes = list(self.lanes.values())
        while True:
            # Tokens without rows (a POSITION's move) at a lane's front go at once.
            for lane in lanes:
                while lane.pending and not lane.pending[0].rows:
                    self._hand_over(lane)
                    released.add(lane.consumer)
            best: _Lane | None = None
            best_ts = 0
            for lane in lanes:
                ts = lane.head_ts()
                if lane.pending and ts is None:
                    # A row without a timestamp (a master without the ts option) cannot be ordered.
                    best, best_ts = lane, -1
                    break
                if ts is not None and (best is None or ts < best_ts):
                    best, best_ts = lane, ts
            if best is None:
                break
            if best_ts >= 0 and any(
                lane is not best and (lane.complete_ts is None or lane.complete_ts < best_ts) for lane in lanes
            ):
                break  # the lowest waiting row waits for a stream that is behind
            self._hand_over(best)
            released.add(best.consumer)
        for consumer in released:
            consumer.kick()

    def _hand_over(self, lane: _Lane) -> None:
        item = lane.pending.popleft()
        lane.pending_rows -= len(item.rows)
        lane.released_rows += len(item.rows)
        lane.released_token = item.token
        self._seq += 1
        item.seq = self._seq
        lane.consumer.accept(item)

    # -- applying ---------------------------------------------------------------------------

    def apply_limit(self, consumer: StreamConsumer) -> int | None:
        """Sequence numbers below this may be applied by ``consumer`` now (None: wait)."""
        front = consumer.front_seq()
        if front is None:
            return None
        limit: int | None = None
        for lane in self.lanes.values():
            if lane.consumer is consumer:
                continue
            other = lane.consumer.front_seq()
            if other is None:
                continue
            if other < front:
                return None  # an earlier release of another stream goes first
            limit = other if limit is None else min(limit, other)
        return limit if limit is not None else self._seq + 1

    def applied(self, consumer: StreamConsumer) -> None:
        """``consumer`` finished an apply: the next stream in release order may go."""
        for lane in self.lanes.values():
            if lane.consumer is not consumer:
                lane.consumer.kick()

    def holds(self, consumer: StreamConsumer) -> bool:
        """Rows of the stream wait here, or will be asked for again (parked)."""
        lane = self.lanes[consumer.stream]
        return bool(lane.pending) or lane.parked

    def stats_of(self, consumer: StreamConsumer, stats: ConsumerStats) -> ConsumerStats:
        """``stats`` with this stream's ordered-delivery figures."""
        lane = self.lanes[consumer.stream]
        return attr.evolve(
            stats,
            ordered=True,
            held_rows=lane.pending_rows,
            blocking=consumer.stream in self.blocking(),
            released_rows=lane.released_rows,
        )

    # -- metrics ----------------------------------------------------------------------------

    def blocking(self) -> set[str]:
        """The streams the lowest waiting row waits for (behind, or not heard from)."""
        best_ts: int | None = None
        for lane in self.lanes.values():
            ts = lane.head_ts()
            if ts is not None and (best_ts is None or ts < best_ts):
                best_ts = ts
        if best_ts is None:
            return set()
        return {
            stream
            for stream, lane in self.lanes.items()
            if not lane.pending and (lane.complete_ts is None or lane.complete_ts < best_ts)
        }


def _max(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)
