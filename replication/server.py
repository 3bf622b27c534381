"""The master's side of a connection: handshake, REPLICATE, replay and flow control.

Each connection holds one :class:`Subscription` per stream it replicates.
A subscription is either *catching up* (its own cursor reads rows from
storage, one chunk at a time, paced by the client: nothing is read while the
transport is paused) or *live* (it receives the master's fan-out, the same
bytes for every connection). A live subscription whose transport pauses
drops back to catching up from its last sent token, so a slow client never
makes the master buffer rows for it.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, ClassVar

from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from zope.interface import implementer

from replication.commands import (
    CLIENT_COMMANDS,
    AuthCommand,
    CancelCommand,
    ClearUserSyncCommand,
    Command,
    DeleteCommand,
    ExtendCommand,
    FederationAckCommand,
    MoveCommand,
    NameCommand,
    OptionsCommand,
    PingCommand,
    PositionCommand,
    ReleaseCommand,
    RemoteServerUpCommand,
    RemovePusherCommand,
    ReplicateCommand,
    ScheduleCommand,
    ServerCommand,
    TimelineCommand,
    UserSyncCommand,
)
from replication.protocol import LineCommandProtocol, ProtocolConfig
from replication.reactor_types import Clock
from replication.stats import STATS

if TYPE_CHECKING:
    from replication.master import Master

logger = logging.getLogger(__name__)


class Subscription:
    """One stream on one connection."""

    __slots__ = ("announce_live", "generation", "live", "reading", "sent_token", "stream")

    def __init__(self, stream: str, sent_token: int, announce_live: bool = False) -> None:
        self.stream = stream
        self.sent_token = sent_token  # every row up to here has been written
        self.live = False
        # A replay ends with POSITION <head> <head> when it first goes live, so
        # the client knows it has caught up.
        self.announce_live = announce_live
        self.reading = False
        self.generation = 0  # bumped when a new REPLICATE restarts the stream


@implementer(IPushProducer)
class ServerProtocol(LineCommandProtocol):
    INBOUND: ClassVar[frozenset[str]] = CLIENT_COMMANDS
    SIDE: ClassVar[str] = "server"

    def __init__(self, master: Master, config: ProtocolConfig, clock: Clock) -> None:
        super().__init__(config, clock)
        self.master = master
        self.client_name: str | None = None
        self.with_ts = False
        self.announce_live = False  # OPTIONS live
        self.authenticated = master.config.secret is None
        self.subscriptions: dict[str, Subscription] = {}
        self.paused = False
        self._pause_timer = None
        self._pending_replicates = 0  # REPLICATEs waiting for the master to follow the store
        self._half_close_synced = False

    # -- lifecycle -------------------------------------------------------------

    def connectionMade(self) -> None:
        super().connectionMade()
        assert self.transport is not None
        self.transport.registerProducer(self, True)
        self.master.connection_made(self)
        self.send(ServerCommand(self.master.config.server_name))
        self.send_ping()

    def connectionLost(self, reason: Failure | None = None) -> None:
        super().connectionLost(reason)
        if self._pause_timer is not None and self._pause_timer.active():
            self._pause_timer.cancel()
        for sub in self.subscriptions.values():
            sub.generation += 1
        self.master.connection_lost(self)
        self.master.timeline.connection_lost(self)
        self.subscriptions.clear()

    def finish_after_half_close(self) -> None:
        # Finish replays owed to a half-closed peer (nc -q1), then close.
        if self.master.timeline.busy(self):
            return  # timeline answers still owed; the service calls again
        if self._pending_replicates or not all(sub.live for sub in self.subscriptions.values()):
            return
        if self.subscriptions and not self._half_close_synced:
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
        return self.client_name or self.conn_name

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
            self.client_name = command.client_name
            self.conn_name = f"{command.client_name}@{self.conn_name}"
            logger.info("[%s] named itself", self.conn_name)

    def on_OPTIONS(self, command: OptionsCommand) -> None:
        if self._allowed("OPTIONS"):
            # Options add up; none can be switched off again.
            self.with_ts = self.with_ts or "ts" in command.options
            self.announce_live = self.announce_live or "live" in command.options

    def on_REPLICATE(self, command: ReplicateCommand) -> None:
        if not self._allowed("REPLICATE"):
            return
        master = self.master
        stream, token = command.stream, command.token
        if self._pending_replicates or (
            stream is not None
            and token is not None
            and (not master.has_stream(stream) or token > master.live_token(stream))
        ):
            # The stream or the rows may be committed but not yet followed by
            # the master: look at the store once more before refusing. Later
            # REPLICATEs wait their turn, so answers keep the order of requests.
            self._pending_replicates += 1
            master.followed().addBoth(self._replicate_after_follow, command)
            return
        self._replicate(command)

    def _replicate_after_follow(self, _: object, command: ReplicateCommand) -> None:
        self._pending_replicates -= 1
        if self._closing:
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
                self._start(stream, head)
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
        self._start(stream, token, announce_live=self.announce_live)

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

    # -- streaming -----------------------------------------------------------------

    def _start(self, stream: str, token: int, announce_live: bool = False) -> None:
        old = self.subscriptions.get(stream)
        if old is not None:
            old.generation += 1
            self.master.unsubscribe_live(self, old)
        sub = Subscription(stream, token, announce_live)
        if old is not None:
            sub.generation = old.generation + 1
        self.subscriptions[stream] = sub
        self.pump(sub)

    def pump(self, sub: Subscription) -> None:
        """Move a catching-up subscription on: read the next chunk, or go live."""
        if sub.live or sub.reading or self.paused or self._closing:
            return
        head = self.master.live_token(sub.stream)
        if sub.sent_token >= head:
            sub.live = True
            self.master.subscribe_live(self, sub)
            if sub.announce_live:
                sub.announce_live = False
                self.send(PositionCommand(sub.stream, self.master.config.instance_name, head, head))
            if self.read_closed:
                self.finish_after_half_close()
            return
        sub.reading = True
        generation = sub.generation
        d = self.master.read_encoded(sub.stream, sub.sent_token, head, self.config.catchup_rows, self.with_ts)

        def got(result: tuple[bytes, int, int]) -> None:
            data, last_token, count = result
            if generation != sub.generation or self.subscriptions.get(sub.stream) is not sub:
                return
            sub.reading = False
            if data:
                STATS.sent["RDATA"] += count
                self.write(data)
                self.master.metrics_catchup_rows(count)
            if data:
                sub.sent_token = last_token
            else:
                # No rows in (sent, head]: every token up to the live head has
                # committed (or never will), so the client may move there.
                self.send(PositionCommand(sub.stream, self.master.config.instance_name, sub.sent_token, head))
                sub.sent_token = head
            self.pump(sub)

        def failed(failure: Failure) -> None:
            if generation != sub.generation:
                return
            sub.reading = False
            logger.error("[%s] reading %s for replay failed: %s", self.conn_name, sub.stream, failure.getErrorMessage())
            self.close_with_error(f"internal error reading stream {sub.stream!r}; reconnect to resume")

        d.addCallbacks(got, failed)

    def send_live(
        self, sub: Subscription, data: bytes, last_token: int, command: str = "RDATA", count: int = 1
    ) -> None:
        """Called by the master's fan-out with ``count`` lines just after ``sub.sent_token``."""
        if self.paused:
            # Don't buffer for a client that is not reading: it catches up later.
            sub.live = False
            self.master.unsubscribe_live(self, sub)
            return
        STATS.sent[command] += count
        self.write(data)
        sub.sent_token = last_token

    # -- IPushProducer -----------------------------------------------------------

    def pauseProducing(self) -> None:
        if self.paused:
            return
        self.paused = True
        self._pause_timer = self.clock.callLater(self.config.max_pause, self._paused_too_long)

    def resumeProducing(self) -> None:
        if not self.paused:
            return
        self.paused = False
        if self._pause_timer is not None and self._pause_timer.active():
            self._pause_timer.cancel()
        for sub in list(self.subscriptions.values()):
            self.pump(sub)
        self.master.timeline.resumed(self)

    def stopProducing(self) -> None:
        self._closing = True

    def _paused_too_long(self) -> None:
        self.close_with_error(f"client stopped reading: paused for more than {self.config.max_pause:g} s")
