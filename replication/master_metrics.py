"""The master's Prometheus collector: reads :meth:`Master.stats` at scrape time, nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.internet import defer, task

from replication.protocol_metrics import peer_metrics, protocol_metrics
from replication.reactor_types import Clock
from replication.stats import LimitCounters, MasterStats


class MeasuredMaster(Protocol):
    """What the collector needs: the master's typed statistics."""

    def stats(self) -> MasterStats: ...

    def refresh_heads(self) -> defer.Deferred[None]: ...


class MasterCollector(Collector):
    def __init__(self, master: MeasuredMaster) -> None:
        self._stats: Callable[[], MasterStats] = master.stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
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
        for stream in stats.streams:
            head.add_metric([stream.stream], stream.head)
            safe.add_metric([stream.stream], stream.safe)
            sent.add_metric([stream.stream], stream.live)
            lag.add_metric([stream.stream], max(0, stream.safe - stream.live))
        safe_time = GaugeMetricFamily(
            "tickline_stream_safe_time_seconds",
            "The stream's safe time (Unix seconds): no further row will have a timestamp at or below it",
            labels=["stream"],
        )
        for stream in stats.streams:
            if stream.safe_time_ms is not None:
                safe_time.add_metric([stream.stream], stream.safe_time_ms / 1000)
        yield from (head, safe, sent, lag, safe_time)
        yield GaugeMetricFamily("tickline_connections", "Open replication connections", value=len(stats.connections))
        yield GaugeMetricFamily(
            "tickline_pending_bytes",
            "Bytes in the connections' socket send queues, not yet acknowledged by the peer",
            value=sum(c.unsent_bytes for c in stats.connections),
        )
        yield GaugeMetricFamily(
            "tickline_paused_connections",
            "Connections whose client is not reading",
            value=sum(1 for c in stats.connections if c.paused),
        )
        yield CounterMetricFamily("tickline_catchup_rows", "Rows sent from replays", value=stats.catchup_rows)
        yield CounterMetricFamily("tickline_live_rows", "Rows fanned out live", value=stats.live_rows)
        yield from protocol_metrics(stats.protocol)
        yield from peer_metrics(stats.connections)
        yield from limit_metrics(stats.limits)


def limit_metrics(limits: LimitCounters) -> Iterator[Metric]:
    """What the master's limits did (replication.limits); every reason is always present."""

    def labelled(name: str, doc: str, label: str, values: tuple[tuple[str, int], ...], keys: tuple[str, ...]):
        family = CounterMetricFamily(name, doc, labels=[label])
        counts = dict(values)
        for key in sorted(set(keys) | set(counts)):
            family.add_metric([key], counts.get(key, 0))
        return family

    yield labelled(
        "tickline_limit_refused_connections",
        "Connections refused by a limit",
        "reason",
        limits.refused,
        ("total", "per_address"),
    )
    yield labelled(
        "tickline_limit_closed_connections",
        "Connections closed by a limit or timeout",
        "reason",
        limits.closed,
        ("auth_timeout", "idle_timeout", "line_timeout", "queued_bytes"),
    )
    yield labelled(
        "tickline_limit_rejected_commands",
        "Commands refused by a limit (answered with ERROR)",
        "reason",
        limits.rejected,
        ("name_bytes", "instances", "users"),
    )
    yield CounterMetricFamily(
        "tickline_limit_dropped_relays",
        "REMOTE_SERVER_UP relays not sent to a peer that does not read",
        value=limits.relays_dropped,
    )
    yield CounterMetricFamily(
        "tickline_limit_suppressed_log_lines",
        "Log lines about peers suppressed by the per-second limits",
        value=limits.log_lines_suppressed,
    )
    yield labelled(
        "tickline_limit_accept_errors",
        "accept() failures (EMFILE: out of file descriptors)",
        "error",
        limits.accept_errors,
        (),
    )


def follow_heads(clock: Clock, master: MeasuredMaster, interval: float = 5.0) -> task.LoopingCall:
    """Refresh the allocated heads for the metrics now and then (a database read)."""

    def refresh() -> defer.Deferred[None]:
        return master.refresh_heads().addErrback(lambda _: None)

    loop = task.LoopingCall(refresh)
    loop.clock = clock  # type: ignore[assignment]
    loop.start(interval, now=True)
    return loop
