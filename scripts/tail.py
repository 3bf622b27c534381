"""``tickline tail``: connect like a worker and print one JSON object per row."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orjson
from twisted.internet.protocol import ClientFactory
from twisted.python.failure import Failure

from replication.client import ClientProtocol, ReplicationHandler
from replication.commands import PositionCommand
from replication.logsafe import safe
from replication.rows import split_ts
from replication.tls import TLSFileError, connect
from scripts.config import Config, parse_address
from scripts.stopping import stop_reactor
from scripts.when import BadInstant, iso_ms, parse_when
from storage.tso import physical_ms

# How long after the first POSITION every requested stream must have one.
POSITIONS_GRACE = 1.0
OUTPUT_BLOCK = 1 << 20  # bytes of output written at once at most (more when one token is larger)


class TailHandler(ReplicationHandler):
    def __init__(
        self,
        reactor: Any,
        streams: list[str],
        from_token: int | None,
        count: int | None,
        with_ts: bool,
        since_ms: int | None = None,
    ) -> None:
        self.reactor = reactor
        self.streams = streams
        self.from_token = from_token
        self.since_ms = since_ms
        self.remaining = count
        self.with_ts = with_ts
        self.exit_code = 0
        self.done = False
        self._out = sys.stdout.buffer
        # Output goes out in blocks: records gather here and are written
        # together once the current buffer of rows is handled (or 1 MiB is due).
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._flush_call = None
        self._check_call = None

    def connected(self, client: ClientProtocol) -> None:
        if self.remaining == 0:
            self.finish(0)
            return
        if self.since_ms is not None:
            for stream in self.streams:
                client.replicate(stream, since_ms=self.since_ms)
        elif self.from_token is None:
            client.replicate()  # live from now; POSITION for every stream
        else:
            for stream in self.streams:
                client.replicate(stream, self.from_token)

    def on_position(self, client: ClientProtocol, command: PositionCommand) -> None:
        if self.from_token is None and self.since_ms is None and self._check_call is None:
            self._check_call = self.reactor.callLater(POSITIONS_GRACE, self._check_streams, client)

    def _check_streams(self, client: ClientProtocol) -> None:
        missing = [s for s in self.streams if s not in client.positioned]
        if missing:
            self.fail(f"unknown stream {missing[0]!r}")

    def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, rows: list[list[Any]]) -> None:
        if self.done or stream not in self.streams:
            return
        pending = self._pending
        dumps = orjson.dumps
        have_ts = client.rows_have_ts
        for row in rows:
            # Rows carry their timestamp only once the master acknowledged
            # OPTIONS ts; from a seed-protocol master "ts" is null.
            values, ts = split_ts(row, have_ts)
            record = {"stream": stream, "instance": instance, "token": token, "row": values}
            if self.with_ts:
                record["ts"] = ts
                record["ts_iso"] = iso_ms(physical_ms(ts)) if isinstance(ts, int) else None
            try:
                line = dumps(record, option=orjson.OPT_APPEND_NEWLINE)
            except orjson.JSONEncodeError as e:
                self.fail(f"cannot print the row of {stream} at token {token}: {e}")
                return
            pending.append(line)
            self._pending_bytes += len(line)
            if self.remaining is not None:
                self.remaining -= 1
                if self.remaining <= 0:
                    self.finish(0)
                    return
        if self._pending_bytes >= OUTPUT_BLOCK and not self._write_pending():
            return
        if self._flush_call is None:
            self._flush_call = self.reactor.callLater(0, self._flush)

    def _write_pending(self) -> bool:
        """Write the records gathered so far in one block; False if the reader went away."""
        if not self._pending:
            return True
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        return self._write(data)

    def _flush(self) -> None:
        self._flush_call = None
        if self._write_pending():
            self._write(b"")

    def _write(self, data: bytes) -> bool:
        """Write and flush-if-empty; a reader that went away (``| head``) ends the tail quietly."""
        try:
            if data:
                self._out.write(data)
            else:
                self._out.flush()
        except BrokenPipeError:
            # Like other Unix tools: no error when the reader has all it wanted.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.finish(0)
            return False
        return True

    def on_error(self, client: ClientProtocol, message: str) -> None:
        self.fail(f"master said: {safe(message)}")

    def disconnected(self, client: ClientProtocol, reason: Failure) -> None:
        if self.done:
            return
        if client.close_reason is not None:  # we closed it: the master sent what we cannot handle
            self.fail(client.close_reason)
        else:
            self.fail(f"connection to the master closed: {reason.getErrorMessage()}")

    def fail(self, message: str) -> None:
        if not self.done:
            print(f"tickline tail: error: {message}", file=sys.stderr)
            self.finish(1)

    def stopping(self) -> None:
        if not self.done:
            self.done = True
            if self._write_pending():
                self._write(b"")

    def finish(self, code: int) -> None:
        if self.done:
            return
        self.done = True
        self.exit_code = code
        if self._write_pending():
            self._write(b"")
        stop_reactor(self.reactor)


class TailFactory(ClientFactory):
    def __init__(self, handler: TailHandler, name: str, config: Config, reactor: Any, with_ts: bool) -> None:
        self.handler = handler
        self.name = name
        self.config = config
        self.reactor = reactor
        self.with_ts = with_ts

    def buildProtocol(self, addr: Any) -> ClientProtocol:
        return ClientProtocol(
            self.handler,
            self.name,
            self.config.protocol,
            self.reactor,
            with_ts=self.with_ts,
            secret=self.config.master.secret,
        )

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.handler.fail(
            f"cannot connect to the master at {connector.host}:{connector.port}: {reason.getErrorMessage()}"
        )


def run_tail(args: argparse.Namespace, config: Config) -> int:
    from replication.reactor_types import global_reactor

    reactor = global_reactor()

    if args.master:
        host, port = parse_address(args.master, "--master")
    else:
        host, port = config.master.listen_host, config.master.listen_port
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
    since_ms = None
    if args.since is not None:
        if args.from_token is not None:
            print("tickline tail: error: --since and --from exclude each other", file=sys.stderr)
            return 2
        try:
            since_ms = parse_when(args.since)
        except BadInstant as e:
            print(f"tickline tail: error: --since {e}", file=sys.stderr)
            return 2
    handler = TailHandler(reactor, list(args.streams), args.from_token, args.count, args.ts, since_ms)
    try:
        connect(reactor, host, port, TailFactory(handler, args.name, config, reactor, args.ts), config.tls)
    except TLSFileError as e:
        print(f"tickline tail: error: {e}", file=sys.stderr)
        return 2
    # Stopped by a signal (Ctrl-C, SIGTERM): a normal end, not a lost master.
    reactor.addSystemEventTrigger("before", "shutdown", handler.stopping)
    reactor.run()
    return handler.exit_code
