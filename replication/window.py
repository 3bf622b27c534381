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

import logging
from array import array
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable

from twisted.internet import defer
from twisted.python.failure import Failure

logger = logging.getLogger(__name__)

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
        self.size = CHUNK_OVERHEAD + sum(map(len, data.values()))
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
        self._stream_size: dict[str, int] = {}  # bytes of each stream's chunks
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
        self._stream_size[stream] = self._stream_size.get(stream, 0) + chunk.size
        self._evict()

    def prepend(self, stream: str, after: int, last: int, count: int, data: dict[bool, bytes], live: int) -> bool:
        """Rows in ``(after, last]`` read from storage, older than the stream's oldest chunk.

        Taken only when they join the window (``last`` is the oldest chunk's
        start, or with no chunk the live token ``live``) and fit in the free
        bytes: older rows never push newer ones out. True if taken.
        """
        chunks = self._streams.get(stream)
        if not (chunks[0].after == last if chunks else last == live) or after >= last:
            return False
        chunk = Chunk(after, last, count, data)
        if self.size + chunk.size > self.max_bytes:
            return False
        if chunks is None:
            chunks = self._streams[stream] = deque()
        chunks.appendleft(chunk)
        self._order.appendleft((stream, chunk))  # the oldest: evicted first
        self.size += chunk.size
        self._stream_size[stream] = self._stream_size.get(stream, 0) + chunk.size
        return True

    def stream_bytes(self, stream: str) -> int:
        """What the stream's chunks take (counted as for the bound)."""
        return self._stream_size.get(stream, 0)

    def free_bytes(self) -> int:
        return max(0, self.max_bytes - self.size)

    def bytes_per_token(self, stream: str) -> float | None:
        """The average size of the stream's chunks per token (for sizing a fill), or None."""
        chunks = self._streams.get(stream)
        if not chunks:
            return None
        tokens = chunks[-1].last - chunks[0].after
        size = self._stream_size.get(stream, 0)
        return size / tokens if tokens > 0 and size else None

    def _evict(self) -> None:
        while self.size > self.max_bytes and self._order:
            stream, chunk = self._order.popleft()
            chunks = self._streams.get(stream)
            if chunks and chunks[0] is chunk:
                chunks.popleft()
                self.size -= chunk.size
                self._stream_size[stream] -= chunk.size

    def forget(self, stream: str) -> None:
        """Drop a stream's chunks (its live token moved on without them)."""
        chunks = self._streams.pop(stream, None)
        self._stream_size.pop(stream, None)
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


class WindowFiller:
    """Extends a stream's window backwards from its oldest chunk, with large storage reads.

    On start the master warms each stream's window from its newest rows
    (:meth:`fill` down to token 0, as far as the free bytes go); a replay that
    starts below the window asks for the rows between its start and the
    window, and is served from memory once they are in (only when they are at
    most ``chunk_tokens``: one read or two; a replay from further below reads
    storage as it sends). One fill runs per
    stream at a time; replays that ask while it runs wait for it (one read
    for all of them). Each read is ``(lo, hi]`` of at most ``chunk_tokens``
    tokens, sized from the bytes per token already seen so that it fits; a
    fill stops when the window has no room, at a batch (a read whose range
    holds one is not offered as whole lines: the fill reads the tokens above
    it in halves, down to the batch, and replays below read storage), or when
    the window changed under it (the stream was dropped).
    """

    def __init__(
        self,
        window: RecentWindow,
        read_range: Callable[[str, int, int, bool], defer.Deferred[Read | None]],
        live_token: Callable[[str], int],
        chunk_tokens: int = 10000,
        read_bytes: int = 4 << 20,
        first_tokens: int = 64,
    ) -> None:
        self.window = window
        self._read_range = read_range
        self._live_token = live_token
        # Tokens per read at most: like the fan-out's reads (fanout_rows), a read
        # holds at most this many lines of at most max_line_bytes each.
        self.chunk_tokens = chunk_tokens
        self.read_bytes = read_bytes  # bytes per read, about (SQLite builds each read in memory)
        self.first_tokens = first_tokens  # the first read of a stream not in the window: its size is not known
        # A fill takes at most half the window, so that the live fan-out keeps room.
        self.max_fill_bytes = window.max_bytes // 2
        self.guess_bytes_per_token = 100.0  # before anything of the stream was read
        self._learned: dict[str, float] = {}  # bytes per token of the stream's last fill read
        self._gave_up: dict[str, int] = {}  # a fill from this token found no room: not again from there
        self._jobs: dict[str, tuple[int, bool, list[defer.Deferred[None]]]] = {}
        self.reads = 0  # storage reads made by fills

    def fill(
        self, stream: str, floor: int, with_ts: bool, whole: bool = True, reason: str = "a replay"
    ) -> defer.Deferred[None] | None:
        """Bring the stream's rows down to ``floor`` into the window; fires when the fill ends.

        With ``whole`` (a replay's request) nothing is started unless all of
        ``(floor, oldest]`` looks like it fits in the free bytes; None then,
        and also when there is nothing to do. A running fill that reaches
        ``floor`` (same variant) is joined.
        """
        job = self._jobs.get(stream)
        if job is not None:
            if job[0] <= floor and job[1] == with_ts:
                waiter: defer.Deferred[None] = defer.Deferred()
                job[2].append(waiter)
                return waiter
            return None
        start = self.window.start(stream)
        top = start if start is not None else self._live_token(stream)
        if top <= floor:
            return None
        if self._gave_up.get(stream, -1) == top:
            return None  # the last fill from here found no room (or a batch): storage
        if whole and not self._fits(stream, top - floor):
            return None
        if whole and top - floor > self.chunk_tokens:
            # A replay far below the window streams from storage instead (reads
            # shared by replays at the same place): a fill goes newest rows
            # first, so such a replay would get nothing until all of it is read.
            return None
        waiters: list[defer.Deferred[None]] = []
        self._jobs[stream] = (floor, with_ts, waiters)
        mine: defer.Deferred[None] = defer.Deferred()
        waiters.append(mine)
        run = defer.ensureDeferred(self._run(stream, floor, top, with_ts, whole))
        run.addBoth(self._done, stream, waiters, reason, self.reads)
        return mine

    def _per_token(self, stream: str) -> float | None:
        return self.window.bytes_per_token(stream) or self._learned.get(stream)

    def _fits(self, stream: str, tokens: int, budget: int | None = None) -> bool:
        per_token = self._per_token(stream) or self.guess_bytes_per_token
        if budget is None:
            budget = min(self.window.free_bytes(), self.max_fill_bytes)
        return tokens * per_token <= budget

    async def _run(self, stream: str, floor: int, top: int, with_ts: bool, whole: bool) -> None:
        window = self.window
        budget = min(window.free_bytes(), self.max_fill_bytes)
        narrowed: int | None = None  # after a read that held a batch: at most this many tokens per read
        while top > floor:
            if whole and not self._fits(stream, top - floor, budget):
                self._gave_up[stream] = top
                return
            per_token = self._per_token(stream)
            if per_token is None:
                tokens = min(self.first_tokens, top - floor)
            else:
                fits = int(budget / (per_token * 1.1))
                tokens = min(self.chunk_tokens, top - floor, fits, max(1, int(self.read_bytes / per_token)))
            if narrowed is not None:
                tokens = min(tokens, narrowed)
            if tokens < 1:
                if narrowed is not None:
                    self._gave_up[stream] = top  # the batch is the next token down
                return
            lo = top - tokens
            self.reads += 1
            result = await self._read_range(stream, lo, top, with_ts)
            if result is None:
                # A batch in (lo, top]: its lines are not offered whole (SQLite).
                # Read the tokens above it in halves (about two reads per
                # halving), so the window still reaches down to the batch.
                narrowed = tokens // 2
                continue
            data, last, count = result
            if last != top and count >= tokens:
                # The read may have been cut short of ``top`` by its limit
                # (PostgreSQL counts rows, and a batch holds several rows per
                # token): prepending would leave a hole in the window. Read
                # in halves, as above, down to the batch's token alone (read
                # whole), then wider again. Fewer rows than the limit: none
                # are left out (the store ends a read only after its limit).
                narrowed = tokens // 2
                continue
            if data:
                self._learned[stream] = len(data) / tokens
            if len(data) + CHUNK_OVERHEAD > budget:
                self._gave_up[stream] = top
                return
            if not window.prepend(stream, lo, top, count, {with_ts: data}, self._live_token(stream)):
                return
            budget -= len(data) + CHUNK_OVERHEAD
            top = lo
            if narrowed is not None:
                narrowed *= 2  # past the batch: back to full reads in a few steps

    def _done(
        self, result: object, stream: str, waiters: list[defer.Deferred[None]], reason: str, reads_before: int
    ) -> None:
        if self._jobs.get(stream, (0, False, None))[2] is waiters:
            del self._jobs[stream]
        if isinstance(result, Failure):
            logger.warning("filling the window of %s failed: %s", stream, result.getErrorMessage())
        elif self.reads > reads_before:
            start = self.window.start(stream)
            logger.info(
                "window of %s filled for %s: tokens %s..%d, %d bytes of %d in all, %d storage reads",
                stream,
                reason,
                "-" if start is None else start + 1,
                self._live_token(stream),
                self.window.stream_bytes(stream),
                self.window.size,
                self.reads - reads_before,
            )
        for w in waiters:
            w.callback(None)
