"""A worker process: follow the master's streams and apply them exactly once.

On every connection the worker sends ``NAME``, ``PING`` and ``OPTIONS live
ts``, waits for ``SERVER`` (and checks the name when one is expected), then
resumes each stream with ``REPLICATE <stream> <applied token>``. Options are
used only once the master acknowledged them: from a seed-protocol master rows
carry no timestamp (their arrival time stands in) and a stream is caught up
once the answer to its ``REPLICATE`` has been applied. It reconnects for
ever with exponential backoff and jitter, and the delay resets once a
connection has passed the handshake.

While more than ``max_pending_rows`` received rows wait to be applied, the
worker stops reading from the socket; the master then stops reading storage
for it (its replay is paced by the reader), so neither side buffers without
bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attr
import orjson
from twisted.internet import defer
from twisted.internet.protocol import ReconnectingClientFactory
from twisted.python.failure import Failure

from replication.client import ClientProtocol, ReplicationHandler
from replication.commands import (
    ClearUserSyncCommand,
    FederationAckCommand,
    PositionCommand,
    RemoteServerUpCommand,
    RemovePusherCommand,
    TickCommand,
    UserSyncCommand,
)
from replication.dbthreads import DatabaseRunner, DatabaseThreads
from replication.pg_async import AsyncQuery
from replication.protocol import ProtocolConfig
from replication.settings import TLSConfig
from replication.stats import STATS, ConnectionStats, ProtocolCounters
from replication.tls import connect as tls_connect
from storage.contracts import AsyncApply, Effects, ReceivedRows, WorkerStore
from storage.schema import StreamSchema
from storage.store import ApplyRefused, CommitUnknown, DatabaseUnavailable, StaleApply
from workers.caches import CacheRegistry
from workers.consumer import ChainLink, ConsumerStats, NotApplied, StreamConsumer
from workers.handlers import HandlerRegistry
from workers.ordering import OrderedDelivery
from workers.replicator import cache_invalidator, table_replicator
from workers.settings import WorkerConfig

logger = logging.getLogger(__name__)
# How long a group copied at the same time as the one before it waits for that one's commit
# before it gives up (rolled back, applied again later): longer than any one apply takes.
CHAIN_WAIT = 60.0
# Consecutive applies of a stream whose COMMIT answer was lost that are applied again at once;
# after that the consumer's retries with backoff take over (a connection lost at every commit).
UNKNOWN_RETRIES = 3


@attr.s(slots=True, frozen=True, auto_attribs=True)
class WorkerStats:
    streams: tuple[ConsumerStats, ...]  # sorted by stream name
    reconnects: int  # connections to the master lost (not counting a clean stop)
    connection: ConnectionStats | None  # None while not connected
    protocol: ProtocolCounters


class Worker(ReplicationHandler):
    def __init__(
        self,
        config: WorkerConfig,
        protocol_config: ProtocolConfig,
        store: WorkerStore,
        streams: dict[str, StreamSchema],
        reactor: Any,
        handlers: HandlerRegistry | None = None,
        caches: CacheRegistry | None = None,
        secret: str | None = None,
        db: DatabaseRunner | None = None,
        tls: TLSConfig | None = None,
        second_db: DatabaseRunner | None = None,
    ) -> None:
        self.config = config
        self.secret = secret  # sent in AUTH when the master requires it
        self.tls = tls  # connect over TLS when it turns TLS on for clients
        self.protocol_config = protocol_config
        self.store = store
        self.reactor = reactor
        self.handlers = handlers or HandlerRegistry()
        self.caches = caches or CacheRegistry()
        self.streams = streams
        self.db: DatabaseRunner = (
            db if db is not None else DatabaseThreads(reactor, max_threads=1, name=f"tickline-worker-{config.name}-db")
        )
        # During a backlog (PostgreSQL, worker.apply_connections 2), every other full group is
        # copied on a second database thread with its own connection, at the same time as the
        # group before it (_chain_in_db). With an injected runner and none given for this, both
        # lanes are that runner.
        if second_db is None and store.concurrent_applies and config.apply.apply_connections > 1:
            second_db = (
                self.db
                if db is not None
                else DatabaseThreads(reactor, max_threads=1, name=f"tickline-worker-{config.name}-db2")
            )
        self._lanes: tuple[DatabaseRunner, ...] = (self.db,) if second_db is None else (self.db, second_db)
        self.consumers: dict[str, StreamConsumer] = {}
        self.client: ClientProtocol | None = None
        self.factory: WorkerFactory | None = None
        self.reconnects = 0
        self.syncing_users: dict[str, int] = {}
        self._federation_ack: int | None = None
        self._reading_paused = False
        self._unchecked_rows = 0  # received since the pending rows were last summed
        self._check_every = max(1, config.max_pending_rows // 100)
        self._retry_calls: dict[str, Any] = {}
        self._caught_up_waiters: list[defer.Deferred] = []
        # Per stream on this connection: the REPLICATE was answered, and the
        # replay reached the live rows (the POSITION that OPTIONS live adds).
        self._answered: set[str] = set()
        self._live_streams: set[str] = set()
        self._connected_at = 0.0
        self._rows_on_connection = False
        # Streams started at a time (worker.start_at) whose POSITION is awaited.
        self._starting: set[str] = set()
        self.ordering: OrderedDelivery | None = None  # worker.ordered (workers.ordering)
        self.stopping = False
        # PostgreSQL: small applies as one statement on the reactor (replication.pg_async),
        # no hop through the database thread; None or broken: the thread applies.
        self._async_apply: AsyncQuery[None] | None = None
        self._async_apply_call: AsyncApply | None = None
        self._async_opening = False
        self._async_opened_at = float("-inf")
        # Per stream, the token of an apply in flight when its connection was lost:
        # committed or not is unknown until a retry (a StaleApply then means it was).
        self._uncertain: dict[str, int] = {}
        self._unknown_retries: dict[str, int] = {}  # CommitUnknown applied again at once, per stream

    # -- set-up --------------------------------------------------------------------

    def consumed_streams(self) -> list[str]:
        wanted = set(self.config.replicate) | set(self.handlers.streams())
        if self.config.invalidate_caches:
            wanted.add("caches")
        return sorted(wanted)

    def prepare(self) -> None:
        """Blocking set-up before the reactor runs: tables, handlers, applied tokens."""
        for stream in self.consumed_streams():
            if stream not in self.streams:
                raise UnknownStreamError(
                    f"unknown stream {stream!r}: declare it under 'streams' in the config "
                    f"(known: {', '.join(sorted(self.streams))})"
                )
        for stream in self.config.replicate:
            self.store.create_replicated_table(self.streams[stream])
        applied = self.store.applied_tokens()
        for stream in self.consumed_streams():
            handlers = []
            if stream in self.config.replicate:
                handlers.append(table_replicator(self.streams[stream]))
            if stream == "caches" and self.config.invalidate_caches:
                handlers.append(cache_invalidator(self.caches))
            handlers.extend(self.handlers.for_stream(stream))
            self.consumers[stream] = StreamConsumer(
                stream,
                self.streams[stream],
                applied.get(stream, 0),
                handlers,
                self._apply_in_db,
                self.config.name,
                self.reactor,
                self.config.apply,
                on_progress=self._progress,
                replicate_in_db=self._replicate_in_db,
                nudge=self._settle_apply,
                chain_in_db=self._chain_in_db,
            )
        for stream, consumer in self.consumers.items():
            if self.config.start_at_ms is not None and stream not in applied:
                consumer.start_at_ms = self.config.start_at_ms  # a new stream starts at that time
        ordered = self.ordered_streams()
        if ordered:
            self.ordering = OrderedDelivery(
                [self.consumers[s] for s in ordered],
                max_held_rows=self.config.max_pending_rows * 2,
                resubscribe=self._resubscribe,
            )
            logger.info("worker %s delivers %s in timestamp order", self.config.name, ", ".join(ordered))
        logger.info(
            "worker %s resumes %s",
            self.config.name,
            ", ".join(f"{s}@{c.applied}" for s, c in sorted(self.consumers.items())) or "no streams",
        )

    def ordered_streams(self) -> list[str]:
        """The streams whose handlers see rows in timestamp order across them.

        Streams with handlers of the worker's own (``worker.handlers``,
        ``worker.replicate``); the built-in cache invalidation alone does not
        make a stream ordered. ``worker.ordered`` unset means true when there
        are two or more; false turns it off.
        """
        with_handlers = sorted(set(self.config.replicate) | set(self.handlers.streams()))
        if self.config.ordered is False or len(with_handlers) < 2:
            return []
        return with_handlers

    def start(self) -> None:
        for lane in dict.fromkeys(self._lanes):
            lane.start()
        self._open_async_apply()
        self.factory = WorkerFactory(self)
        tls_connect(self.reactor, self.config.master_host, self.config.master_port, self.factory, self.tls)

    async def stop(self) -> None:
        """Clean stop: tell the master our users stopped syncing, finish the current apply."""
        self.stopping = True
        if self.factory is not None:
            self.factory.stopTrying()
        client = self.client
        if client is not None and client.transport is not None:
            client.send(ClearUserSyncCommand(self.config.name))
            client.close()
        for consumer in self.consumers.values():
            consumer.stop()
        for call in self._retry_calls.values():
            if call.active():
                call.cancel()
        # An apply in flight commits or rolls back as a whole; wait for it. Wait
        # too until the connection has closed, or the reactor's shutdown drops
        # CLEAR_USER_SYNC unwritten (close() aborts after close_grace at most).
        while any(c.applying for c in self.consumers.values()) or (client is not None and self.client is client):
            self._settle_apply()
            await _sleep(self.reactor, 0.01)
        if self._async_apply is not None:
            self._async_apply.close()
            self._async_apply = None
        for lane in reversed(dict.fromkeys(self._lanes)):
            lane.stop()

    def client_protocol(self) -> ClientProtocol:
        """The protocol for one connection to the master."""
        # ts: rows carry their timestamps; live: a replay ends with a POSITION,
        # so the worker knows when it has caught up.
        return ClientProtocol(
            self,
            self.config.name,
            self.protocol_config,
            self.reactor,
            with_ts=True,
            secret=self.secret,
            options=frozenset({"live", "tick"}),
        )

    def _apply_in_db(self, stream: str, token: int, effects: Effects) -> defer.Deferred[None]:
        d = self.db.run(self.store.apply, stream, token, effects)
        d = self._settle_uncertain(d, stream, token)
        return d.addErrback(
            self._commit_unknown, stream, token, lambda: self._apply_uncertain_effects(stream, token, effects)
        )

    def _apply_uncertain_effects(self, stream: str, token: int, effects: Effects) -> defer.Deferred[None]:
        """Apply again, the general way, a group that may have committed (``_settle_uncertain``)."""
        self._mark_uncertain(stream, token)
        return self._apply_in_db(stream, token, effects)

    def _mark_uncertain(self, stream: str, token: int) -> None:
        """An apply up to ``token`` may have committed: until one up to it succeeds, a stale token is
        checked against the database (``_maybe_applied``)."""
        self._uncertain[stream] = max(token, self._uncertain.get(stream, 0))

    def _replicate_in_db(
        self, stream: str, token: int, schema: StreamSchema, received: list[ReceivedRows], effects: Effects
    ) -> defer.Deferred[None]:
        """Rows as received into ``replicated_<stream>``: small applies on the reactor where it can.

        Not while streams are delivered in timestamp order: their applies
        must follow one another as released (the one database thread does that).
        """
        apply, call = self._async_apply, self._async_apply_call
        if self.ordering is None and apply is not None and call is not None:
            if apply.busy:
                apply.settle()  # another stream's apply: its answer may be in (it may start another)
            if apply.usable:
                # Lazy: its answer is taken when the next rows come (they settle it), not
                # by a wake-up of its own (replication.pg_async, _settle_apply).
                d = apply.run(lambda: call.start(stream, token, schema, received), lazy=True)
                if d is not None:
                    return d.addErrback(self._async_apply_failed, stream, token, schema, received, effects)
            elif apply.broken:
                self._open_async_apply()
        return self._replicate_threaded(stream, token, schema, received, effects)

    def _settle_apply(self) -> None:
        """Rows wait behind an apply in flight: take its answer now if it came, else watch for it."""
        if self._async_apply is not None:
            self._async_apply.settle()

    def _replicate_threaded(
        self, stream: str, token: int, schema: StreamSchema, received: list[ReceivedRows], effects: Effects
    ) -> defer.Deferred[None]:
        d = self.db.run(self.store.apply_replicated, stream, token, schema, received, effects)
        d = self._settle_uncertain(d, stream, token)
        return d.addErrback(
            self._commit_unknown, stream, token, lambda: self._apply_uncertain(stream, token, schema, received, effects)
        )

    def _chain_in_db(
        self,
        stream: str,
        token: int,
        schema: StreamSchema,
        received: list[ReceivedRows],
        effects: Effects,
        link: ChainLink,
        before: ChainLink | None,
    ) -> defer.Deferred[None] | None:
        """A full group of a backlog on a database thread; ``before``: the group it follows, or None.

        The first group of a chain (``before`` None) goes to the database
        thread (lane 0) as before: its token moves forwards, then the rows.
        A group behind another, where the store can (PostgreSQL, its ``COPY``
        text made here while the other is applied), goes to the other lane's
        thread and connection and is copied at the same time: its token moves
        only from exactly ``before``'s last token, after ``before`` committed
        (``WorkerStore.apply_after``); else it is queued on lane 0 behind
        ``before`` and applied once that committed. Either way, if ``before``
        did not commit, nothing of it commits (:class:`NotApplied`). Each group
        tells the group behind it how it ended (``link.finish``) on its thread.
        None (not offered) while streams are delivered in timestamp order, or
        while an apply of the stream is uncertain after a lost connection: the
        usual way then.
        """
        if self.ordering is not None or stream in self._uncertain:
            return None
        # The first group of a chain makes its text on the database thread as before; a group
        # behind another has it made here, while the other is applied.
        prepared = None if before is None else self.store.prepare_replicated(schema, received)
        store = self.store
        concurrent = before is not None and prepared is not None and len(self._lanes) > 1
        if before is not None and not concurrent and before.lane != 0:
            return None  # waiting on lane 0 for a group on lane 1 would hold up lane 0's other applies
        link.lane = 1 - before.lane if before is not None and concurrent else 0

        def run() -> None:
            committed = False
            try:
                if concurrent:
                    assert before is not None and prepared is not None
                    committed = store.apply_after(
                        stream, token, before.token, schema, prepared, lambda: before.wait(CHAIN_WAIT)
                    )
                elif before is None or before.wait(CHAIN_WAIT):
                    store.apply_replicated(stream, token, schema, received, effects, prepared)
                    committed = True
                if not committed:
                    raise NotApplied(f"{stream}: the group before token {token} did not commit")
            finally:
                link.finish(committed)  # on this thread: the group behind may be waiting for it

        d = self._lanes[link.lane].run(run)
        return d.addErrback(
            self._commit_unknown, stream, token, lambda: self._apply_uncertain(stream, token, schema, received, effects)
        )

    def _commit_unknown(
        self, failure: Failure, stream: str, token: int, apply_again: Callable[[], defer.Deferred[None]]
    ) -> defer.Deferred[None]:
        """An apply's connection was lost after its ``COMMIT`` was sent: committed or not is unknown.
        The same group is applied again at once on the database thread (``apply_again``; a chained
        group's commit was sent only after the group before it committed, so the forward move of the
        retry is exact), where a :class:`StaleApply` means it had committed (``_settle_uncertain``).
        Retried token by token instead, a group that had committed would meet a stale token on every
        retry. A connection that cannot be made again fails the retry as usual (the consumer's backoff)."""
        if not failure.check(CommitUnknown):
            return defer.fail(failure)
        retries = self._unknown_retries[stream] = self._unknown_retries.get(stream, 0) + 1
        if retries > UNKNOWN_RETRIES:
            # Bounded: from here the consumer retries with its backoff; the stream stays uncertain,
            # so a stale token is still checked against the database (_maybe_applied).
            return defer.fail(failure)
        logger.warning(
            "%s: the connection was lost while token %s committed (%s); applying it again",
            stream,
            token,
            failure.getErrorMessage(),
        )
        return apply_again()

    def _apply_uncertain(
        self, stream: str, token: int, schema: StreamSchema, received: list[ReceivedRows], effects: Effects
    ) -> defer.Deferred[None]:
        """Apply again on the database thread a group that may have committed (``_settle_uncertain``)."""
        self._mark_uncertain(stream, token)
        return self._replicate_threaded(stream, token, schema, received, effects)

    def _async_apply_failed(
        self,
        failure: Failure,
        stream: str,
        token: int,
        schema: StreamSchema,
        received: list[ReceivedRows],
        effects: Effects,
    ) -> defer.Deferred[None]:
        if failure.check(ApplyRefused):
            # Nothing committed; the general way applies what fits and names a bad row.
            return self._replicate_threaded(stream, token, schema, received, effects)
        if failure.check(DatabaseUnavailable):
            logger.warning(
                "the apply connection failed (%s); applying on the database thread", failure.getErrorMessage()
            )
            return self._apply_uncertain(stream, token, schema, received, effects)
        return defer.fail(failure)

    def _settle_uncertain(self, d: defer.Deferred[None], stream: str, token: int) -> defer.Deferred[None]:
        """After a lost apply connection: this apply tells whether the lost statement had committed."""
        if stream in self._uncertain:
            d.addCallbacks(
                self._certain, self._maybe_applied, callbackArgs=(stream, token), errbackArgs=(stream, token)
            )
        return d

    def _certain(self, result: None, stream: str, token: int) -> None:
        if token >= self._uncertain.get(stream, token + 1):
            del self._uncertain[stream]
            self._unknown_retries.pop(stream, None)

    def _maybe_applied(self, failure: Failure, stream: str, token: int) -> defer.Deferred[None] | Failure:
        """A retry after a lost connection found the token applied: the lost statement had committed."""
        if not failure.check(StaleApply):
            return failure  # still unknown: the next retry checks again

        def check(applied: dict[str, int]) -> None:
            held = applied.get(stream, 0)
            if held < token:
                failure.raiseException()
            # The database may hold more than this retry's token (a group retried token by token
            # after the lost one committed): the consumer takes all of it as applied.
            self.consumers[stream].found_applied(held)
            self._certain(None, stream, held)
            logger.info("%s: token %s was applied before its connection was lost", stream, token)

        d: defer.Deferred[dict[str, int]] = self.db.run(self.store.applied_tokens)
        return d.addCallback(check)

    def _open_async_apply(self) -> None:
        """Open the non-blocking apply connection on the database thread (at most once a second)."""
        now = self.reactor.seconds()
        if self._async_opening or self.stopping or now - self._async_opened_at < 1.0:
            return
        self._async_opening = True
        self._async_opened_at = now

        def opened(call: AsyncApply | None) -> None:
            self._async_opening = False
            if call is None:
                return
            if self.stopping:
                call.close()
                return
            again = self._async_apply is not None
            self._async_apply_call = call
            self._async_apply = AsyncQuery(self.reactor, call, "tickline-apply")
            if again:
                logger.info("small applies run on the reactor again")

        def failed(failure: Failure) -> None:
            self._async_opening = False
            logger.warning("small applies run on the database thread for now: %s", failure.getErrorMessage())

        self.db.run(self.store.open_async_apply).addCallbacks(opened, failed)

    # -- connection events --------------------------------------------------------------

    def connected(self, client: ClientProtocol) -> None:
        self.client = client
        self._connected_at = self.reactor.seconds()
        self._rows_on_connection = False
        # REPLICATE waits for SERVER, so a wrong master is refused before any row.

    def on_server(self, client: ClientProtocol, server_name: str) -> None:
        expected = self.config.server_name
        if expected is not None and server_name != expected:
            logger.error(
                "master at %s:%s is %r, expected %r: refusing it, will retry",
                self.config.master_host,
                self.config.master_port,
                server_name,
                expected,
            )
            client.close_with_error(f"wrong server: expected {expected!r}, got {server_name!r}")
            return
        logger.info("connected to master %s", server_name)
        for stream, consumer in sorted(self.consumers.items()):
            self._replicate(client, stream, consumer.resume_token())
        for user_id, last in self.syncing_users.items():
            client.send(UserSyncCommand(self.config.name, user_id, True, last))
        if self._federation_ack is not None:
            client.send(FederationAckCommand(self.config.name, self._federation_ack))

    def on_position(self, client: ClientProtocol, command: PositionCommand) -> None:
        consumer = self.consumers.get(command.stream)
        if consumer is None:
            return
        if command.stream in self._answered or not client.uses("live"):
            # With OPTIONS live acknowledged, the replay's end is a second
            # POSITION; without it (a seed-protocol master), the answer to
            # REPLICATE is all there is: once what it announced is applied,
            # the stream is caught up.
            self._live_streams.add(command.stream)
        first_answer = command.stream not in self._answered
        self._answered.add(command.stream)
        if first_answer and command.stream in self._starting:
            # The answer to REPLICATE <stream> @<ms>: the stream starts here.
            self._starting.discard(command.stream)
            consumer.started_at(command.new_token)
            self._check_caught_up()
            return
        missed_from = consumer.position(command.prev_token, command.new_token)
        if missed_from is not None:
            self._replicate(client, command.stream, missed_from)
        self._check_caught_up()

    def read_started(self, client: ClientProtocol) -> None:
        for consumer in self.consumers.values():
            consumer.hold()

    def read_ended(self, client: ClientProtocol) -> None:
        # Held on while the next read follows at once: not once reading is paused (the rows
        # queued must be applied for it to resume) or the connection is closing. The socket is
        # asked (a system call) only when a stream holds rows: not after a single row's read.
        consumers = self.consumers.values()
        if not any(consumer.kick_due for consumer in consumers):
            for consumer in consumers:
                consumer.release(True)
            return
        kick = self._reading_paused or client.transport is None or client.closing or not client.more_waiting()
        for consumer in consumers:
            consumer.release(kick)

    def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, rows: list[list[Any]]) -> None:
        consumer = self.consumers.get(stream)
        if consumer is None:
            return
        self._rows_on_connection = True
        consumer.rows_received(instance, token, rows, client.rows_have_ts)
        self._count_received(client, len(rows))

    def on_rows_run(
        self, client: ClientProtocol, stream: str, instance: str, tokens: list[bytes], rows: list[list[Any]]
    ) -> bool:
        """A run of ``RDATA`` lines of one stream, one row per token (the client's block parser)."""
        consumer = self.consumers.get(stream)
        if consumer is None:
            return True  # not a stream of ours: nothing to do per token either
        self._rows_on_connection = True
        # The tokens are digits (0 or at most 18, no leading zero: parse_rdata_block checked them),
        # so they are a JSON array of integers: one orjson call, not one int() per row.
        consumer.rows_run(instance, orjson.loads(b"[" + b",".join(tokens) + b"]"), rows, client.rows_have_ts)
        self._count_received(client, len(rows))
        return True

    def _count_received(self, client: ClientProtocol, rows: int) -> None:
        """Pause reading once the rows waiting to be applied pass ``max_pending_rows``.

        The sum over streams is taken about every 1% of the limit, not per token.
        """
        self._unchecked_rows += rows
        if self._unchecked_rows < self._check_every or self._reading_paused:
            return
        self._unchecked_rows = 0
        if self._pending_rows() > self.config.max_pending_rows:
            self._reading_paused = True
            if client.transport is not None:
                client.transport.pauseProducing()

    def on_options(self, client: ClientProtocol, acknowledged: frozenset[str]) -> None:
        if self.ordering is None:
            return
        enabled = {"tick", "ts"} <= acknowledged
        if not enabled and self.ordering.enabled:
            logger.warning(
                "the master does not acknowledge OPTIONS tick ts: delivering %s unordered on this connection",
                ", ".join(sorted(self.ordering.lanes)),
            )
        self.ordering.enabled = enabled

    def on_tick(self, client: ClientProtocol, command: TickCommand) -> None:
        consumer = self.consumers.get(command.stream)
        if consumer is not None:
            consumer.tick(command.safe_token, command.safe_ts)

    def on_error(self, client: ClientProtocol, message: str) -> None:
        # Peer text: escaped and rate-limited with the connection's other log lines.
        client.peer_log(logging.ERROR, "master refused: %s", message, log=logger)
        # A REPLICATE the master refused (e.g. a token above its head) is
        # retried later, never rewound.
        for stream in self.consumers:
            if stream not in client.positioned and stream not in self._retry_calls:
                self._retry_calls[stream] = self.reactor.callLater(
                    self.config.replicate_retry, self._retry_replicate, client, stream
                )

    def _retry_replicate(self, client: ClientProtocol, stream: str) -> None:
        self._retry_calls.pop(stream, None)
        if client is self.client and client.transport is not None and stream not in client.positioned:
            self._replicate(client, stream, self.consumers[stream].resume_token())

    def _replicate(self, client: ClientProtocol, stream: str, token: int) -> None:
        self._answered.discard(stream)
        self._live_streams.discard(stream)
        consumer = self.consumers[stream]
        if consumer.start_at_ms is not None and consumer.applied == 0 and token == 0:
            # worker.start_at: a stream never applied here starts at that time.
            self._starting.add(stream)
            client.replicate(stream, since_ms=consumer.start_at_ms)
            return
        self._starting.discard(stream)
        client.replicate(stream, token)

    def on_remote_server_up(self, client: ClientProtocol, server: str) -> None:
        # Relayed from any other peer of the master: escaped and rate-limited.
        client.peer_log(logging.INFO, "remote server up: %s", server, log=logger)

    def disconnected(self, client: ClientProtocol, reason: Failure) -> None:
        if client is self.client:
            self.client = None
        self._answered.clear()
        self._live_streams.clear()
        self._starting.clear()
        for consumer in self.consumers.values():
            consumer.reset()
        if self.ordering is not None:
            self.ordering.reset()
        for call in self._retry_calls.values():
            if call.active():
                call.cancel()
        self._retry_calls.clear()
        self._reading_paused = False
        if self.stopping:
            return
        self.reconnects += 1
        # The backoff starts again only after a healthy connection: one that
        # brought rows or lasted, and that we did not have to close. A master
        # that sends what this worker cannot handle is retried ever more slowly.
        lived = self.reactor.seconds() - self._connected_at
        healthy = client.close_reason is None and (self._rows_on_connection or lived >= self.config.reconnect_max)
        factory = self.factory
        if factory is not None and healthy:
            factory.resetDelay()
        next_try = "" if factory is None else f" (reconnecting in about {_next_delay(factory):.1f} s)"
        if client.close_reason is not None:
            logger.error("closed the connection to the master: %s%s", client.close_reason, next_try)
        else:
            logger.warning("connection to the master lost: %s%s", reason.getErrorMessage(), next_try)

    # -- progress --------------------------------------------------------------------

    def _pending_rows(self) -> int:
        """Rows received and waiting to be applied; not those held back for ordering.

        Held rows wait for rows and TICKs of other streams on this connection,
        so they must not stop the reading (they are bounded by parking, see
        ``workers.ordering``).
        """
        held = 0 if self.ordering is None else sum(lane.pending_rows for lane in self.ordering.lanes.values())
        return sum(c.queued_rows for c in self.consumers.values()) - held

    def _resubscribe(self, stream: str, token: int) -> None:
        """Ordered delivery asks again for a parked stream's rows after ``token``."""
        if self.client is not None and self.client.transport is not None:
            self._replicate(self.client, stream, token)

    def _progress(self, consumer: StreamConsumer) -> None:
        if self._reading_paused and self._pending_rows() <= self.config.max_pending_rows // 2:
            self._reading_paused = False
            if self.client is not None and self.client.transport is not None:
                self.client.transport.resumeProducing()
        self._check_caught_up()

    def caught_up(self) -> bool:
        """Every stream's replay reached the live rows on this connection, all applied."""
        return (
            self.client is not None
            and all(s in self._live_streams for s in self.consumers)
            and not any(c.busy for c in self.consumers.values())
        )

    def when_caught_up(self) -> defer.Deferred[None]:
        d: defer.Deferred = defer.Deferred()
        self._caught_up_waiters.append(d)
        self._check_caught_up()
        return d

    def _check_caught_up(self) -> None:
        if self._caught_up_waiters and self.caught_up():
            waiters, self._caught_up_waiters = self._caught_up_waiters, []
            for d in waiters:
                d.callback(None)

    def stats(self) -> WorkerStats:
        """A typed snapshot of the worker's streams and connection."""
        now_ms = int(self.reactor.seconds() * 1000)
        return WorkerStats(
            streams=tuple(c.stats(now_ms) for _, c in sorted(self.consumers.items())),
            reconnects=self.reconnects,
            connection=self.client.stats() if self.client is not None else None,
            protocol=STATS.snapshot(),
        )

    # -- commands to the master -------------------------------------------------------

    def _send(self, command: Any) -> bool:
        if self.client is None or self.client.transport is None:
            return False
        self.client.send(command)
        return True

    def user_sync(self, user_id: str, syncing: bool, last_sync_ms: int | None = None) -> None:
        """Tell the master a user started or stopped syncing here (re-sent after reconnects)."""
        last = int(time.time() * 1000) if last_sync_ms is None else last_sync_ms
        if syncing:
            self.syncing_users[user_id] = last
        else:
            self.syncing_users.pop(user_id, None)
        self._send(UserSyncCommand(self.config.name, user_id, syncing, last))

    def federation_ack(self, token: int) -> None:
        self._federation_ack = token
        self._send(FederationAckCommand(self.config.name, token))

    def remove_pusher(self, app_id: str, push_key: str, user_id: str) -> bool:
        return self._send(RemovePusherCommand(app_id, push_key, user_id))

    def remote_server_up(self, server: str) -> bool:
        return self._send(RemoteServerUpCommand(server))


class UnknownStreamError(ValueError):
    pass


class WorkerFactory(ReconnectingClientFactory):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.initialDelay = worker.config.reconnect_initial
        self.delay = self.initialDelay
        self.maxDelay = worker.config.reconnect_max  # type: ignore[assignment]
        self.factor = 2.0
        self.jitter = 0.25
        self.clock = worker.reactor
        self.noisy = False

    def buildProtocol(self, addr: Any) -> ClientProtocol:
        # The delay resets after the handshake (on_server), not on TCP connect.
        return self.worker.client_protocol()

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        if not self.worker.stopping:
            logger.warning(
                "cannot connect to the master at %s:%s: %s (retrying in about %.1f s)",
                connector.host,
                connector.port,
                reason.getErrorMessage(),
                self.delay,
            )
        super().clientConnectionFailed(connector, reason)


def _next_delay(factory: ReconnectingClientFactory) -> float:
    """The delay the factory's next retry takes (before its jitter)."""
    return min(factory.delay * factory.factor, factory.maxDelay)


def _sleep(reactor: Any, seconds: float) -> defer.Deferred[None]:
    from twisted.internet import task

    return task.deferLater(reactor, seconds, lambda: None)
