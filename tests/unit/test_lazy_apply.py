"""Lazy calls of ``replication.pg_async.AsyncQuery`` (a worker's small apply).

A lazy call's answer is not watched for: ``settle()`` takes it if it came,
else watches for it from then on; a backstop timer settles a call nobody asks
about; a consumer with rows waiting behind its apply asks (``nudge``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet.task import Clock

from replication.pg_async import LAZY_ANSWER_SECONDS, AsyncQuery
from replication.streams import EVENTS
from workers.consumer import StreamConsumer


class FakeReactor(Clock):
    def __init__(self) -> None:
        super().__init__()
        self.readers: set[Any] = set()
        self.writers: set[Any] = set()

    def addReader(self, r: Any) -> None:
        self.readers.add(r)

    def removeReader(self, r: Any) -> None:
        self.readers.discard(r)

    def addWriter(self, w: Any) -> None:
        self.writers.add(w)

    def removeWriter(self, w: Any) -> None:
        self.writers.discard(w)


class FakeCall:
    """A non-blocking call whose answer arrives when the test says so."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        self.sent: list[int] = []
        self.answered = False
        self.polls = 0

    def fileno(self) -> int:
        return self._r

    def start(self, n: int) -> bool:
        self.sent.append(n)
        self.answered = False
        return True

    def poll(self) -> str:
        self.polls += 1
        return "done" if self.answered else "read"

    def result(self) -> int:
        return self.sent[-1]

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


@pytest.fixture
def setup() -> Iterator[tuple[FakeReactor, FakeCall, AsyncQuery[int]]]:
    reactor, call = FakeReactor(), FakeCall()
    query: AsyncQuery[int] = AsyncQuery(reactor, call)  # type: ignore[arg-type]
    yield reactor, call, query
    query.close()


def test_a_lazy_call_is_not_watched_and_settle_takes_an_answer_that_came(setup) -> None:
    reactor, call, query = setup
    got: list[int] = []
    d = query.run(lambda: call.start(1), lazy=True)
    assert d is not None
    d.addCallback(got.append)
    assert query not in reactor.readers and query.busy
    call.answered = True
    query.settle()
    assert got == [1] and not query.busy and query not in reactor.readers


def test_settling_before_the_answer_watches_for_it(setup) -> None:
    reactor, call, query = setup
    got: list[int] = []
    query.run(lambda: call.start(1), lazy=True).addCallback(got.append)
    query.settle()
    assert got == [] and query in reactor.readers  # from now on the answer wakes the reactor
    call.answered = True
    query.doRead()
    assert got == [1] and query not in reactor.readers


def test_an_eager_call_is_watched_and_settle_does_nothing(setup) -> None:
    reactor, call, query = setup
    query.run(lambda: call.start(1))
    assert query in reactor.readers
    polls = call.polls
    query.settle()
    assert call.polls == polls


def test_the_backstop_settles_a_call_nobody_asks_about(setup) -> None:
    reactor, call, query = setup
    got: list[int] = []
    query.run(lambda: call.start(1), lazy=True).addCallback(got.append)
    call.answered = True
    reactor.advance(LAZY_ANSWER_SECONDS)
    assert got == [1]
    assert not reactor.getDelayedCalls()  # nothing left behind while idle


def test_the_backstop_gives_a_later_call_its_own_time(setup) -> None:
    reactor, call, query = setup
    got: list[int] = []
    query.run(lambda: call.start(1), lazy=True).addCallback(got.append)
    reactor.advance(LAZY_ANSWER_SECONDS / 2)
    call.answered = True
    query.settle()  # the next rows came and took the first answer
    query.run(lambda: call.start(2), lazy=True).addCallback(got.append)
    assert len(reactor.getDelayedCalls()) == 1  # one timer for both calls
    reactor.advance(LAZY_ANSWER_SECONDS / 2)  # the first call's time: not the second's
    assert got == [1] and query not in reactor.readers
    call.answered = True
    reactor.advance(LAZY_ANSWER_SECONDS)
    assert got == [1, 2]


def test_close_fails_a_lazy_call_and_cancels_the_backstop(setup) -> None:
    reactor, call, query = setup
    failures: list[Any] = []
    query.run(lambda: call.start(1), lazy=True).addErrback(failures.append)
    query.close()
    assert len(failures) == 1 and not reactor.getDelayedCalls()


def test_rows_queued_behind_an_apply_in_flight_nudge_it() -> None:
    from twisted.internet import defer

    applies: list[defer.Deferred[None]] = []
    nudges: list[int] = []

    def replicate(stream: str, token: int, schema: Any, received: Any, effects: Any) -> defer.Deferred[None]:
        d: defer.Deferred[None] = defer.Deferred()
        applies.append(d)
        return d

    def nudge() -> None:
        nudges.append(len(applies))
        applies[-1].callback(None)  # the answer had come: taken now, the next apply follows at once

    from workers.replicator import table_replicator

    consumer = StreamConsumer(
        "events",
        EVENTS,
        0,
        [table_replicator(EVENTS)],
        lambda *a: defer.succeed(None),
        "w",
        Clock(),
        replicate_in_db=replicate,
        nudge=nudge,
    )
    row = ["$e", "!r", "m.room.message", None, None, 1000]
    consumer.rows_received("w", 1, [[*row, 5]])
    assert len(applies) == 1 and nudges == []  # nothing waits behind it: no nudge
    consumer.rows_received("w", 2, [[*row, 6]])
    assert nudges == [1] and len(applies) == 2 and consumer.applied == 1
    applies[-1].callback(None)
    assert consumer.applied == 2 and not consumer.busy
