"""A catching-up subscription reads its next storage chunk while the client drains the one that paused it.

One read ahead at most (a store without parallel reads), held until the
connection resumes, used only from where it starts; let go when the
subscription is replaced, closed or goes live. With parallel reads, ranges
of tokens read at once and written in order. Subscriptions against a fake
master and connection (no reactor).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer

from replication.commands import Command
from replication.subscriptions import Subscription, Subscriptions
from replication.window import Read


class Source:
    """A master whose storage reads are answered by the test."""

    instance_name = "master"
    parallel_reads = 1

    def __init__(self, head: int) -> None:
        self.head = head
        self.reads: list[tuple[int, int]] = []  # (after, upto) of each storage read asked
        self.pending: dict[int, defer.Deferred[Read]] = {}
        self.live: list[Subscription] = []

    def live_token(self, stream: str) -> int:
        return self.head

    def read_recent(self, stream: str, after: int, upto: int, limit: int, with_ts: bool) -> Read | None:
        return None

    def fill_recent(self, stream: str, after: int, with_ts: bool) -> defer.Deferred[None] | None:
        return None

    def read_encoded(self, stream: str, after: int, upto: int, limit: int, with_ts: bool) -> defer.Deferred[Read]:
        self.reads.append((after, upto))
        d: defer.Deferred[Read] = defer.Deferred()
        self.pending[after] = d
        return d

    def read_encoded_since(self, *args: Any) -> defer.Deferred[Read]:
        raise AssertionError("no reads from a time here")

    def answer(self, after: int, rows: int) -> None:
        """The chunk of ``rows`` rows after ``after``: one line per token."""
        data = b"".join(b"RDATA s master %d []\n" % t for t in range(after + 1, after + rows + 1))
        self.pending.pop(after).callback((data, after + rows, rows))

    def join_live(self, target: Any, sub: Subscription) -> None:
        self.live.append(sub)

    def leave_live(self, target: Any, sub: Subscription) -> None:
        if sub in self.live:
            self.live.remove(sub)

    def count_catchup_rows(self, count: int) -> None:
        pass


class Outlet:
    """A connection whose every write pauses it while ``slow``."""

    conn_name = "test"
    closing = False

    def __init__(self) -> None:
        self.data = b""
        self.slow = True
        self.subs: Subscriptions | None = None

    def write(self, data: bytes) -> None:
        self.data += data
        if self.slow and self.subs is not None:
            self.subs.pause()

    def send(self, command: Command) -> None:
        self.data += command.encode()

    def close_with_error(self, message: str) -> None:
        raise AssertionError(message)

    def went_live(self, stream: str) -> None:
        pass


def _setup(head: int) -> tuple[Source, Outlet, Subscriptions]:
    source, outlet = Source(head), Outlet()
    subs = Subscriptions(source, outlet, catchup_rows=10)
    outlet.subs = subs
    return source, outlet, subs


def _tokens(data: bytes) -> list[int]:
    return [int(line.split(b" ")[3]) for line in data.splitlines() if line.startswith(b"RDATA ")]


def test_the_next_chunk_is_read_while_the_client_drains_and_sent_on_resume() -> None:
    source, outlet, subs = _setup(head=30)
    subs.start("s", 0)
    assert source.reads == [(0, 30)]
    source.answer(0, 10)  # written; the write paused the connection
    assert subs.paused and _tokens(outlet.data) == list(range(1, 11))
    assert source.reads == [(0, 30), (10, 30)]  # one read ahead, no more
    source.answer(10, 10)
    assert _tokens(outlet.data) == list(range(1, 11))  # held while paused
    assert source.reads == [(0, 30), (10, 30)]
    outlet.slow = False
    subs.resume()
    assert _tokens(outlet.data) == list(range(1, 21))
    assert source.reads[2:] == [(20, 30)]  # not paused: no read ahead, the next read as before
    source.answer(20, 10)
    assert _tokens(outlet.data) == list(range(1, 31))
    assert len(source.reads) == 3 and len(source.live) == 1  # caught up: live


def test_a_read_ahead_still_in_flight_on_resume_is_the_next_read() -> None:
    source, outlet, subs = _setup(head=30)
    subs.start("s", 0)
    source.answer(0, 10)
    outlet.slow = False
    subs.resume()  # the read ahead has not answered yet: nothing new is asked
    assert source.reads == [(0, 30), (10, 30)]
    source.answer(10, 10)
    source.answer(20, 10)
    assert _tokens(outlet.data) == list(range(1, 31))


def test_a_read_ahead_is_let_go_when_the_subscription_is_replaced_or_closed() -> None:
    source, outlet, subs = _setup(head=50)
    subs.start("s", 0)
    source.answer(0, 10)
    first = subs.get("s")
    assert first is not None and first.reads is not None and len(first.reads) == 1
    assert source.reads[-1] == (10, 50)
    ahead = source.pending[10]
    subs.start("s", 25)  # a new REPLICATE: the old read ahead is not used
    assert len(first.reads) == 0
    source.pending.pop(10).errback(RuntimeError("gone"))  # ignored (no unhandled error)
    assert ahead.called
    subs.resume()
    assert source.reads[-1] == (25, 50)
    source.answer(25, 10)
    second = subs.get("s")
    assert second is not None and second.reads is not None and len(second.reads) == 1
    assert source.reads[-1] == (35, 50)
    subs.close()
    assert len(second.reads) == 0
    source.answer(35, 10)  # answered after the close: nothing written
    assert _tokens(outlet.data) == [*range(1, 11), *range(26, 36)]


def _setup_parallel(head: int) -> tuple[Source, Outlet, Subscriptions]:
    source, outlet, subs = _setup(head)
    source.parallel_reads = 2
    outlet.slow = False
    return source, outlet, subs


def _answer_tokens(source: Source, after: int, tokens: list[int]) -> None:
    """The chunk after ``after`` with one row for each of ``tokens`` (the last is its end)."""
    data = b"".join(b"RDATA s master %d []\n" % t for t in tokens)
    source.pending.pop(after).callback((data, tokens[-1] if tokens else after, len(tokens)))


def test_parallel_reads_ask_ranges_at_once_and_write_them_in_order() -> None:
    source, outlet, subs = _setup_parallel(head=100)
    subs.start("s", 0)
    # Two ranges at once (the first a quarter of catchup_rows tokens), each bounded at twice its rows.
    assert source.reads == [(0, 2), (2, 4)]
    _answer_tokens(source, 2, [3, 4])  # the second answers first: held, nothing written
    assert outlet.data == b""
    _answer_tokens(source, 0, [1, 2])
    assert _tokens(outlet.data) == [1, 2, 3, 4]
    # Each chunk read asks the next range: two in flight, spans following the chunks' density.
    assert source.reads[2:] == [(4, 14), (14, 24)]
    _answer_tokens(source, 4, list(range(5, 15)))
    assert _tokens(outlet.data) == list(range(1, 15))
    assert len(source.pending) == 2  # (14, 24] and the next range


def test_a_range_without_rows_moves_the_replay_to_its_end_and_a_short_one_reads_on_from_its_last() -> None:
    source, outlet, subs = _setup_parallel(head=100)
    subs.start("s", 0)
    _answer_tokens(source, 0, [])  # no row in (0, 2]: POSITION up to 2
    assert outlet.data == b"POSITION s master 0 2\n"
    _answer_tokens(source, 2, [3])  # (2, 4] ended at 3 (as a bound cutting a batch does)
    assert _tokens(outlet.data) == [3]
    # The range asked after it starts at 4, where nothing will: let go, read on from 3.
    assert source.reads[2:] == [(4, 6), (3, 13), (13, 23)]
    _answer_tokens(source, 4, [5, 6])  # the one let go: not written
    assert _tokens(outlet.data) == [3]
    _answer_tokens(source, 3, list(range(4, 14)))
    assert _tokens(outlet.data) == list(range(3, 14))
