"""The live fan-out's reads ahead (replication.read_ahead): which ranges are asked, which read a chunk
takes, and that reads not used are let go."""

from __future__ import annotations

from twisted.internet import defer
from twisted.python.failure import Failure

from replication.read_ahead import ReadAhead, ReplayAhead


class Reads:
    """The database reads asked, each answered by the test."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, int, tuple[bool, ...]]] = []
        self.pending: list[defer.Deferred] = []

    def __call__(self, stream: str, after: int, upto: int, limit: int, variants: tuple[bool, ...]) -> defer.Deferred:
        assert stream == "s"
        self.asked.append((after, upto, limit, variants))
        d: defer.Deferred = defer.Deferred()
        self.pending.append(d)
        return d


def test_one_read_ahead_finds_its_own_end() -> None:
    reads = Reads()
    ahead = ReadAhead(reads, "s", 10, 1)
    ahead.chunk_read(0, 10, 10)
    ahead.fill(10, 100, (False,))
    ahead.fill(10, 100, (False,))  # already asked: nothing more
    assert reads.asked == [(10, 100, 10, (False,))]
    taken = ahead.take(10, (False,))
    assert taken is not None and taken[0] == 100 and taken[1] is reads.pending[0]
    ahead.fill(20, 20, (False,))  # at the head: nothing to read
    assert len(reads.asked) == 1


def test_two_reads_ahead_are_ranges_of_tokens_one_after_the_other() -> None:
    reads = Reads()
    ahead = ReadAhead(reads, "s", 10, 2)
    ahead.chunk_read(0, 10, 10)  # one row per token
    ahead.fill(10, 35, (True,))
    assert reads.asked == [(10, 20, 20, (True,)), (20, 30, 20, (True,))]
    assert ahead.take(10, (True,)) == (20, reads.pending[0])
    ahead.fill(20, 35, (True,))  # the second is still asked; one more up to the head
    assert reads.asked[2:] == [(30, 35, 20, (True,))]
    # Batches: 50 rows in 5 tokens, so the next ranges hold about 10 rows each.
    assert ahead.take(20, (True,)) is not None
    ahead.chunk_read(20, 25, 50)
    ahead.fill(25, 100, (True,))  # the read of (30, 35] starts elsewhere: dropped, asked again from 25
    assert reads.asked[3:] == [(25, 26, 20, (True,)), (26, 27, 20, (True,))]


def test_a_read_that_starts_elsewhere_or_in_other_variants_is_not_taken() -> None:
    reads = Reads()
    ahead = ReadAhead(reads, "s", 10, 2)
    ahead.fill(0, 100, (False,))
    assert ahead.take(0, (False, True)) is None  # the variants changed: every read dropped
    assert ahead.take(0, (False,)) is None
    ahead.fill(0, 100, (False,))
    assert ahead.take(5, (False,)) is None  # the last chunk ended before its range


def test_reads_let_go_swallow_their_failures() -> None:
    reads = Reads()
    ahead = ReadAhead(reads, "s", 10, 2)
    ahead.fill(0, 100, (False,))
    ahead.drop()
    failures = []
    for d in reads.pending:
        d.errback(Failure(RuntimeError("connection lost")))
        d.addErrback(failures.append)  # nothing left to catch: the drop handled it
    assert failures == []


class ReplayReads:
    def __init__(self) -> None:
        self.asked: list[tuple[str, int, int, int, bool]] = []
        self.pending: list[defer.Deferred] = []

    def __call__(self, stream: str, after: int, upto: int, limit: int, with_ts: bool) -> defer.Deferred:
        self.asked.append((stream, after, upto, limit, with_ts))
        d: defer.Deferred = defer.Deferred()
        self.pending.append(d)
        return d


def test_a_replays_next_read_starts_when_its_read_answers_and_is_taken_by_its_next_ask() -> None:
    reads = ReplayReads()
    ahead = ReplayAhead(reads, 2)
    result = (b"lines", 10, 10)
    assert ahead.answered(result, "s", 100, 10, False) is result
    assert reads.asked == [("s", 10, 100, 10, False)]
    ahead.answered(result, "s", 100, 10, False)  # already started: not again
    assert len(reads.asked) == 1
    assert ahead.take("s", 10, 100, True) is None  # another variant
    assert ahead.take("s", 10, 120, False) is reads.pending[0]  # a later head takes it
    assert ahead.take("s", 10, 120, False) is None  # taken once
    # Nothing after a read without rows, or one that reached its end.
    ahead.answered((b"", 100, 0), "s", 200, 10, False)
    ahead.answered((b"x", 100, 1), "s", 100, 10, False)
    assert len(reads.asked) == 1


def test_reads_ahead_of_replays_are_bounded_and_let_go() -> None:
    reads = ReplayReads()
    ahead = ReplayAhead(reads, 2)
    for last in (10, 20, 30):  # three replays: the third goes without (no read is stale yet)
        ahead.answered((b"x", last, 1), "s", 100, 10, False)
    assert [a[1] for a in reads.asked] == [10, 20]
    assert ahead.take("s", 30, 100, False) is None
    for _ in range(8):  # many answers later, the oldest read ahead is stale: let go for a new one
        ahead.answered((b"x", 100, 1), "s", 100, 10, False)
    ahead.answered((b"x", 40, 1), "s", 100, 10, False)
    assert [a[1] for a in reads.asked] == [10, 20, 40]
    assert ahead.take("s", 10, 100, False) is None
    reads.pending[0].errback(Failure(RuntimeError("lost")))  # let go: its failure is swallowed
    assert ahead.take("s", 20, 15, False) is None  # a read beyond the asker's end is not used
    reads.pending[1].errback(Failure(RuntimeError("lost")))
    ahead.drop()
    reads.pending[2].errback(Failure(RuntimeError("lost")))
    assert ahead.take("s", 40, 100, False) is None
    none = ReplayAhead(reads, 0)  # SQLite: no reads ahead
    none.answered((b"x", 40, 1), "s", 100, 10, False)
    assert len(reads.asked) == 3
