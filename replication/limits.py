"""Bounds on what a peer can make the master hold: connections, time, log lines, queues.

The shapes follow ``twisted.protocols.policies`` (LimitTotalConnectionsFactory,
TimeoutMixin), written small and for this protocol:

- :class:`ConnectionLimiter` and :class:`LimitedFactory`: at most
  ``max_connections`` open connections, and ``max_connections_per_address``
  from one IP address. A refused peer gets ``ERROR too many connections ...``
  and a close; refusals are counted and logged at most once a second.
- :class:`InputWatch`: the master's timeouts for one connection: no ``AUTH``
  within ``auth_timeout`` (when a secret is set), no valid command within
  ``idle_timeout``, a line left incomplete for ``line_timeout``.
- :class:`LogBudget`: log lines about one peer, at most
  ``log_lines_per_second`` per connection and ``max_log_lines_per_second``
  over all peers; what is suppressed is summarized (``suppressed N log
  lines``) once lines are allowed again and when the connection closes.
- :func:`watch_accept_errors`: ``accept()`` failing for lack of file
  descriptors (EMFILE) is logged (rate-limited) and counted; Twisted only
  writes it to its own log, which nobody reads.
- :data:`LIMIT_STATS`: the counters behind the ``tickline_limit_*`` metrics.
"""

from __future__ import annotations

import collections
import logging
import resource
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.protocol import Factory, Protocol
from twisted.logger import ILogObserver, Logger, globalLogPublisher

from replication.logsafe import safe
from replication.reactor_types import Clock, Transport
from replication.settings import LimitsConfig
from replication.stats import LimitCounters

logger = logging.getLogger(__name__)

# File descriptors kept free beyond the connections (database, logs, listening sockets).
FD_HEADROOM = 64


class LimitStats:
    """Process-wide counters of what the limits did (read by the metrics endpoint)."""

    def __init__(self) -> None:
        self.refused: collections.Counter[str] = collections.Counter()  # connections refused, by reason
        self.closed: collections.Counter[str] = collections.Counter()  # connections closed by a limit, by reason
        self.rejected: collections.Counter[str] = collections.Counter()  # commands refused by a limit, by reason
        self.relays_dropped = 0  # REMOTE_SERVER_UP not relayed to a peer that does not read
        self.log_lines_suppressed = 0
        self.accept_errors: collections.Counter[str] = collections.Counter()  # accept() failures, by errno name

    def snapshot(self) -> LimitCounters:
        return LimitCounters(
            refused=tuple(sorted(self.refused.items())),
            closed=tuple(sorted(self.closed.items())),
            rejected=tuple(sorted(self.rejected.items())),
            relays_dropped=self.relays_dropped,
            log_lines_suppressed=self.log_lines_suppressed,
            accept_errors=tuple(sorted(self.accept_errors.items())),
        )


LIMIT_STATS = LimitStats()


# -- log lines -----------------------------------------------------------------------


class _Window:
    """Counts events in one-second windows."""

    __slots__ = ("count", "start", "suppressed")

    def __init__(self) -> None:
        self.start = float("-inf")
        self.count = 0
        self.suppressed = 0

    def roll(self, now: float) -> bool:
        """Start a new window if a second has passed; True if one started."""
        if now - self.start >= 1.0:
            self.start = now
            self.count = 0
            return True
        return False


class SharedLogBudget:
    """The log lines about peers allowed per second, over every connection together."""

    def __init__(self, clock: Clock, per_second: int) -> None:
        self.clock = clock
        self.per_second = per_second
        self._window = _Window()

    def _report(self) -> None:
        suppressed, self._window.suppressed = self._window.suppressed, 0
        self._window.count += 1
        logger.warning(
            "suppressed %d log lines about peers (more than %d per second over all connections)",
            suppressed,
            self.per_second,
        )

    def tick(self) -> None:
        """Report what was suppressed once its second is over, even if no line follows."""
        if self._window.suppressed and self._window.roll(self.clock.seconds()):
            self._report()

    def take(self) -> bool:
        now = self.clock.seconds()
        if self._window.roll(now) and self._window.suppressed:
            self._report()
        if self._window.count < self.per_second:
            self._window.count += 1
            return True
        self._window.suppressed += 1
        LIMIT_STATS.log_lines_suppressed += 1
        return False

    def suppressed(self, count: int) -> None:
        """Lines a connection could not report itself (its summary was suppressed)."""
        self._window.suppressed += count


class LogBudget:
    """Log lines about one connection: at most ``per_second``, then a summary."""

    def __init__(self, clock: Clock, per_second: int, shared: SharedLogBudget | None) -> None:
        self.clock = clock
        self.per_second = per_second
        self.shared = shared
        self._window = _Window()

    def _take(self, force: bool = False) -> bool:
        if self._window.count >= self.per_second and not force:
            return False
        if self.shared is not None and not self.shared.take():
            return False
        self._window.count += 1
        return True

    def log(
        self, log: logging.Logger, level: int, conn_name: str, message: str, *args: object, force: bool = False
    ) -> None:
        """``log.log(level, "[conn] " + message, *args)`` within the budget; args are escaped.

        ``force``: a line that comes once per connection (why it was closed)
        passes the connection's own limit, but not the limit over all peers.
        """
        if not log.isEnabledFor(level):
            return
        now = self.clock.seconds()
        if self._window.roll(now) and self._window.suppressed:
            self._summary(log, conn_name)
        if self._take(force):
            log.log(level, "[%s] " + message, conn_name, *(safe(a) for a in args))
        else:
            self._window.suppressed += 1
            LIMIT_STATS.log_lines_suppressed += 1

    def _summary(self, log: logging.Logger, conn_name: str) -> None:
        if self._take():
            suppressed, self._window.suppressed = self._window.suppressed, 0
            log.warning(
                "[%s] suppressed %d log lines (more than %d per second)", conn_name, suppressed, self.per_second
            )

    def tick(self, log: logging.Logger, conn_name: str) -> None:
        """Called now and then (every keepalive tick): report what was suppressed once
        its second is over, even if no further line comes."""
        if self._window.suppressed and self._window.roll(self.clock.seconds()):
            self._summary(log, conn_name)
        if self.shared is not None:
            self.shared.tick()

    def flush(self, log: logging.Logger, conn_name: str) -> None:
        """The connection is closing: report what was suppressed (or leave it to the shared summary)."""
        if not self._window.suppressed:
            return
        self._window.count = 0  # the closing summary does not wait for the next second
        self._summary(log, conn_name)
        if self._window.suppressed and self.shared is not None:
            self.shared.suppressed(self._window.suppressed)
        self._window.suppressed = 0


# -- timeouts ------------------------------------------------------------------------


class InputWatch:
    """The master's timeouts for what one connection sends (checked every keepalive tick)."""

    def __init__(self, limits: LimitsConfig, now: float, needs_auth: bool) -> None:
        self.limits = limits
        self.needs_auth = needs_auth
        self.connected_at = now
        self.last_command = now  # the last line that parsed as a command
        self.partial_since: float | None = None  # when the incomplete line now buffered started

    def data(self, now: float, had_newline: bool, pending: int) -> None:
        """Bytes arrived: ``had_newline`` if a line ended; ``pending`` bytes of a line remain."""
        if not pending:
            self.partial_since = None
        elif had_newline or self.partial_since is None:
            self.partial_since = now

    def command(self, now: float) -> None:
        self.last_command = now

    def shift(self, seconds: float) -> None:
        """We stood still for ``seconds``: the peer's clocks stop for that long too."""
        self.connected_at += seconds
        self.last_command += seconds
        if self.partial_since is not None:
            self.partial_since += seconds

    def check(self, now: float, authenticated: bool, pending: int, consuming: bool = False) -> tuple[str, str] | None:
        """(reason, ERROR message) once a timeout has passed, else None.

        ``consuming``: the peer replicates streams, so it did something useful
        and only listens now (as ``nc`` following live rows): no idle timeout.
        """
        limits = self.limits
        if self.needs_auth and not authenticated and now - self.connected_at >= limits.auth_timeout:
            return "auth_timeout", f"authentication timeout: no AUTH within {limits.auth_timeout:g} s"
        if pending and self.partial_since is not None and now - self.partial_since >= limits.line_timeout:
            return (
                "line_timeout",
                f"line timeout: {pending} bytes without a newline for {limits.line_timeout:g} s",
            )
        if not consuming and now - self.last_command >= limits.idle_timeout:
            return "idle_timeout", f"idle timeout: no command for {limits.idle_timeout:g} s"
        return None


# -- names and instance bookkeeping --------------------------------------------------


def too_long(limits: LimitsConfig, **values: str) -> str | None:
    """The first value longer than ``max_name_bytes``, as an ERROR message, else None."""
    for what, value in values.items():
        size = len(value.encode("utf-8"))
        if size > limits.max_name_bytes:
            return f"{what} is {size} bytes long, the limit is {limits.max_name_bytes}"
    return None


# -- connections ---------------------------------------------------------------------


class ConnectionSlot:
    """One accepted connection's place in the limiter; released once when it closes."""

    __slots__ = ("_limiter", "host")

    def __init__(self, limiter: ConnectionLimiter, host: str) -> None:
        self._limiter: ConnectionLimiter | None = limiter
        self.host = host

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter._release(self.host)
            self._limiter = None


class ConnectionLimiter:
    """Counts open connections, in total and per IP address."""

    def __init__(self, limits: LimitsConfig, clock: Clock) -> None:
        self.limits = limits
        self.total = 0
        self.by_address: collections.Counter[str] = collections.Counter()
        self._refusals = _Window()
        self.clock = clock

    def acquire(self, host: str) -> tuple[ConnectionSlot | None, str, str]:
        """(a slot for a new connection from ``host``, "", ""), or (None, reason, message)."""
        limits = self.limits
        if self.total >= limits.max_connections:
            return None, "total", f"too many connections: the limit is {limits.max_connections}"
        if self.by_address[host] >= limits.max_connections_per_address:
            return (
                None,
                "per_address",
                f"too many connections from {host}: the limit is {limits.max_connections_per_address} per address",
            )
        self.total += 1
        self.by_address[host] += 1
        return ConnectionSlot(self, host), "", ""

    def _release(self, host: str) -> None:
        self.total -= 1
        self.by_address[host] -= 1
        if self.by_address[host] <= 0:
            del self.by_address[host]

    def refused(self, reason: str, host: str, message: str) -> None:
        """Count a refusal and log it, at most one line a second (with how many were not logged)."""
        LIMIT_STATS.refused[reason] += 1
        now = self.clock.seconds()
        if self._refusals.roll(now):
            skipped, self._refusals.suppressed = self._refusals.suppressed, 0
            more = f" ({skipped} more refused in the last second)" if skipped else ""
            logger.warning("refused a connection from %s: %s%s", safe(host), message, more)
        else:
            self._refusals.suppressed += 1


class RefusedProtocol(Protocol):
    """Tells a refused peer why in one ``ERROR`` line, then closes."""

    transport: Transport | None  # type: ignore[assignment]

    def __init__(self, message: str) -> None:
        self.message = message

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(b"ERROR " + self.message.encode("utf-8") + b"\n")
        self.transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        pass  # whatever it says, the answer is the same


class LimitedFactory(Factory):
    """Builds a protocol per accepted connection while the limits allow, else a refusal.

    ``build(addr, slot)`` makes the real protocol; that protocol must call
    ``slot.release()`` when its connection is lost.
    """

    def __init__(self, limiter: ConnectionLimiter, build: Callable[[Any, ConnectionSlot], Protocol]) -> None:
        self.limiter = limiter
        self.build = build

    def buildProtocol(self, addr: Any) -> Protocol | None:
        host = str(getattr(addr, "host", "?"))
        slot, reason, message = self.limiter.acquire(host)
        if slot is None:
            self.limiter.refused(reason, host, message)
            refused = RefusedProtocol(message)
            refused.factory = self
            return refused
        protocol = self.build(addr, slot)
        protocol.factory = self
        return protocol


# -- file descriptors ----------------------------------------------------------------


def ensure_file_limit(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards what ``max_connections`` needs; returns the limit.

    Logs a warning when even the hard limit is too low: connections past it
    then fail in ``accept()`` with EMFILE (logged by :func:`watch_accept_errors`).
    """
    need = max_connections + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError) as e:
                logger.warning("cannot raise the file descriptor limit to %d: %s", new, e)
    if soft != resource.RLIM_INFINITY and soft < need:
        logger.warning(
            "master.max_connections is %d but the file descriptor limit is %d: connections beyond about %d "
            "will be closed at once for lack of file descriptors (raise LimitNOFILE or lower max_connections)",
            max_connections,
            soft,
            max(soft - FD_HEADROOM, 0),
        )
    return int(soft)


def watch_accept_errors(port: Any, clock: Clock) -> None:
    """Count and log (at most once a second) the failures of a listening port's ``accept()``.

    Twisted's TCP port reports EMFILE (and ENFILE, ENOBUFS, ENOMEM) to its own
    logger; here those events are taken out of Twisted's log, counted, and
    written to the process's log. Other events go on to Twisted's log.
    """
    window = _Window()
    original = getattr(port, "_logger", None)
    namespace = getattr(original, "namespace", "twisted.internet.tcp.Port")

    def observe(event: dict[str, Any]) -> None:
        text = str(event.get("log_format") or "")
        if "EMFILE" in text or "Could not accept" in text:
            if "Could not accept" in text:
                error = str(event.get("acceptError", "error"))
            elif "Closed socket" in text:
                error = "EMFILE"
            else:
                return  # Twisted's notes about its reserved descriptor; the closed socket is counted
            LIMIT_STATS.accept_errors[error] += 1
            if window.roll(clock.seconds()):
                skipped, window.suppressed = window.suppressed, 0
                more = f" ({skipped} more in the last second)" if skipped else ""
                logger.error(
                    "cannot accept a connection: %s (out of file descriptors?); the client was disconnected%s",
                    error,
                    more,
                )
            else:
                window.suppressed += 1
            return
        globalLogPublisher(event)

    port._logger = Logger(namespace=namespace, observer=cast(ILogObserver, observe))
