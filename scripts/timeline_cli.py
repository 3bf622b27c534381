"""``tickline timeline``: schedule, move, cancel, list, stats and consume timeline messages.

``schedule``, ``move``, ``cancel`` and ``consume`` speak the wire protocol to
the master (so the master wakes for the change); ``list`` and ``stats`` read
the database. Times: ``+30s``, ``+5m``, ``+2h``, ``+1d``, ``+250ms`` (``+N``
alone is ms), ``now``, Unix ms, or ISO-8601 (a time without a zone is UTC).
Bad input is one line on stderr and exit code 2; a refused change (``NACK``)
prints its reason and exits with 1.
"""

from __future__ import annotations

import argparse
import re
import signal
import socket
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson

from scripts.cli import UsageError
from scripts.config import Config, parse_address

_RELATIVE = re.compile(r"\+(\d+)(ms|s|m|h|d)?")
_UNITS = {None: 1, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class Refused(Exception):
    """The master answered NACK: nothing changed."""


def parse_time(text: str, what: str = "time") -> tuple[int, bool]:
    """(ms, relative): ``+<n><unit>`` is relative (ms from now); the rest are Unix ms."""
    value = text.strip()
    match = _RELATIVE.fullmatch(value)
    if match:
        return int(match.group(1)) * _UNITS[match.group(2)], True
    if value == "now":
        return 0, True
    if value.isdigit():
        return int(value), False
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(
            f"bad {what} {text!r}: use +30s, +5m, +2h, +1d, +250ms, now, Unix ms or ISO-8601 (2030-01-02T03:04:05Z)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000), False


def absolute_ms(text: str, what: str) -> int:
    ms, relative = parse_time(text, what)
    return int(time.time() * 1000) + ms if relative else ms


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def add_parser(commands: Any) -> None:
    timeline = commands.add_parser("timeline", help="scheduled messages with leases (schedule, consume, ...)")
    actions = timeline.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    def common(parser: argparse.ArgumentParser, wire: bool) -> None:
        parser.add_argument("-c", "--config", metavar="FILE", help="configuration file (YAML)")
        if wire:
            parser.add_argument("--master", metavar="HOST:PORT", help="master address (default: the config's listen)")
        else:
            parser.add_argument("--database", metavar="URL", help="database URL (default: the config's database)")
        parser.add_argument("topic", metavar="TOPIC")

    schedule = actions.add_parser("schedule", help="put a message on the timeline")
    common(schedule, True)
    schedule.add_argument("--group", default="cli", help="producer group that owns it (default: cli)")
    schedule.add_argument("--id", dest="message_id", help="natural id (default: a generated sortable id)")
    schedule.add_argument("--at", default="now", help="when: +30s, +5m, ISO-8601, Unix ms (default: now)")
    schedule.add_argument("body", metavar="BODY_JSON", help="the message body (JSON)")

    move = actions.add_parser("move", help="move a message (no active lease) to another time")
    common(move, True)
    move.add_argument("--group", default="cli", help="owner group (default: cli)")
    move.add_argument("message_id", metavar="ID")
    move.add_argument("--at", required=True, help="when: +30s, +5m, ISO-8601, Unix ms")

    cancel = actions.add_parser("cancel", help="delete a message that has no active lease")
    common(cancel, True)
    cancel.add_argument("--group", default="cli", help="owner group (default: cli)")
    cancel.add_argument("message_id", metavar="ID")

    for name, help_text in (("list", "print messages as JSON lines"), ("stats", "count messages by status")):
        parser = actions.add_parser(name, help=help_text)
        common(parser, False)
        parser.add_argument("--from", "--since", dest="start", metavar="TIME", help="timestamps from TIME (inclusive)")
        parser.add_argument("--to", "--until", dest="end", metavar="TIME", help="timestamps before TIME")
        if name == "list":
            parser.add_argument("--status", choices=("available", "waiting", "processing"))
            parser.add_argument("--limit", type=int, default=1000, help="at most N messages (default: 1000)")

    consume = actions.add_parser("consume", help="lease messages, print each as JSON and delete it")
    common(consume, True)
    consume.add_argument("--consumer", default="cli-consume", help="consumer id (default: cli-consume)")
    consume.add_argument("--credit", type=int, default=10, help="active leases at once (default: 10)")
    consume.add_argument("--lease", default="30s", help="lease time (default: 30s)")
    consume.add_argument("--count", type=int, help="exit after N messages")
    consume.add_argument("--keep", action="store_true", help="print only; do not delete (leases expire)")


# -- a blocking line client ---------------------------------------------------------------


class WireClient:
    def __init__(self, host: str, port: int, secret: str | None, timeout: float = 10.0) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise UsageError(f"cannot connect to the master at {host}:{port}: {e.strerror or e}") from None
        self.timeout = timeout
        self._buffer = b""
        if secret is not None:
            self.send(f"AUTH {secret}")
        self.send("NAME tickline-timeline")

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode("utf-8") + b"\n")

    def line(self, timeout: float | None = None) -> str | None:
        """The next line that is not a PING; None on timeout (when given)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while b"\n" in self._buffer:
                raw, _, self._buffer = self._buffer.partition(b"\n")
                text = raw.decode("utf-8", "replace").rstrip("\r")
                if text and not text.startswith(("PING ", "SERVER ")):
                    return text
            left = self.timeout if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                if deadline is None:
                    raise UsageError(f"no answer from the master within {self.timeout:g} s") from None
                return None
            except OSError as e:
                raise UsageError(f"connection to the master failed: {e}") from None
            if not data:
                raise UsageError("the master closed the connection")
            self._buffer += data

    def answer(self, on_lease: Any = None) -> list[str]:
        """The ACK / NACK / ERROR of the last command, as its words."""
        while True:
            text = self.line()
            assert text is not None
            if text.startswith("LEASE ") and on_lease is not None:
                on_lease(text)
                continue
            if text.startswith("ERROR "):
                raise UsageError(f"the master answered: {text[6:]}")
            if text.startswith("NACK "):
                raise Refused(text.split(" ", 4)[4])
            if text.startswith("ACK "):
                return text.split()

    def close(self) -> None:
        self.sock.close()


def _client(args: argparse.Namespace, config: Config) -> WireClient:
    if args.master:
        host, port = parse_address(args.master, "--master")
    else:
        host = config.master.listen_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        port = config.master.listen_port
    return WireClient(host, port, config.master.secret)


def _print(obj: Any) -> None:
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.flush()


def _ack_json(topic: str, words: list[str]) -> dict[str, Any]:
    _, _command, _topic, mid, version, ts = words
    return {"topic": topic, "id": mid, "version": int(version), "timestamp": int(ts), "at": iso(int(ts))}


# -- the actions ---------------------------------------------------------------------------


def run_timeline(args: argparse.Namespace, config: Config) -> int:
    try:
        return _run(args, config)
    except Refused as e:
        print(f"tickline timeline {args.action}: refused: {e}", file=sys.stderr)
        return 1


def _word(value: str, what: str) -> str:
    if not value or any(c.isspace() for c in value) or not value.isprintable():
        raise UsageError(f"{what} must be one word of printable characters, got {value!r}")
    return value


def _at_wire(text: str) -> str:
    ms, relative = parse_time(text, "--at")
    return f"+{ms}" if relative else str(ms)


def _run(args: argparse.Namespace, config: Config) -> int:
    topic = _word(args.topic, "TOPIC")
    if args.action in ("list", "stats"):
        return _read(args, config, topic)
    if args.action == "schedule":
        try:
            body = orjson.dumps(orjson.loads(args.body)).decode()
        except orjson.JSONDecodeError as e:
            raise UsageError(f"BODY_JSON is not valid JSON ({e}): {args.body[:80]!r}") from None
        mid = "-" if args.message_id is None else _word(args.message_id, "--id")
        line = f"SCHEDULE {topic} {_word(args.group, '--group')} {mid} {_at_wire(args.at)} {body}"
    elif args.action == "move":
        mid = _word(args.message_id, "ID")
        line = f"MOVE {topic} {_word(args.group, '--group')} {mid} {_at_wire(args.at)}"
    elif args.action == "cancel":
        line = f"CANCEL {topic} {_word(args.group, '--group')} {_word(args.message_id, 'ID')}"
    else:
        return _consume(args, config, topic)
    client = _client(args, config)
    try:
        client.send(line)
        _print(_ack_json(topic, client.answer()))
    finally:
        client.close()
    return 0


def _read(args: argparse.Namespace, config: Config, topic: str) -> int:
    from scripts.cli import database_url
    from storage.timeline_store import open_timeline_store

    start = absolute_ms(args.start, "--from") if args.start else None
    end = absolute_ms(args.end, "--to") if args.end else None
    if topic not in config.timeline.topics:
        raise UsageError(f"unknown topic {topic!r} (topics: {', '.join(config.timeline.topics)})")
    store = open_timeline_store(database_url(args, config))
    now = int(time.time() * 1000)
    try:
        if args.action == "stats":
            counts = store.counts(topic, now, start, end)
            _print({"topic": topic, **counts, "total": sum(counts.values())})
            return 0
        if args.limit < 1:
            raise UsageError("--limit must be at least 1")
        for m in store.list_messages(topic, now, args.status, start, end, args.limit):
            _print(
                {
                    "id": m.id,
                    "status": m.status(now),
                    "timestamp": m.ts,
                    "at": iso(m.ts),
                    "group": m.group,
                    "consumer": m.consumer,
                    "version": m.version,
                    "body": orjson.loads(m.body),
                }
            )
    finally:
        store.close()
    return 0


def _consume(args: argparse.Namespace, config: Config, topic: str) -> int:
    lease_ms, relative = parse_time(args.lease if args.lease.startswith("+") else "+" + args.lease, "--lease")
    if not relative or lease_ms < 1:
        raise UsageError(f"--lease must be a duration like 30s or 5000ms, got {args.lease!r}")
    if args.credit < 1:
        raise UsageError("--credit must be at least 1")
    if args.count is not None and args.count < 1:
        raise UsageError("--count must be at least 1")
    consumer = _word(args.consumer, "--consumer")
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    client = _client(args, config)
    client.send(f"TIMELINE {topic} {consumer} {args.credit} {lease_ms}")
    printed = 0
    pending: list[str] = []
    try:
        while not stopping and (args.count is None or printed < args.count):
            text = pending.pop(0) if pending else client.line(timeout=0.5)
            if text is None:
                continue
            if text.startswith("ERROR "):
                raise UsageError(f"the master answered: {text[6:]}")
            if not text.startswith("LEASE "):
                continue
            _, _, mid, version, until, body = text.split(" ", 5)
            _print(
                {
                    "topic": topic,
                    "id": mid,
                    "version": int(version),
                    "lease_until": int(until),
                    "body": orjson.loads(body),
                }
            )
            printed += 1
            if not args.keep:
                client.send(f"DELETE {topic} {mid} {version}")
                try:
                    client.answer(on_lease=pending.append)
                except Refused as e:
                    print(f"tickline timeline consume: delete {mid} refused: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return 0
