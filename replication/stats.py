"""Statistics: process-wide protocol counters and the typed ``stats()`` snapshots.

:data:`STATS` holds plain integers and counters bumped on the reactor thread
(cheap enough for the hot path). The attrs classes below are what the
``stats()`` methods of connections (``LineCommandProtocol.stats``) and the
master (``Master.stats``) return: frozen snapshots taken on the reactor
thread, which the Prometheus collectors (``replication.master_metrics``,
``workers.worker_metrics``) turn into metrics without touching anything else.
"""

from __future__ import annotations

import collections

import attr


class ProtocolStats:
    def __init__(self) -> None:
        self.sent: collections.Counter[str] = collections.Counter()  # commands by name
        self.received: collections.Counter[str] = collections.Counter()
        self.bytes_sent = 0
        self.bytes_received = 0

    def snapshot(self) -> ProtocolCounters:
        return ProtocolCounters(
            sent=tuple(sorted(self.sent.items())),
            received=tuple(sorted(self.received.items())),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )


STATS = ProtocolStats()


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ProtocolCounters:
    """This process's protocol traffic over all connections since it started."""

    sent: tuple[tuple[str, int], ...]  # (command name, count), sorted by name
    received: tuple[tuple[str, int], ...]
    bytes_sent: int
    bytes_received: int


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ConnectionStats:
    """One connection."""

    name: str  # the client's NAME@host:port on the master, NAME->host:port on a client
    bytes_sent: int
    bytes_received: int
    unsent_bytes: int  # in the socket's send queue, not yet acknowledged by the peer
    paused: bool  # the peer is not reading (flow control)
    rtt_ms: float | None  # the kernel's smoothed round trip, read when the peer's PING arrives
    clock_offset_ms: float | None  # the peer's clock minus ours, from its PING
    address: str = "?"  # the peer's host:port: two peers with one NAME stay apart


@attr.s(slots=True, frozen=True, auto_attribs=True)
class StreamStats:
    """One stream on the master."""

    stream: str
    head: int  # highest token allocated (refreshed now and then), never below ``safe``
    safe: int  # every row up to here has committed (the timetick)
    live: int  # rows up to here went out to live subscriptions
    safe_time_ms: int | None = None  # the stream's safe time (Unix ms), see replication.timeticks


@attr.s(slots=True, frozen=True, auto_attribs=True)
class LimitCounters:
    """What the master's limits did since it started (``replication.limits.LIMIT_STATS``)."""

    refused: tuple[tuple[str, int], ...] = ()  # connections refused, by reason
    closed: tuple[tuple[str, int], ...] = ()  # connections closed by a limit or timeout, by reason
    rejected: tuple[tuple[str, int], ...] = ()  # commands refused by a limit, by reason
    relays_dropped: int = 0
    log_lines_suppressed: int = 0
    accept_errors: tuple[tuple[str, int], ...] = ()  # accept() failures, by errno name


@attr.s(slots=True, frozen=True, auto_attribs=True)
class MasterStats:
    streams: tuple[StreamStats, ...]  # sorted by stream name
    connections: tuple[ConnectionStats, ...]
    catchup_rows: int  # rows sent from replays
    live_rows: int  # rows fanned out live, once per row whatever the number of connections
    protocol: ProtocolCounters
    limits: LimitCounters = LimitCounters()
