"""The line protocol both sides share: framing, parsing, keepalive, bad input.

Framing is ``\\n``-terminated UTF-8 lines (``\\r\\n`` accepted, blank lines
ignored) up to a maximum length. Each line is parsed into a command (see
``replication.commands``) and dispatched to ``on_<NAME>``. Bad input is
answered with ``ERROR <what was wrong>``; an over-long line closes the
connection, since its framing can no longer be trusted.

Keepalive: both sides send ``PING`` on connect and every ``ping_interval``
seconds; a peer silent for ``ping_timeout`` seconds is dropped, but only after
its first ``PING``, so a person typing into netcat is never cut off.

Half-close: when the peer shuts down its sending side (``nc -q1``), the
protocol finishes what it owes and then closes (``IHalfCloseableProtocol``).
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
from collections.abc import Callable
from typing import Any, ClassVar, cast

from twisted.internet import task
from twisted.internet.interfaces import IHalfCloseableProtocol, ITCPTransport
from twisted.internet.protocol import Protocol
from twisted.internet.tcp import Connection
from twisted.python.failure import Failure
from zope.interface import implementer

from replication.commands import (
    Command,
    ErrorCommand,
    MalformedCommand,
    PingCommand,
    UnknownCommand,
    parse_line,
)
from replication.limits import LogBudget
from replication.reactor_types import Clock, DelayedCall, Transport
from replication.settings import LimitsConfig, ProtocolConfig
from replication.stats import STATS, ConnectionStats

logger = logging.getLogger(__name__)
# Longest ERROR message we send: peer text echoed in it is cut (replies are bounded).
MAX_ERROR_CHARS = 512
_TCP_INFO_RTT = struct.Struct("I")  # tcpi_rtt: microseconds, at offset 68 of struct tcp_info


class SendBatch:
    """``with send_batch:`` what is written to connections inside goes out once per connection when it ends.

    The master opens one around a database notification's fan-out, around
    the sending of commits held during a pass, and over each synchronous
    stretch of a pass (``master._Stretches``): a commit's ``RDATA`` and its
    ``TICK`` to a connection become one ``send()``, made there and then
    (:func:`send_now`) instead of on the reactor's next turn. A connection's
    held bytes go out at once when they reach ``HELD_BYTES`` (the size at
    which Twisted pauses a producer), so a connection that does not read is
    paused after the same one write as without a batch. Reactor thread only;
    nested batches end with the outermost. Order per connection is kept: its
    lines go out in the order written, after anything it had queued before.
    (A class, not a ``contextmanager`` generator: it runs once per commit.)
    """

    def __init__(self) -> None:
        self.depth = 0
        self.held: list[LineCommandProtocol] = []  # connections written to meanwhile

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if not self.depth and self.held:
            held, self.held = self.held, []
            error: Exception | None = None
            for proto in held:
                # Every connection's bytes go out even if one's send fails: the rest are no longer
                # in self.held, and what they hold would otherwise never be sent.
                try:
                    proto.flush_held()
                except Exception as e:
                    error = error or e
            if error is not None:
                raise error


send_batch = SendBatch()


# A connection's bytes held in a batch go out once they reach this (Twisted's FileDescriptor.bufferSize,
# past which it pauses the connection's producer): flow control sees them as without a batch.
HELD_BYTES = 1 << 16
# At most this many pieces go to one sendmsg (the kernel's IOV_MAX is 1024); more are joined first.
MAX_SEND_PIECES = 256


def send_now(transport: Transport, pieces: list[bytes]) -> None:
    """``transport.writeSequence(pieces)``, sent in this call when nothing of the connection is queued.

    Twisted's ``write`` queues the bytes, registers the descriptor for
    writing and sends on the reactor's next turn (two ``epoll_ctl``, an
    ``epoll_wait`` and a dispatch). On a plain TCP connection with nothing
    queued (the usual case for a live subscription) this sends at once, the
    pieces as they are in one ``sendmsg`` (no join: a 1000-row commit's
    150 KB of ``RDATA`` is not copied once more, nor cut at Twisted's
    ``SEND_LIMIT`` of 128 KiB, which left its tail to the next turn); what
    the kernel does not take, or a connection that is closing, TLS or
    anything else goes through ``writeSequence`` as before, so flow control
    (the producer paused on a full buffer) and loss detection are Twisted's
    (an error of the send is left for Twisted's own write to find).
    """
    t: Any = transport
    if (
        isinstance(t, Connection)
        and not t.TLS
        and t.connected
        and not t.disconnecting
        and not t._writeDisconnecting
        and not t.dataBuffer
        and not t._tempDataBuffer
    ):
        if len(pieces) > MAX_SEND_PIECES:
            pieces = [b"".join(pieces)]
        try:
            sent = t.socket.sendmsg(pieces)
        except OSError:
            sent = 0  # EWOULDBLOCK, ENOBUFS: all of it queued; a lost connection: Twisted's write finds it
        if sent > 0:
            pieces = _unsent(pieces, sent)
            if not pieces:
                return
    t.writeSequence(pieces)


def _unsent(pieces: list[bytes], sent: int) -> list[bytes]:
    """What is left of ``pieces`` once their first ``sent`` bytes went out."""
    for i, piece in enumerate(pieces):
        if sent < len(piece):
            return [piece[sent:], *pieces[i + 1 :]]
        sent -= len(piece)
    return []


@implementer(IHalfCloseableProtocol)
class LineCommandProtocol(Protocol):
    """Base of the server and client protocols."""

    transport: Transport | None  # type: ignore[assignment]

    # Commands the peer may send us, by name.
    INBOUND: ClassVar[frozenset[str]]
    # Who we are in log lines.
    SIDE: ClassVar[str] = "peer"

    def __init__(self, config: ProtocolConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.conn_name = "?"
        self.peer_address = "?"  # host:port of the peer
        # Log lines about this peer are rate-limited (the server shares a budget over all peers).
        self.log_budget = LogBudget(clock, LimitsConfig().log_lines_per_second, None)
        self._buffer = b""
        self._closing = False
        self._peer_pinged = False
        self._last_received = 0.0
        self._last_sent = 0.0
        self._keepalive: task.LoopingCall | None = None
        self._tick = 1.0
        self._last_tick = 0.0  # when the keepalive last ran (a late run means we stood still)
        self._abort_call: DelayedCall | None = None
        self.read_closed = False
        self.close_reason: str | None = None  # why this side closed with ERROR, if it did
        self.rtt_ms: float | None = None  # kernel's smoothed TCP round trip
        self.clock_offset_ms: float | None = None  # peer's clock minus ours, from its PINGs
        self.bytes_sent = 0  # on this connection
        self.bytes_received = 0
        self._held: list[bytes] | None = None  # written inside send_batch, not yet sent
        self._held_bytes = 0  # their length

    @property
    def closing(self) -> bool:
        """Closing or closed: nothing more is read or produced."""
        return self._closing

    @property
    def paused(self) -> bool:
        """The peer is not reading what we send (flow control); see the server."""
        return False

    @property
    def display_name(self) -> str:
        return self.conn_name

    def stats(self) -> ConnectionStats:
        return ConnectionStats(
            name=self.display_name,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            unsent_bytes=kernel_unsent_bytes(self.transport),
            paused=self.paused,
            rtt_ms=self.rtt_ms,
            clock_offset_ms=self.clock_offset_ms,
            address=self.peer_address,
        )

    # -- connection lifecycle --------------------------------------------------

    def connectionMade(self) -> None:
        assert self.transport is not None
        if ITCPTransport.providedBy(self.transport):
            # Lines are small and sent as they come: no Nagle delay (with the
            # peer's delayed ACK it held RDATA and PING back by tens of ms).
            cast(Any, self.transport).setTcpNoDelay(True)
        peer = self.transport.getPeer()
        self.peer_address = f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}"
        self.conn_name = self.peer_address
        now = self.clock.seconds()
        self._last_received = now
        self._keepalive = task.LoopingCall(self._keepalive_tick)
        self._keepalive.clock = self.clock  # type: ignore[assignment]
        tick = min(self.config.ping_interval, self.config.ping_timeout) / 5
        self._tick = max(tick, 0.01)
        self._last_tick = now
        self._keepalive.start(self._tick, now=False)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._closing = True
        self._held = None
        if self._keepalive is not None and self._keepalive.running:
            self._keepalive.stop()
        if self._abort_call is not None and self._abort_call.active():
            self._abort_call.cancel()
        self.log_budget.flush(logger, self.conn_name)

    def peer_log(
        self, level: int, message: str, *args: object, log: logging.Logger = logger, force: bool = False
    ) -> None:
        """Log a line about this peer: rate-limited, every argument escaped (peer text is safe)."""
        self.log_budget.log(log, level, self.conn_name, message, *args, force=force)

    def readConnectionLost(self) -> None:
        """The peer will send no more; finish what we owe, then close."""
        self.read_closed = True
        if self._buffer.strip():
            # A last line without its newline still counts, as for a person's nc.
            line, self._buffer = self._buffer, b""
            self._handle_line(line)
        self.finish_after_half_close()

    def writeConnectionLost(self) -> None:
        self.close()

    def finish_after_half_close(self) -> None:
        """Subclasses with work in flight delay this; by default close now."""
        self.close()

    # -- sending -------------------------------------------------------------

    def send(self, command: Command) -> None:
        STATS.sent[command.NAME] += 1
        self.write(command.encode())

    def write(self, data: bytes) -> None:
        if self.transport is None:
            return
        self._last_sent = self.clock.seconds()
        STATS.bytes_sent += len(data)
        self.bytes_sent += len(data)
        if send_batch.depth:
            if self._held is None:
                self._held = [data]
                self._held_bytes = len(data)
                send_batch.held.append(self)
            else:
                self._held.append(data)
                self._held_bytes += len(data)
            if self._held_bytes >= HELD_BYTES:
                self.flush_held()  # now, so that a connection that does not read is paused now
            return
        self.transport.write(data)

    def flush_held(self) -> None:
        """Send what was written inside ``send_batch`` (one ``send`` when nothing is queued)."""
        held, self._held = self._held, None
        if held and self.transport is not None:
            send_now(self.transport, held)

    def send_ping(self) -> None:
        self.send(PingCommand(int(self.clock.seconds() * 1000)))

    def close(self) -> None:
        """Close after what is queued has been written."""
        if self.transport is None:
            return
        self.flush_held()  # what a batch holds goes before the close
        self._closing = True
        self.transport.loseConnection()
        if self._abort_call is None:
            self._abort_call = self.clock.callLater(self.config.close_grace, self._abort)

    def close_with_error(self, message: str) -> None:
        """Tell the peer what was wrong, then close."""
        if not self._closing:
            self.close_reason = message
            self.log_closing(message)
            self.send(ErrorCommand(_cut(message)))
        self.close()

    def log_closing(self, message: str) -> None:
        self.peer_log(logging.WARNING, "closing: %s", message, force=True)

    def _abort(self) -> None:
        # A peer that does not read never lets loseConnection finish.
        if self.transport is not None:
            self.transport.abortConnection()

    # -- receiving -----------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return
        self._last_received = self.clock.seconds()
        STATS.bytes_received += len(data)
        self.bytes_received += len(data)
        buffer = self._buffer + data if self._buffer else data
        end = buffer.rfind(b"\n") + 1
        if end:
            self._buffer = buffer[end:]
            self.input_progress(True, len(self._buffer))
            self._lines_received(buffer[:end] if end < len(buffer) else buffer)
            if self._closing:
                return
        else:
            self._buffer = buffer
            self.input_progress(False, len(self._buffer))
        if len(self._buffer) > self.config.max_line_bytes + 1:
            self._line_too_long(len(self._buffer))

    def _lines_received(self, block: bytes) -> None:
        """Whole lines, each ending with ``\\n``: checked and handled one by one."""
        lines = block.split(b"\n")
        lines.pop()
        limit = self.config.max_line_bytes
        for line in lines:
            if self._closing:
                return
            if len(line) > limit + 1 or (len(line) == limit + 1 and not line.endswith(b"\r")):
                self._line_too_long(len(line))
                return
            self._handle_line(line)

    def input_progress(self, had_newline: bool, pending: int) -> None:
        """Hook: bytes arrived (``had_newline`` if a line ended; ``pending`` bytes of a line wait)."""

    def command_received(self) -> None:
        """Hook: a line parsed as a command the peer may send."""

    def check_limits(self, now: float) -> bool:
        """Hook run every keepalive tick; True if it closed the connection."""
        return False

    def stalled(self, seconds: float) -> None:
        """Hook: this process could not run for ``seconds`` (timeouts should not count them)."""

    def _line_too_long(self, length: int) -> None:
        self._buffer = b""
        self.close_with_error(
            f"line too long: {length} bytes without a newline, the limit is {self.config.max_line_bytes}"
        )

    def _handle_line(self, raw: bytes) -> None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.send_error(f"invalid UTF-8 at byte {e.start} of the line")
            return
        line = text.strip()
        if not line:
            return
        try:
            command = parse_line(line)
        except (UnknownCommand, MalformedCommand) as e:
            self.send_error(str(e))
            return
        if command.NAME not in self.INBOUND:
            self.send_error(f"{command.NAME} may not be sent by the {self.peer_side}")
            return
        STATS.received[command.NAME] += 1
        self.command_received()
        handler: Callable[[Command], None] = getattr(self, f"on_{command.NAME}")
        handler(command)

    @property
    def peer_side(self) -> str:
        return "client" if self.SIDE == "server" else "server"

    def send_error(self, message: str) -> None:
        """Answer bad input; the connection stays open."""
        self.peer_log(logging.INFO, "bad input: %s", message)
        self.send(ErrorCommand(_cut(message)))

    # -- keepalive -------------------------------------------------------------

    def _keepalive_tick(self) -> None:
        if self._closing:
            return
        now = self.clock.seconds()
        stalled = now - self._last_tick
        self._last_tick = now
        if stalled > 2 * self._tick:
            # This process stood still (a blocked reactor, a stopped process):
            # what the peer sent meanwhile waits unread in the socket, so the
            # time we could not read is not the peer's silence.
            self._last_received += stalled
            self.stalled(stalled)
        self.log_budget.tick(logger, self.conn_name)
        if self.check_limits(now):
            return
        if self._peer_pinged and now - self._last_received >= self.config.ping_timeout:
            self.close_with_error(f"ping timeout: nothing received for {self.config.ping_timeout:g} s")
            return
        # Ping now if waiting for the next tick would leave more than
        # ping_interval without a command.
        if now + self._tick - self._last_sent > self.config.ping_interval + 1e-6:
            self.send_ping()

    def on_PING(self, command: PingCommand) -> None:
        self._peer_pinged = True
        self.rtt_ms = tcp_rtt_ms(self.transport)
        # The peer's clock when the PING left, plus half the round trip, against ours now.
        now_ms = self.clock.seconds() * 1000
        self.clock_offset_ms = command.unix_ms + (self.rtt_ms or 0.0) / 2 - now_ms

    def on_ERROR(self, command: ErrorCommand) -> None:
        self.peer_log(logging.WARNING, "%s sent ERROR %s", self.peer_side, command.message)


def _cut(message: str) -> str:
    """An ERROR message of bounded length (it may echo what the peer sent)."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    return message[:MAX_ERROR_CHARS] + f"...({len(message) - MAX_ERROR_CHARS} more chars)"


def kernel_unsent_bytes(transport: object) -> int:
    """Bytes in a TCP socket's send queue that the peer has not acknowledged (Linux ``SIOCOUTQ``), or 0."""
    get_handle = getattr(transport, "getHandle", None)
    if get_handle is None:
        return 0
    try:
        queued = fcntl.ioctl(get_handle().fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError, TypeError):
        return 0
    return max(0, struct.unpack("i", queued)[0])


def tcp_rtt_ms(transport: object) -> float | None:
    """The kernel's smoothed round-trip time of a TCP connection (Linux), or None."""
    get_handle = getattr(transport, "getHandle", None)
    if get_handle is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = get_handle().getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError):
        return None
    if len(info) < 72:
        return None
    return _TCP_INFO_RTT.unpack_from(info, 68)[0] / 1000.0
