"""The live fan-out's reads ahead: the next chunks of a stream read while this one is fanned out.

The master's live loop (``Master._advance``) reads a stream's new rows in
chunks of about ``fanout_rows`` rows, each chunk whole tokens, and fans each
chunk out in token order. With ``depth`` 1 the next chunk is read (on a
database thread) while the current one is fanned out: ``(last, head]``, the
read itself finds where it ends. With a larger ``depth`` (PostgreSQL, where
the server's line building bounds the delivery and another backend can build
the next lines on the other core) more chunks are read at once, each on its
own thread and connection; a read's start must then be known before the
reads before it end. So each is a **range of tokens**: ``(start, start +
span]``, ``span`` the tokens the last chunk held per ``fanout_rows`` rows
(one row per token: ``fanout_rows``), the next starting where it ends, with
a bound of ``2 * fanout_rows`` rows (a read never returns part of a token;
if the bound cuts it, it ends before its range).

The first ranges of a pass span a quarter of that: the fan-out waits for the
first read, which on PostgreSQL takes about 1 µs of the server's time per row
(docs/benchmarks.md, pgread3: the first row of a 200,000-row commit came
after 25-31 ms with full ranges, 8-12 ms with these).

A read is used only by the chunk that starts where it starts (and in the
same variants): :meth:`ReadAhead.take`. A read that ended before its range
(burnt tokens at its end, more rows than the bound) leaves the next reads
starting where nothing will; they are dropped, and the loop reads from where
it is. Nothing is sent but in token order and from whole reads: the reads
only change which database thread builds which chunk.

A replay that reads storage (``replication.subscriptions``) reads ahead the
same way, in chunks of ``catchup_rows``: with depth 1 (SQLite) one chunk
while the client drains the last, with a larger depth that many ranges at
once (pgread4: replay-storage-1 on PostgreSQL read one chunk at a time, the
server idle while the master made a chunk's lines).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from twisted.internet import defer

logger = logging.getLogger(__name__)

# A pass's first ranges span fanout_rows / FIRST_SPAN_DIVISOR tokens (see ReadAhead.__init__).
FIRST_SPAN_DIVISOR = 4

# What a read gives: the live fan-out's encoded variants, or a replay's bytes (replication.window.Read).
Chunk = TypeVar("Chunk")


class ReadAhead(Generic[Chunk]):
    """Reads ahead of one stream's live fan-out or replay, at most ``depth`` at once (see the module doc).

    ``read(stream, after, upto, limit, variants)``: the chunk, read on a database thread.
    """

    def __init__(
        self,
        read: Callable[[str, int, int, int, tuple[bool, ...]], defer.Deferred[Chunk]],
        stream: str,
        rows: int,
        depth: int,
    ) -> None:
        self._read = read
        self._stream = stream
        self._rows = rows
        self._depth = max(depth, 1)
        # The first ranges are short: the fan-out starts once the first read is in, and the
        # ranges after it take the span the chunks show (chunk_read).
        self._span = max(1, rows // FIRST_SPAN_DIVISOR)
        # (start, end of the range asked, variants, the read)
        self._reads: deque[tuple[int, int, tuple[bool, ...], defer.Deferred[Chunk]]] = deque()

    @property
    def depth(self) -> int:
        return self._depth

    def __len__(self) -> int:
        """Reads asked and not taken."""
        return len(self._reads)

    def take(self, start: int, variants: tuple[bool, ...]) -> tuple[int, defer.Deferred[Chunk]] | None:
        """``(end, read)`` of the chunk that starts at ``start``, if one was asked: it reads ``(start, end]``.

        None if none was: every read is dropped.
        """
        if self._reads and self._reads[0][0] == start and self._reads[0][2] == variants:
            _start, end, _variants, read = self._reads.popleft()
            return end, read
        self.drop()
        return None

    def chunk_read(self, after: int, last: int, count: int) -> None:
        """A chunk of ``count`` rows in ``(after, last]`` came: the span of the next ranges follows it."""
        if count > 0 and last > after:
            self._span = max(1, min(self._rows * (last - after) // count, 16 * self._rows))

    def fill(self, last: int, head: int, variants: tuple[bool, ...]) -> None:
        """Ask the reads after ``last`` (the chunk being fanned out ends there) up to ``head``."""
        if self._reads and (self._reads[0][0] != last or self._reads[0][2] != variants):
            self.drop()
        start = self._reads[-1][1] if self._reads else last
        while len(self._reads) < self._depth and start < head:
            if self._depth == 1:
                end, limit = head, self._rows  # the read finds its end
            else:
                end, limit = min(start + self._span, head), 2 * self._rows
            self._reads.append((start, end, variants, self._read(self._stream, start, end, limit, variants)))
            start = end

    def drop(self) -> None:
        """Let every read go (the loop left, or they are not used): their results or failures are ignored."""
        while self._reads:
            _let_go(self._reads.popleft()[3])


def _let_go(d: defer.Deferred[Any]) -> None:
    d.addErrback(lambda f: logger.debug("a read ahead was not used: %s", f.getErrorMessage()))
