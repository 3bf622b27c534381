"""Timeline metrics: plain counters bumped by the service, a Prometheus collector read at scrape time."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

# Push lateness buckets (seconds): due time to LEASE sent.
LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TimelineStats:
    def __init__(self) -> None:
        self.granted: dict[str, int] = {}
        self.expired = 0  # leases that ran out while their connection still held them
        self.refused = 0  # EXTEND / RELEASE / DELETE answered with NACK
        self.counts: dict[str, dict[str, int]] = {}  # topic -> status -> messages (refreshed by the remover)
        self.lateness_buckets = [0] * (len(LATENESS_BUCKETS) + 1)
        self.lateness_sum = 0.0
        self.lateness_count = 0

    def lease_sent(self, topic: str, lateness_ms: int) -> None:
        self.granted[topic] = self.granted.get(topic, 0) + 1
        seconds = lateness_ms / 1000
        self.lateness_buckets[bisect.bisect_left(LATENESS_BUCKETS, seconds)] += 1
        self.lateness_sum += seconds
        self.lateness_count += 1


class TimelineCollector:
    """Prometheus collector for a master's timeline (``service.stats``)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self) -> Iterable[Metric]:
        stats: TimelineStats | None = getattr(self.service, "stats", None)
        if stats is None:
            return
        messages = GaugeMetricFamily(
            "tickline_timeline_messages", "Timeline messages by topic and status", labels=["topic", "status"]
        )
        for topic, counts in sorted(stats.counts.items()):
            for status, n in sorted(counts.items()):
                messages.add_metric([topic, status], n)
        yield messages
        granted = CounterMetricFamily("tickline_timeline_leases_granted", "Leases sent to consumers", labels=["topic"])
        for topic, n in sorted(stats.granted.items()):
            granted.add_metric([topic], n)
        yield granted
        yield CounterMetricFamily(
            "tickline_timeline_leases_expired", "Leases that ran out while held", value=stats.expired
        )
        yield CounterMetricFamily(
            "tickline_timeline_refused", "EXTEND, RELEASE and DELETE refused (NACK)", value=stats.refused
        )
        cumulative, buckets = 0, []
        for bound, n in zip((*LATENESS_BUCKETS, float("inf")), stats.lateness_buckets, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily(
            "tickline_timeline_push_lateness_seconds",
            "Due time to LEASE sent",
            buckets=buckets,
            sum_value=stats.lateness_sum,
        )


class Collectors:
    """Several collectors registered as one (the master's /metrics takes one)."""

    def __init__(self, *collectors: Any) -> None:
        self.collectors = collectors

    def collect(self) -> Iterable[Metric]:
        for collector in self.collectors:
            yield from collector.collect()
