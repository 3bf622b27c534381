"""Bulk writes: any number of rows, streamed, in one transaction, all or nothing.

``write_rows`` takes rows lazily (a generator reading a file or stdin), checks
and inserts them in chunks inside one write transaction of the store
(``store.writing``), and keeps their tokens compactly (:class:`TokenRuns`), so
memory stays flat whatever the input's size. A bad row (or a bad line of the
input, raised by the generator) or a storage failure rolls everything back:
the caller prints the tokens only once ``write_rows`` has returned, after the
commit.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any

from storage.contracts import StreamStore
from storage.limits import MAX_BATCH_ROWS
from storage.schema import RowError
from storage.store import CommitUnknown, StorageError, error_line

Row = Sequence[Any] | Mapping[str, Any]
CHUNK_ROWS = 2000  # rows checked and inserted per statement batch


class TokenRuns:
    """Tokens in order, kept as runs ``(first, count, step)``: step 1 for consecutive tokens, 0 for a batch."""

    __slots__ = ("_count", "_runs")

    def __init__(self) -> None:
        self._runs: list[list[int]] = []
        self._count = 0

    def add(self, tokens: Iterable[int]) -> None:
        runs = self._runs
        for token in tokens:
            self._count += 1
            if runs:
                run = runs[-1]
                first, count, step = run
                if count == 1 and token - first in (0, 1):
                    run[1], run[2] = 2, token - first
                    continue
                if count > 1 and token == first + count * step:
                    run[1] += 1
                    continue
            runs.append([token, 1, 0])

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        for first, count, step in self._runs:
            if step:
                yield from range(first, first + count)
            else:
                for _ in range(count):
                    yield first

    @property
    def runs(self) -> int:
        return len(self._runs)

    def write_lines(self, out: IO[str]) -> None:
        """One token per line, in blocks (never the whole output in memory)."""
        block: list[str] = []
        for token in self:
            block.append(str(token))
            if len(block) >= 10_000:
                out.write("\n".join(block) + "\n")
                block.clear()
        if block:
            out.write("\n".join(block) + "\n")


def write_rows(
    store: StreamStore,
    stream: str,
    rows: Iterable[tuple[str, Row]],
    instance_name: str,
    batch: bool = False,
    chunk_rows: int = CHUNK_ROWS,
) -> TokenRuns:
    """Append ``(where, row)`` pairs in one transaction; returns their tokens after the commit.

    ``where`` names a row for errors ("stdin line 10001"): a RowError's
    message starts with it. Database errors become one-line StorageErrors;
    in every failure nothing is committed, but where the connection was lost
    once the ``COMMIT`` was sent: then the error says the write may have
    committed. ``rows`` given as a list of at most ``chunk_rows`` pairs (the
    transactions of ``tickline write --commit-every``) go through the store's
    ``append``, in as few round trips as it can.
    """
    tokens = TokenRuns()
    if batch:
        # One token for every row: they are checked and inserted in one append,
        # so that their timestamps are allocated with the token (a stream's ts
        # increases with its token). Every client holds a batch whole, so a
        # batch is bounded: one row past the bound is enough to refuse it.
        chunk_rows = MAX_BATCH_ROWS + 1
    with _write_errors():
        if isinstance(rows, list) and len(rows) <= chunk_rows:
            if rows:
                tokens.add(_appended(lambda chunk: store.append(stream, chunk, instance_name, batch), rows))
            return tokens
        with store.writing(stream, instance_name) as txn:
            chunk: list[tuple[str, Row]] = []
            for pair in rows:
                chunk.append(pair)
                if len(chunk) >= chunk_rows:
                    tokens.add(_appended(lambda rows: txn.append(rows, batch), chunk))
                    chunk = []
            if chunk:
                tokens.add(_appended(lambda rows: txn.append(rows, batch), chunk))
    return tokens


@contextlib.contextmanager
def _write_errors() -> Iterator[None]:
    """A failed write's error as one line that says whether anything may have committed."""
    try:
        yield
    except RowError:
        raise
    except CommitUnknown as e:
        raise StorageError(
            f"the write may have committed: the connection was lost as it committed ({error_line(e)}); "
            "look for its rows before writing them again"
        ) from None
    except StorageError as e:
        raise StorageError(f"the write failed, nothing was committed: {error_line(e)}") from None
    except Exception as e:
        if type(e).__name__ == "Fenced":
            raise StorageError(
                "the write failed, nothing was committed: this writer was declared dead while writing "
                "(it did not report for master.writer_timeout); run it again"
            ) from None
        if is_database_error(e):
            raise StorageError(f"the write failed, nothing was committed: {error_line(e)}") from None
        raise


def _appended(append: Callable[[list[Row]], list[int]], chunk: list[tuple[str, Row]]) -> list[int]:
    """``append`` of the chunk's rows; a RowError names the row by its place."""
    try:
        return append([row for _, row in chunk])
    except RowError as e:
        if e.index is None:
            raise
        raise RowError(f"{chunk[e.index][0]}: {e.reason}") from None


def is_database_error(e: Exception) -> bool:
    if isinstance(e, sqlite3.Error):
        return True
    psycopg2 = sys.modules.get("psycopg2")
    return psycopg2 is not None and isinstance(e, psycopg2.Error)
