"""Recent rows in memory, and replay reads shared between connections.

:class:`RecentWindow` keeps the most recent rows of each stream as the encoded
``RDATA`` bytes the fan-out already made, one :class:`Chunk` per fan-out read
(whole tokens: a batch is never split), in a memory bounded in bytes across
all streams; the oldest chunks are dropped first. A stream's chunks are
contiguous: chunk *n* starts at the token where chunk *n - 1* ended. A span
with no rows (the fan-out moved the live token on with a ``POSITION``) is a
chunk of no bytes.

A replay that starts inside the window (``after`` at or above the oldest
chunk's start) is answered from these bytes, without touching storage; one
that starts in the middle of a chunk gets the chunk's bytes from the first
line after ``after`` (the chunk's token offsets are found once, when first
needed). Each chunk holds the variants (with and without ``ts``) the fan-out
encoded; a variant it does not hold is read from storage.

:class:`SharedReads` makes concurrent replays of the same range share one
storage read: reads in flight and a few recent answers are kept by
``(stream, after, with_ts)``.

No sockets here and no database: the master feeds the window and asks it.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable

from twisted.internet import defer
from twisted.python.failure import Failure

# What a chunk costs beyond its bytes (objects, dict, deque slot): counted so
# that a flood of empty POSITION spans is bounded too.
CHUNK_OVERHEAD = 256

Read = tuple[bytes, int, int]  # (RDATA bytes, last token, row count)


class Chunk:
    """Rows of one stream in ``(after, last]``, encoded once per variant."""

    __slots__ = ("_index", "after", "count", "data", "last", "size")

    def __init__(self, after: int, last: int, count: int, data: dict[bool, bytes]) -> None:
        self.after = after
        self.last = last
        self.count = count
        self.data = data
        self.size = CHUNK_OVERHEAD + sum(len(b) for b in data.values())
        self._index: dict[bool, tuple[array, array, array]] = {}

    def tail(self, after: int, with_ts: bool) -> Read | None:
        """The lines of rows with tokens above ``after`` (inside this chunk)."""
        data = self.data.get(with_ts)
        if data is None:
            return None
        if after <= self.after:
            return data, self.last, self.count
        if self.count == 0:
            return b"", self.last, 0
        index = self._index.get(with_ts)
        if index is None:
            index = self._index[with_ts] = token_offsets(data)
        tokens, ends, lines = index
        i = bisect_right(tokens, after)  # tokens[:i] are <= after
        if i == len(tokens):
            return b"", self.last, 0
        start = ends[i - 1] if i else 0
        sent = lines[i - 1] if i else 0
        return data[start:], self.last, self.count - sent


def token_offsets(data: bytes) -> tuple[array, array, array]:
    """For each line that carries a real token: the token, where its line ends, lines so far."""
    tokens = array("q")
    ends = array("q")
    lines = array("q")
    offset = 0
    for n, line in enumerate(data.split(b"\n")[:-1], 1):
        offset += len(line) + 1
        token = line.split(b" ", 4)[3]
        if token != b"batch":
            tokens.append(int(token))
            ends.append(offset)
            lines.append(n)
    return tokens, ends, lines


class RecentWindow:
    """The recent encoded rows of every stream, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._streams: dict[str, deque[Chunk]] = {}
        self._order: deque[tuple[str, Chunk]] = deque()  # every chunk, oldest first

    def append(self, stream: str, after: int, last: int, count: int, data: dict[bool, bytes]) -> None:
        """Rows in ``(after, last]`` (none when ``count`` is 0), as the fan-out sent them."""
        chunks = self._streams.setdefault(stream, deque())
        if chunks and chunks[-1].last != after:
            self.forget(stream)  # not contiguous: the rows in between are not here
            chunks = self._streams.setdefault(stream, deque())
        if count == 0 and chunks and chunks[-1].count == 0:
            chunks[-1].last = last  # one span without rows
            return
        chunk = Chunk(after, last, count, data)
        if chunk.size > self.max_bytes:
            self.forget(stream)
            return
        chunks.append(chunk)
        self._order.append((stream, chunk))
        self.size += chunk.size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_bytes and self._order:
            stream, chunk = self._order.popleft()
            chunks = self._streams.get(stream)
            if chunks and chunks[0] is chunk:
                chunks.popleft()
                self.size -= chunk.size

    def forget(self, stream: str) -> None:
        """Drop a stream's chunks (its live token moved on without them)."""
        chunks = self._streams.pop(stream, None)
        if chunks:
            self.size -= sum(c.size for c in chunks)
            dropped = {id(c) for c in chunks}
            self._order = deque(item for item in self._order if id(item[1]) not in dropped)

    def start(self, stream: str) -> int | None:
        """The oldest token a replay may start at and be served from memory."""
        chunks = self._streams.get(stream)
        return chunks[0].after if chunks else None

    def read(self, stream: str, after: int, upto: int, limit_rows: int, with_ts: bool) -> Read | None:
        """Rows after ``after`` (up to ``upto``, about ``limit_rows``) from memory; None if not all here.

        Whole chunks are returned, joined while they add up to fewer than
        ``limit_rows`` rows; an answer of no rows ends where a span without
        rows ends.
        """
        chunks = self._streams.get(stream)
        if not chunks or after < chunks[0].after or after >= chunks[-1].last:
            return None
        # Chunks are contiguous and in token order: find the one holding after + 1.
        lo, hi = 0, len(chunks) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if chunks[mid].last <= after:
                lo = mid + 1
            else:
                hi = mid
        first = chunks[lo].tail(after, with_ts)
        if first is None or first[1] > upto:
            return None
        if first[2] == 0:
            return first
        parts = [first[0]]
        last, count = first[1], first[2]
        for i in range(lo + 1, len(chunks)):
            chunk = chunks[i]
            if count >= limit_rows or chunk.count == 0 or chunk.last > upto:
                break
            data = chunk.data.get(with_ts)
            if data is None:
                break
            parts.append(data)
            last = chunk.last
            count += chunk.count
        return (parts[0] if len(parts) == 1 else b"".join(parts)), last, count


class SharedReads:
    """Replay reads from storage shared by key ``(stream, after, with_ts)``.

    A read in flight is shared by every replay that asks for the same start
    (and an end at or above it); answers are kept for later askers, the most
    recent first, within ``max_bytes``.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._done: OrderedDict[tuple[str, int, bool], Read] = OrderedDict()
        self._flying: dict[tuple[str, int, bool], tuple[int, list[defer.Deferred[Read]]]] = {}
        self.shared = 0  # reads answered without a storage read of their own

    def read(
        self,
        stream: str,
        after: int,
        upto: int,
        with_ts: bool,
        start: Callable[[], defer.Deferred[Read]],
    ) -> defer.Deferred[Read]:
        key = (stream, after, with_ts)
        done = self._done.get(key)
        if done is not None and done[1] <= upto:
            self._done.move_to_end(key)
            self.shared += 1
            return defer.succeed(done)
        flying = self._flying.get(key)
        if flying is not None and flying[0] <= upto:
            self.shared += 1
            waiter: defer.Deferred[Read] = defer.Deferred()
            flying[1].append(waiter)
            return waiter
        waiters: list[defer.Deferred[Read]] = []
        mine: defer.Deferred[Read] = defer.Deferred()
        waiters.append(mine)
        if flying is None:
            self._flying[key] = (upto, waiters)
        d = start()
        d.addCallbacks(self._answered, self._failed, callbackArgs=(key, waiters), errbackArgs=(key, waiters))
        return mine

    def _answered(self, result: Read, key: tuple[str, int, bool], waiters: list[defer.Deferred[Read]]) -> None:
        if self._flying.get(key, (0, None))[1] is waiters:
            del self._flying[key]
        if result[2] and len(result[0]) <= self.max_bytes:
            old = self._done.pop(key, None)
            if old is not None:
                self.size -= len(old[0])
            self._done[key] = result
            self.size += len(result[0])
            while self.size > self.max_bytes:
                _, dropped = self._done.popitem(last=False)
                self.size -= len(dropped[0])
        for w in waiters:
            w.callback(result)

    def _failed(self, failure: Failure, key: tuple[str, int, bool], waiters: list[defer.Deferred[Read]]) -> None:
        if self._flying.get(key, (0, None))[1] is waiters:
            del self._flying[key]
        for w in waiters:
            w.errback(failure)
