"""The live fan-out's reads ahead (replication.read_ahead): which ranges are asked, which read a chunk
takes, and that reads not used are let go."""

from __future__ import annotations

from twisted.internet import defer
from twisted.python.failure import Failure

from replication.read_ahead import ReadAhead


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
    failures: list[Failure] = []
    for d in reads.pending:
        d.errback(Failure(RuntimeError("connection lost")))
        d.addErrback(failures.append)  # nothing left to catch: the drop handled it
    assert failures == []
