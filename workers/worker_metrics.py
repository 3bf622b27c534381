"""The worker's Prometheus collector: reads :meth:`Worker.stats` at scrape time, nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replication.protocol_metrics import peer_metrics, protocol_metrics
from workers.worker import WorkerStats


class MeasuredWorker(Protocol):
    def stats(self) -> WorkerStats: ...


class WorkerCollector(Collector):
    def __init__(self, worker: MeasuredWorker) -> None:
        self._stats: Callable[[], WorkerStats] = worker.stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        applied = GaugeMetricFamily(
            "tickline_worker_applied_token", "Token applied in the worker's database", labels=["stream"]
        )
        received = GaugeMetricFamily(
            "tickline_worker_received_token", "Highest token received from the master", labels=["stream"]
        )
        lag_tokens = GaugeMetricFamily("tickline_worker_lag_tokens", "Received but not yet applied", labels=["stream"])
        lag_seconds = GaugeMetricFamily(
            "tickline_worker_lag_seconds",
            "Now minus the time up to which the stream is complete in the worker (last applied row, or the safe time when all is applied)",
            labels=["stream"],
        )
        pending = GaugeMetricFamily("tickline_worker_pending_rows", "Rows waiting to be applied", labels=["stream"])
        rows = CounterMetricFamily("tickline_worker_applied_rows", "Rows applied", labels=["stream"])
        for stream in stats.streams:
            applied.add_metric([stream.stream], stream.applied)
            received.add_metric([stream.stream], stream.received)
            lag_tokens.add_metric([stream.stream], max(0, stream.received - stream.applied))
            lag_seconds.add_metric([stream.stream], float("nan") if stream.lag_ms is None else stream.lag_ms / 1000)
            pending.add_metric([stream.stream], stream.pending_rows)
            rows.add_metric([stream.stream], stream.applied_rows)
        yield from (applied, received, lag_tokens, lag_seconds, pending, rows)
        ordered = [stream for stream in stats.streams if stream.ordered]
        if ordered:
            held = GaugeMetricFamily(
                "tickline_worker_ordered_held_rows",
                "Rows received but held back for timestamp order across streams",
                labels=["stream"],
            )
            blocking = GaugeMetricFamily(
                "tickline_worker_ordered_blocking",
                "1 while the stream holds the other streams back (it is behind, or not heard from yet)",
                labels=["stream"],
            )
            released = CounterMetricFamily(
                "tickline_worker_ordered_released_rows", "Rows released in timestamp order", labels=["stream"]
            )
            for stream in ordered:
                held.add_metric([stream.stream], stream.held_rows)
                blocking.add_metric([stream.stream], int(stream.blocking))
                released.add_metric([stream.stream], stream.released_rows)
            yield from (held, blocking, released)
        yield CounterMetricFamily("tickline_reconnects", "Connections to the master lost", value=stats.reconnects)
        yield GaugeMetricFamily(
            "tickline_connections", "Open replication connections", value=int(stats.connection is not None)
        )
        yield from protocol_metrics(stats.protocol)
        yield from peer_metrics([stats.connection] if stats.connection is not None else [])
