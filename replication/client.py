"""The client's side of a connection, as ``tail`` and workers use it.

The client sends ``NAME``, ``PING`` (and ``OPTIONS`` when it wants
extensions), then whatever ``REPLICATE`` its handler asks for. It keeps, per
stream, whether a ``POSITION`` has been seen on this connection: ``RDATA``
before that is dropped. ``batch`` rows are held until the line with the real
token arrives, then handed over together.

Options are used only once acknowledged. The master handles lines in order
and TCP keeps them in order, so its answer to ``OPTIONS`` (``OPTIONS
<accepted>...``) arrives before its answer to any later command. Until then
the options are *pending*; the first ``POSITION`` or ``RDATA`` settles them
as "none" (a seed-protocol master that ignores ``OPTIONS``), and so does an
``ERROR`` while they are pending (a seed-protocol master that does not know
the command) or one that names ``OPTIONS``: that ``ERROR`` is the answer to
``OPTIONS``, not a refusal of anything else, and is not passed on as one.
"""

from __future__ import annotations

import array
import fcntl
import logging
import termios
from typing import Any, ClassVar

from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure

from replication.commands import (
    BATCH,
    RDATA_RUN,
    SERVER_COMMANDS,
    AuthCommand,
    ErrorCommand,
    MalformedCommand,
    NameCommand,
    OptionsCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    TickCommand,
    one_rdata_run,
    parse_line,
    parse_rdata_block,
    parse_rdata_fast,
    parse_tick_fast,
)
from replication.protocol import LineCommandProtocol, ProtocolConfig
from replication.reactor_types import Clock
from replication.stats import STATS
from storage.limits import MAX_BATCH_ROWS

logger = logging.getLogger(__name__)
_BATCH = BATCH.encode("ascii")
_MUST_PARSE = (b"RDATA ", b"POSITION ")  # lines a client may not skip


def unusable_line(raw: bytes) -> str | None:
    """Why an ``RDATA`` or ``POSITION`` line cannot be used, or None if it parses."""
    try:
        parse_line(raw.decode("utf-8").strip())
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 at byte {e.start} of the line"
    except MalformedCommand as e:
        return str(e)
    return None


def bytes_waiting(transport: Any) -> int:
    """How many received bytes wait unread on ``transport``'s socket (0 if that cannot be told)."""
    try:
        handle = transport.getHandle()
        waiting = array.array("i", [0])
        fcntl.ioctl(handle.fileno(), termios.FIONREAD, waiting, True)
    except (AttributeError, OSError, ValueError):
        return 0
    return waiting[0]


class ReplicationHandler:
    """What a client does with what the master sends; override what you need."""

    def connected(self, client: ClientProtocol) -> None:
        """The handshake is sent: ask for streams with ``client.replicate(...)``."""

    def on_server(self, client: ClientProtocol, server_name: str) -> None:
        pass

    def on_options(self, client: ClientProtocol, acknowledged: frozenset[str]) -> None:
        """The options are settled: ``acknowledged`` (possibly none) are in use."""

    def on_position(self, client: ClientProtocol, command: PositionCommand) -> None:
        pass

    def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, rows: list[list[Any]]) -> None:
        """Rows of one token (one row, or a whole batch), in order.

        With the ``ts`` option acknowledged (``client.rows_have_ts``) each row
        ends with its timestamp; otherwise rows are the stream's columns only.
        """

    def on_rows_run(
        self, client: ClientProtocol, stream: str, instance: str, tokens: list[bytes], rows: list[list[Any]]
    ) -> bool:
        """A run of lines parsed as one block, one row per token (no batch); ``tokens`` as digits.

        Return True when taken here in one call; False (this default) hands
        them over as one :meth:`on_rows` per token.
        """
        return False

    def on_tick(self, client: ClientProtocol, command: TickCommand) -> None:
        """The stream's safe time (``OPTIONS tick``); only for streams positioned on this connection."""

    def read_started(self, client: ClientProtocol) -> None:
        """The lines of one read from the socket follow (then :meth:`read_ended`)."""

    def read_ended(self, client: ClientProtocol) -> None:
        """The lines of that read are handled. Whether the next read follows at once (bytes already
        wait on the socket) is ``client.more_waiting()``: asked only by a handler that needs it, a
        system call each time."""

    def on_error(self, client: ClientProtocol, message: str) -> None:
        pass

    def on_remote_server_up(self, client: ClientProtocol, server: str) -> None:
        pass

    def disconnected(self, client: ClientProtocol, reason: Failure) -> None:
        """The connection is gone; ``client.close_reason`` says why when this side closed it.

        That is the case when the server sent what the client cannot handle
        (a line over ``max_line_bytes``, a malformed ``RDATA`` or ``POSITION``,
        invalid UTF-8): the client never skips such a line, it closes.
        """


class ClientProtocol(LineCommandProtocol):
    INBOUND: ClassVar[frozenset[str]] = SERVER_COMMANDS
    SIDE: ClassVar[str] = "client"

    def __init__(
        self,
        handler: ReplicationHandler,
        client_name: str,
        config: ProtocolConfig,
        clock: Clock,
        with_ts: bool = False,
        secret: str | None = None,
        options: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(config, clock)
        self.secret = secret
        self.handler = handler
        self.client_name = client_name
        # What we ask for, and what the master acknowledged (used only then).
        self.options = frozenset(({"ts"} if with_ts else set()) | set(options))
        self.acknowledged: frozenset[str] = frozenset()
        self.options_pending = False
        self.server_name: str | None = None
        self.positioned: set[str] = set()
        self._pending_batch: dict[str, list[list[Any]]] = {}

    @property
    def rows_have_ts(self) -> bool:
        """Rows carry their timestamp as a last element (``ts`` acknowledged)."""
        return "ts" in self.acknowledged

    def uses(self, option: str) -> bool:
        """The master acknowledged ``option`` on this connection."""
        return option in self.acknowledged

    def dataReceived(self, data: bytes) -> None:
        # The handler learns where a read's lines start and end (and may ask whether more bytes
        # wait: more_waiting): a worker applies a commit's rows split over several reads as one
        # group (workers.consumer).
        self.handler.read_started(self)
        try:
            super().dataReceived(data)
        finally:
            self.handler.read_ended(self)

    def more_waiting(self) -> bool:
        """Received bytes already wait unread on the socket: the next read follows at once."""
        return bytes_waiting(self.transport) > 0

    def connectionMade(self) -> None:
        super().connectionMade()
        self.conn_name = f"{self.client_name}->{self.conn_name}"
        if self.secret is not None:
            self.send(AuthCommand(self.secret))
        self.send(NameCommand(self.client_name))
        self.send_ping()
        if self.options:
            self.options_pending = True
            self.send(OptionsCommand(self.options))
        self.handler.connected(self)

    def connectionLost(self, reason: Failure | None = None) -> None:
        super().connectionLost(reason)
        self.handler.disconnected(self, reason or Failure(ConnectionDone()))

    def replicate(self, stream: str | None = None, token: int | None = None, since_ms: int | None = None) -> None:
        """``REPLICATE`` (every stream, live from now), one stream after a token, or from a time."""
        if stream is not None:
            self.positioned.discard(stream)
            self._pending_batch.pop(stream, None)
        self.send(ReplicateCommand(stream, None if since_ms is not None else token, since_ms))

    # -- commands from the server --------------------------------------------------

    def on_SERVER(self, command: ServerCommand) -> None:
        self.server_name = command.server_name
        self.handler.on_server(self, command.server_name)

    def _settle_options(self, acknowledged: frozenset[str], why: str) -> None:
        self.options_pending = False
        self.acknowledged = acknowledged
        if acknowledged == self.options:
            logger.debug("[%s] options %s acknowledged", self.conn_name, " ".join(sorted(acknowledged)))
        else:
            logger.info(
                "[%s] %s: using options %s",
                self.conn_name,
                why,
                " ".join(sorted(acknowledged)) or "none (seed protocol)",
            )
        self.handler.on_options(self, acknowledged)

    def on_OPTIONS(self, command: OptionsCommand) -> None:
        if not self.options_pending:
            logger.info("[%s] ignored an OPTIONS answer that was not asked for", self.conn_name)
            return
        # Only what we asked for counts; a master cannot switch on more.
        self._settle_options(command.options & self.options, "the master acknowledged only some options")

    def on_POSITION(self, command: PositionCommand) -> None:
        if self.options_pending:
            self._settle_options(frozenset(), "the master answered without acknowledging OPTIONS")
        self.positioned.add(command.stream)
        self._pending_batch.pop(command.stream, None)
        self.handler.on_position(self, command)

    def _lines_received(self, block: bytes) -> None:
        # Most of what arrives is runs of RDATA lines: each run is parsed in one
        # call (see parse_rdata_block); the other lines go one by one. Most
        # often the whole block is one run of one stream: tried whole first
        # (one_rdata_run), without the run expression's pass over every byte.
        if one_rdata_run(block) and self._whole_run(block):
            return
        done = 0
        for run in RDATA_RUN.finditer(block):
            start, end = run.span()
            if start > done:
                super()._lines_received(block[done:start])
            if self._closing:
                return
            self._rdata_run(block[start:end] if start or end < len(block) else block)
            if self._closing:
                return
            done = end
        if done < len(block):
            super()._lines_received(block[done:] if done else block)

    def _whole_run(self, block: bytes) -> bool:
        """The block as one run of one stream's RDATA lines; False, nothing done, if it is not one."""
        parsed = parse_rdata_block(block, self.config.max_line_bytes)
        if parsed is None:
            return False  # taken run by run (the same parse again for a block that is one bad run: rare)
        self._parsed_run(*parsed)
        return True

    def _rdata_run(self, run: bytes) -> None:
        parsed = parse_rdata_block(run, self.config.max_line_bytes)
        if parsed is None:
            # Several streams in one run, or something in it is wrong: line by
            # line (RDATA by parse_rdata_fast), with its ERROR.
            super()._lines_received(run)
            return
        self._parsed_run(*parsed)

    def _parsed_run(self, stream: str, instance: str, tokens: list[bytes], entries: list[list[Any]]) -> None:
        STATS.received["RDATA"] += len(entries)
        if self.options_pending:
            self._settle_options(frozenset(), "the master sent rows without acknowledging OPTIONS")
        if stream not in self.positioned:
            logger.debug("[%s] dropped %d RDATA for %s before its POSITION", self.conn_name, len(entries), stream)
            return
        pending = self._pending_batch.pop(stream, None)
        if (
            pending is None
            and _BATCH not in tokens
            and self.handler.on_rows_run(self, stream, instance, tokens, entries)
        ):
            return  # a handler that takes a run of single-row tokens in one call (the worker)
        on_rows = self.handler.on_rows
        for position, row in zip(tokens, entries, strict=True):
            if position == _BATCH:
                if pending is None:
                    pending = [row]
                else:
                    pending.append(row)
                    if len(pending) > MAX_BATCH_ROWS:
                        self._batch_too_long(stream)
                        return
                continue
            if pending is None:
                rows = [row]
            else:
                pending.append(row)
                rows = pending
                pending = None
            on_rows(self, stream, instance, int(position), rows)
            if self._closing:
                return
            if stream not in self.positioned:  # the handler asked for the stream again
                return
        if pending is not None:
            self._pending_batch[stream] = pending

    def _handle_line(self, raw: bytes) -> None:
        # Most lines are RDATA: take them without building a command object.
        fast = parse_rdata_fast(raw)
        if fast is None:
            tick = parse_tick_fast(raw)
            if tick is not None:
                # The TICK after each batch of rows (one per single-row commit): without the
                # decode, the command table and the attribute lookup of the general way.
                STATS.received[TickCommand.NAME] += 1
                self.command_received()
                self.on_TICK(tick)
                return
            if raw.startswith(_MUST_PARSE):
                problem = unusable_line(raw)
                if problem is not None:
                    # Skipping it would lose a row: stop, say so, reconnect (with backoff) later.
                    self.close_with_error(f"cannot handle what the server sent: {problem}")
                    return
            super()._handle_line(raw)
            return
        STATS.received["RDATA"] += 1
        self._rows(*fast)

    def _line_too_long(self, length: int) -> None:
        self._buffer = b""
        self.close_with_error(
            f"cannot handle what the server sent: a line of {length} bytes without a newline, "
            f"over the limit of {self.config.max_line_bytes} (protocol.max_line_bytes)"
        )

    def log_closing(self, message: str) -> None:
        """Not logged here: the handler reports it once, from ``close_reason``, when disconnected."""
        logger.debug("[%s] closing: %s", self.conn_name, message)

    def on_RDATA(self, command: RdataCommand) -> None:
        self._rows(command.stream, command.instance, command.token, command.row)

    def _rows(self, stream: str, instance: str, token: int | None, row: list) -> None:
        if self.options_pending:
            self._settle_options(frozenset(), "the master sent rows without acknowledging OPTIONS")
        if stream not in self.positioned:
            logger.debug("[%s] dropped RDATA for %s before its POSITION", self.conn_name, stream)
            return
        if token is None:
            held = self._pending_batch.setdefault(stream, [])
            held.append(row)
            if len(held) > MAX_BATCH_ROWS:
                self._batch_too_long(stream)
            return
        pending = self._pending_batch.pop(stream, None)
        if pending is None:
            rows = [row]
        else:
            pending.append(row)
            rows = pending
        self.handler.on_rows(self, stream, instance, token, rows)

    def _batch_too_long(self, stream: str) -> None:
        # Writers never store a longer batch: holding more would let a peer grow
        # this without bound. Nothing of it is applied; it comes again on resume.
        self._pending_batch.pop(stream, None)
        self.close_with_error(
            f"cannot handle what the server sent: a batch of {stream} longer than {MAX_BATCH_ROWS} rows "
            "(rows sharing one token; writers refuse longer ones)"
        )

    def on_TICK(self, command: TickCommand) -> None:
        if command.stream in self.positioned:
            self.handler.on_tick(self, command)

    def on_ERROR(self, command: ErrorCommand) -> None:
        if self.options and not self.acknowledged and (self.options_pending or "OPTIONS" in command.message):
            # A seed-protocol master that does not know OPTIONS: no options,
            # and nothing else was refused.
            if self.options_pending:
                self._settle_options(frozenset(), f"the master answered OPTIONS with ERROR {command.message}")
            return
        super().on_ERROR(command)
        self.handler.on_error(self, command.message)

    def on_REMOTE_SERVER_UP(self, command: RemoteServerUpCommand) -> None:
        self.handler.on_remote_server_up(self, command.server)
