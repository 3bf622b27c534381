"""The timeline consumer of a worker: run a handler for each leased message.

A handler is a plain function ``handler(job: TimelineJob) -> None``; it may
block (it runs on a thread pool of ``credit`` threads, so at most ``credit``
run at once, which is also the master's bound on active leases):

- it returns: the message is deleted (``DELETE`` with the version held);
- it raises: the error is logged and the message is released
  (``RELEASE``) with an exponential backoff: ``backoff_initial_ms`` doubled
  per failure of that message in this process, up to ``backoff_max_ms``;
- it is still running at half its lease: the lease is extended
  (``EXTEND``), again at half of each new lease, for as long as it runs.

The connection reconnects with backoff; the master then sends this consumer
id's active leases first, so a handler still running keeps its lease and
finishes with the version it has. A refused DELETE/EXTEND (``NACK``) is
logged: the lease was lost (expired), and the message goes to another
consumer: processing is at-least-once (see docs/timeline.md).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import attr
import orjson
from twisted.internet import defer, threads
from twisted.internet.protocol import ReconnectingClientFactory
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from replication.commands import (
    Command,
)
from replication.settings import ProtocolConfig
from replication.timeline_client import TimelineClientProtocol
from replication.timeline_commands import (
    AckCommand,
    DeleteCommand,
    ExtendCommand,
    LeaseCommand,
    NackCommand,
    ReleaseCommand,
    TimelineCommand,
)
from workers.settings import TimelineWorkerSettings


class LeaseConnection(Protocol):
    """What the consumer needs of its connection to the master (a ``TimelineClientProtocol``)."""

    conn_name: str

    def command(self, command: Command) -> None: ...

    def close(self) -> None: ...


logger = logging.getLogger(__name__)

MAX_REMEMBERED_FAILURES = 10_000


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TimelineJob:
    """What a handler gets: one leased message."""

    topic: str
    id: str
    version: int  # the version leased (the consumer keeps the current one)
    lease_until_ms: int
    body: Any  # the parsed JSON body


JobHandler = Callable[[TimelineJob], Any]


class _Running:
    __slots__ = ("extend_call", "extending", "finished", "until_ms", "version")

    def __init__(self, version: int, until_ms: int) -> None:
        self.extending = False  # an EXTEND is out: DELETE/RELEASE wait for its new version
        self.version = version
        self.until_ms = until_ms
        self.extend_call: Any = None
        self.finished: tuple[str, int] | None = None  # ("DELETE" | "RELEASE", delay) waiting for a connection


class TimelineConsumer:
    """Consumes one topic with one handler, on its own connection to the master."""

    def __init__(
        self,
        settings: TimelineWorkerSettings,
        handler: JobHandler,
        name: str,
        host: str,
        port: int,
        protocol_config: ProtocolConfig,
        reactor: Any,
        secret: str | None = None,
        reconnect_max: float = 5.0,
        run_handler: Callable[[JobHandler, TimelineJob], defer.Deferred[Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.handler = handler
        self.consumer_id = settings.consumer or name
        self.name = name
        self.host, self.port = host, port
        self.protocol_config = protocol_config
        self.reactor = reactor
        self.secret = secret
        self.client: LeaseConnection | None = None
        self.running: dict[str, _Running] = {}
        self.failures: OrderedDict[str, int] = OrderedDict()
        self.counters = {"handled": 0, "failed": 0, "extended": 0, "lost": 0}
        self._pool = ThreadPool(minthreads=0, maxthreads=settings.credit, name=f"tickline-timeline-{name}")
        # How a handler runs: on the pool (tests inject their own).
        self._run_handler = run_handler or (
            lambda handler, job: threads.deferToThreadPool(self.reactor, self._pool, handler, job)
        )
        self._factory = _Factory(self, reconnect_max)
        self._connector: Any = None
        self._stopping = False

    # -- start and stop -----------------------------------------------------------------

    def start(self) -> None:
        self._pool.start()
        self._connector = self.reactor.connectTCP(self.host, self.port, self._factory)

    def stop(self) -> None:
        self._stopping = True
        self._factory.stopTrying()
        if self.client is not None:
            self.client.close()
        for job in self.running.values():
            if job.extend_call is not None and job.extend_call.active():
                job.extend_call.cancel()
        self._pool.stop()

    # -- the connection ------------------------------------------------------------------

    def subscribe_command(self) -> TimelineCommand:
        s = self.settings
        return TimelineCommand(s.topic, self.consumer_id, s.credit, s.lease_ms)

    def connected(self, client: LeaseConnection) -> None:
        self.client = client
        self._factory.resetDelay()
        logger.info("[%s] consuming timeline %s as %s", client.conn_name, self.settings.topic, self.consumer_id)
        # Handlers that finished while we were away report now (after TIMELINE).
        for mid, job in list(self.running.items()):
            job.extending = False
            if job.finished is not None:
                self._finish(mid, job)

    def disconnected(self, client: LeaseConnection, reason: Failure) -> None:
        if self.client is client:
            self.client = None
        if not self._stopping:
            logger.warning("timeline connection lost (%s); reconnecting", reason.getErrorMessage())

    def on_error(self, client: LeaseConnection, message: str) -> None:
        logger.error("[%s] master sent ERROR %s", client.conn_name, message)

    # -- leases ----------------------------------------------------------------------------

    def on_lease(self, client: LeaseConnection, command: LeaseCommand) -> None:
        known = self.running.get(command.id)
        if known is not None:
            # Ours already (a lease sent again after a reconnect): keep running.
            if command.version >= known.version:
                known.version, known.until_ms = command.version, command.until_ms
                self._plan_extend(command.id, known)
            return
        job = _Running(command.version, command.until_ms)
        self.running[command.id] = job
        self._plan_extend(command.id, job)
        try:
            body = orjson.loads(command.body)
        except orjson.JSONDecodeError:
            body = command.body
        work = TimelineJob(command.topic, command.id, command.version, command.until_ms, body)
        d = self._run_handler(self.handler, work)
        d.addCallbacks(self._handled, self._raised, (command.id,), {}, (command.id,))

    def _plan_extend(self, mid: str, job: _Running) -> None:
        if job.extend_call is not None and job.extend_call.active():
            job.extend_call.cancel()
        now_ms = self.reactor.seconds() * 1000
        delay = max(0.0, (job.until_ms - now_ms) / 2000)
        job.extend_call = self.reactor.callLater(delay, self._extend, mid)

    def _extend(self, mid: str) -> None:
        job = self.running.get(mid)
        if job is None or job.finished is not None:
            return
        job.extend_call = None
        if self.client is not None:
            job.extending = True
            self.client.command(ExtendCommand(self.settings.topic, mid, job.version, self.settings.lease_ms))

    def _handled(self, _: Any, mid: str) -> None:
        self.counters["handled"] += 1
        self.failures.pop(mid, None)
        job = self.running.get(mid)
        if job is not None:
            job.finished = ("DELETE", 0)
            self._finish(mid, job)

    def _raised(self, failure: Failure, mid: str) -> None:
        self.counters["failed"] += 1
        count = self.failures.pop(mid, 0) + 1
        self.failures[mid] = count
        while len(self.failures) > MAX_REMEMBERED_FAILURES:
            self.failures.popitem(last=False)
        s = self.settings
        delay = min(s.backoff_max_ms, s.backoff_initial_ms * 2 ** (count - 1))
        logger.error(
            "timeline %s message %s failed (attempt %d here), released for %d ms: %s",
            s.topic,
            mid,
            count,
            delay,
            failure.getTraceback(),
        )
        job = self.running.get(mid)
        if job is not None:
            job.finished = ("RELEASE", delay)
            self._finish(mid, job)

    def _finish(self, mid: str, job: _Running) -> None:
        if job.extend_call is not None and job.extend_call.active():
            job.extend_call.cancel()
        if self.client is None or job.finished is None or job.extending:
            return  # sent once connected again, or once the EXTEND is answered
        action, delay = job.finished
        if action == "DELETE":
            self.client.command(DeleteCommand(self.settings.topic, mid, job.version))
        else:
            self.client.command(ReleaseCommand(self.settings.topic, mid, job.version, delay))

    def on_answer(self, client: LeaseConnection, command: AckCommand | NackCommand) -> None:
        mid = command.id
        job = self.running.get(mid)
        if job is None:
            return
        ok = isinstance(command, AckCommand)
        if command.command == "EXTEND":
            job.extending = False
            if isinstance(command, AckCommand):
                self.counters["extended"] += 1
                job.version, job.until_ms = command.version, command.timestamp_ms
            else:
                self._lost(command)
            if job.finished is not None:
                self._finish(mid, job)  # the handler finished meanwhile
            elif ok:
                self._plan_extend(mid, job)
            return
        if command.command in ("DELETE", "RELEASE"):
            del self.running[mid]
            if isinstance(command, NackCommand):
                self._lost(command)

    def _lost(self, command: NackCommand) -> None:
        self.counters["lost"] += 1
        logger.warning(
            "timeline %s message %s: %s refused (%s); the lease is lost, the message goes to another consumer",
            command.topic,
            command.id,
            command.command,
            command.reason,
        )


class _Factory(ReconnectingClientFactory):
    def __init__(self, consumer: TimelineConsumer, reconnect_max: float) -> None:
        self.consumer = consumer
        self.maxDelay = reconnect_max  # type: ignore[assignment]
        self.initialDelay = 0.1

    def buildProtocol(self, addr: Any) -> TimelineClientProtocol:
        c = self.consumer
        proto = TimelineClientProtocol(
            c, f"{c.name}-timeline", c.subscribe_command(), c.protocol_config, c.reactor, c.secret
        )
        proto.factory = self
        return proto
