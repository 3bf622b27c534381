"""Prometheus metric families of the protocol, shared by the master's and the workers' collectors.

They read only typed snapshots (:class:`~replication.stats.ProtocolCounters`,
:class:`~replication.stats.ConnectionStats`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from replication.stats import ConnectionStats, ProtocolCounters


def protocol_metrics(counters: ProtocolCounters) -> Iterator[Metric]:
    sent = CounterMetricFamily("tickline_commands_sent", "Commands sent, by command name", labels=["command"])
    for name, count in counters.sent:
        sent.add_metric([name], count)
    yield sent
    received = CounterMetricFamily(
        "tickline_commands_received", "Commands received, by command name", labels=["command"]
    )
    for name, count in counters.received:
        received.add_metric([name], count)
    yield received
    yield CounterMetricFamily("tickline_sent_bytes", "Bytes written to connections", value=counters.bytes_sent)
    yield CounterMetricFamily("tickline_received_bytes", "Bytes read from connections", value=counters.bytes_received)


def peer_metrics(connections: Iterable[ConnectionStats]) -> Iterator[Metric]:
    # "address" (the peer's host:port) keeps two peers with the same NAME apart.
    labels = ["peer", "address"]
    rtt = GaugeMetricFamily("tickline_ping_rtt_seconds", "TCP round-trip time to the peer", labels=labels)
    offset = GaugeMetricFamily(
        "tickline_clock_offset_seconds", "Peer's clock minus ours, estimated from its PING timestamps", labels=labels
    )
    for conn in connections:
        if conn.rtt_ms is not None:
            rtt.add_metric([conn.name, conn.address], conn.rtt_ms / 1000)
        if conn.clock_offset_ms is not None:
            offset.add_metric([conn.name, conn.address], conn.clock_offset_ms / 1000)
    yield rtt
    yield offset
