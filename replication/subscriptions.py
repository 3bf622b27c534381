"""One connection's subscriptions: one per stream, and every transition between their states.

A :class:`Subscription` is one stream on one connection. It is in one of two
states:

- *catching up*: its own cursor reads rows from storage in chunks
  (``catchup_rows``), paced by the client: when the write of a chunk pauses
  the connection, the next chunk is read while the client drains it (one
  read ahead, held until the connection resumes), and nothing more is read
  until then. Where the store runs reads beside each other (PostgreSQL's
  ``parallel_reads``), that many ranges of tokens are read at once, as the
  live fan-out's reads ahead (``replication.read_ahead``), and written in
  order. When the cursor reaches the master's live token the subscription
  goes *live*.
- *live*: it is in the master's fan-out and receives the same encoded bytes
  as every live connection. When it cannot take them (its connection is
  paused, or it joined at a token the fan-out has passed) it is *lagging*:
  nothing is written or buffered for it, it only counts the bytes it missed,
  and when its connection resumes it takes them from the master's window of
  recent rows (the same shared bytes; storage only for what the window no
  longer holds) until it has caught up. Only when it has missed more than
  ``max_lag_bytes`` does it leave the fan-out and go back to *catching up*;
  it rejoins as soon as it has caught up. A paused connection therefore
  costs the master at most the one write that paused it.

Catching up and lagging read the window first (synchronously). A replay that
starts below the window first asks the master to read the rows between its
start and the window into the window (when they fit; one fill shared by
every replay that asks) and is then served from memory; otherwise it reads
storage, concurrent replays of the same range sharing one storage read (see
``replication.window``).

A new ``REPLICATE`` for a stream replaces its subscription; the *generation*
number makes the answers of reads started for the old one fall on the floor.

:class:`Subscriptions` owns these states for one connection. It talks to the
master through :class:`StreamSource` (heads, reads, joining and leaving the
fan-out) and to its connection through :class:`Outlet` (writing bytes,
pause state, closing); the master reaches it only through
:class:`FanOutTarget`. No other module changes a subscription's state.
"""

from __future__ import annotations

import logging
from typing import Protocol

import attr
from twisted.internet import defer
from twisted.python.failure import Failure

from replication.commands import Command, PositionCommand
from replication.read_ahead import ReadAhead
from replication.stats import STATS
from replication.window import Read

logger = logging.getLogger(__name__)


class Subscription:
    """One stream on one connection (its state is changed only by :class:`Subscriptions`)."""

    __slots__ = (
        "announce_live",
        "filled_at",
        "generation",
        "lag_bytes",
        "lagging",
        "live",
        "reading",
        "reads",
        "sent_token",
        "since_ts",
        "stream",
    )

    def __init__(
        self,
        stream: str,
        sent_token: int,
        announce_live: bool = False,
        generation: int = 0,
        since_ts: int | None = None,
    ) -> None:
        self.stream = stream
        self.sent_token = sent_token  # every row up to here has been written
        self.live = False  # in the master's fan-out (False: catching up on its own)
        self.lagging = False  # live, but behind the fan-out (takes the bytes it missed from the window)
        self.lag_bytes = 0  # fan-out bytes missed while lagging
        # A replay ends with POSITION <head> <head> when it first goes live, so
        # the client knows it has caught up (OPTIONS live).
        self.announce_live = announce_live
        self.reading = False  # a catch-up read is in flight
        self.generation = generation  # bumped when a new REPLICATE restarts the stream
        # REPLICATE <stream> @<unix_ms>: the replay drops rows older than this.
        self.since_ts = since_ts
        self.filled_at = -1  # the position at which it last waited for the window to be filled
        # Its storage reads asked ahead (Subscriptions._reads_for): made on its first storage read.
        self.reads: ReadAhead[Read] | None = None

    @property
    def state(self) -> str:
        if not self.live:
            return "catching_up"
        return "lagging" if self.lagging else "live"


@attr.s(slots=True, frozen=True, auto_attribs=True)
class SubscriptionStats:
    stream: str
    state: str  # "live", "lagging" or "catching_up"
    sent_token: int


class StreamSource(Protocol):
    """What subscriptions need from the master."""

    @property
    def instance_name(self) -> str: ...

    @property
    def parallel_reads(self) -> int:
        """Storage reads of one replay that may run at once (the store's ``parallel_reads``)."""
        ...

    def live_token(self, stream: str) -> int:
        """The token up to which rows have been fanned out to live subscriptions."""
        ...

    def read_recent(self, stream: str, after: int, upto: int, limit: int, with_ts: bool) -> Read | None:
        """The same from the window of recent rows, at once; None when the window does not hold them."""
        ...

    def fill_recent(self, stream: str, after: int, with_ts: bool) -> defer.Deferred[None] | None:
        """Bring the rows after ``after`` into the window (one fill shared by every replay asking).

        Fires when that fill ends; None when it will not be done (no room,
        nothing to do): the replay then reads storage.
        """
        ...

    def read_encoded(self, stream: str, after: int, upto: int, limit: int, with_ts: bool) -> defer.Deferred[Read]:
        """RDATA bytes for rows in ``(after, upto]``: (bytes, last token, row count)."""
        ...

    def read_encoded_since(
        self, stream: str, after: int, upto: int, limit: int, with_ts: bool, since_ts: int
    ) -> defer.Deferred[tuple[bytes, int, int]]:
        """The same, without rows older than ``since_ts`` (``replication.timeticks.read_since``)."""
        ...

    def join_live(self, target: FanOutTarget, sub: Subscription) -> None: ...

    def leave_live(self, target: FanOutTarget, sub: Subscription) -> None: ...

    def count_catchup_rows(self, count: int) -> None: ...


class Outlet(Protocol):
    """What subscriptions need from their connection."""

    conn_name: str

    @property
    def closing(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    def send(self, command: Command) -> None: ...

    def close_with_error(self, message: str) -> None: ...

    def went_live(self, stream: str) -> None:
        """A subscription reached the live rows (a half-closed connection may finish)."""
        ...


class FanOutTarget(Protocol):
    """What the master's fan-out needs from a connection's subscriptions."""

    @property
    def with_ts(self) -> bool: ...

    @property
    def ticks(self) -> bool:
        """OPTIONS tick: the connection gets TICK lines (``replication.timeticks``)."""
        ...

    def send_live(
        self,
        sub: Subscription,
        data: bytes | None,
        after: int,
        last_token: int,
        command: str = "RDATA",
        count: int = 1,
    ) -> None:
        """``count`` lines for ``(after, last_token]`` (``None``: not in this connection's variant)."""
        ...


class Subscriptions:
    """The subscriptions of one connection, by stream (implements :class:`FanOutTarget`)."""

    def __init__(self, source: StreamSource, outlet: Outlet, catchup_rows: int, max_lag_bytes: int = 16 << 20) -> None:
        self._source = source
        self._outlet = outlet
        self._catchup_rows = catchup_rows
        self._max_lag_bytes = max_lag_bytes
        self._subs: dict[str, Subscription] = {}
        self._with_ts = False  # OPTIONS ts: rows carry their timestamp
        self._ticks = False  # OPTIONS tick: TICK lines for live streams
        self.paused = False  # the connection's transport asked us to stop producing

    # -- what the connection asks --------------------------------------------------

    @property
    def with_ts(self) -> bool:
        return self._with_ts

    def use_ts(self) -> None:
        """Rows from now on carry their timestamp (``OPTIONS ts``; cannot be undone)."""
        self._with_ts = True

    @property
    def ticks(self) -> bool:
        return self._ticks

    def use_ticks(self) -> None:
        """Live streams get ``TICK`` lines from now on (``OPTIONS tick``; cannot be undone)."""
        self._ticks = True

    def __len__(self) -> int:
        return len(self._subs)

    def get(self, stream: str) -> Subscription | None:
        return self._subs.get(stream)

    def all_live(self) -> bool:
        return all(sub.live for sub in self._subs.values())

    def start(self, stream: str, token: int, announce_live: bool = False, since_ts: int | None = None) -> Subscription:
        """Replace the stream's subscription with one that has sent everything up to ``token``.

        With ``since_ts`` (start at a time) its replay drops rows older than that.
        """
        old = self._subs.get(stream)
        generation = 0
        if old is not None:
            _drop_ahead(old)
            old.generation += 1
            self._source.leave_live(self, old)
            generation = old.generation + 1
        sub = Subscription(stream, token, announce_live, generation, since_ts)
        self._subs[stream] = sub
        self._pump(sub)
        return sub

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        for sub in list(self._subs.values()):
            self._pump(sub)

    def close(self) -> None:
        """The connection is gone: every read in flight is void, the fan-out forgets us."""
        for sub in self._subs.values():
            _drop_ahead(sub)
            sub.generation += 1
            self._source.leave_live(self, sub)
        self._subs.clear()

    def stats(self) -> tuple[SubscriptionStats, ...]:
        return tuple(SubscriptionStats(s.stream, s.state, s.sent_token) for _, s in sorted(self._subs.items()))

    # -- what the master's fan-out calls -------------------------------------------

    def send_live(
        self,
        sub: Subscription,
        data: bytes | None,
        after: int,
        last_token: int,
        command: str = "RDATA",
        count: int = 1,
    ) -> None:
        if data is not None and not sub.lagging and sub.sent_token == after and not self.paused:
            STATS.sent[command] += count
            self._outlet.write(data)
            sub.sent_token = last_token
            return
        # Behind the fan-out: nothing is buffered here; the bytes wait in the
        # master's window, shared, until the connection takes them.
        sub.lagging = True
        sub.lag_bytes += len(data) if data is not None else 0
        if sub.lag_bytes > self._max_lag_bytes:
            logger.debug("[%s] %s fell %d bytes behind: catching up", self._outlet.conn_name, sub.stream, sub.lag_bytes)
            sub.live = False
            sub.lagging = False
            sub.lag_bytes = 0
            self._source.leave_live(self, sub)
        self._pump(sub)

    # -- catching up ----------------------------------------------------------------

    def _pump(self, sub: Subscription) -> None:
        """Move a lagging or catching-up subscription on, as far as the connection takes it."""
        source = self._source
        outlet = self._outlet
        while not (sub.reading or self.paused or outlet.closing):
            head = source.live_token(sub.stream)
            if sub.sent_token >= head:
                _drop_ahead(sub)
                sub.lagging = False
                sub.lag_bytes = 0
                if sub.live:
                    return
                sub.live = True
                sub.since_ts = None
                source.join_live(self, sub)
                if sub.announce_live:
                    sub.announce_live = False
                    outlet.send(PositionCommand(sub.stream, source.instance_name, head, head))
                outlet.went_live(sub.stream)
                return
            if sub.since_ts is None:
                # The window has no time filter: a replay from a time reads storage.
                recent = source.read_recent(sub.stream, sub.sent_token, head, self._catchup_rows, self._with_ts)
                if recent is not None:
                    self._deliver(sub, recent, head)
                    continue
                if sub.filled_at != sub.sent_token:
                    # Below the window: the rows up to it are read into the
                    # window once for every replay, then served from there.
                    sub.filled_at = sub.sent_token
                    filled = source.fill_recent(sub.stream, sub.sent_token, self._with_ts)
                    if filled is not None:
                        sub.reading = True
                        filled.addCallback(self._filled, sub, sub.generation)
                        return
            sub.reading = True
            generation = sub.generation
            reads = self._reads_for(sub)
            variants = (self._with_ts,)
            read = reads.take(sub.sent_token, variants)  # read while the last chunk was written
            if read is None:
                reads.fill(sub.sent_token, head, variants)
                read = reads.take(sub.sent_token, variants)
                assert read is not None
            end, d = read
            d.addCallbacks(
                self._read, self._read_failed, callbackArgs=(sub, generation, end), errbackArgs=(sub, generation)
            )
            return

    def _reads_for(self, sub: Subscription) -> ReadAhead[Read]:
        """The subscription's storage reads ahead (``replication.read_ahead``), made on its first.

        Depth 1 (SQLite, or a replay from a time): the next chunk ``(sent_token,
        head]`` is read once the last one is in, while the connection writes
        it or the client drains it. Deeper (PostgreSQL: the store's
        ``parallel_reads``): ranges of tokens read at once, each on its own
        database thread and connection, so the server makes the next chunk's
        columns while the master makes this one's lines.
        """
        if sub.reads is None:
            depth = self._source.parallel_reads if sub.since_ts is None else 1

            def storage_read(
                stream: str, after: int, upto: int, limit: int, variants: tuple[bool, ...]
            ) -> defer.Deferred[Read]:
                if sub.since_ts is not None:
                    return self._source.read_encoded_since(stream, after, upto, limit, variants[0], sub.since_ts)
                return self._source.read_encoded(stream, after, upto, limit, variants[0])

            sub.reads = ReadAhead(storage_read, sub.stream, self._catchup_rows, depth)
        return sub.reads

    def _read_ahead(self, sub: Subscription, after: int, result: Read) -> None:
        """After a storage read's chunk was written: ask the next ones, up to the reads' depth.

        Depth 1: only while the connection is paused (the client drains the
        chunk); otherwise :meth:`_pump` asks the next read, after looking in
        the window. At most ``depth`` chunks are asked or held (a paused
        connection holds them until it resumes: it costs the master at most
        the write that paused it and these); used by :meth:`_pump` only if the
        subscription still reads storage from where they start, else let go
        (the reads ahead of a replay that reached the window).
        """
        reads = sub.reads
        if reads is None or self._outlet.closing or sub.live:
            return
        reads.chunk_read(after, result[1], result[2])
        if reads.depth == 1 and not self.paused:
            return
        head = self._source.live_token(sub.stream)
        if sub.sent_token < head:
            reads.fill(sub.sent_token, head, (self._with_ts,))

    def _deliver(self, sub: Subscription, result: Read, head: int) -> None:
        data, last_token, count = result
        if count:
            STATS.sent["RDATA"] += count
            self._outlet.write(data)
            if not sub.live:
                self._source.count_catchup_rows(count)
            sub.sent_token = last_token
        else:
            # No rows in (sent, last] (or up to the live head): every token up
            # to there has committed (or never will), so the client may move there.
            upto = last_token if last_token > sub.sent_token else head
            self._outlet.send(PositionCommand(sub.stream, self._source.instance_name, sub.sent_token, upto))
            sub.sent_token = upto

    def _filled(self, _: None, sub: Subscription, generation: int) -> None:
        if generation != sub.generation or self._subs.get(sub.stream) is not sub:
            return
        sub.reading = False
        if not self._outlet.closing:
            self._pump(sub)

    def _read(self, result: Read, sub: Subscription, generation: int, head: int) -> None:
        if generation != sub.generation or self._subs.get(sub.stream) is not sub:
            return
        sub.reading = False
        if self._outlet.closing:
            return
        after = sub.sent_token
        self._deliver(sub, result, head)
        self._read_ahead(sub, after, result)
        self._pump(sub)

    def _read_failed(self, failure: Failure, sub: Subscription, generation: int) -> None:
        if generation != sub.generation:
            return
        sub.reading = False
        logger.error(
            "[%s] reading %s for replay failed: %s", self._outlet.conn_name, sub.stream, failure.getErrorMessage()
        )
        self._outlet.close_with_error(f"internal error reading stream {sub.stream!r}; reconnect to resume")


def _drop_ahead(sub: Subscription) -> None:
    """Let the subscription's reads ahead go (not used): their answers or failures are ignored."""
    if sub.reads is not None:
        sub.reads.drop()
