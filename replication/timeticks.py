"""Time on the master's side: timeticks in time (``TICK``) and starting at a time.

:class:`TimeTicker` makes every pass of the master over the store's safe
positions take an oracle timestamp first (``storage.time_index.safe_point``),
so that after the pass each stream's live token ``L`` and that timestamp
``t`` form a safe time: no row with a timestamp at or below ``t`` has a token
above ``L``. It then sends ``TICK <stream> <L> <t>`` to every connection that
asked for ``OPTIONS tick``, for every stream live on it, after the rows the
pass fanned out; and it makes the master pass at least every
``tick_interval`` seconds so that the safe time advances while streams are
idle. That pass takes a fresh timestamp (a durable commit) only when reading
the oracle's mark would not move some stream's safe time: while writes flow,
they move the mark (see :meth:`TimeTicker._fresh_time_needed`).

:func:`replicate_at` answers ``REPLICATE <stream> @<unix_ms>``: it finds the
first token at or after the instant in the stream's ``ts`` index, answers
``POSITION <stream> <instance> <t> <t>`` with the token just before it, and
starts a replay that drops rows older than the instant (:func:`read_since`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from twisted.internet import defer, task
from twisted.python.failure import Failure

from replication.commands import PositionCommand, ReplicateCommand, TickCommand
from replication.rows import encode_json_rows
from storage import time_index
from storage.store import TOKEN, TS
from storage.tso import physical_ms

if TYPE_CHECKING:
    from replication.master import Master
    from replication.server import ServerProtocol
    from replication.subscriptions import FanOutTarget, Subscription

logger = logging.getLogger(__name__)

TICK_OPTION = "tick"


class TimeTicker:
    """The master's safe time per stream, and its ``TICK`` lines."""

    def __init__(self, master: Master, interval: float) -> None:
        self.master = master
        self.interval = interval
        self.safe_ts: dict[str, int] = {}  # per stream: the latest safe time (metrics)
        # Reactor time of the last fresh time: a timestamp allocated, or the decision that
        # the oracle's mark would do as well (_fresh_time_needed).
        self._allocated_at = float("-inf")
        # Per connection (its subscriptions) and stream: (safe time, token) of the last TICK sent.
        self._sent: dict[tuple[FanOutTarget, str], tuple[int, int]] = {}
        self._loop: task.LoopingCall | None = None
        self._allocating = False  # a timestamp is being allocated apart from the passes
        self._read_next = False  # the next pass reads the oracle's mark (one was just allocated)
        # Writes seen since the timer last decided how to take its time (streams), the
        # largest timestamp of a write seen, and the safe positions of the last pass
        # that took a time (one that moved saw a write): _fresh_time_needed.
        self._written: set[str] = set()
        self._written_ts: int | None = None
        self._positions: dict[str, int] = {}

    def start(self) -> None:
        self._loop = task.LoopingCall(self._pass)
        self._loop.clock = self.master.reactor  # type: ignore[assignment]
        self._loop.start(self.interval, now=False).addErrback(
            lambda f: logger.error("timeticks stopped: %s", f.getTraceback())
        )

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()

    def _pass(self) -> None:
        # While streams are idle nothing else makes the master look: do it.
        master = self.master
        if self._due(master.reactor.seconds()) and not self._allocating and master.wakes_on_reactor():
            if not self._fresh_time_needed():
                # Writes move the oracle's mark: this interval's pass reads it, no commit
                # (as after an allocation).
                self._allocated(None)
                return
            # PostgreSQL: the fresh timestamp (a durable commit, milliseconds)
            # is taken on a database thread beside the fan-out, and the pass
            # after it reads the oracle's mark, at least that timestamp (the
            # wake-up reads the mark before the positions, as the proof in
            # docs/time.md needs). A pass that allocated would hold every
            # commit behind it.
            self._allocating = True
            d = master.db.run(master.store.allocate_timestamps, 1)
            d.addCallbacks(self._allocated, self._not_allocated)
            return  # the pass follows the allocation (either way it ends)
        master.followed()

    def _due(self, now: float) -> bool:
        """Whether a fresh time is due: about ``interval`` since the last (a timer that fires a
        little early still counts, or an interval would be skipped now and then)."""
        return now - self._allocated_at >= self.interval * 0.9

    def _fresh_time_needed(self) -> bool:
        """Whether the timer's pass must allocate a fresh timestamp, or the oracle's mark will do.

        A pass that reads the mark gives every stream without rows in flight
        a safe time at or above the largest timestamp written before the read
        (docs/time.md, "How the master gets it"). So when a write newer than
        the safe time of every stream not written since the last decision has
        been seen (a commit's own rows, or a pass that found a stream's
        position moved), reading the mark moves each of them on, as an
        allocation would, and the durable commit (a WAL flush on the master's
        database, which every writer's allocation waits behind) is skipped.
        Streams written since then have safe times from their own writes. With
        no such write (all idle), a fresh timestamp: idle streams' safe time
        follows the clock. Starts a new round of writes seen.
        """
        written, self._written = self._written, set()
        if self._written_ts is None:
            return True
        written_ts = self._written_ts
        return any(ts >= written_ts for stream, ts in self.safe_ts.items() if stream not in written)

    def _wrote(self, stream: str, ts: int) -> None:
        self._written.add(stream)
        if self._written_ts is None or ts > self._written_ts:
            self._written_ts = ts

    def _allocated(self, _: object) -> None:
        self._allocating = False
        self._allocated_at = self.master.reactor.seconds()
        self._read_next = True
        self.master.followed()

    def _not_allocated(self, failure: Failure) -> None:
        self._allocating = False
        # The passes report an unreachable database; a pass still runs (it reads the mark).
        logger.debug("allocating a timestamp for the safe time failed: %s", failure.getErrorMessage())
        self._read_next = True
        self.master.followed()

    def wanted(self, allocate: bool = True) -> str | None:
        """How the next pass takes its time (on the reactor thread).

        ``"allocate"``: a fresh oracle timestamp, so the safe time advances
        while streams are idle; about every ``tick_interval``.
        ``"read"``: the oracle's high-water mark (no commit), which covers every
        row written meanwhile. ``None``: no time at all. Without ``allocate``
        (a pass woken by a commit: the oracle moved, and a durable allocation
        would delay the fan-out) never ``"allocate"``.
        """
        now = self.master.reactor.seconds()
        if self._read_next:
            self._read_next = False
            return "read"
        if self.master.wakes_on_reactor():
            allocate = False  # _pass allocates apart from the passes
        if not allocate:
            return (
                "read" if self._due(now) or any(conn.subscriptions.ticks for conn in self.master.connections) else None
            )
        if self._due(now):
            self._allocated_at = now
            # While writes move the oracle's mark, reading it is as fresh (_fresh_time_needed).
            return "allocate" if self._fresh_time_needed() else "read"
        if any(conn.subscriptions.ticks for conn in self.master.connections):
            return "read"
        return None

    def safe_point(self, expire_writers: bool, take_time: str | None) -> tuple[dict[str, int] | None, dict[str, int]]:
        """On a database thread: (safe time per stream, or None; safe positions)."""
        if take_time is not None:
            return self.master.store.safe_point(expire_writers, allocate=take_time == "allocate")
        return None, self.master.store.safe_positions(expire_writers)

    def passed(self, times: dict[str, int] | None, positions: dict[str, int]) -> None:
        """A pass succeeded: every live subscription has every row up to its stream's position."""
        if times is None:
            return
        master = self.master
        for stream, safe_ts in times.items():
            if master.has_stream(stream):
                position = positions.get(stream)
                before = self._positions.get(stream)
                if position is not None:
                    self._positions[stream] = position
                    if before is not None and position > before:
                        # Rows committed since the last pass: their stream's safe time is
                        # at most the mark read after them, or their last row's timestamp.
                        self._wrote(stream, safe_ts)
                # A safe time stays true once it was: never go back.
                self.safe_ts[stream] = max(safe_ts, self.safe_ts.get(stream, 0))
        live = {stream: master.live_subscriptions(stream) for stream in positions if master.has_stream(stream)}
        current = {(target, stream) for stream, subs in live.items() for target, _ in subs}
        for key in [key for key in self._sent if key not in current]:
            del self._sent[key]
        for stream, subs in live.items():
            safe = positions[stream]
            tick_ts = self.safe_ts.get(stream)
            if tick_ts is None:
                continue
            for target, sub in subs:
                if target.ticks and sub.sent_token >= safe:
                    self._tick(target, sub, stream, tick_ts)

    def passed_rows(self, stream: str, safe_ts: int, token: int) -> None:
        """Rows of one stream up to ``token`` were fanned out without a pass (the commit's own claim).

        The same ``TICK`` lines as :meth:`passed` for that stream alone, without
        its look at every stream and connection (the next pass forgets what
        was sent to connections that went away).
        """
        tick_ts = self.safe_ts[stream] = max(safe_ts, self.safe_ts.get(stream, 0))
        self._wrote(stream, safe_ts)
        for target, sub in self.master.live_subscriptions(stream):
            if target.ticks and sub.sent_token >= token:
                self._tick(target, sub, stream, tick_ts)

    def _tick(self, target: FanOutTarget, sub: Subscription, stream: str, tick_ts: int) -> None:
        """``TICK`` to one subscription at the token it was sent, unless it has this one already.

        Sent when the safe time or the token moved: after rows of any stream
        (they move the oracle), and about every tick_interval while all is
        idle (allocate); not on every pass.
        """
        at = sub.sent_token
        key = (target, stream)
        last_ts, last_token = self._sent.get(key, (-1, -1))
        if tick_ts <= last_ts and at == last_token:
            return
        self._sent[key] = (max(tick_ts, last_ts), at)
        target.send_live(sub, TickCommand.line(stream, at, tick_ts), at, at, "TICK")

    def safe_time_ms(self, stream: str) -> int | None:
        """The stream's latest safe time as Unix milliseconds (None: none yet)."""
        ts = self.safe_ts.get(stream)
        return None if ts is None else physical_ms(ts)


def replicate_at(conn: ServerProtocol, command: ReplicateCommand) -> defer.Deferred[None]:
    """Answer ``REPLICATE <stream> @<unix_ms>`` on ``conn`` (see the module doc)."""
    master = conn.master
    stream = command.stream
    assert stream is not None and command.since_ms is not None
    since_ts = time_index.ts_at_ms(command.since_ms)

    async def answer() -> None:
        await master.followed()  # a stream just created is known, the live token is fresh
        if conn.closing:
            return
        if not master.has_stream(stream):
            conn.send_error(f"unknown stream {stream!r} (streams: {', '.join(master.stream_names())})")
            return
        at = await master.token_at(stream, since_ts)
        if conn.closing:
            return
        live = master.live_token(stream)
        # Never past the live token: rows above it may still be in flight.
        start = live if at.before is None else min(at.before, live)
        logger.info(
            "[%s] %s from %s: token %s (%d statements)", conn.conn_name, stream, command.since_ms, start, at.queries
        )
        conn.send(PositionCommand(stream, master.config.instance_name, start, start))
        conn.subscriptions.start(stream, start, announce_live=conn.announce_live, since_ts=since_ts)

    def failed(failure: Failure) -> None:
        logger.error(
            "[%s] finding %s at %s failed: %s", conn.conn_name, stream, command.since_ms, failure.getErrorMessage()
        )
        conn.send_error(
            f"cannot find the start of stream {stream!r} at {command.since_ms}: {failure.getErrorMessage()}"
        )

    def done(_: object) -> None:
        conn._pending_replicates -= 1
        if conn.read_closed and not conn.closing:
            conn.finish_after_half_close()  # a netcat session that half-closed meanwhile

    # Counted as a pending REPLICATE: a half-closed connection waits for it.
    conn._pending_replicates += 1
    return defer.ensureDeferred(answer()).addErrback(failed).addBoth(done)


def read_since(
    master: Master, stream: str, after: int, upto: int, limit: int, with_ts: bool, since_ts: int
) -> defer.Deferred[tuple[bytes, int, int]]:
    """Like ``Master.read_encoded``, dropping rows older than ``since_ts``.

    A token is kept or dropped whole: a batch with rows on both sides of the
    time (appended in steps, docs/time.md) is sent whole, as the atomic unit a
    client applies (a read never splits a token). Returns ``(bytes, last token read, rows sent)``. When rows at the end of
    the chunk were dropped, the bytes end with ``POSITION <stream> <instance>
    <last sent> <last read>`` so the client moves past them (a client that
    received nothing of them would otherwise take the next POSITION as rows
    missed).
    """

    def run() -> tuple[bytes, int, int]:
        rows = master.store.read_rows_json(stream, after, upto, limit)
        if not rows:
            return b"", after, 0
        last_read = rows[-1][TOKEN]
        recent = {row[TOKEN] for row in rows if row[TS] >= since_ts}
        kept = [row for row in rows if row[TOKEN] in recent]
        data, _ = encode_json_rows(stream, kept, with_ts)
        last_sent = kept[-1][TOKEN] if kept else after
        if last_sent != last_read:
            data += PositionCommand(stream, master.config.instance_name, last_sent, last_read).encode()
        return data, last_read, len(kept)

    result: defer.Deferred[tuple[bytes, int, int]] = master.db.run(run)
    return result
