"""The Prometheus endpoint: ``/metrics`` of a master or a worker, served on the reactor thread.

Metrics are read from the live objects at scrape time (custom collectors), so
the hot path only bumps plain counters (``replication.stats``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from twisted.internet import task
from twisted.web.resource import Resource
from twisted.web.server import Site

from replication.limits import LIMIT_STATS
from replication.stats import STATS
from storage.tso import physical_ms


def _protocol_metrics(stats: Any) -> Iterable[Metric]:
    sent = CounterMetricFamily("tickline_commands_sent", "Commands sent, by command name", labels=["command"])
    for name, count in sorted(stats.sent.items()):
        sent.add_metric([name], count)
    yield sent
    received = CounterMetricFamily(
        "tickline_commands_received", "Commands received, by command name", labels=["command"]
    )
    for name, count in sorted(stats.received.items()):
        received.add_metric([name], count)
    yield received
    yield CounterMetricFamily("tickline_sent_bytes", "Bytes written to connections", value=stats.bytes_sent)
    yield CounterMetricFamily("tickline_received_bytes", "Bytes read from connections", value=stats.bytes_received)


def _peer_metrics(connections: Iterable[Any]) -> Iterable[Metric]:
    # "address" (the peer's host:port) keeps two peers with the same NAME apart.
    labels = ["peer", "address"]
    rtt = GaugeMetricFamily("tickline_ping_rtt_seconds", "TCP round-trip time to the peer", labels=labels)
    offset = GaugeMetricFamily(
        "tickline_clock_offset_seconds", "Peer's clock minus ours, estimated from its PING timestamps", labels=labels
    )
    for conn in connections:
        name = getattr(conn, "display_name", None) or conn.conn_name
        address = getattr(conn, "peer_address", "?")
        if conn.rtt_ms is not None:
            rtt.add_metric([name, address], conn.rtt_ms / 1000)
        if conn.clock_offset_ms is not None:
            offset.add_metric([name, address], conn.clock_offset_ms / 1000)
    yield rtt
    yield offset


def _limit_metrics(stats: Any) -> Iterable[Metric]:
    """What the master's limits did (replication.limits)."""
    refused = CounterMetricFamily(
        "tickline_limit_refused_connections", "Connections refused by a limit", labels=["reason"]
    )
    for reason in ("total", "per_address"):
        refused.add_metric([reason], stats.refused.get(reason, 0))
    yield refused
    closed = CounterMetricFamily(
        "tickline_limit_closed_connections", "Connections closed by a limit or timeout", labels=["reason"]
    )
    for reason in ("auth_timeout", "idle_timeout", "line_timeout", "queued_bytes"):
        closed.add_metric([reason], stats.closed.get(reason, 0))
    yield closed
    rejected = CounterMetricFamily(
        "tickline_limit_rejected_commands", "Commands refused by a limit (answered with ERROR)", labels=["reason"]
    )
    for reason in ("name_bytes", "instances", "users"):
        rejected.add_metric([reason], stats.rejected.get(reason, 0))
    yield rejected
    yield CounterMetricFamily(
        "tickline_limit_dropped_relays",
        "REMOTE_SERVER_UP relays not sent to a peer that does not read",
        value=stats.relays_dropped,
    )
    yield CounterMetricFamily(
        "tickline_limit_suppressed_log_lines",
        "Log lines about peers suppressed by the per-second limits",
        value=stats.log_lines_suppressed,
    )
    errors = CounterMetricFamily(
        "tickline_limit_accept_errors", "accept() failures (EMFILE: out of file descriptors)", labels=["error"]
    )
    for error, count in sorted(stats.accept_errors.items()):
        errors.add_metric([error], count)
    yield errors


def _pending_bytes(transport: Any) -> int:
    """Bytes a Twisted TCP transport holds that the kernel has not taken yet."""
    buffered = getattr(transport, "dataBuffer", b"")
    return len(buffered) + int(getattr(transport, "_tempDataLen", 0)) - int(getattr(transport, "offset", 0))


class MasterCollector:
    def __init__(self, master: Any, heads: dict[str, int]) -> None:
        self.master = master
        self.heads = heads  # refreshed by a LoopingCall off the reactor thread

    def collect(self) -> Iterable[Metric]:
        master = self.master
        head = GaugeMetricFamily(
            "tickline_stream_head_token", "Highest token allocated in the stream", labels=["stream"]
        )
        safe = GaugeMetricFamily(
            "tickline_stream_safe_token", "Token up to which every row has committed (the timetick)", labels=["stream"]
        )
        sent = GaugeMetricFamily(
            "tickline_stream_sent_token", "Token up to which rows went out live", labels=["stream"]
        )
        lag = GaugeMetricFamily(
            "tickline_stream_lag_tokens", "Safe position minus what went out live", labels=["stream"]
        )
        for stream in master.stream_names():
            live = master.live_token(stream)
            position = master.safe_position(stream)
            head.add_metric([stream], max(self.heads.get(stream, 0), position))
            safe.add_metric([stream], position)
            sent.add_metric([stream], live)
            lag.add_metric([stream], max(0, position - live))
        yield from (head, safe, sent, lag)
        yield GaugeMetricFamily("tickline_connections", "Open replication connections", value=len(master.connections))
        yield GaugeMetricFamily(
            "tickline_pending_bytes",
            "Bytes waiting in connections' outgoing buffers",
            value=sum(_pending_bytes(c.transport) for c in master.connections if c.transport is not None),
        )
        yield GaugeMetricFamily(
            "tickline_paused_connections",
            "Connections whose client is not reading",
            value=sum(1 for c in master.connections if c.paused),
        )
        yield CounterMetricFamily(
            "tickline_catchup_rows", "Rows sent from replays", value=master.counters["catchup_rows"]
        )
        yield CounterMetricFamily("tickline_live_rows", "Rows fanned out live", value=master.counters["live_rows"])
        yield from _protocol_metrics(STATS)
        yield from _peer_metrics(list(master.connections))
        yield from _limit_metrics(LIMIT_STATS)


class WorkerCollector:
    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collect(self) -> Iterable[Metric]:
        worker = self.worker
        now_ms = int(time.time() * 1000)
        applied = GaugeMetricFamily(
            "tickline_worker_applied_token", "Token applied in the worker's database", labels=["stream"]
        )
        received = GaugeMetricFamily(
            "tickline_worker_received_token", "Highest token received from the master", labels=["stream"]
        )
        lag_tokens = GaugeMetricFamily("tickline_worker_lag_tokens", "Received but not yet applied", labels=["stream"])
        lag_seconds = GaugeMetricFamily(
            "tickline_worker_lag_seconds", "Age of the applied data while rows wait to be applied", labels=["stream"]
        )
        pending = GaugeMetricFamily("tickline_worker_pending_rows", "Rows waiting to be applied", labels=["stream"])
        rows = CounterMetricFamily("tickline_worker_applied_rows", "Rows applied", labels=["stream"])
        for stream, consumer in sorted(worker.consumers.items()):
            applied.add_metric([stream], consumer.applied)
            received.add_metric([stream], consumer.known)
            lag_tokens.add_metric([stream], max(0, consumer.known - consumer.applied))
            behind = 0.0
            if consumer.busy and consumer.applied_ts is not None:
                behind = max(0, now_ms - physical_ms(consumer.applied_ts)) / 1000
            lag_seconds.add_metric([stream], behind)
            pending.add_metric([stream], consumer.queued_rows)
            rows.add_metric([stream], consumer.rows_applied)
        yield from (applied, received, lag_tokens, lag_seconds, pending, rows)
        yield CounterMetricFamily("tickline_reconnects", "Connections to the master lost", value=worker.reconnects)
        yield GaugeMetricFamily(
            "tickline_connections", "Open replication connections", value=int(worker.client is not None)
        )
        yield from _protocol_metrics(STATS)
        yield from _peer_metrics([worker.client] if worker.client is not None else [])


class MetricsPage(Resource):
    """``/metrics`` rendered on the reactor thread.

    prometheus_client's own Twisted resource collects on a thread pool, where
    the collectors would read the master's connections and streams while the
    reactor changes them; collecting here reads a consistent picture.
    """

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Any) -> bytes:
        # The text format, or OpenMetrics when the scraper asks for it.
        accept = (request.getHeader(b"accept") or b"").decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        request.setHeader(b"Content-Type", content_type.encode("ascii"))
        return encoder(self.registry)


def serve_metrics(reactor: Any, collector: Any, host: str, port: int) -> Any:
    """Listen for ``GET /metrics``; returns the listening port."""
    registry = CollectorRegistry()
    registry.register(collector)
    root = Resource()
    root.putChild(b"metrics", MetricsPage(registry))
    return reactor.listenTCP(port, Site(root), interface=host)


def follow_heads(reactor: Any, master: Any, heads: dict[str, int], interval: float = 5.0) -> task.LoopingCall:
    """Refresh the allocated heads for the metrics now and then (a database read)."""

    def refresh() -> Any:
        d = master.db.run(master.store.heads)
        d.addCallback(heads.update)
        d.addErrback(lambda _: None)
        return d

    loop = task.LoopingCall(refresh)
    loop.clock = reactor
    loop.start(interval, now=True)
    return loop
