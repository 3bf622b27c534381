"""The master's side of a connection: framing, authentication and dispatch.

:class:`ServerProtocol` is a :class:`~replication.protocol.LineCommandProtocol`
(framing, keepalive, bad input) that sends the handshake (``SERVER``,
``PING``), checks ``AUTH``, answers ``OPTIONS``, validates ``REPLICATE``
against the master's streams and heads, and hands client commands to the
master's handlers. The subscriptions it starts are owned by its
:class:`~replication.subscriptions.Subscriptions` (catching up, live, paused,
generations); as the transport's ``IPushProducer`` it tells them when to
pause and resume, and closes a connection paused for longer than
``max_pause``.

What a connection needs from the master is :class:`MasterServices`.
"""

from __future__ import annotations

import hmac
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from zope.interface import implementer

from replication.commands import (
    CLIENT_COMMANDS,
    AuthCommand,
    ClearUserSyncCommand,
    Command,
    FederationAckCommand,
    NameCommand,
    OptionsCommand,
    PingCommand,
    PositionCommand,
    RemoteServerUpCommand,
    RemovePusherCommand,
    ReplicateCommand,
    ServerCommand,
    UserSyncCommand,
)
from replication.limits import LIMIT_STATS, ConnectionSlot, InputWatch, LogBudget, SharedLogBudget, too_long
from replication.protocol import LineCommandProtocol, ProtocolConfig
from replication.reactor_types import Clock, DelayedCall
from replication.settings import LimitsConfig, MasterConfig
from replication.stats import STATS as PROTOCOL_STATS
from replication.subscriptions import StreamSource, Subscriptions
from replication.timeline_commands import (
    CancelCommand,
    DeleteCommand,
    ExtendCommand,
    MoveCommand,
    ReleaseCommand,
    ScheduleCommand,
    TimelineCommand,
)
from replication.timeticks import TICK_OPTION, replicate_at
from storage.time_index import TokenAt

if TYPE_CHECKING:
    from replication.client_commands import ClientCommandHandlers
    from replication.timeline import TimelineHooks

logger = logging.getLogger(__name__)


class MasterServices(StreamSource, Protocol):
    """What a connection needs from the master (``replication.master.Master``)."""

    @property
    def config(self) -> MasterConfig: ...

    @property
    def client_commands(self) -> ClientCommandHandlers: ...

    def has_stream(self, stream: str) -> bool: ...

    def stream_names(self) -> list[str]: ...

    def followed(self) -> defer.Deferred[None]:
        """Fires once the master has looked at the store's heads after this call."""
        ...

    def connection_made(self, conn: ServerProtocol) -> None: ...

    def connection_lost(self, conn: ServerProtocol) -> None: ...

    @property
    def timeline(self) -> TimelineHooks:
        """The timeline's commands and connection hooks (``replication.timeline``)."""
        ...

    def token_at(self, stream: str, since_ts: int) -> defer.Deferred[TokenAt]:
        """The first token of ``stream`` at or after ``since_ts`` (``REPLICATE <stream> @<ms>``)."""
        ...

    @property
    def limits(self) -> LimitsConfig:
        """What a connection may hold (replication.limits)."""
        ...

    @property
    def log_budget(self) -> SharedLogBudget:
        """Log lines about peers, over every connection together."""
        ...


@implementer(IPushProducer)
class ServerProtocol(LineCommandProtocol):
    INBOUND: ClassVar[frozenset[str]] = CLIENT_COMMANDS
    SIDE: ClassVar[str] = "server"

    def __init__(self, master: MasterServices, config: ProtocolConfig, clock: Clock) -> None:
        super().__init__(config, clock)
        self.master = master
        self.client_name: str | None = None
        self.announce_live = False  # OPTIONS live
        self.authenticated = master.config.secret is None
        self.subscriptions = Subscriptions(master, self, config.catchup_rows, config.max_lag_bytes)
        self._pause_timer: DelayedCall | None = None
        self._pending_replicates = 0  # REPLICATEs waiting for the master to follow the store
        self._replicate_waits = False  # a REPLICATE's answer waits for the database
        self._replicates_behind: deque[ReplicateCommand] = deque()  # REPLICATEs that arrived meanwhile, in order
        self._answering = False
        self._half_close_synced = False
        # Limits (replication.limits): timeouts, the connection's slot, replies queued while paused.
        self.limits = master.limits
        self.log_budget = LogBudget(clock, self.limits.log_lines_per_second, master.log_budget)
        self.slot: ConnectionSlot | None = None  # set by the master's LimitedFactory
        self._watch = InputWatch(self.limits, clock.seconds(), master.config.secret is not None)
        self._queued_while_paused = 0
        self._replies_overflowed = False
        self._seen_data = False

    @property
    def with_ts(self) -> bool:
        """OPTIONS ts: rows carry their timestamp."""
        return self.subscriptions.with_ts

    @property
    def paused(self) -> bool:
        return self.subscriptions.paused

    # -- lifecycle -------------------------------------------------------------

    def connectionMade(self) -> None:
        super().connectionMade()
        assert self.transport is not None
        self.transport.registerProducer(self, True)
        self.master.connection_made(self)
        self.send(ServerCommand(self.master.config.server_name))
        self.send_ping()

    def connectionLost(self, reason: Failure | None = None) -> None:
        if reason is not None and _is_tls_error(reason):
            self.peer_log(logging.INFO, "TLS failed: %s", reason.getErrorMessage())
        super().connectionLost(reason)
        if self.slot is not None:
            self.slot.release()
        if self._pause_timer is not None and self._pause_timer.active():
            self._pause_timer.cancel()
        self.subscriptions.close()
        self.master.connection_lost(self)
        self.master.timeline.connection_lost(self)

    def finish_after_half_close(self) -> None:
        # Finish replays owed to a half-closed peer (nc -q1), then close.
        if self.master.timeline.busy(self):
            return  # timeline answers still owed; the service calls again
        if self._pending_replicates or self._replicates_behind or not self.subscriptions.all_live():
            return
        if len(self.subscriptions) and not self._half_close_synced:
            # Rows committed before the peer half-closed may not be followed
            # yet: let the master look at the store once more, then close.
            self._half_close_synced = True
            self._pending_replicates += 1
            self.master.followed().addBoth(self._synced_after_half_close)
            return
        self.close()

    def _synced_after_half_close(self, _: object) -> None:
        self._pending_replicates -= 1
        self.finish_after_half_close()

    @property
    def display_name(self) -> str:
        # Metrics label peers with this and with peer_address (host:port), so
        # two peers with one NAME are two series.
        return self.client_name or self.conn_name

    # -- limits (replication.limits) ---------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if not self._seen_data:
            self._seen_data = True
            if data.startswith(_TLS_HANDSHAKE):
                # A TLS client on a plaintext port: say so in the log (the
                # client cannot read our ERROR, but an operator can).
                self.close_with_error("TLS handshake on a plaintext port: this master does not use TLS")
                return
        super().dataReceived(data)

    def input_progress(self, had_newline: bool, pending: int) -> None:
        self._watch.data(self.clock.seconds(), had_newline, pending)

    def command_received(self) -> None:
        self._watch.command(self.clock.seconds())

    def stalled(self, seconds: float) -> None:
        self._watch.shift(seconds)

    def listening(self) -> bool:
        """Whether the client asked for something that keeps coming (streams it
        replicates): it may then stay silent, exempt from the idle timeout."""
        return len(self.subscriptions) > 0

    def check_limits(self, now: float) -> bool:
        if self.paused:
            return False  # a client that does not read is max_pause's business
        timeout = self._watch.check(now, self.authenticated, len(self._buffer), self.listening())
        if timeout is None:
            return False
        reason, message = timeout
        LIMIT_STATS.closed[reason] += 1
        self.close_with_error(message)
        return True

    def send(self, command: Command) -> None:
        if self.paused and self._reply_overflows(len(command.encode())):
            return
        super().send(command)

    def send_lines(self, name: str, data: bytes, count: int) -> None:
        """``count`` encoded ``name`` lines in one write (the timeline's answers and leases)."""
        if self.paused and self._reply_overflows(len(data)):
            return
        PROTOCOL_STATS.sent[name] += count
        self.write(data)

    def _reply_overflows(self, size: int) -> bool:
        if not self._closing and not self._replies_overflowed:
            # The client does not read: replies wait in memory. Bounded.
            self._queued_while_paused += size
            if self._queued_while_paused > self.limits.max_queued_bytes:
                LIMIT_STATS.closed["queued_bytes"] += 1
                self._replies_overflowed = True  # the ERROR below is the last reply
                self.close_with_error(
                    f"client does not read: more than {self.limits.max_queued_bytes} bytes of replies queued"
                )
                return True
        return False

    def relay(self, data: bytes) -> bool:
        """Write a relayed line (REMOTE_SERVER_UP); dropped for a client that does not read."""
        if self._closing or self.transport is None:
            return False
        if self.paused:
            LIMIT_STATS.relays_dropped += 1
            return False
        self.write(data)
        return True

    # -- commands from the client -------------------------------------------

    def _allowed(self, name: str) -> bool:
        if self.authenticated:
            return True
        self.close_with_error(f"authentication required: send AUTH <secret> before {name}")
        return False

    def on_AUTH(self, command: AuthCommand) -> None:
        if self.master.config.secret is None or hmac.compare_digest(
            command.secret.encode(), self.master.config.secret.encode()
        ):
            self.authenticated = True
        else:
            self.close_with_error("authentication failed: wrong secret")

    def on_PING(self, command: PingCommand) -> None:
        # A PING proves liveness even before AUTH, so it needs no check.
        super().on_PING(command)

    def on_NAME(self, command: NameCommand) -> None:
        if self._allowed("NAME"):
            problem = too_long(self.limits, client_name=command.client_name)
            if problem is not None:
                LIMIT_STATS.rejected["name_bytes"] += 1
                self.send_error(f"NAME refused: {problem}")
                return
            # A new NAME replaces the old one (it is never prepended).
            self.client_name = command.client_name
            self.conn_name = f"{command.client_name}@{self.peer_address}"
            self.peer_log(logging.INFO, "named itself", log=logger)

    def on_OPTIONS(self, command: OptionsCommand) -> None:
        if self._allowed("OPTIONS"):
            # Options add up; none can be switched off again. The answer names
            # what was accepted (unknown options are not acknowledged); it goes
            # out before the answer to any later command.
            accepted = command.accepted()
            if "ts" in accepted.options:
                self.subscriptions.use_ts()
            self.announce_live = self.announce_live or "live" in accepted.options
            if TICK_OPTION in accepted.options:
                self.subscriptions.use_ticks()
            self.send(accepted)

    def on_REPLICATE(self, command: ReplicateCommand) -> None:
        if not self._allowed("REPLICATE"):
            return
        if self._replicate_waits:
            # An earlier REPLICATE still waits (for the master to follow the
            # store, or for a look by time): this one is answered after it, so
            # answers keep the order of requests.
            if len(self._replicates_behind) >= MAX_WAITING_REPLICATES:
                self.send_error(f"more than {MAX_WAITING_REPLICATES} REPLICATE commands waiting; this one is ignored")
                return
            self._replicates_behind.append(command)
            return
        self._answer_replicates(command)

    def _answer_replicates(self, command: ReplicateCommand | None) -> None:
        """Answer ``command``, then those queued behind it, until one has to wait."""
        self._answering = True  # an answer that fires at once must not recurse into the queue
        try:
            while command is not None:
                started = self._start_replicate(command)
                if started is not None:
                    self._replicate_waits = True
                    started.addBoth(self._replicate_answered)
                    if self._replicate_waits:
                        return  # its answer goes on with the queue
                command = self._next_replicate()
        finally:
            self._answering = False

    def _replicate_answered(self, _: object) -> None:
        self._replicate_waits = False
        if self._answering:
            return
        self._answer_replicates(self._next_replicate())
        if self.read_closed and not self.closing:
            self.finish_after_half_close()

    def _next_replicate(self) -> ReplicateCommand | None:
        if self.closing or not self._replicates_behind:
            return None
        return self._replicates_behind.popleft()

    def _start_replicate(self, command: ReplicateCommand) -> defer.Deferred[Any] | None:
        """Answer ``command``; a Deferred when the answer waits (fires once it is sent), else None."""
        if command.since_ms is not None:
            return replicate_at(self, command)  # start at a time (replication.timeticks)
        master = self.master
        stream, token = command.stream, command.token
        if (
            stream is not None
            and token is not None
            and (not master.has_stream(stream) or token > master.live_token(stream))
        ):
            # The stream or the rows may be committed but not yet followed by
            # the master: look at the store once more before refusing.
            self._pending_replicates += 1
            return master.followed().addBoth(self._replicate_after_follow, command)
        self._replicate(command)
        return None

    def _replicate_after_follow(self, _: object, command: ReplicateCommand) -> None:
        self._pending_replicates -= 1
        if self.closing:
            return
        self._replicate(command)
        if self.read_closed:
            self.finish_after_half_close()

    def _replicate(self, command: ReplicateCommand) -> None:
        master = self.master
        if command.stream is None:
            for stream in master.stream_names():
                head = master.live_token(stream)
                self.send(PositionCommand(stream, master.config.instance_name, head, head))
                self.subscriptions.start(stream, head)
            return
        stream, token = command.stream, command.token
        assert token is not None
        if not master.has_stream(stream):
            self.send_error(f"unknown stream {stream!r} (streams: {', '.join(master.stream_names())})")
            return
        head = master.live_token(stream)
        if token > head:
            self.send_error(f"token {token} is above the head {head} of stream {stream!r}")
            return
        self.send(PositionCommand(stream, master.config.instance_name, token, token))
        self.subscriptions.start(stream, token, announce_live=self.announce_live)

    def on_USER_SYNC(self, command: UserSyncCommand) -> None:
        if self._allowed("USER_SYNC"):
            self.master.client_commands.user_sync(self, command)

    def on_CLEAR_USER_SYNC(self, command: ClearUserSyncCommand) -> None:
        if self._allowed("CLEAR_USER_SYNC"):
            self.master.client_commands.clear_user_sync(self, command)

    def on_FEDERATION_ACK(self, command: FederationAckCommand) -> None:
        if self._allowed("FEDERATION_ACK"):
            self.master.client_commands.federation_ack(self, command)

    def on_REMOVE_PUSHER(self, command: RemovePusherCommand) -> None:
        if self._allowed("REMOVE_PUSHER"):
            self.master.client_commands.remove_pusher(self, command)

    def on_REMOTE_SERVER_UP(self, command: RemoteServerUpCommand) -> None:
        if self._allowed("REMOTE_SERVER_UP"):
            self.master.client_commands.remote_server_up(self, command)

    # -- the timeline (replication.timeline does the work) ------------------------------

    def _timeline(self, command: Command) -> None:
        if self._allowed(command.NAME):
            self.master.timeline.command(self, command)

    def on_TIMELINE(self, command: TimelineCommand) -> None:
        self._timeline(command)

    def on_EXTEND(self, command: ExtendCommand) -> None:
        self._timeline(command)

    def on_RELEASE(self, command: ReleaseCommand) -> None:
        self._timeline(command)

    def on_DELETE(self, command: DeleteCommand) -> None:
        self._timeline(command)

    def on_SCHEDULE(self, command: ScheduleCommand) -> None:
        self._timeline(command)

    def on_MOVE(self, command: MoveCommand) -> None:
        self._timeline(command)

    def on_CANCEL(self, command: CancelCommand) -> None:
        self._timeline(command)

    # -- what the subscriptions ask (Outlet) ------------------------------------------------

    def went_live(self, stream: str) -> None:
        if self.read_closed:
            self.finish_after_half_close()

    # -- IPushProducer -----------------------------------------------------------

    def pauseProducing(self) -> None:
        if self.subscriptions.paused:
            return
        self.subscriptions.pause()
        self._queued_while_paused = 0
        self._pause_timer = self.clock.callLater(self.config.max_pause, self._paused_too_long)

    def resumeProducing(self) -> None:
        if not self.subscriptions.paused:
            return
        if self._pause_timer is not None and self._pause_timer.active():
            self._pause_timer.cancel()
        self.subscriptions.resume()
        self.master.timeline.resumed(self)

    def stopProducing(self) -> None:
        self._closing = True

    def _paused_too_long(self) -> None:
        self.close_with_error(f"client stopped reading: paused for more than {self.config.max_pause:g} s")


# A TLS record of type handshake (22), version 3.x: how every TLS connection starts.
_TLS_HANDSHAKE = b"\x16\x03"
# REPLICATEs a connection may have waiting behind one that waits for the
# database (each is a few hundred bytes of closure): more are refused.
MAX_WAITING_REPLICATES = 1000


def _is_tls_error(reason: Failure) -> bool:
    """Whether a connection was lost to TLS (a handshake refused, a plaintext peer)."""
    try:
        from OpenSSL import SSL
    except ImportError:
        return False
    return reason.check(SSL.Error) is not None
