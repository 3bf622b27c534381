"""The worker's timeline consumer with an injected clock: extension at half the lease, backoff, answers."""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, task
from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure

from replication.commands import (
    Command,
)
from replication.settings import ProtocolConfig
from replication.timeline_commands import (
    AckCommand,
    LeaseCommand,
    NackCommand,
)
from workers.settings import TimelineWorkerSettings
from workers.timeline import TimelineConsumer, TimelineJob

T0 = 1_700_000_000.0


class Client:
    conn_name = "test"

    def __init__(self) -> None:
        self.sent: list[str] = []

    def command(self, command: Command) -> None:
        self.sent.append(command.to_line())

    def close(self) -> None:
        pass


def make(**settings: Any) -> tuple[TimelineConsumer, task.Clock, Client, dict[str, defer.Deferred]]:
    clock = task.Clock()
    clock.advance(T0)
    running: dict[str, defer.Deferred] = {}

    def run(handler: Any, job: TimelineJob) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        running[job.id] = d
        return d

    s = TimelineWorkerSettings(handler="x:y", **settings)
    consumer = TimelineConsumer(s, lambda job: None, "w", "127.0.0.1", 1, ProtocolConfig(), clock, run_handler=run)
    client = Client()
    consumer.connected(client)
    return consumer, clock, client, running


def lease(mid: str, version: int, until_ms: int) -> LeaseCommand:
    return LeaseCommand("jobs", mid, version, until_ms, '{"n":1}')


def test_a_running_handler_is_extended_at_half_of_each_lease() -> None:
    consumer, clock, client, running = make(lease_ms=1000)
    now = int(T0 * 1000)
    consumer.on_lease(client, lease("a", 2, now + 1000))
    assert "a" in running
    clock.advance(0.499)
    assert client.sent == []
    clock.advance(0.001)
    assert client.sent == ["EXTEND jobs a 2 1000"]
    consumer.on_answer(client, AckCommand("EXTEND", "jobs", "a", 3, now + 1500))
    clock.advance(0.499)
    assert len(client.sent) == 1
    clock.advance(0.001)
    assert client.sent[-1] == "EXTEND jobs a 3 1000"
    # The handler returns while that EXTEND is out: DELETE waits for its new version.
    running["a"].callback(None)
    assert client.sent[-1] == "EXTEND jobs a 3 1000"
    consumer.on_answer(client, AckCommand("EXTEND", "jobs", "a", 4, now + 2000))
    assert client.sent[-1] == "DELETE jobs a 4"
    consumer.on_answer(client, AckCommand("DELETE", "jobs", "a", 5, now + 2000))
    assert consumer.running == {}
    clock.advance(10)
    assert client.sent[-1] == "DELETE jobs a 4"  # no more extensions


def test_a_raising_handler_is_released_with_exponential_backoff() -> None:
    consumer, _clock, client, running = make(lease_ms=60_000, backoff_initial_ms=1000, backoff_max_ms=3000)
    now = int(T0 * 1000)
    delays = []
    for version in (2, 4, 6, 8):
        consumer.on_lease(client, lease("a", version, now + 60_000))
        running["a"].errback(RuntimeError("boom"))
        line = client.sent[-1]
        assert line.startswith(f"RELEASE jobs a {version} ")
        delays.append(int(line.split()[-1]))
        consumer.on_answer(client, AckCommand("RELEASE", "jobs", "a", version + 1, now))
    assert delays == [1000, 2000, 3000, 3000]
    assert consumer.counters["failed"] == 4
    # Success forgets the failures.
    consumer.on_lease(client, lease("a", 10, now + 60_000))
    running["a"].callback(None)
    assert client.sent[-1] == "DELETE jobs a 10"
    assert "a" not in consumer.failures


def test_a_refused_extend_is_a_lost_lease_and_the_finish_is_still_reported() -> None:
    consumer, clock, client, running = make(lease_ms=1000)
    now = int(T0 * 1000)
    consumer.on_lease(client, lease("a", 2, now + 1000))
    clock.advance(0.5)
    consumer.on_answer(client, NackCommand("EXTEND", "jobs", "a", "lease expired"))
    assert consumer.counters["lost"] == 1
    running["a"].callback(None)
    assert client.sent[-1] == "DELETE jobs a 2"
    consumer.on_answer(client, NackCommand("DELETE", "jobs", "a", "not the holder"))
    assert consumer.running == {} and consumer.counters["lost"] == 2


def test_a_lease_sent_again_after_a_reconnect_keeps_the_running_handler() -> None:
    consumer, _clock, client, running = make(lease_ms=1000)
    now = int(T0 * 1000)
    consumer.on_lease(client, lease("a", 2, now + 1000))
    first = running["a"]
    consumer.disconnected(client, Failure(ConnectionDone()))
    again = Client()
    consumer.connected(again)
    consumer.on_lease(again, lease("a", 2, now + 1000))
    assert running["a"] is first  # not started twice
    first.callback(None)
    assert again.sent[-1] == "DELETE jobs a 2"
