"""SQLite stream tables without secondary indexes: rows found by binary search over the rowid.

tickline's writers append a stream's rows in rowid (``seq``) order with tokens
and timestamps taken under the same write lock, so in ``seq`` order both
``token`` and ``ts`` never decrease. A stream table therefore needs no
``token`` or ``ts`` index: a row by token or by time is a binary search over
``seq`` (:func:`bound_sql`, a recursive CTE whose every probe is one descent
of the table's own B-tree, at most 64 of them). One index fewer per row makes
a large write's ``COMMIT`` cheap (an index's rebalances rewrite interior
pages spilled long before, and the ``COMMIT`` then reads the WAL back;
docs/benchmarks.md, "sqlive4").

Rows that break that order (written by hand, or by anything else than
tickline's writer) are caught by two triggers on the stream table
(:func:`order_triggers_sql`): an insert whose token or timestamp is below
the previous row's, an insert below the last ``seq``, or an update of
``seq``, ``token`` or ``ts`` marks the stream in ``tickline_unordered``.
A marked stream is read as before (``ORDER BY token, seq`` and the lookup by
``ts``, through the indexes of :func:`index_sql`, which the store creates
again as soon as a read finds the mark: :class:`StreamOrder`). A mark is
for good.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from storage.schema import StreamSchema

UNORDERED_TABLE = "tickline_unordered"

T = TypeVar("T")


class Transactions(Protocol):
    """What :class:`StreamOrder` needs of a SQLite database: a read and a write transaction on a database thread."""

    def read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any: ...

    def write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any: ...


class IndexesMissing(Exception):
    """A read found a stream marked unordered whose indexes are not there (yet): create them, read again."""

    def __init__(self, schema: StreamSchema) -> None:
        super().__init__(schema.name)
        self.schema = schema


def index_sql(schema: StreamSchema) -> list[str]:
    """The indexes a marked (unordered) stream is read through: ``(token)`` (with the rowid) and ``(ts)``."""
    table = schema.table
    return [
        f"CREATE INDEX IF NOT EXISTS {table}_token ON {table} (token)",
        f"CREATE INDEX IF NOT EXISTS {table}_ts ON {table} (ts)",
    ]


def drop_index_sql(schema: StreamSchema) -> list[str]:
    table = schema.table
    return [f"DROP INDEX IF EXISTS {table}_token", f"DROP INDEX IF EXISTS {table}_ts"]


def order_triggers_sql(schema: StreamSchema) -> list[str]:
    """The triggers that mark the stream in ``tickline_unordered`` when a row breaks the rowid order.

    Insert: a row whose ``seq`` is below the table's last (inserted in the
    middle), or whose token or timestamp is below the row before it: one
    look at the last row other than the new one (a step back from the end
    of the rowid B-tree, in pages the insert has just touched), which is
    the row before it unless the new row went in below it. Rows appended by
    tickline's writer pass (about 0.6 µs per row in a large write, the
    trigger's own cost included; docs/benchmarks.md, "sqlive4"). Update:
    any change of ``seq``, ``token`` or ``ts``.
    """
    table = schema.table
    mark = f"INSERT OR IGNORE INTO {UNORDERED_TABLE} (stream) VALUES ('{schema.name}')"
    last_other = f"SELECT seq, token, ts FROM {table} WHERE seq <> NEW.seq ORDER BY seq DESC LIMIT 1"
    return [
        f"CREATE TRIGGER IF NOT EXISTS {table}_order_insert AFTER INSERT ON {table} "
        f"WHEN EXISTS (SELECT 1 FROM ({last_other}) AS p "
        "WHERE p.seq > NEW.seq OR p.token > NEW.token OR p.ts > NEW.ts) "
        f"BEGIN {mark}; END",
        f"CREATE TRIGGER IF NOT EXISTS {table}_order_update AFTER UPDATE OF seq, token, ts ON {table} "
        "WHEN NEW.seq IS NOT OLD.seq OR NEW.token IS NOT OLD.token OR NEW.ts IS NOT OLD.ts "
        f"BEGIN {mark}; END",
    ]


def out_of_order_sql(schema: StreamSchema) -> str:
    """One row (or none) that breaks the order of the table's rows: for the upgrade of an existing table (one scan)."""
    return (
        "SELECT 1 FROM (SELECT token, ts, lag(token) OVER w AS pt, lag(ts) OVER w AS pts "
        f"FROM {schema.table} WINDOW w AS (ORDER BY seq)) WHERE token < pt OR ts < pts LIMIT 1"
    )


def bound_sql(table: str, column: str, op: str, value: str) -> str:
    """``(seq, token, ts)`` of the first row in ``seq`` order with ``column op value``; no row if none.

    For an ordered stream only (``column`` never decreases in ``seq``
    order, so the condition is false, then true). A binary search over
    ``[min(seq), max(seq)]`` by recursive CTE: each probe takes the first
    row at or after the middle (rowids may have holes), one descent of the
    table's B-tree. The last probe's row is checked once more (no row may
    qualify). ``value`` is an SQL expression (a parameter).
    """

    def probe(mid: str) -> str:
        return f"(SELECT {column} FROM {table} WHERE seq >= {mid} ORDER BY seq LIMIT 1) {op} {value}"

    # SQLite allows the recursive table once, in the step's own FROM: the next
    # bounds are written out where they are used (one probe per step all the same).
    low = "CASE WHEN yes THEN lo ELSE lo + (hi - lo) / 2 + 1 END"
    high = "CASE WHEN yes THEN lo + (hi - lo) / 2 ELSE hi END"
    return (
        "WITH RECURSIVE b(lo, hi, yes) AS ("
        f"SELECT l, h, {probe('l + (h - l) / 2')} FROM (SELECT "
        f"(SELECT min(seq) FROM {table}) AS l, (SELECT max(seq) FROM {table}) AS h) "
        "UNION ALL "
        f"SELECT {low}, {high}, {probe(f'{low} + ({high} - {low}) / 2')} FROM b WHERE lo < hi) "
        f"SELECT seq, token, ts FROM (SELECT seq, token, ts FROM {table} "
        "WHERE seq >= (SELECT lo FROM b WHERE lo >= hi) ORDER BY seq LIMIT 1) "
        f"WHERE {column} {op} {value}"
    )


def before_sql(table: str) -> str:
    """``(seq, token, ts)`` of the last row before ``:seq`` in ``seq`` order (the row before a bound)."""
    return f"SELECT seq, token, ts FROM {table} WHERE seq < :seq ORDER BY seq DESC LIMIT 1"


def last_sql(table: str) -> str:
    return f"SELECT seq, token, ts FROM {table} ORDER BY seq DESC LIMIT 1"


class OrderedStream:
    """The bounds of an ordered stream's token ranges, on one connection (inside the caller's read)."""

    def __init__(self, conn: sqlite3.Connection, schema: StreamSchema) -> None:
        self._conn = conn
        table = schema.table
        self._after_token = bound_sql(table, "token", ">", ":v")
        self._from_ts = bound_sql(table, "ts", ">=", ":v")
        self._before = before_sql(table)
        self._last = last_sql(table)

    def first_after(self, token: int) -> tuple[int, int, int] | None:
        """``(seq, token, ts)`` of the first row with a token above ``token``."""
        found = self._conn.execute(self._after_token, {"v": token}).fetchone()
        return None if found is None else (int(found[0]), int(found[1]), int(found[2]))

    def last_upto(self, token: int) -> tuple[int, int, int] | None:
        """``(seq, token, ts)`` of the last row with a token at or below ``token``."""
        found = self.first_after(token)
        if found is None:
            last = self._conn.execute(self._last).fetchone()
        else:
            last = self._conn.execute(self._before, {"seq": found[0]}).fetchone()
        if last is None or int(last[1]) > token:
            return None
        return int(last[0]), int(last[1]), int(last[2])

    def first_from_ts(self, ts: int) -> tuple[int, int, int] | None:
        """``(seq, token, ts)`` of the first row with ``ts`` at or above ``ts``."""
        found = self._conn.execute(self._from_ts, {"v": ts}).fetchone()
        return None if found is None else (int(found[0]), int(found[1]), int(found[2]))


class StreamOrder:
    """Which streams of one SQLite store are read by rowid search, and the indexes of the others.

    :meth:`ordered` is asked inside each read's transaction (so the answer
    holds for what that read sees): a stream without a mark in
    ``tickline_unordered`` is ordered. For a marked one whose indexes are
    missing it raises :class:`IndexesMissing`; :meth:`read` then creates
    them in a write transaction (on the reading thread: a database thread of
    the master, never its reactor) and reads again. Without them every read
    of a marked stream would scan the table.
    """

    def __init__(self) -> None:
        self._indexed: set[str] = set()  # marked streams seen with their indexes (a mark is for good)

    def ordered(self, conn: sqlite3.Connection, schema: StreamSchema) -> bool:
        found = conn.execute(f"SELECT 1 FROM {UNORDERED_TABLE} WHERE stream = ?", (schema.name,)).fetchone()
        if found is None:
            return True
        if schema.name in self._indexed:
            return False
        names = {f"{schema.table}_token", f"{schema.table}_ts"}
        have = conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name IN (?, ?)", tuple(names)
        ).fetchone()[0]
        if have != len(names):
            raise IndexesMissing(schema)
        self._indexed.add(schema.name)
        return False

    def read(
        self,
        database: Transactions,
        schema: StreamSchema,
        fn: Callable[[sqlite3.Connection, bool], T],
    ) -> T:
        """``fn(conn, ordered)`` in one read transaction; a marked stream's indexes are created first if missing."""
        try:
            return database.read(lambda conn: fn(conn, self.ordered(conn, schema)))
        except IndexesMissing:
            database.write(lambda conn: create_indexes(conn, schema))
        return database.read(lambda conn: fn(conn, self.ordered(conn, schema)))


def create_indexes(conn: sqlite3.Connection, schema: StreamSchema) -> None:
    """In a write transaction: a marked stream's indexes (idempotent)."""
    for statement in index_sql(schema):
        conn.execute(statement)
