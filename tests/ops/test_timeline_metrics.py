"""The master's /metrics for the timeline: messages by status, leases, refusals, push lateness."""

from __future__ import annotations

from tests.conftest import LineClient
from tests.integration.procs import free_port
from tests.ops.helpers import sample, scrape, wait_for


def _answer(client: LineClient) -> str:
    while True:
        line = client.next_command()
        if not line.startswith("LEASE "):
            return line


def test_timeline_metrics_move(master) -> None:
    port = free_port()
    m = master("timeline:\n  remove_interval: 0.2\n", "--metrics-listen", f"127.0.0.1:{port}")
    c = m.connect()
    c.handshake()
    c.send("SCHEDULE jobs g a +0 {}", "SCHEDULE jobs g b +600000 {}")
    assert _answer(c).startswith("ACK") and _answer(c).startswith("ACK")
    c.send("TIMELINE jobs c 5 30000")
    lease = c.expect("LEASE jobs a 2 ")
    wait_for(
        lambda: sample(scrape(port), "tickline_timeline_messages", topic="jobs", status="processing") == 1,
        10,
        "the processing count",
    )
    text = scrape(port)
    assert sample(text, "tickline_timeline_messages", topic="jobs", status="waiting") == 1
    assert sample(text, "tickline_timeline_leases_granted_total", topic="jobs") == 1
    assert sample(text, "tickline_timeline_push_lateness_seconds_count") == 1
    assert sample(text, "tickline_timeline_push_lateness_seconds_bucket", le="+Inf") == 1
    c.send("DELETE jobs a 1")
    assert _answer(c) == "NACK DELETE jobs a stale version"
    assert sample(scrape(port), "tickline_timeline_refused_total") == 1
    c.send(f"DELETE jobs a {lease.split()[3]}")
    assert _answer(c).startswith("ACK DELETE")
    wait_for(
        lambda: sample(scrape(port), "tickline_timeline_messages", topic="jobs", status="processing") == 0,
        10,
        "the deleted message to leave the counts",
    )
