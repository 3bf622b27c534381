"""The consumer's side of a timeline connection: ``TIMELINE`` on connect, then LEASE / ACK / NACK.

The protocol only speaks the wire; what to do with a lease is the
:class:`TimelineClientHandler`'s business (``workers.timeline``).
"""

from __future__ import annotations

import logging
from typing import ClassVar, Protocol

from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure

from replication.commands import (
    SERVER_COMMANDS,
    AuthCommand,
    Command,
    ErrorCommand,
    NameCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ServerCommand,
)
from replication.protocol import LineCommandProtocol
from replication.reactor_types import Clock
from replication.settings import ProtocolConfig
from replication.timeline_commands import (
    AckCommand,
    LeaseCommand,
    NackCommand,
    TimelineCommand,
)

logger = logging.getLogger(__name__)


class TimelineClientHandler(Protocol):
    def connected(self, client: TimelineClientProtocol) -> None: ...

    def disconnected(self, client: TimelineClientProtocol, reason: Failure) -> None: ...

    def on_lease(self, client: TimelineClientProtocol, command: LeaseCommand) -> None: ...

    def on_answer(self, client: TimelineClientProtocol, command: AckCommand | NackCommand) -> None: ...

    def on_error(self, client: TimelineClientProtocol, message: str) -> None: ...


class TimelineClientProtocol(LineCommandProtocol):
    INBOUND: ClassVar[frozenset[str]] = SERVER_COMMANDS
    SIDE: ClassVar[str] = "client"

    def __init__(
        self,
        handler: TimelineClientHandler,
        client_name: str,
        subscribe: TimelineCommand,
        config: ProtocolConfig,
        clock: Clock,
        secret: str | None = None,
    ) -> None:
        super().__init__(config, clock)
        self.handler = handler
        self.client_name = client_name
        self.subscribe = subscribe
        self.secret = secret

    def connectionMade(self) -> None:
        super().connectionMade()
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)  # small lines back and forth: no Nagle delay
        self.conn_name = f"{self.client_name}->{self.conn_name}"
        if self.secret is not None:
            self.send(AuthCommand(self.secret))
        self.send(NameCommand(self.client_name))
        self.send_ping()
        self.send(self.subscribe)
        self.handler.connected(self)

    def connectionLost(self, reason: Failure | None = None) -> None:
        super().connectionLost(reason)
        self.handler.disconnected(self, reason or Failure(ConnectionDone()))

    def command(self, command: Command) -> None:
        self.send(command)

    def on_SERVER(self, command: ServerCommand) -> None:
        logger.debug("[%s] master %s", self.conn_name, command.server_name)

    def on_LEASE(self, command: LeaseCommand) -> None:
        self.handler.on_lease(self, command)

    def on_ACK(self, command: AckCommand) -> None:
        self.handler.on_answer(self, command)

    def on_NACK(self, command: NackCommand) -> None:
        self.handler.on_answer(self, command)

    def on_ERROR(self, command: ErrorCommand) -> None:
        super().on_ERROR(command)
        self.handler.on_error(self, command.message)

    # Stream commands never come to a connection that did not ask for them.
    def on_POSITION(self, command: PositionCommand) -> None:
        pass

    def on_RDATA(self, command: RdataCommand) -> None:
        pass

    def on_REMOTE_SERVER_UP(self, command: RemoteServerUpCommand) -> None:
        pass
