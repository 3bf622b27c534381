"""The Prometheus ``/metrics`` endpoints of a real master and a real worker while rows flow."""

from __future__ import annotations

import http.client
import re
import time
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

from tests.integration.procs import free_port, sqlite_url
from tests.ops.helpers import EVENT_ROW, families, sample, scrape, value_of, wait_for

FAST_PINGS = "protocol:\n  ping_interval: 0.2\n"
METRIC_NAME = re.compile(r"tickline_[a-z][a-z0-9_]*")
LABEL_NAME = re.compile(r"[a-z][a-z0-9_]*")

MASTER_METRICS = {
    "tickline_stream_head_token": "gauge",
    "tickline_stream_safe_token": "gauge",
    "tickline_stream_sent_token": "gauge",
    "tickline_stream_lag_tokens": "gauge",
    "tickline_stream_safe_time_seconds": "gauge",
    "tickline_connections": "gauge",
    "tickline_pending_bytes": "gauge",
    "tickline_paused_connections": "gauge",
    "tickline_catchup_rows": "counter",
    "tickline_live_rows": "counter",
    "tickline_commands_sent": "counter",
    "tickline_commands_received": "counter",
    "tickline_sent_bytes": "counter",
    "tickline_received_bytes": "counter",
    "tickline_ping_rtt_seconds": "gauge",
    "tickline_clock_offset_seconds": "gauge",
    # replication.limits (issue 10)
    "tickline_limit_refused_connections": "counter",
    "tickline_limit_closed_connections": "counter",
    "tickline_limit_rejected_commands": "counter",
    "tickline_limit_dropped_relays": "counter",
    "tickline_limit_suppressed_log_lines": "counter",
    "tickline_limit_accept_errors": "counter",
    "tickline_timeline_messages": "gauge",
    "tickline_timeline_leases_granted": "counter",
    "tickline_timeline_leases_expired": "counter",
    "tickline_timeline_refused": "counter",
    "tickline_timeline_push_lateness_seconds": "histogram",
}
WORKER_METRICS = {
    "tickline_worker_applied_token": "gauge",
    "tickline_worker_received_token": "gauge",
    "tickline_worker_lag_tokens": "gauge",
    "tickline_worker_lag_seconds": "gauge",
    "tickline_worker_pending_rows": "gauge",
    "tickline_worker_applied_rows": "counter",
    "tickline_reconnects": "counter",
    "tickline_connections": "gauge",
    "tickline_commands_sent": "counter",
    "tickline_commands_received": "counter",
    "tickline_sent_bytes": "counter",
    "tickline_received_bytes": "counter",
    "tickline_ping_rtt_seconds": "gauge",
    "tickline_clock_offset_seconds": "gauge",
}


def check_conventions(port: int, expected: dict[str, str]) -> None:
    """Names, types, units, help and labels as Prometheus wants them, in both exposition formats."""
    text = scrape(port)
    found = families(text)
    assert {name: f.type for name, f in found.items()} == expected
    for name, family in found.items():
        assert METRIC_NAME.fullmatch(name), name
        assert family.documentation, f"{name} has no HELP"
        assert not name.endswith(("_total", "_count", "_sum", "_bucket", "_created")), name
        assert "_ms" not in name and "millisecond" not in name, f"{name}: use base units (seconds)"
        for s in family.samples:
            if family.type == "histogram":
                assert s.name in (name + "_bucket", name + "_sum", name + "_count"), s.name
            else:
                assert s.name == (name + "_total" if family.type == "counter" else name), s.name
            assert all(LABEL_NAME.fullmatch(label) for label in s.labels), s.labels
    # The OpenMetrics parser is stricter (counters must end in _total, # EOF, ...).
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        om = {f.name: f.type for f in openmetrics_families(response.read().decode("utf-8"))}
    assert om == expected


def test_master_and_worker_metrics_move_while_rows_flow(master, procs, tmp_path) -> None:
    master_metrics, worker_metrics = free_port(), free_port()
    m = master(FAST_PINGS, "--metrics-listen", f"127.0.0.1:{master_metrics}")
    worker_config = tmp_path / "worker.yaml"
    worker_config.write_text(FAST_PINGS)
    worker = procs(
        "worker",
        "worker",
        "-c",
        str(worker_config),
        "--name",
        "w1",
        "--master",
        m.address,
        "--database",
        sqlite_url(tmp_path / "w.db"),
        "--replicate",
        "events",
        "--metrics-listen",
        str(worker_metrics),
    )
    first_token = m.write("events", EVENT_ROW.format(n=0))[-1]
    wait_for(
        lambda: polled(worker_metrics, "tickline_worker_applied_token", stream="events") == first_token,
        30,
        "the worker to apply the first row",
    )
    before_m, before_w = scrape(master_metrics), scrape(worker_metrics)

    # More rows, one `tickline write` after another, until both sides moved.
    last_token = first_token
    deadline = time.monotonic() + 30
    for n in range(1, 1000):
        last_token = m.write("events", EVENT_ROW.format(n=n), EVENT_ROW.format(n=n + 1000))[-1]
        if n >= 3 and sample(scrape(worker_metrics), "tickline_worker_applied_token", stream="events") == last_token:
            break
        assert time.monotonic() < deadline, "the worker did not keep up within 30 s"
    after_m, after_w = scrape(master_metrics), scrape(worker_metrics)

    def moved(name: str, before: str, after: str, **labels: str) -> None:
        old, new = sample(before, name, **labels), sample(after, name, **labels)
        assert old is not None and new is not None and new > old, f"{name}{labels}: {old} -> {new}"

    # The master: positions, what went out, and what came in.
    for name in ("tickline_stream_safe_token", "tickline_stream_sent_token"):
        moved(name, before_m, after_m, stream="events")
    assert sample(after_m, "tickline_stream_safe_token", stream="events") == last_token
    assert sample(after_m, "tickline_stream_sent_token", stream="events") == last_token
    assert value_of(after_m, "tickline_stream_head_token", stream="events") >= last_token
    assert sample(after_m, "tickline_stream_lag_tokens", stream="events") == 0
    assert sample(after_m, "tickline_stream_safe_token", stream="caches") == 0
    moved("tickline_commands_sent_total", before_m, after_m, command="RDATA")
    moved("tickline_commands_received_total", before_m, after_m, command="PING")
    moved("tickline_sent_bytes_total", before_m, after_m)
    moved("tickline_received_bytes_total", before_m, after_m)
    moved("tickline_live_rows_total", before_m, after_m)
    assert value_of(after_m, "tickline_commands_received_total", command="NAME") >= 1
    assert value_of(after_m, "tickline_commands_received_total", command="REPLICATE") >= 2
    assert sample(after_m, "tickline_connections") == 1
    assert sample(after_m, "tickline_paused_connections") == 0
    # PINGs were exchanged: the round trip and the clock offset to the worker, by its NAME.
    assert 0 <= value_of(after_m, "tickline_ping_rtt_seconds", peer="w1") < 1
    assert abs(value_of(after_m, "tickline_clock_offset_seconds", peer="w1")) < 1

    # The worker: applied token and rows, lag, commands.
    moved("tickline_worker_applied_token", before_w, after_w, stream="events")
    moved("tickline_worker_applied_rows_total", before_w, after_w, stream="events")
    moved("tickline_commands_received_total", before_w, after_w, command="RDATA")
    moved("tickline_commands_sent_total", before_w, after_w, command="PING")
    assert sample(after_w, "tickline_worker_applied_token", stream="events") == last_token
    assert sample(after_w, "tickline_worker_received_token", stream="events") == last_token
    assert sample(after_w, "tickline_worker_lag_tokens", stream="events") == 0
    assert sample(after_w, "tickline_worker_pending_rows", stream="events") == 0
    assert 0 <= value_of(after_w, "tickline_worker_lag_seconds", stream="events") < 30
    # Time: the master's safe time follows the clock; an idle stream lags about zero.
    assert abs(value_of(after_m, "tickline_stream_safe_time_seconds", stream="caches") - time.time()) < 5
    wait_for(
        lambda: 0 <= (sample(scrape(worker_metrics), "tickline_worker_lag_seconds", stream="caches") or 99) < 2,
        10,
        "the idle caches stream to lag about zero",
    )
    assert sample(after_w, "tickline_worker_applied_token", stream="caches") == 0
    assert sample(after_w, "tickline_commands_sent_total", command="REPLICATE") == 2  # caches and events
    assert sample(after_w, "tickline_reconnects_total") == 0
    assert sample(after_w, "tickline_connections") == 1
    peers = [s for f in families(after_w).values() if f.name == "tickline_ping_rtt_seconds" for s in f.samples]
    assert len(peers) == 1 and peers[0].labels["peer"].startswith("w1->127.0.0.1:"), peers
    assert 0 <= peers[0].value < 1
    assert abs(value_of(after_w, "tickline_clock_offset_seconds", peer=peers[0].labels["peer"])) < 1

    check_conventions(master_metrics, MASTER_METRICS)
    check_conventions(worker_metrics, WORKER_METRICS)
    assert worker.stop() == 0


def test_metrics_listen_from_the_config_file_and_off_by_default(master, procs, tmp_path) -> None:
    master_metrics, worker_metrics = free_port(), free_port()
    # PORT alone means 127.0.0.1:PORT.
    m = master(f"metrics_listen: {master_metrics}\nworker:\n  metrics_listen: 127.0.0.1:{worker_metrics}\n")
    wait_for(lambda: polled(master_metrics, "tickline_connections") is not None, 10, "the master's /metrics")
    worker = procs(
        "worker", "worker", *m.config_args(), "--master", m.address, "--database", sqlite_url(tmp_path / "w.db")
    )
    wait_for(lambda: polled(worker_metrics, "tickline_connections") == 1, 15, "the worker's /metrics and connection")
    assert sample(scrape(worker_metrics), "tickline_worker_applied_token", stream="caches") == 0
    assert worker.stop() == 0

    # Without metrics_listen nothing listens for /metrics: a plain master's only port is the replication one.
    plain = master()
    assert plain.alive()
    assert _scrape_or_none(plain.port) is None  # the replication port does not speak HTTP


def _scrape_or_none(port: int):
    """The page, or None while nothing serves it yet (or not HTTP)."""
    try:
        return scrape(port, timeout=2)
    except (OSError, http.client.HTTPException):
        return None


def polled(port: int, name: str, **labels: str):
    """One sample's value for a wait: None while /metrics does not answer yet."""
    text = _scrape_or_none(port)
    return None if text is None else sample(text, name, **labels)
