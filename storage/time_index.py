"""Time over streams: where a stream is at an instant, and up to when it is complete.

Two questions the master asks of storage, on either database:

* :func:`first_token_at`: the first token of a stream whose row has a
  timestamp at or after an instant (``REPLICATE <stream> @<unix_ms>``), in
  two statements, then the boundary check. On SQLite the first is one lookup
  in the stream's ``ts`` index (``stream_<name>_ts``, a B-tree: O(log n)
  pages, never a scan of the rows). On PostgreSQL the stream table has no
  ``ts`` index (one index fewer for every row written): the first statement
  is a binary search over the ``(token, seq)`` index every read uses
  (:func:`pg_search_sql`: at most 64 probes for the token and 64 within a
  token that holds many rows, each an O(log n) index descent, whatever the
  table's size). Both rely on ``ts`` being non-decreasing in ``(token, seq)``
  order within a stream, which both stores guarantee (see ``docs/time.md``:
  SQLite allocates both under the write lock, PostgreSQL in one statement
  under the oracle's lock); the second statement checks the boundary in the
  token index.

* :func:`safe_point`: a *safe time* for every stream at once: no row of the
  stream with a timestamp at or below it can ever have a token above the
  stream's safe position (proof in ``docs/time.md``). An oracle time ``t`` is
  taken first, then the safe positions and the allocated heads are read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attr

from storage import tso
from storage.schema import INT64_MAX, StreamSchema


class TimedDatabase(Protocol):
    """The database a store holds (``SqliteDatabase`` or ``PgDatabase``)."""

    @property
    def dialect(self) -> str: ...

    @property
    def placeholder(self) -> str: ...

    def read(self, fn: Callable[[Any], Any]) -> Any: ...

    def query(self, sql: str, params: Any = ()) -> list[Any]:
        """One statement's rows, in a transaction of its own (on PostgreSQL one round trip)."""
        ...


class TimedStore(Protocol):
    """What this module needs of a stream store (both stores have it; storage-internal)."""

    @property
    def database(self) -> TimedDatabase: ...

    def schema(self, stream: str) -> StreamSchema: ...

    def allocate_timestamps(self, count: int = 1) -> list[int]: ...

    def safe_positions(self, expire_writers: bool = True) -> dict[str, int]: ...

    def last_ts_upto(self, stream: str, token: int) -> int | None: ...


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TokenAt:
    """Where a stream stands at an instant.

    ``token`` is the first token with a row at or after the instant (None:
    no stored row is that recent); ``ts`` that row's timestamp; ``queries``
    how many statements the answer took (for tests and logs; on PostgreSQL
    the first is a binary search of bounded probes, see :func:`pg_search_sql`).
    """

    token: int | None
    ts: int | None
    queries: int

    @property
    def before(self) -> int | None:
        """The token just before the first row at or after the instant."""
        return None if self.token is None else self.token - 1


MAX_STORED_TS = INT64_MAX  # a row's ts is a signed 64-bit column in both databases


def ts_at_ms(unix_ms: int) -> int:
    """The lowest timestamp whose physical time is ``unix_ms``.

    Capped at the largest ``ts`` a row can hold: an instant past it (from
    about the year 3084 on) is after every row, and a database would refuse
    the larger integer.
    """
    return min(tso.compose(max(unix_ms, 0)), MAX_STORED_TS)


def pg_search_sql(table: str) -> str:
    """PostgreSQL: the first row of ``table`` in ``(token, seq)`` order with ``ts >= %(t)s``, as ``(token, ts)``.

    One statement, two binary searches by recursive CTE, every probe one
    descent of the ``(token, seq)`` index: first the lowest token ``m`` whose
    last row at or below it (``token <= m ORDER BY token DESC, seq DESC
    LIMIT 1``) has ``ts >= t``, between the table's lowest and highest token;
    then, within that token, the lowest ``seq`` the same way (a token holds
    one row unless written as a batch). Each search halves a 64-bit range:
    at most 64 probes each. No row (or the last row older than ``t``): no
    result.
    """
    last_upto = f"SELECT ts FROM {table} WHERE token <= {{}} ORDER BY token DESC, seq DESC LIMIT 1"
    last_in_token = f"SELECT ts FROM {table} WHERE token = {{}} AND seq <= {{}} ORDER BY token DESC, seq DESC LIMIT 1"
    return (
        "WITH RECURSIVE "
        f"ends AS (SELECT (SELECT token FROM {table} ORDER BY token LIMIT 1) AS lo, "
        f"(SELECT token FROM {table} ORDER BY token DESC LIMIT 1) AS hi), "
        "tok(lo, hi) AS ("
        f"SELECT lo, hi FROM ends WHERE hi IS NOT NULL AND ({last_upto.format('ends.hi')}) >= %(t)s "
        "UNION ALL "
        "SELECT CASE WHEN f.ts >= %(t)s THEN s.lo ELSE s.mid + 1 END, "
        "CASE WHEN f.ts >= %(t)s THEN s.mid ELSE s.hi END "
        "FROM (SELECT lo, hi, lo + (hi - lo) / 2 AS mid FROM tok WHERE lo < hi) AS s, "
        f"LATERAL ({last_upto.format('s.mid')}) AS f), "
        "found AS (SELECT lo AS token FROM tok WHERE lo = hi), "
        "sq(token, lo, hi) AS ("
        f"SELECT found.token, (SELECT seq FROM {table} WHERE token = found.token ORDER BY token, seq LIMIT 1), "
        f"(SELECT seq FROM {table} WHERE token = found.token ORDER BY token DESC, seq DESC LIMIT 1) FROM found "
        "UNION ALL "
        "SELECT s.token, CASE WHEN f.ts >= %(t)s THEN s.lo ELSE s.mid + 1 END, "
        "CASE WHEN f.ts >= %(t)s THEN s.mid ELSE s.hi END "
        "FROM (SELECT token, lo, hi, lo + (hi - lo) / 2 AS mid FROM sq WHERE lo < hi) AS s, "
        f"LATERAL ({last_in_token.format('s.token', 's.mid')}) AS f) "
        f"SELECT sq.token, (SELECT ts FROM {table} WHERE token = sq.token AND seq = sq.lo) FROM sq WHERE lo = hi"
    )


def first_token_at(store: TimedStore, stream: str, since_ts: int) -> TokenAt:
    """The first token of ``stream`` whose row has ``ts >= since_ts`` (see the module doc), through its indexes."""
    table = store.schema(stream).table
    db = store.database
    result: TokenAt = db.read(lambda cur: search_by_ts(cur, table, db.dialect, db.placeholder, since_ts))
    return result


def search_by_ts(cur: Any, table: str, dialect: str, p: str, since_ts: int) -> TokenAt:
    """:func:`first_token_at` in the caller's transaction (``cur``: a cursor or SQLite connection).

    On SQLite for a stream whose rows are marked out of order, read through
    its ``ts`` and ``token`` indexes (``storage.sqlite_order``).
    """
    before = f"SELECT token, ts FROM {table} WHERE token < {p} ORDER BY token DESC LIMIT 1"
    params: Any
    if dialect == "postgresql":
        by_ts, params = pg_search_sql(table), {"t": since_ts}
    else:
        by_ts, params = f"SELECT token, ts FROM {table} WHERE ts >= {p} ORDER BY ts LIMIT 1", (since_ts,)
    found = cur.execute(by_ts, params).fetchone()
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


def oracle_time(store: TimedStore) -> int:
    """A fresh timestamp from the oracle: every later allocation is above it."""
    return store.allocate_timestamps(1)[0]


def oracle_last(store: TimedStore) -> int:
    """The oracle's high-water mark: every timestamp handed out so far is at or below it.

    Cheaper than :func:`oracle_time` (a read, no commit) and just as safe, but
    it moves only when someone allocates.
    """
    sql = "SELECT last_ts FROM tickline_tso WHERE id = 1"
    if store.database.dialect == "postgresql":
        # The oracle's sequence holds what appends took (storage.pg_store); the table, what the master took.
        sql = "SELECT GREATEST(t.last_ts, s.last_value) FROM tickline_tso t, tickline_tso_seq s WHERE t.id = 1"
    return int(store.database.query(sql)[0][0])


def allocated_heads(store: TimedStore, streams: list[str]) -> dict[str, int]:
    """Per stream, the highest token allocated so far (committed or not).

    On SQLite that is the committed head (tokens are allocated in the writing
    transaction); on PostgreSQL the token sequence's last value.
    """
    if not streams:
        return {}
    db = store.database
    if db.dialect != "postgresql":
        rows = db.read(lambda cur: cur.execute("SELECT stream, token FROM tickline_stream_heads").fetchall())
        return {name: int(token) for name, token in rows}
    p = db.placeholder
    parts = [
        f"SELECT {p}, CASE WHEN is_called THEN last_value ELSE 0 END FROM {store.schema(name).table}_token_seq"
        for name in streams
    ]
    rows = db.query(" UNION ALL ".join(parts), tuple(streams))
    return {name: int(token) for name, token in rows}


def streams_with_live_writers(store: TimedStore) -> set[str] | None:
    """PostgreSQL: the streams that have a live writer (None on SQLite, where writers hold no tokens)."""
    if store.database.dialect != "postgresql":
        return None
    rows = store.database.query("SELECT DISTINCT stream FROM tickline_writers WHERE alive")
    return {row[0] for row in rows}


def last_ts_upto_sql(table: str, p: str) -> str:
    """The timestamp of the last row with a token at or below the parameter, through the token index."""
    return f"SELECT ts FROM {table} WHERE token <= {p} ORDER BY token DESC LIMIT 1"


def last_ts_upto(store: TimedStore, stream: str, token: int) -> int | None:
    """The timestamp of the last row with a token at or below ``token`` (None: no such row), through the token index.

    SQLite's store has its own (``SqliteStreamStore.last_ts_upto``: a
    binary search over the rowid); :func:`safe_point` asks the store.
    """
    table = store.schema(stream).table
    found = store.database.query(last_ts_upto_sql(table, store.database.placeholder), (token,))
    return int(found[0][0]) if found else None


def stream_safe_time(t: int, free: bool, last_ts: int | None) -> int | None:
    """One stream's safe time from the pass's oracle time ``t`` (None: none yet).

    ``free``: nothing is allocated above the safe position, or (PostgreSQL)
    the stream had no live writer; ``last_ts``: the timestamp of the last
    row at or below the position. That timestamp is always a safe time (every
    later token has a larger one); with ``free``, so is ``t``, and the larger
    of the two is taken: a write that committed between ``t`` and the
    positions lifts the safe time to its row, so the ``TICK`` after a row is
    never below that row's own timestamp.
    """
    if not free:
        return last_ts
    # Without a live writer, tokens above the position can never commit (dead
    # writers are fenced off and write again with new tokens and timestamps;
    # a writer that registers later allocates after t).
    return t if last_ts is None else max(t, last_ts)


def safe_point(
    store: TimedStore, expire_writers: bool = True, allocate: bool = True, taken: int | None = None
) -> tuple[dict[str, int], dict[str, int]]:
    """``(safe_ts, positions)``: per stream, a safe time and the safe position.

    No row of stream ``s`` with ``ts <= safe_ts[s]`` has a token above
    ``positions[s]`` (proof in ``docs/time.md``). A time ``t`` is taken from
    the oracle first (with ``allocate`` a fresh timestamp, so the safe time
    advances while nobody writes; without, the oracle's high-water mark), then
    the safe positions and the allocated heads are read. Where nothing is
    allocated above the safe position, every later token is allocated after
    ``t`` and has a larger timestamp: the safe time is ``t`` (or the last
    row's timestamp if larger, :func:`stream_safe_time`); so it is on
    PostgreSQL for a stream that had no live writer when the writers were read
    (before the positions). Where tokens above
    it are allocated (in flight, or committed above a writer still in flight,
    on PostgreSQL), they have larger timestamps than every token below them:
    the safe time is the timestamp of the last row at or below the position.
    ``taken``: a fresh timestamp the caller allocated just before (it is
    ``t``; SQLite allocates it only when the write lock is free).
    """
    if taken is not None:
        t = taken
    else:
        t = oracle_time(store) if allocate else oracle_last(store)
    # The live writers are read before the positions: a writer that commits
    # and leaves in between must still count as live here (its row may lie
    # above a position read while it was in flight).
    live = streams_with_live_writers(store)
    positions = store.safe_positions(expire_writers)
    heads = allocated_heads(store, sorted(positions))
    times: dict[str, int] = {}
    for stream, position in positions.items():
        last = store.last_ts_upto(stream, position)
        free = heads.get(stream, 0) <= position or (live is not None and stream not in live)
        found = stream_safe_time(t, free, last)
        if found is not None:
            times[stream] = found
    return times, positions
