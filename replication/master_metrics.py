"""The master's Prometheus collector: reads :meth:`Master.stats` at scrape time, nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.internet import defer, task

from replication.protocol_metrics import peer_metrics, protocol_metrics
from replication.reactor_types import Clock
from replication.stats import MasterStats


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


def follow_heads(clock: Clock, master: MeasuredMaster, interval: float = 5.0) -> task.LoopingCall:
    """Refresh the allocated heads for the metrics now and then (a database read)."""

    def refresh() -> defer.Deferred[None]:
        return master.refresh_heads().addErrback(lambda _: None)

    loop = task.LoopingCall(refresh)
    loop.clock = clock  # type: ignore[assignment]
    loop.start(interval, now=True)
    return loop
