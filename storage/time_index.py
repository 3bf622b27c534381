"""Time over streams: where a stream is at an instant, and up to when it is complete.

Two questions the master asks of storage, on either database:

* :func:`first_token_at`: the first token of a stream whose row has a
  timestamp at or after an instant (``REPLICATE <stream> @<unix_ms>``). It
  is one lookup in the stream's ``ts`` index (``stream_<name>_ts``, a B-tree:
  a binary search of the index, O(log n) pages, never a scan of the rows) and
  one lookup in the ``token`` index to check the boundary. It relies on ``ts``
  being increasing in token within a stream, which both stores guarantee (see
  ``docs/time.md``: SQLite allocates both under the write lock, PostgreSQL in
  one statement under the oracle's row lock).

* :func:`safe_point`: a *safe time* for every stream at once. An oracle
  timestamp ``t`` is allocated first and the safe positions ``P`` are read
  after it; then no row of a stream with a timestamp at or below ``t`` can
  ever have a token above that stream's ``P`` (proof in ``docs/time.md``).
  Allocating ``t`` moves the oracle on, so the safe time advances while every
  stream is idle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attr

from storage import tso
from storage.schema import StreamSchema


class TimedStore(Protocol):
    """What this module needs of a stream store (both stores have it)."""

    placeholder: str

    def schema(self, stream: str) -> StreamSchema: ...

    def read(self, fn: Callable[[Any], Any]) -> Any: ...

    def allocate_timestamps(self, count: int = 1) -> list[int]: ...

    def safe_positions(self, expire_writers: bool = True) -> dict[str, int]: ...


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TokenAt:
    """Where a stream stands at an instant.

    ``token`` is the first token with a row at or after the instant (None:
    no stored row is that recent); ``ts`` that row's timestamp; ``queries``
    how many index lookups the answer took (for tests and logs).
    """

    token: int | None
    ts: int | None
    queries: int

    @property
    def before(self) -> int | None:
        """The token just before the first row at or after the instant."""
        return None if self.token is None else self.token - 1


def ts_at_ms(unix_ms: int) -> int:
    """The lowest timestamp whose physical time is ``unix_ms``."""
    return tso.compose(max(unix_ms, 0))


def first_token_at(store: TimedStore, stream: str, since_ts: int) -> TokenAt:
    """The first token of ``stream`` whose row has ``ts >= since_ts`` (see the module doc)."""
    schema = store.schema(stream)
    p = store.placeholder
    table = schema.table
    by_ts = f"SELECT token, ts FROM {table} WHERE ts >= {p} ORDER BY ts LIMIT 1"
    before = f"SELECT token, ts FROM {table} WHERE token < {p} ORDER BY token DESC LIMIT 1"

    def run(cur: Any) -> TokenAt:
        found = cur.execute(by_ts, (since_ts,)).fetchone()
        if found is None:
            return TokenAt(None, None, 1)
        token, ts = int(found[0]), int(found[1])
        queries = 1
        # Check the boundary in the token index: the row just before must be
        # older. If ts were not increasing in token (rows written by hand),
        # walk back a row at a time, a bounded number of steps.
        for _ in range(64):
            previous = cur.execute(before, (token,)).fetchone()
            queries += 1
            if previous is None or int(previous[1]) < since_ts:
                break
            token, ts = int(previous[0]), int(previous[1])
        return TokenAt(token, ts, queries)

    return store.read(run)


def oracle_time(store: TimedStore) -> int:
    """A fresh timestamp from the oracle: every later allocation is above it."""
    return store.allocate_timestamps(1)[0]


def oracle_last(store: TimedStore) -> int:
    """The oracle's high-water mark: every timestamp handed out so far is at or below it.

    Cheaper than :func:`oracle_time` (a read, no commit) and just as safe, but
    it moves only when someone allocates.
    """
    return int(store.read(lambda cur: cur.execute("SELECT last_ts FROM tickline_tso WHERE id = 1").fetchone()[0]))


def safe_point(store: TimedStore, expire_writers: bool = True, allocate: bool = True) -> tuple[int, dict[str, int]]:
    """``(t, positions)``: a safe time ``t`` and, per stream, the safe position.

    ``t`` is taken before the positions are read: every row of stream ``s``
    with ``ts <= t`` has a token ``<= positions[s]`` or never commits. With
    ``allocate`` it is a fresh oracle timestamp (the safe time advances while
    nobody writes); without, the oracle's high-water mark.
    """
    t = oracle_time(store) if allocate else oracle_last(store)
    return t, store.safe_positions(expire_writers)
