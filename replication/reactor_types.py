"""What tickline needs from Twisted's reactor and transports, as ``typing.Protocol``s.

Twisted declares these as ``zope.interface`` interfaces, which type checkers
read as functions without ``self``. These structural types say the same thing
in a form mypy checks; a real reactor, ``twisted.internet.task.Clock`` and a
TCP transport all satisfy them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast


class DelayedCall(Protocol):
    def active(self) -> bool: ...

    def cancel(self) -> None: ...


class Clock(Protocol):
    """A source of time and timers (the reactor, or ``task.Clock`` in tests)."""

    def seconds(self) -> float: ...

    def callLater(self, delay: float, callable: Callable[..., Any], /, *args: Any, **kw: Any) -> Any: ...


class Address(Protocol):
    host: str
    port: int


class Transport(Protocol):
    """The parts of a TCP transport the protocols use."""

    def write(self, data: bytes, /) -> None: ...

    def loseConnection(self) -> None: ...

    def abortConnection(self) -> None: ...

    def getPeer(self) -> Any: ...

    def getHost(self) -> Any: ...

    def registerProducer(self, producer: Any, streaming: bool, /) -> None: ...

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...


class Reactor(Clock, Protocol):
    """The reactor as the master and workers use it (Twisted's global reactor satisfies it)."""

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any: ...

    def connectTCP(self, host: str, port: int, factory: Any, timeout: float = 30, bindAddress: Any = None) -> Any: ...

    def addReader(self, reader: Any) -> None: ...

    def removeReader(self, reader: Any) -> None: ...

    def addWriter(self, writer: Any) -> None: ...

    def removeWriter(self, writer: Any) -> None: ...

    def addSystemEventTrigger(self, phase: str, eventType: str, callable: Callable[..., Any], *args: Any) -> Any: ...


class RunningReactor(Reactor, Protocol):
    """The global reactor as a command's main loop uses it."""

    running: bool

    def run(self) -> None: ...

    def stop(self) -> None: ...


def global_reactor() -> RunningReactor:
    """Twisted's installed global reactor, typed (importing it installs the default one if none is)."""
    from twisted.internet import reactor

    return cast(RunningReactor, reactor)


def transport_of(protocol: Any) -> Transport:
    """A connected protocol's transport, typed (Twisted declares it ``ITransport | None``)."""
    transport = protocol.transport
    assert transport is not None, "the protocol is not connected"
    return cast(Transport, transport)
