"""The master: owns the streams, follows their heads, fans rows out to clients.

The master follows each stream's committed head: on PostgreSQL woken by
``LISTEN/NOTIFY``; on SQLite by a cheap look for other connections' commits
every ``change_check_interval`` (``PRAGMA data_version``,
:class:`~storage.contracts.ChangeWatch`); a full pass also runs every
``poll_interval`` (safe times, TICKs of idle streams), and at once when told
of a local write. New rows are read once, encoded once into
``RDATA`` lines (each variant live connections use: with and without ``ts``),
kept in the window of recent rows (``recent_bytes``, see
``replication.window``) and the same bytes are written to every live
subscription that can take them; one that cannot (paused) takes them from the
window later. Replays (``REPLICATE <stream> <token>``) are paced by their
connection (see ``replication.subscriptions``): served from the window when
they start inside it, otherwise read from storage, concurrent replays of the
same range sharing one read. The fan-out reads a stream while some
connection is live on it or while the window holds the stream (filled on
start from the newest rows, or for a replay): so the window stays whole when
every connection is catching up for a moment. A stream with neither is moved
on without reading.

Layers: :class:`~replication.server.ServerProtocol` (one per connection:
framing, authentication, dispatch) uses the master through
:class:`~replication.server.MasterServices`; each connection's
:class:`~replication.subscriptions.Subscriptions` uses it through
:class:`~replication.subscriptions.StreamSource`, and the master's fan-out
reaches them only through :class:`~replication.subscriptions.FanOutTarget`.
The master owns the streams' tokens (live, safe, allocated heads), which
subscriptions are live, and its counters; :meth:`Master.stats` is their public,
typed snapshot.

Collaborators are injected: the store, the reactor (clock, listening,
readers) and the database threads (``db``, any
:class:`~replication.dbthreads.DatabaseRunner`; by default a
:class:`~replication.dbthreads.DatabaseThreads` pool of ``config.db_threads``).

On PostgreSQL a pass woken by a commit (or any pass that does not take a
fresh oracle time nor sweep dead writers) runs as one call on a non-blocking
connection driven by the reactor (``StreamStore.open_wake``,
:class:`~replication.pg_async.AsyncQuery`): the oracle's mark, the safe
positions and the first lines of every stream read, in one round trip, with
no hop through the database threads. When that connection is lost the pass
reads on the threads and the slow loop opens a new one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from twisted.internet import defer, task
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IReadDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

from replication.client_commands import ClientCommandHandlers
from replication.commands import PositionCommand
from replication.dbthreads import DatabaseRunner, DatabaseThreads
from replication.limits import (
    LIMIT_STATS,
    ConnectionLimiter,
    ConnectionSlot,
    LimitedFactory,
    SharedLogBudget,
    ensure_file_limit,
    watch_accept_errors,
)
from replication.pg_async import AsyncQuery
from replication.protocol import ProtocolConfig, send_batch
from replication.reactor_types import DelayedCall, Reactor
from replication.read_ahead import ReadAhead
from replication.rows import encode_json_rows
from replication.server import ServerProtocol
from replication.settings import LimitsConfig, MasterConfig, TLSConfig
from replication.stats import STATS, MasterStats, StreamStats
from replication.streams import cache_invalidation_row
from replication.subscriptions import FanOutTarget, Subscription
from replication.timeline import TimelineService
from replication.timeline_settings import TimelineSettings
from replication.timeticks import TimeTicker, read_since
from replication.window import Read, RecentWindow, SharedReads, WindowFiller
from storage.contracts import ChangeWatch, CommittedRows, Notifier, StreamStore, WakeQuery, WakeResult
from storage.schema import StreamSchema
from storage.store import TOKEN, StorageError
from storage.time_index import TokenAt
from storage.timeline_contract import TimelineStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Commits with their rows held while a pass runs (Master.notified); beyond, a pass reads them.
MAX_HELD_COMMITS = 256


def _live_variants(subs: dict[FanOutTarget, Subscription]) -> tuple[bool, ...]:
    """The variants (with and without ``ts``) live subscriptions take, in order.

    (A loop rather than ``tuple(sorted({...}))``: it runs for every commit a notification carries.)
    """
    without = with_ts = False
    for target in subs:
        if target.with_ts:
            with_ts = True
        else:
            without = True
    if with_ts:
        return (False, True) if without else (True,)
    return (False,) if without else ()


class _Stretches:
    """``send_batch`` held over a coroutine's synchronous stretches: entered on resuming, left before each await.

    What a pass writes between two awaits (a chunk's ``RDATA``, the ``POSITION``
    and ``TICK`` lines after it) goes out in one send per connection when the
    stretch ends, as a notification's lines do (``protocol.send_batch``),
    instead of being queued for the reactor's next turn (two ``epoll_ctl``
    and a turn more per pass). Never held across an await: what other
    events write meanwhile is not held back.
    """

    def __enter__(self) -> _Stretches:
        send_batch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        send_batch.__exit__()

    async def wait(self, awaited: Awaitable[T]) -> T:
        """``await awaited`` outside the batch (what was written so far goes out first)."""
        send_batch.__exit__()
        try:
            return await awaited
        finally:
            send_batch.__enter__()


class Master:
    def __init__(
        self,
        config: MasterConfig,
        protocol_config: ProtocolConfig,
        store: StreamStore,
        streams: dict[str, StreamSchema],
        reactor: Reactor,
        db: DatabaseRunner | None = None,
        limits: LimitsConfig | None = None,
        tls: TLSConfig | None = None,
        timeline_store: TimelineStore | None = None,
        timeline_settings: TimelineSettings | None = None,
    ) -> None:
        self.config = config
        self.limits = limits or LimitsConfig()
        self.tls = tls or TLSConfig()
        self.limiter = ConnectionLimiter(self.limits, reactor)
        self.log_budget = SharedLogBudget(reactor, self.limits.max_log_lines_per_second)
        self.protocol_config = protocol_config
        self.store = store
        self.reactor = reactor
        self.db: DatabaseRunner = (
            db if db is not None else DatabaseThreads(reactor, config.db_threads, name="tickline-master-db")
        )
        self._declared = streams
        self._schemas: dict[str, StreamSchema] = {}
        self._live: dict[str, int] = {}
        self._safe: dict[str, int] = {}
        self._allocated: dict[str, int] = {}  # the store's heads, see refresh_heads
        self._live_subs: dict[str, dict[FanOutTarget, Subscription]] = {}
        # Per stream, the variants its live subscriptions last took: new rows are kept in them
        # while nobody is live (a worker that comes back asks for the same).
        self._last_variants: dict[str, tuple[bool, ...]] = {}
        self.window = RecentWindow(config.recent_bytes)
        # Answers of replay reads kept for other replays of the same range.
        self.shared_reads = SharedReads(config.recent_bytes // 8)
        # Fills the window from storage in large reads: on start, and for replays below it.
        self.filler = WindowFiller(self.window, self._read_range, self.live_token)
        self.connections: set[ServerProtocol] = set()
        self.client_commands = ClientCommandHandlers(self)
        self._catchup_rows = 0
        self._live_rows = 0
        self._poller: task.LoopingCall | None = None
        self._watch: ChangeWatch | None = None  # SQLite: PRAGMA data_version (storage.sqlite_db)
        self._watcher: DelayedCall | None = None  # the next look (a bare callLater: no Deferred per look)
        self._checkpointing: defer.Deferred[Any] | None = None  # SQLite: the WAL checkpoint running, if one is
        self._following = False
        self._follow_again = False
        self._expire_writers = True
        self._woken = False  # the next pass was asked for by a commit (notify)
        self._follow_waiters: list[defer.Deferred[None]] = []
        self._notifications: NotificationReader | None = None
        # Commits notified with their rows while a pass ran: sent after it (notified).
        self._held: list[CommittedRows] = []
        # A pass waits for its wake-up's answer (safe positions, first rows) and has
        # fanned nothing out yet: notified commits are sent at once, not held.
        self._waking = False
        self._relistening = False
        # PostgreSQL: the wake-up in one round trip on the reactor (replication.pg_async);
        # None (SQLite, or not open yet) or broken: the database threads read instead.
        self._wake_query: AsyncQuery[WakeResult] | None = None
        self._wake_call: WakeQuery | None = None  # what _wake_query drives
        self._reopening_wake = False
        self._stopped = False
        self._db_error: str | None = None
        self.port: Any = None  # the reactor's listening port
        self.timeticks = TimeTicker(self, config.tick_interval)  # safe times and TICK
        self.timeline = TimelineService.for_master(self, timeline_store, timeline_settings or TimelineSettings())

    # -- start and stop ------------------------------------------------------------

    async def start(self) -> Any:
        """Register the streams, read their heads, start following and listening."""
        self.db.start()
        self.timeline.start()
        await self.db.run(self._register_all)
        for stream, head in (await self.db.run(self.store.safe_positions)).items():
            if stream in self._schemas:
                self._live[stream] = head
        notifier = await self.db.run(self.store.notifier)
        watch = None if notifier is not None else await self.db.run(self.store.change_watch)
        if watch is not None:
            # SQLite: a cheap look for other processes' commits, often; a pass only when one came.
            self._watch = watch
            watch.schedule.at = self.reactor.seconds()  # the first checkpoint counts from the start
            self._watcher = self.reactor.callLater(self.config.change_check_interval, self._check_changes)
        if notifier is not None:
            # PostgreSQL: commits and writer reports wake us (LISTEN/NOTIFY);
            # the slow loop only notices writers that went silent.
            self._notifications = NotificationReader(notifier, self.notified)
            self.reactor.addReader(self._notifications)
            interval = max(self.config.writer_timeout / 5, self.config.poll_interval)
            await self._open_wake()
        else:
            interval = self.config.poll_interval
        self._poller = task.LoopingCall(self._slow_tick)
        self._poller.clock = self.reactor  # type: ignore[assignment]
        self._poller.start(interval, now=False).addErrback(
            lambda f: logger.error("following stream heads stopped: %s", f.getTraceback())
        )
        self.timeticks.start()
        await self._warm_window()
        self.port = self._listen()
        address = self.port.getHost()
        logger.info(
            "master %s listening on %s:%s%s with streams %s",
            self.config.server_name,
            address.host,
            address.port,
            " (TLS)" if self.tls.server_enabled else "",
            ", ".join(f"{s}@{t}" for s, t in sorted(self._live.items())),
        )
        return self.port

    async def _warm_window(self, bound: float = 3.0) -> None:
        """Fill the window with each stream's newest rows before listening (at most ``bound`` s).

        A replay that arrives while the window is being filled waits for the
        fill; warming before the first connection keeps the first replays
        from waiting (a slow database only delays listening by ``bound``).
        """
        fills = [self.filler.fill(stream, 0, False, whole=False, reason="the start") for stream in self._live]
        waiting = [d for d in fills if d is not None]
        if not waiting:
            return
        done: defer.Deferred[None] = defer.Deferred()

        def finish(_: object = None) -> None:
            if not done.called:
                done.callback(None)

        timer = self.reactor.callLater(bound, finish)
        defer.DeferredList(waiting).addCallback(finish)
        await done
        if timer.active():
            timer.cancel()

    def _listen(self) -> Any:
        """Listen with the connection limits (replication.limits), over TLS when configured."""
        ensure_file_limit(self.limits.max_connections)
        factory: Any = LimitedFactory(self.limiter, self._build_protocol)
        if self.tls.server_enabled:
            from replication.tls import server_factory

            factory = server_factory(self.tls, factory)
        port = self.reactor.listenTCP(self.config.listen_port, factory, interface=self.config.listen_host)
        watch_accept_errors(port, self.reactor)
        return port

    def _build_protocol(self, addr: Any, slot: ConnectionSlot) -> ServerProtocol:
        protocol = ServerProtocol(self, self.protocol_config, self.reactor)
        protocol.slot = slot
        return protocol

    def stop_following(self) -> None:
        """Stop the periodic pass over the stream heads (``stop`` does this too)."""
        self._stopped = True
        if self._poller is not None and self._poller.running:
            self._poller.stop()
        if self._watcher is not None and self._watcher.active():
            self._watcher.cancel()
        self._watcher = None
        if self._watch is not None:
            watch, self._watch = self._watch, None
            if self._checkpointing is not None:
                self._checkpointing.addBoth(lambda _: watch.close())  # closed once its checkpoint is done
            else:
                watch.close()
        self.timeticks.stop()

    async def stop(self) -> None:
        self.stop_following()
        if self.port is not None:
            await self.port.stopListening()
        if self._notifications is not None:
            if not self._notifications.broken:
                self.reactor.removeReader(self._notifications)
            self._notifications.close()
            self._notifications = None
        if self._wake_query is not None:
            # Forgotten first: closing fails a call in flight at once, and its
            # handler must see a stop, not a failed connection (no warning).
            wake, self._wake_query = self._wake_query, None
            wake.close()
        for conn in list(self.connections):
            conn.close()
        self.timeline.stop()
        await self.db.run(self.store.retire_writers)
        self.db.stop()

    def _register_all(self) -> None:
        for schema in self._declared.values():
            self.store.register_stream(schema)
        self._learn(self.store.catalog())

    def _learn(self, catalog: dict[str, StreamSchema]) -> None:
        for name, schema in catalog.items():
            if name not in self._schemas:
                self._schemas[name] = schema
                self._live_subs[name] = {}

    # -- streams -------------------------------------------------------------------

    def stream_names(self) -> list[str]:
        return sorted(self._live)

    def has_stream(self, stream: str) -> bool:
        return stream in self._live

    def safe_position(self, stream: str) -> int:
        """The last safe position seen: every row up to it has committed."""
        return max(self._safe.get(stream, 0), self._live.get(stream, 0))

    def live_token(self, stream: str) -> int:
        """The token up to which rows have been fanned out to live subscriptions."""
        return self._live[stream]

    @property
    def instance_name(self) -> str:
        return self.config.instance_name

    @property
    def parallel_reads(self) -> int:
        """Storage reads of one stream that run at once (the store's; replays read ahead as many)."""
        return self.store.parallel_reads

    def refresh_heads(self) -> defer.Deferred[None]:
        """Read the highest allocated token of every stream (for :meth:`stats`), off the reactor."""
        d: defer.Deferred[dict[str, int]] = self.db.run(self.store.heads)
        return d.addCallback(self._allocated.update)

    def stats(self) -> MasterStats:
        """A typed snapshot of the master's streams, connections and counters."""
        streams = []
        for stream in self.stream_names():
            safe = self.safe_position(stream)
            streams.append(
                StreamStats(
                    stream,
                    max(self._allocated.get(stream, 0), safe),
                    safe,
                    self._live[stream],
                    self.timeticks.safe_time_ms(stream),
                )
            )
        return MasterStats(
            streams=tuple(streams),
            connections=tuple(conn.stats() for conn in self.connections),
            catchup_rows=self._catchup_rows,
            live_rows=self._live_rows,
            protocol=STATS.snapshot(),
            limits=LIMIT_STATS.snapshot(),
        )

    def _keeps_recent(self, stream: str) -> bool:
        """Whether new rows of ``stream`` are read into the window while nobody is live on it.

        They are while the window holds the stream (filled on start, or for a
        replay), and also, with a window of any size, once a subscription was
        live on it since the start: a consumer that went away (a worker
        stopped for a while) comes back and catches up from the bytes built
        once, as the rows were committed, in the variant it took
        (:meth:`_variants`), instead of having the server build every line
        again while it waits. A stream nobody has replicated is not read.
        """
        return self.window.start(stream) is not None or (self.window.max_bytes > 0 and stream in self._last_variants)

    def _variants(self, stream: str, subs: dict[FanOutTarget, Subscription]) -> tuple[bool, ...]:
        """The variants (with and without ``ts``) to encode new rows in: the live subscriptions', else the last ones seen live."""
        if subs:
            return _live_variants(subs)
        return self._last_variants.get(stream, (False,))

    def read_recent(self, stream: str, after: int, upto: int, limit: int, with_ts: bool) -> Read | None:
        """RDATA bytes for rows after ``after`` from the window of recent rows; None if it does not hold them."""
        return self.window.read(stream, after, upto, limit, with_ts)

    def read_encoded(self, stream: str, after: int, upto: int, limit: int, with_ts: bool) -> defer.Deferred[Read]:
        """RDATA bytes for rows in ``(after, upto]`` (about ``limit`` rows) from storage, off the reactor.

        Replays asking for the same start at the same time share one read.
        """

        def start() -> defer.Deferred[Read]:
            d: defer.Deferred[Any] = self.db.run(self._read_encoded, stream, after, upto, limit, (with_ts,))
            d.addCallback(lambda result: (result[0].get(with_ts, b""), result[1], result[2]))
            return d

        return self.shared_reads.read(stream, after, upto, with_ts, start)

    def fill_recent(self, stream: str, after: int, with_ts: bool) -> defer.Deferred[None] | None:
        """Read the rows between ``after`` and the window into it (see ``WindowFiller``)."""
        return self.filler.fill(stream, after, with_ts)

    def _read_range(self, stream: str, after: int, upto: int, with_ts: bool) -> defer.Deferred[Read | None]:
        """Whole lines of the rows in ``(after, upto]`` built by the store, off the reactor (None: a batch)."""
        d: defer.Deferred[Read | None] = self.db.run(
            self.store.read_lines_json, stream, after, upto, upto - after, f"RDATA {stream} ", with_ts
        )
        return d

    def read_encoded_since(
        self, stream: str, after: int, upto: int, limit: int, with_ts: bool, since_ts: int
    ) -> defer.Deferred[tuple[bytes, int, int]]:
        """Like :meth:`read_encoded`, without rows older than ``since_ts`` (start at a time)."""
        return read_since(self, stream, after, upto, limit, with_ts, since_ts)

    def token_at(self, stream: str, since_ts: int) -> defer.Deferred[TokenAt]:
        """The first token at or after ``since_ts``, from the stream's ``ts`` index, off the reactor."""
        d: defer.Deferred[TokenAt] = self.db.run(self.store.first_token_at, stream, since_ts)
        return d

    def live_subscriptions(self, stream: str) -> list[tuple[FanOutTarget, Subscription]]:
        """The subscriptions that are live on ``stream`` (for ``TICK``)."""
        return list(self._live_subs.get(stream, {}).items())

    def _read_chunk(
        self, stream: str, after: int, upto: int, limit: int, variants: tuple[bool, ...]
    ) -> defer.Deferred[tuple[dict[bool, bytes], int, int]]:
        """:meth:`_read_encoded` on a database thread."""
        d: defer.Deferred[tuple[dict[bool, bytes], int, int]] = self.db.run(
            self._read_encoded, stream, after, upto, limit, variants
        )
        return d

    def _read_encoded(
        self, stream: str, after: int, upto: int, limit: int, variants: tuple[bool, ...]
    ) -> tuple[dict[bool, bytes], int, int]:
        """Runs on a database thread: read rows once, encode each variant once."""
        # SQLite builds whole lines itself when the range has no batch.
        prefix = f"RDATA {stream} "
        first = self.store.read_lines_json(stream, after, upto, limit, prefix, variants[0])
        if first is not None:
            data, last, count = first
            if count == 0:
                return {}, after, 0
            encoded = {variants[0]: data}
            for v in variants[1:]:
                other = self.store.read_lines_json(stream, after, last, count, prefix, v)
                if other is None or other[1:] != (last, count):
                    break
                encoded[v] = other[0]
            else:
                return encoded, last, count
        # Otherwise the store builds each row's JSON once (SQLite: json_array in SQL).
        json_rows = self.store.read_rows_json(stream, after, upto, limit)
        if not json_rows:
            return {}, after, 0
        encoded = {v: encode_json_rows(stream, json_rows, v)[0] for v in variants}
        return encoded, json_rows[-1][TOKEN], len(json_rows)

    def notified(self, plain: set[str], committed: list[CommittedRows]) -> None:
        """Database notifications arrived: rows they carried are sent at once where they can be, else a pass.

        While a pass fans out (it may be reading the same rows) the rows are
        held and sent when it ends (:meth:`_send_held`), a second pass only if
        they cannot be. While it only waits for its wake-up's answer they are
        sent at once (unless commits are held already: order), and the pass
        then uses its answer's rows only if they still start at the live
        token (:meth:`_advance`). See :meth:`_send_committed` and docs/time.md
        ("the commit's own claim").
        """
        if committed and self._poller is not None and self._poller.running:
            if self._following and (not self._waking or self._held):
                if len(self._held) + len(committed) > MAX_HELD_COMMITS:
                    self._held.clear()  # a pass reads them all
                    self.notify()
                    return
                self._held.extend(committed)
                if plain:
                    self.notify()
                return
            for rows in committed:
                if not self._send_committed(rows):
                    self.notify()
                    return
            if not plain:
                return
        self.notify()

    def _send_held(self) -> None:
        """After a pass: the commits notified during it, sent in order; a pass again if one cannot be."""
        held, self._held = self._held, []
        for rows in held:
            if not self._send_committed(rows):
                self.notify()  # the pass reads this one and every later one
                return

    def _send_committed(self, committed: CommittedRows) -> bool:
        """Fan out the rows of one commit without reading them; False when a pass must read instead.

        They are sent only when they follow what was sent (no gap: the live
        token is just below the first) and the commit's claim covers the last
        (every token up to it has committed or never will). The last row's
        timestamp is then a safe time at that token: every later token is
        allocated after this commit's, with a larger timestamp.
        """
        stream, rows = committed.stream, committed.rows
        live = self._live.get(stream)
        if live is None or stream not in self._schemas or not rows:
            return False
        first, last, last_ts = rows[0][0], rows[-1][0], rows[-1][1]
        if live >= last:
            return True  # a pass sent them already
        if live != first - 1 or committed.safe is None or committed.safe < last:
            return False
        subs = self._live_subs[stream]
        if subs or self._keeps_recent(stream):
            variants = self._variants(stream, subs)
            instance = committed.instance.encode()
            stored = [(0, token, instance, ts, values) for token, ts, values in rows]
            encoded = {v: encode_json_rows(stream, stored, v)[0] for v in variants}
            limit = self.store.max_line_bytes
            if limit is not None and any(
                # Every line is within the limit when the whole data is (a single row's one line).
                len(data) > limit + 1 and any(len(line) > limit for line in data.split(b"\n"))
                for data in encoded.values()
            ):
                return False
            self._fan_out(stream, encoded, last, len(rows))
        else:
            self._live[stream] = last  # nobody live and nothing kept: no read
        self._safe[stream] = max(self._safe.get(stream, 0), last)
        self.timeticks.passed_rows(stream, last_ts, last)
        return True

    def notify(self) -> None:
        """Rows were committed (a database notification, or a write of this process): fan them out now."""
        self._woken = True
        if self._poller is not None and self._poller.running:
            self._follow_heads()

    def _check_changes(self) -> None:
        """On the reactor, every ``change_check_interval``: a commit of another connection starts a pass.

        Not while a pass runs (it reads the heads anyway, and the look costs
        more while the fan-out reads): the first look after it sees any
        commit made meanwhile (``data_version`` changed since the last look).
        """
        if self._watch is None:
            return
        try:
            if not self._following and self._watch.changed():
                self.notify()
        except Exception:
            logger.exception("looking for commits failed; a pass runs")
            self.notify()
        self._watcher = self.reactor.callLater(self.config.change_check_interval, self._check_changes)

    def _checkpoint(self) -> None:
        """SQLite: after a pass, checkpoint the WAL on a database thread when it is due (``storage.sqlite_db``).

        Due once this master delivered ``CHECKPOINT_ROWS`` rows to live
        connections since the last one (or ``CHECKPOINT_SECONDS`` went by),
        after the pass, and only while no connection is paused (its client
        has not yet taken what was written to it), so a large commit's
        checkpoint (about 0.65 us of CPU per row of the fan-out benchmark)
        runs once its rows went out, not beside their delivery; a later pass
        checkpoints once they did, or once ``CHECKPOINT_SECONDS`` went by
        whatever the clients do (the writers also checkpoint past a
        backstop). Rows only counted where they were delivered: a master
        with no live connection on the stream (another master on the same
        database may be delivering them) leaves them to the timer. One at a time; passive, through
        SQLite (``PRAGMA wal_checkpoint(PASSIVE)``): it never waits for a
        reader or a writer, and what it cannot copy now a later one does.
        """
        watch = self._watch
        if watch is None or self._checkpointing is not None:
            return
        schedule = watch.schedule
        now = self.reactor.seconds()
        if not schedule.due(now, any(conn.paused for conn in self.connections)):
            return
        rows = schedule.begin(now)

        def done(result: object) -> object:
            self._checkpointing = None
            if isinstance(result, Failure):
                logger.debug("checkpointing the WAL failed (a later pass tries again): %s", result.getErrorMessage())
                schedule.finished(rows, None)
            else:
                schedule.finished(rows, cast(tuple[int, int, int], result))  # not complete: due again later
            return None

        d: defer.Deferred[Any] = self.db.run(watch.checkpoint)
        self._checkpointing = d
        d.addBoth(done)

    def _slow_tick(self) -> defer.Deferred[Any] | None:
        # The periodic pass also looks for writers that went silent; wake-ups
        # by notification skip that sweep to keep commit -> RDATA short.
        if self._notifications is not None and self._notifications.broken and not self._relistening:
            # The reactor dropped the old reader; a new connection listens.
            self._relistening = True
            self.db.run(self.store.notifier).addCallbacks(self._listening_again, self._not_listening_yet)
        wake = self._wake_query
        if self._notifications is not None and not self._reopening_wake and (wake is None or wake.broken):
            defer.ensureDeferred(self._open_wake())
        if self.wakes_on_reactor():
            # PostgreSQL with the wake-up on the reactor: the sweep runs on a
            # database thread beside the fan-out, not as a pass of it (a pass
            # holds every commit behind it); a pass follows it.
            return self._sweep_writers()
        self._expire_writers = True
        return self._follow_heads()

    def wakes_on_reactor(self) -> bool:
        """Whether wake-ups run on the reactor's non-blocking connection now (PostgreSQL)."""
        wake = self._wake_query
        return wake is not None and not wake.broken

    def _sweep_writers(self) -> defer.Deferred[None]:
        """Writers silent for ``writer_timeout`` are marked dead (a database thread), then a pass.

        Apart from the passes: a sweep only moves safe positions up (a dead
        writer no longer holds its stream back), and the next pass reads them
        in its own snapshot, after the sweep committed.
        """

        def swept(_: object) -> None:
            self._follow_heads()

        def failed(failure: Failure) -> None:
            # The passes report an unreachable database; this one says it at debug level.
            logger.debug("sweeping silent writers failed: %s", failure.getErrorMessage())

        d: defer.Deferred[Any] = self.db.run(self.store.safe_positions, True)
        return d.addCallbacks(swept, failed)

    async def _open_wake(self) -> None:
        """Open the wake-up's non-blocking connection (off the reactor); log once if it fails."""
        self._reopening_wake = True
        try:
            query: WakeQuery | None = await self.db.run(self.store.open_wake)
        except Exception as e:
            if self._wake_query is None or not self._wake_query.broken:
                logger.warning("wake-ups read on the database threads for now: %s", e)
            return
        finally:
            self._reopening_wake = False
        if query is None:
            return
        if self._stopped:  # stopped meanwhile
            query.close()
            return
        again = self._wake_query is not None
        self._wake_call = query
        self._wake_query = AsyncQuery(self.reactor, query, "tickline-wake")
        if again:
            logger.info("wake-ups run on the reactor again")

    async def _wake_on_reactor(
        self, take_time: str | None, reads: dict[str, tuple[int, tuple[bool, ...]]]
    ) -> WakeResult | None:
        """The wake-up in one round trip on the reactor; None when it cannot run (read on the threads)."""
        wake = self._wake_query
        if wake is None or not wake.usable or take_time == "allocate":
            return None
        query = self._wake_call
        assert query is not None
        d = wake.run(lambda: query.start(take_time == "read", reads, self.config.fanout_rows))
        if d is None:
            return None
        try:
            return await d
        except StorageError as e:
            if self._wake_query is wake:  # else closed by stop(): nothing to report
                logger.warning(
                    "the wake-up connection failed (%s); reading on the database threads until it is back", e
                )
            return None

    def _listening_again(self, notifier: Notifier) -> None:
        self._relistening = False
        if self._notifications is None:  # stopped meanwhile
            notifier.close()
            return
        self._notifications = NotificationReader(notifier, self.notified)
        self.reactor.addReader(self._notifications)
        logger.info("listening for database notifications again")
        self.notify()

    def _not_listening_yet(self, failure: Any) -> None:
        self._relistening = False
        logger.warning("cannot listen for database notifications yet: %s", failure.getErrorMessage())

    def _follow_heads(self) -> defer.Deferred[None] | None:
        if self._following:
            self._follow_again = True
            return None
        self._following = True
        return defer.ensureDeferred(self._follow_loop())

    def followed(self) -> defer.Deferred[None]:
        """Fires once the master has looked at the store's heads after this call."""
        d: defer.Deferred[None] = defer.Deferred()
        self._follow_waiters.append(d)
        self._follow_heads()
        return d

    async def _follow_loop(self) -> None:
        try:
            while True:
                self._follow_again = False
                waiters, self._follow_waiters = self._follow_waiters, []
                try:
                    await self._advance()
                except StorageError as e:
                    # One line when the database goes away, one when it is back.
                    if self._db_error is None:
                        logger.error("database unavailable, retrying every pass: %s", e)
                    self._db_error = str(e)
                except Exception:
                    logger.exception("following stream heads failed; retrying")
                else:
                    if self._db_error is not None:
                        logger.warning("database reachable again")
                        self._db_error = None
                for d in waiters:
                    d.callback(None)
                self._checkpoint()
                if self._held and not self._follow_again:
                    try:
                        with send_batch:  # one send per connection, now (see _Stretches)
                            self._send_held()
                    except Exception:
                        logger.exception("sending the rows of notified commits failed; a pass reads them")
                        self._held = []
                        self._follow_again = True
                if not self._follow_again:
                    return
        finally:
            self._following = False

    async def _advance(self) -> None:
        # The safe position: every row up to it has committed (see storage).
        expire, self._expire_writers = self._expire_writers, False
        if expire and self.wakes_on_reactor():
            # The sweep apart from the pass (see _slow_tick); this pass on the reactor.
            self._sweep_writers()
            expire = False
        # A pass woken by a commit reads the oracle's mark (the commit moved it);
        # the durable allocation that keeps idle streams' safe time moving is
        # left to the timer's passes, off the commit -> RDATA path.
        woken, self._woken = self._woken, False
        # Streams with live subscriptions: their first rows are read in the same
        # database hop as the safe point (no second hop through the thread pool;
        # PostgreSQL's wake-up: when the new rows are at most fanout_rows).
        reads = {
            stream: (self._live[stream], _live_variants(subs))
            for stream, subs in self._live_subs.items()
            if subs and stream in self._live
        }
        # A time taken before the safe positions gives each stream a safe time (TICK).
        take_time = self.timeticks.wanted(not woken)
        # Until the answer comes, commits notified meanwhile go out at once (notified):
        # the live token may move, and the answer's rows are then read again
        # from the new live token (pre below), never sent twice.
        self._waking = True
        try:
            answer = None if expire else await self._wake_on_reactor(take_time, reads)
            if answer is None:
                answer = await self.db.run(self._wake, expire, take_time, reads)
        finally:
            self._waking = False
        safe_times, heads, first = answer
        self._safe.update(heads)
        if any(stream not in self._schemas for stream in heads):
            self._learn(await self.db.run(self.store.catalog))
        # What the pass writes to a connection goes out in one send at the end of each stretch
        # between awaits (protocol.send_now), not on the reactor's next turn (_Stretches).
        with _Stretches() as stretches:
            for stream, head in heads.items():
                if stream not in self._live:
                    if stream in self._schemas:
                        logger.info("stream %s appeared (head %s)", stream, head)
                        self._live[stream] = head
                    continue
                # The next chunks are read while this one is fanned out (replication.read_ahead).
                ahead = ReadAhead(self._read_chunk, stream, self.config.fanout_rows, self.store.parallel_reads)
                empty_range = False
                try:
                    while self._live[stream] < head:
                        subs = self._live_subs[stream]
                        if not subs and not self._keeps_recent(stream):
                            self._live[stream] = head  # nobody live and nobody to keep them for: no read
                            break
                        variants = self._variants(stream, subs)
                        after = self._live[stream]
                        pre = first.pop(stream, None)
                        end = head  # the read covers (after, end]
                        if pre is not None and pre[0] == after:
                            encoded, last_token, count = pre[1]
                        elif empty_range:
                            # A range read ahead held no row: this read finds where its rows end.
                            empty_range = False
                            encoded, last_token, count = await stretches.wait(
                                self._read_chunk(stream, after, head, self.config.fanout_rows, variants)
                            )
                        else:
                            read = ahead.take(after, variants)
                            if read is None:
                                # The pass's first read: with depth > 1 the next ones start with it,
                                # not once it is in.
                                ahead.fill(after, head, variants)
                                read = ahead.take(after, variants)
                                assert read is not None
                            end = read[0]
                            encoded, last_token, count = await stretches.wait(read[1])
                        if count == 0:
                            if end < head:
                                ahead.drop()  # a range read ahead without rows: read on from here
                                empty_range = True
                                continue
                            self._timetick(stream, head)
                            break
                        ahead.chunk_read(after, last_token, count)
                        ahead.fill(last_token, head, variants)
                        self._fan_out(stream, encoded, last_token, count)
                finally:
                    ahead.drop()  # the reads not used (also when a read failed)
            self.timeticks.passed(safe_times, heads)

    def _wake(
        self, expire: bool, take_time: str | None, reads: dict[str, tuple[int, tuple[bool, ...]]]
    ) -> tuple[dict[str, int] | None, dict[str, int], dict[str, tuple[int, tuple[dict[bool, bytes], int, int]]]]:
        """Runs on a database thread: the safe point, then the first rows of each stream read live.

        ``reads``: per stream, the token fanned out so far and the variants
        its live subscriptions take. Returns the safe times, the safe
        positions and, per stream that moved, ``(after, encoded rows)``.
        A subscription of another variant that joins meanwhile takes these
        rows from storage (``send_live`` with None).
        """
        times, heads = self.timeticks.safe_point(expire, take_time)
        first = {}
        for stream, (after, variants) in reads.items():
            head = heads.get(stream)
            if head is not None and head > after:
                first[stream] = (after, self._read_encoded(stream, after, head, self.config.fanout_rows, variants))
        return times, heads, first

    def _timetick(self, stream: str, safe: int) -> None:
        """No rows in (live, safe]: tell live subscriptions they may move to ``safe``."""
        after = self._live[stream]
        data = PositionCommand(stream, self.config.instance_name, after, safe).encode()
        self.window.append(stream, after, safe, 0, {False: b"", True: b""})
        self._live[stream] = safe
        for target, sub in list(self._live_subs[stream].items()):
            target.send_live(sub, data, after, safe, "POSITION")

    def _fan_out(self, stream: str, encoded: dict[bool, bytes], last_token: int, count: int) -> None:
        self._live_rows += count
        if self._live_subs[stream] and self._watch is not None:
            self._watch.schedule.delivered(count)  # SQLite: checkpointed after their delivery (_checkpoint)
        after = self._live[stream]
        self.window.append(stream, after, last_token, count, encoded)
        self._live[stream] = last_token
        for target, sub in list(self._live_subs[stream].items()):
            # None: a subscription with the other variant joined during the
            # read; it takes these rows from storage.
            target.send_live(sub, encoded.get(target.with_ts), after, last_token, "RDATA", count)

    def invalidate_cache(self, cache_name: str, keys: list[Any] | None = None) -> defer.Deferred[int]:
        """Record a cache invalidation on the ``caches`` stream; fires with its token."""
        row = cache_invalidation_row(cache_name, keys, int(self.reactor.seconds() * 1000))
        d = self.db.run(self.store.append, "caches", [row], self.config.instance_name)

        def written(tokens: list[int]) -> int:
            self.notify()
            return tokens[0]

        return d.addCallback(written)

    # -- connections ---------------------------------------------------------------

    def connection_made(self, conn: ServerProtocol) -> None:
        self.connections.add(conn)

    def connection_lost(self, conn: ServerProtocol) -> None:
        self.connections.discard(conn)
        self.client_commands.connection_lost(conn)

    # -- what subscriptions ask (StreamSource) ----------------------------------------------

    def join_live(self, target: FanOutTarget, sub: Subscription) -> None:
        subs = self._live_subs[sub.stream]
        subs[target] = sub
        self._last_variants[sub.stream] = _live_variants(subs)

    def leave_live(self, target: FanOutTarget, sub: Subscription) -> None:
        subs = self._live_subs.get(sub.stream)
        if subs is not None and subs.get(target) is sub:
            del subs[target]

    def count_catchup_rows(self, count: int) -> None:
        self._catchup_rows += count


@implementer(IReadDescriptor)
class NotificationReader:
    """Watches the store's notification connection on the reactor (non-blocking)."""

    def __init__(self, notifier: Notifier, wake: Callable[[set[str], list[CommittedRows]], None]) -> None:
        self._notifier = notifier
        # A duplicate descriptor of our own: psycopg2 closes its descriptor when the
        # server goes away, and the reactor must still be able to unregister ours.
        self._fd = os.dup(notifier.fileno())
        self._wake = wake
        self.broken = False  # the master listens again from its slow loop

    def fileno(self) -> int:
        return self._fd

    def doRead(self) -> Exception | None:
        try:
            plain, committed = self._notifier.drain_committed()
            if plain or committed:
                # A commit's RDATA and TICK to each connection: one send, now.
                with send_batch:
                    self._wake(plain, committed)
        except Exception as e:
            # Returning an error makes the reactor drop this reader.
            return ConnectionLost(f"database notifications failed: {e}")
        return None

    def connectionLost(self, reason: Any) -> None:
        self.broken = True
        self.close()
        logger.warning("database notification connection lost (%s); listening again soon", reason.getErrorMessage())
        self._wake(set(), [])  # what was committed meanwhile is followed by the next pass

    def logPrefix(self) -> str:
        return "tickline-notifications"

    def close(self) -> None:
        try:
            self._notifier.close()
        except Exception:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
