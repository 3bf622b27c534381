"""Streams on SQLite, the embedded default.

Writes take the database's write lock first (``BEGIN IMMEDIATE``), so token
allocation, the timestamp oracle and the rows commit together, and tokens
commit in order.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from storage import sqlite_order, time_index, tso
from storage.contracts import JsonRow, Row, StoredRow
from storage.limits import DEFAULT_MAX_LINE_BYTES, batch_step_rows, check_rows
from storage.schema import ROW_JSON_COLUMN, ROW_LINE_COLUMN, StreamSchema, check_instance_name
from storage.sqlite_db import WRITER_CHECKPOINT_BYTES, SqliteChangeWatch, SqliteDatabase
from storage.sqlite_order import UNORDERED_TABLE, OrderedStream, StreamOrder
from storage.store import StreamCatalog


class SqliteStreamStore:
    """Implements :class:`storage.contracts.StreamStore`; holds its :class:`SqliteDatabase`."""

    max_line_bytes: int | None = DEFAULT_MAX_LINE_BYTES  # refuse rows whose RDATA line could be longer
    parallel_reads = 1  # concurrent reads of one database cost more than they give (docs/benchmarks.md)

    def __init__(
        self,
        path: str,
        clock: Callable[[], float] = time.time,
        busy_timeout_ms: int = 30_000,
    ) -> None:
        # A master following the database checkpoints it (storage.sqlite_db); its writers only past a backstop.
        self.database = SqliteDatabase(path, busy_timeout_ms, WRITER_CHECKPOINT_BYTES)
        self._clock = clock
        self._catalog = StreamCatalog(self.database)
        self._order = StreamOrder()  # which streams are read by rowid search (storage.sqlite_order)

    @property
    def path(self) -> str:
        return self.database.path

    def migrate(self) -> list[int]:
        """Create or upgrade the tables; returns the migration versions applied.

        Then every stream table created before ``row_line`` existed gets the
        column (and ``row_json``, if it predates that too), filled for its
        rows, and the trigger that drops a stored line when its row is changed
        by hand (:meth:`add_row_lines`); and every stream table gets the
        order triggers and loses its indexes, or keeps them if its rows are
        not in rowid order (:meth:`order_tables`).
        """
        applied: list[int] = self.database.migrate()
        if self.database.read(self._tables_to_upgrade):  # a write (the lock) only when needed
            self.database.write(self.add_row_lines)
        if self.database.read(self._tables_to_order):
            self.database.write(self.order_tables)
        return applied

    @staticmethod
    def _tables_to_order(conn: sqlite3.Connection) -> list[tuple[StreamSchema, bool, set[str]]]:
        """Stream tables not in the shape of ``storage.sqlite_order``: each with its mark and its indexes.

        Missing an order trigger, an unmarked one with an index (created by
        an earlier tickline), or a marked one without its indexes.
        """
        found = []
        objects = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('trigger', 'index')")}
        marked = {row[0] for row in conn.execute(f"SELECT stream FROM {UNORDERED_TABLE}")}
        for name, columns in conn.execute("SELECT name, columns FROM tickline_streams ORDER BY name").fetchall():
            schema = StreamSchema.from_columns_json(name, columns)
            table = schema.table
            indexes = {f"{table}_token", f"{table}_ts"} & objects
            triggers = {f"{table}_order_insert", f"{table}_order_update"}
            is_marked = name in marked
            if not triggers <= objects or (indexes if not is_marked else len(indexes) < 2):
                found.append((schema, is_marked, indexes))
        return found

    def order_tables(self, conn: sqlite3.Connection) -> list[str]:
        """In a write transaction: each stream table to the shape of ``storage.sqlite_order``; returns the streams changed.

        The order triggers first; then a table with indexes (an earlier
        tickline's) whose rows are in rowid order (one scan of the table)
        loses them, and one whose rows are not is marked and keeps them. A
        marked table gets its indexes. One transaction, under the write
        lock: no write slips in between the scan and the triggers.
        """
        changed = []
        for schema, marked, indexes in self._tables_to_order(conn):
            for statement in sqlite_order.order_triggers_sql(schema):
                conn.execute(statement)
            if not marked and indexes and conn.execute(sqlite_order.out_of_order_sql(schema)).fetchone():
                conn.execute(f"INSERT OR IGNORE INTO {UNORDERED_TABLE} (stream) VALUES (?)", (schema.name,))
                marked = True
            for statement in sqlite_order.index_sql(schema) if marked else sqlite_order.drop_index_sql(schema):
                conn.execute(statement)
            changed.append(schema.name)
        return changed

    @staticmethod
    def _tables_to_upgrade(conn: sqlite3.Connection) -> list[tuple[StreamSchema, set[str]]]:
        """The stream tables without ``row_line`` or its trigger, each with the columns it has."""
        missing = []
        triggers = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        for name, columns in conn.execute("SELECT name, columns FROM tickline_streams ORDER BY name").fetchall():
            schema = StreamSchema.from_columns_json(name, columns)
            have = {row[1] for row in conn.execute("SELECT * FROM pragma_table_info(?)", (schema.table,))}
            if have and (ROW_LINE_COLUMN not in have or f"{schema.table}_stale_line" not in triggers):
                missing.append((schema, have))
        return missing

    def add_row_lines(self, conn: sqlite3.Connection) -> list[str]:
        """In a write transaction: add ``row_line`` (and ``row_json``) to the stream tables without it, and fill it.

        Each row's line is written by the same encoder as new rows'
        (:func:`row_line_encoder`, a Python function SQLite calls for each
        row), so the lines are byte for byte the same as for rows written after
        the upgrade; ``row_json`` (the values alone, stored by the tickline
        before) is set to NULL: the line holds it. Then the trigger
        (``StreamSchema.stale_lines_trigger_sql``). One transaction: every
        table is upgraded or none. Returns the streams upgraded.
        """
        upgraded = []
        for schema, have in self._tables_to_upgrade(conn):
            if ROW_LINE_COLUMN not in have:
                encode = row_line_encoder(schema)
                conn.create_function(
                    "tickline_row_line",
                    2 + len(schema.columns),
                    lambda instance, token, *values: encode(instance, token, values),
                    deterministic=True,
                )
                if ROW_JSON_COLUMN not in have:
                    conn.execute(f"ALTER TABLE {schema.table} ADD COLUMN {ROW_JSON_COLUMN} BLOB")
                conn.execute(f"ALTER TABLE {schema.table} ADD COLUMN {ROW_LINE_COLUMN} BLOB")
                conn.execute(
                    f"UPDATE {schema.table} SET {ROW_JSON_COLUMN} = NULL, {ROW_LINE_COLUMN} = "
                    f"tickline_row_line(instance_name, token, {', '.join(schema.column_names)})"
                )
            conn.execute(schema.stale_lines_trigger_sql())
            upgraded.append(schema.name)
        return upgraded

    def close(self) -> None:
        self.database.close()

    def catalog(self) -> dict[str, StreamSchema]:
        return self._catalog.catalog()

    # -- time (storage.time_index) ------------------------------------------------------

    def first_token_at(self, stream: str, since_ts: int) -> time_index.TokenAt:
        """The first token at or after ``since_ts``: a binary search over the rowid (a marked stream: its ``ts`` index)."""
        schema = self.schema(stream)

        def run(conn: sqlite3.Connection, ordered: bool) -> time_index.TokenAt:
            if not ordered:
                return time_index.search_by_ts(conn, schema.table, "sqlite", "?", since_ts)
            found = OrderedStream(conn, schema).first_from_ts(since_ts)
            return time_index.TokenAt(None, None, 1) if found is None else time_index.TokenAt(found[1], found[2], 1)

        result: time_index.TokenAt = self._order.read(self.database, schema, run)
        return result

    def last_ts_upto(self, stream: str, token: int) -> int | None:
        """The timestamp of the last row with a token at or below ``token`` (None: no such row)."""
        schema = self.schema(stream)

        def run(conn: sqlite3.Connection, ordered: bool) -> int | None:
            if not ordered:
                found = conn.execute(time_index.last_ts_upto_sql(schema.table, "?"), (token,)).fetchone()
                return None if found is None else int(found[0])
            last = OrderedStream(conn, schema).last_upto(token)
            return None if last is None else last[2]

        result: int | None = self._order.read(self.database, schema, run)
        return result

    def safe_point(self, expire_writers: bool = True, allocate: bool = True) -> tuple[dict[str, int], dict[str, int]]:
        """``time_index.safe_point``; an allocation only if the write lock is free now.

        While a writer holds the lock (a long transaction), the oracle's mark
        is read instead, which is as safe (``time_index.oracle_last``): the
        master's pass never waits behind a writer, so the rows that writer
        commits are read as soon as they are there.
        """
        if allocate:
            done, first = self.database.try_write(lambda conn: self._allocate_timestamps(conn, 1))
            if done:
                return time_index.safe_point(self, expire_writers, allocate=False, taken=first)
        return time_index.safe_point(self, expire_writers, allocate=False)

    def schema(self, stream: str) -> StreamSchema:
        return self._catalog.schema(stream)

    # -- schema ---------------------------------------------------------------

    def register_stream(self, schema: StreamSchema) -> None:
        """Create the stream's table if missing; refuse a changed declaration."""

        def run(conn: sqlite3.Connection) -> None:
            if self._catalog.registered_already(conn, schema):
                return
            for statement in [*schema.create_table_sql("sqlite"), *sqlite_order.order_triggers_sql(schema)]:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO tickline_streams (name, columns) VALUES (?, ?)",
                (schema.name, schema.columns_json()),
            )
            conn.execute("INSERT INTO tickline_stream_heads (stream, token) VALUES (?, 0)", (schema.name,))

        self.database.write(run)
        self._catalog.remember(schema)

    # -- writing ----------------------------------------------------------------

    def append(self, stream: str, rows: Iterable[Row], instance_name: str, batch: bool = False) -> list[int]:
        """Append rows in one transaction; returns the token of each row.

        Each row gets its own token, or with ``batch`` all rows share one.
        Every row is checked first (columns, and ``max_line_bytes``): a bad
        row is a RowError naming it, and nothing is written.
        """
        with self.writing(stream, instance_name) as txn:
            return txn.append(rows, batch)

    @contextlib.contextmanager
    def writing(self, stream: str, instance_name: str) -> Iterator[SqliteWriteTransaction]:
        """One write transaction: ``append`` any number of times, commit on exit (all or nothing)."""
        schema = self.schema(stream)
        check_instance_name(instance_name)
        with self.database.transaction() as conn:
            yield SqliteWriteTransaction(self, conn, schema, instance_name)

    def _allocate_timestamps(self, conn: sqlite3.Connection, count: int) -> int:
        (last,) = conn.execute("SELECT last_ts FROM tickline_tso WHERE id = 1").fetchone()
        first = tso.allocate(last, int(self._clock() * 1000), count)
        conn.execute("UPDATE tickline_tso SET last_ts = ? WHERE id = 1", (first + count - 1,))
        return first

    def allocate_timestamps(self, count: int = 1) -> list[int]:
        """Timestamps from the oracle without writing rows (strictly increasing)."""
        first = self.database.write(lambda conn: self._allocate_timestamps(conn, count))
        return list(range(first, first + count))

    # -- reading ----------------------------------------------------------------

    def heads(self) -> dict[str, int]:
        """The highest committed token of every stream."""
        rows = self.database.read(
            lambda conn: conn.execute("SELECT stream, token FROM tickline_stream_heads").fetchall()
        )
        return dict(rows)

    def safe_positions(self, expire_writers: bool = True) -> dict[str, int]:
        """Per stream, the token up to which every row has committed.

        On SQLite the write lock makes tokens commit in order, so that is the head.
        """
        return self.heads()

    def notifier(self) -> None:
        """SQLite has no change notification: the master polls (:meth:`change_watch`)."""
        return None

    def change_watch(self) -> SqliteChangeWatch:
        """A cheap check for commits of other connections (``PRAGMA data_version``), for the master's poller."""
        return SqliteChangeWatch(self.path)

    def open_wake(self) -> None:
        """SQLite reads on the database threads (no non-blocking connection)."""
        return None

    def retire_writers(self) -> None:
        """Nothing to retire: SQLite writers need no positions."""

    def read_rows(self, stream: str, after: int, upto: int, limit: int) -> list[StoredRow]:
        """Rows with ``after < token <= upto`` in order, about ``limit`` of them.

        Never splits a token: if the limit falls inside a token's rows, the rest
        of that token's rows are read too.
        """
        schema = self.schema(stream)
        return self._read_range(
            schema, f"seq, token, instance_name, ts, {', '.join(schema.column_names)}", after, upto, limit
        )

    def read_rows_json(self, stream: str, after: int, upto: int, limit: int) -> list[JsonRow]:
        """Like :meth:`read_rows`, but each row is ``(seq, token, instance_name, ts, json)``.

        ``json`` is the UTF-8 bytes of the JSON array of the row's columns, as
        the writer stored it (in ``row_line``): the master's fan-out then sends
        it as it is, without making Python objects of every value.
        """
        schema = self.schema(stream)
        return self._read_range(
            schema,
            f"seq, token, CAST(instance_name AS BLOB), ts, {self._row_json(schema)}",
            after,
            upto,
            limit,
        )

    @classmethod
    def _row_json(cls, schema: StreamSchema) -> str:
        """SQL for a row's JSON array (a BLOB): the values part of the stored ``row_line``.

        The line is ``RDATA <stream> <instance> <token> <values>\n``, so the
        values start after ``9 + len(stream) + len(instance) + len(token)``
        bytes (instance names are ASCII). A row without ``row_line`` has its
        ``row_json`` (written by the tickline before ``row_line``), or, written
        by a tickline older than both while this one had already upgraded the
        table, is built by SQLite from the columns (``json_array``: the same
        values, a double possibly written with more digits).
        """
        skip = f"{9 + len(schema.name)} + length(instance_name) + length(token)"
        stored = f"substr({ROW_LINE_COLUMN}, {skip} + 1, length({ROW_LINE_COLUMN}) - ({skip}) - 1)"
        built = f"CAST(json_array({', '.join(cls._json_values(schema))}) AS BLOB)"
        return f"coalesce({ROW_JSON_COLUMN}, {stored}, {built})"

    @classmethod
    def _line(cls, schema: StreamSchema, stored: bool, with_ts: bool) -> str:
        """SQL for a row's whole line (a BLOB, the newline included), ``:prefix`` before the instance.

        ``stored``: the stored ``row_line`` where there is one (the caller's
        prefix is ``RDATA <stream> ``, the one it holds). ``with_ts``: the
        row's ``ts`` added to the values (the line's last two bytes are ``]\n``).
        """
        built = f"CAST(:prefix || instance_name || ' ' || token || ' ' || {cls._row_json(schema)} || char(10) AS BLOB)"
        line = f"coalesce({ROW_LINE_COLUMN}, {built})" if stored else built
        if with_ts:
            line = f"CAST(substr({line}, 1, length({line}) - 2) || ',' || ts || char(93, 10) AS BLOB)"
        return line

    @staticmethod
    def _json_values(schema: StreamSchema) -> list[str]:
        """SQL for each column's value in the row's JSON array."""
        values = []
        for column in schema.columns:
            if column.type == "json":
                values.append(f"json({column.name})")
            elif column.type == "double":
                # json_array keeps only 15 digits of a double; 17 round-trip exactly.
                values.append(
                    f"CASE WHEN {column.name} IS NULL THEN NULL ELSE json(printf('%!.17g', {column.name})) END"
                )
            elif column.type == "boolean":
                values.append(
                    f"CASE WHEN {column.name} IS NULL THEN NULL WHEN {column.name} THEN json('true') ELSE json('false') END"
                )
            else:
                values.append(column.name)
        return values

    def read_lines_json(
        self, stream: str, after: int, upto: int, limit: int, prefix: str, with_ts: bool
    ) -> tuple[bytes, int, int] | None:
        """Whole lines from the stored ``row_line`` in one value (no Python object per row); None if a batch is in range.

        Reads the tokens ``(after, min(upto, after + limit)]`` (SQLite's tokens
        are dense, so that is about ``limit`` rows; over a gap it moves to the
        next row's token first). One ``group_concat`` of each row's stored
        line with no separator: SQLite only copies stored bytes (the value is
        not copied again in Python, under the GIL). With ``ts`` (or a row
        without a stored line, or another ``prefix``) each line is built in
        the statement from the stored values (:meth:`_line`).

        The rows are scanned as a range of ``seq`` (the rowid: no lookup from
        the token index into the table per row) when the range is laid out as
        tickline writes it (:meth:`_read_seq_range`), else through the token
        index in ``(token, seq)`` order (:meth:`_read_token_range`).

        Batches (rows sharing a token: None, the caller builds ``batch``
        lines; a batch's stored lines carry its token, never read as they
        are): the seq range proves one row per token; through the token
        index, more rows than tokens in ``[first, last]`` is a batch, and
        otherwise the distinct tokens are counted (an index-only scan, on this
        path only): rows deleted by hand (a gap) can hide a batch of as many
        rows from a count alone.
        """
        schema = self.schema(stream)
        table = schema.table
        lines = f"CAST(group_concat({self._line(schema, prefix == f'RDATA {stream} ', with_ts)}, '') AS BLOB)"
        first_row = (
            f"SELECT token, seq FROM {table} INDEXED BY {table}_token "
            "WHERE token > ? AND token <= ? ORDER BY token, seq LIMIT 1"
        )
        last_row = (
            f"SELECT token, seq FROM {table} INDEXED BY {table}_token "
            "WHERE token > ? AND token <= ? ORDER BY token DESC, seq DESC LIMIT 1"
        )
        rows_in = f"SELECT count(*) FROM {table} INDEXED BY {table}_token WHERE token > ? AND token <= ?"
        by_seq = (
            f"SELECT {lines}, count(*), total(token - seq <> :offset) FROM {table} WHERE seq >= :first AND seq <= :last"
        )
        by_token = (
            f"SELECT {lines}, count(*), min(token), max(token) "
            f"FROM {table} INDEXED BY {table}_token WHERE token > :after AND token <= :end"
        )
        distinct = f"SELECT count(DISTINCT token) FROM {table} INDEXED BY {table}_token WHERE token > ? AND token <= ?"

        def run(conn: sqlite3.Connection, ordered: bool) -> tuple[bytes, int, int] | None:
            if ordered:
                return self._read_ordered_lines(conn, schema, lines, after, upto, limit, prefix)
            found = conn.execute(first_row, (after, upto)).fetchone()
            if found is None:
                return b"", after, 0
            token, seq = found
            # From the first row's token (past a gap, if any), about limit tokens.
            end = min(upto, max(after, token - 1) + max(limit, 1))
            read = self._read_seq_range(conn, by_seq, last_row, rows_in, prefix, after, end, token, seq)
            if read is not None:
                return read
            return self._read_token_range(conn, by_token, distinct, prefix, after, end)

        result: tuple[bytes, int, int] | None = self._order.read(self.database, schema, run)
        return result

    @staticmethod
    def _read_ordered_lines(
        conn: sqlite3.Connection,
        schema: StreamSchema,
        lines: str,
        after: int,
        upto: int,
        limit: int,
        prefix: str,
    ) -> tuple[bytes, int, int] | None:
        """:meth:`read_lines_json` for an ordered stream: the tokens' rowid range from two binary searches.

        Tokens never decrease in ``seq`` order (no mark), so the rows from
        the first with a token above ``after`` to the last with one at or
        below the end are exactly the range's rows, in token order. Left to
        tell: whether two of them share a token (a batch: None). ``token -
        seq`` the same for every row proves one row per token (tickline's
        writes without batches); else more rows than tokens is a batch, and
        otherwise (holes from rows deleted by hand) neighbours are compared.
        """
        order = OrderedStream(conn, schema)
        first = order.first_after(after)
        if first is None or first[1] > upto:
            return b"", after, 0
        seq, token, _ = first
        # From the first row's token (past a gap, if any), about limit tokens.
        end = min(upto, max(after, token - 1) + max(limit, 1))
        last = order.last_upto(end)
        assert last is not None  # the first row's token is at or below end
        last_seq, last_token = last[0], last[1]
        table = schema.table
        params = {"prefix": prefix, "first": seq, "last": last_seq, "offset": token - seq}
        data, count, off_layout = conn.execute(
            f"SELECT {lines}, count(*), total(token - seq <> :offset) FROM {table} WHERE seq >= :first AND seq <= :last",
            params,
        ).fetchone()
        if off_layout:
            if count > last_token - token + 1:
                return None  # rows sharing a token: batch lines, built by the caller
            (shared,) = conn.execute(
                "SELECT count(*) FROM (SELECT token, lag(token) OVER (ORDER BY seq) AS previous "
                f"FROM {table} WHERE seq >= ? AND seq <= ?) WHERE token = previous",
                (seq, last_seq),
            ).fetchone()
            if shared:
                return None
        return data, last_token, count

    @staticmethod
    def _read_seq_range(
        conn: sqlite3.Connection,
        by_seq: str,
        last_row: str,
        rows_in: str,
        prefix: str,
        after: int,
        end: int,
        token: int,
        seq: int,
    ) -> tuple[bytes, int, int] | None:
        """The lines of the tokens ``(after, end]`` scanned as the rowid range of their first and last rows.

        None when that cannot be proven to be exactly those rows in token
        order (the caller reads through the token index). tickline's writes
        insert rows with a larger ``seq`` than every row before them (the
        rowid, allocated on insert) and take their tokens from the head
        under the same write lock, in the same transaction, so ``seq`` order
        is token order and, where no token holds several rows, ``token - seq``
        is the same for every row of a range: the first row's ``c``. The
        proof, for the rows of ``[first seq, last seq]``: each has ``token =
        seq + c`` (so their tokens rise with ``seq``, one row per token, all
        within the first and the last row's tokens, so inside ``(after,
        end]``), and there are as many of them as the token index counts in
        ``(after, end]``: they are every row of the token range, in token
        order. A batch, a row written by hand or anything else off that
        layout fails a check, and the token index is read instead.
        """
        last_token, last_seq = conn.execute(last_row, (after, end)).fetchone()
        offset = token - seq
        if last_token - last_seq != offset:
            return None  # a batch (or rows not laid out as tickline writes them) in between
        params = {"prefix": prefix, "first": seq, "last": last_seq, "offset": offset}
        data, count, off_layout = conn.execute(by_seq, params).fetchone()
        if off_layout or count != conn.execute(rows_in, (after, end)).fetchone()[0]:
            return None
        return data, last_token, count

    @staticmethod
    def _read_token_range(
        conn: sqlite3.Connection,
        by_token: str,
        distinct: str,
        prefix: str,
        after: int,
        end: int,
    ) -> tuple[bytes, int, int] | None:
        """The lines of the tokens ``(after, end]`` in ``(token, seq)`` order of the token index; None: a batch."""
        params = {"prefix": prefix, "after": after, "end": end}
        data, count, low, last = conn.execute(by_token, params).fetchone()
        if count > last - low + 1:
            return None  # rows sharing a token: batch lines, built by the caller
        # As many rows as tokens or fewer: one row per token, or rows deleted by hand
        # (a gap) as many as a batch has rows too; only the distinct tokens tell.
        (tokens,) = conn.execute(distinct, (after, end)).fetchone()
        if tokens != count:
            return None
        return data, last, count

    def _read_range(self, schema: StreamSchema, columns: str, after: int, upto: int, limit: int) -> list[Any]:
        first = f"SELECT {columns} FROM {schema.table} WHERE token > ? AND token <= ? ORDER BY token, seq LIMIT ?"
        rest = f"SELECT {columns} FROM {schema.table} WHERE token = ? AND seq > ? ORDER BY seq"
        # An ordered stream (storage.sqlite_order): the rows are a rowid range.
        by_seq = f"SELECT {columns} FROM {schema.table} WHERE seq >= ? AND seq <= ? ORDER BY seq LIMIT ?"
        rest_by_seq = f"SELECT {columns} FROM {schema.table} WHERE seq > ? AND seq <= ? ORDER BY seq"

        def run(conn: sqlite3.Connection, ordered: bool) -> list[Any]:
            if ordered:
                order = OrderedStream(conn, schema)
                start, end = order.first_after(after), order.last_upto(upto)
                if start is None or end is None or start[0] > end[0]:
                    return []
                rows = conn.execute(by_seq, (start[0], end[0], limit)).fetchall()
                if len(rows) == limit and rows:
                    seq, token = rows[-1][0], rows[-1][1]
                    token_end = order.last_upto(token)
                    assert token_end is not None
                    rows.extend(conn.execute(rest_by_seq, (seq, token_end[0])).fetchall())
                return rows
            rows = conn.execute(first, (after, upto, limit)).fetchall()
            if len(rows) == limit and rows:
                last = rows[-1]
                rows.extend(conn.execute(rest, (last[1], last[0])).fetchall())
            return rows

        result: list[Any] = self._order.read(self.database, schema, run)
        return result


class SqliteWriteTransaction:
    """Rows appended in one open write transaction (see ``SqliteStreamStore.writing``).

    With ``batch``, the transaction's batch appends share one token as long
    as no other token of the stream is allocated between them, as on
    PostgreSQL. Here only the transaction itself can (its own rows outside the
    batch): it holds the database's write lock from its start to its end.
    """

    def __init__(self, store: SqliteStreamStore, conn: sqlite3.Connection, schema: StreamSchema, instance: str) -> None:
        self._store = store
        self._conn = conn
        self._schema = schema
        self._instance = instance
        placeholders = ", ".join("?" * (4 + len(schema.columns)))
        self._insert = (
            f"INSERT INTO {schema.table} (token, instance_name, ts, {', '.join(schema.column_names)}, "
            f"{ROW_LINE_COLUMN}) VALUES ({placeholders})"
        )
        self._line = row_line_encoder(schema)
        self._batch_token: int | None = None
        self._batch_rows = 0  # rows of the batch token so far
        self._last_token = 0

    def append(self, rows: Iterable[Row], batch: bool = False) -> list[int]:
        values = check_rows(self._schema, rows, self._store.max_line_bytes)
        if not values:
            return []
        count = len(values)
        # A batch append continues the batch token if it is still the stream's last token.
        shared = batch and self._batch_token is not None and self._last_token == self._batch_token
        batch_rows = batch_step_rows(self._schema.name, self._batch_rows, count, shared) if batch else 0
        conn = self._conn
        if shared:
            assert self._batch_token is not None
            first_token = self._batch_token
        else:
            token_count = 1 if batch else count
            (head,) = conn.execute(
                "UPDATE tickline_stream_heads SET token = token + ? WHERE stream = ? RETURNING token",
                (token_count, self._schema.name),
            ).fetchone()
            first_token = head - token_count + 1
        tokens = [first_token] * count if batch else list(range(first_token, first_token + count))
        # Recorded before the rows go in: an insert that fails after some rows, caught by the caller
        # who goes on, must still make the next batch step take a token after these.
        if batch:
            self._batch_token, self._batch_rows = first_token, batch_rows
        self._last_token = tokens[-1]
        first_ts = self._store._allocate_timestamps(conn, count)
        instance = self._instance
        line = self._line
        # row_line (the row's RDATA line) in the rows' own statement: all rows or none.
        conn.executemany(
            self._insert,
            [
                (token, instance, first_ts + i, *row, line(instance, token, row))
                for i, (token, row) in enumerate(zip(tokens, values, strict=True))
            ],
        )
        return tokens


def row_line_encoder(schema: StreamSchema) -> Callable[[str, int, Sequence[Any]], bytes]:
    """A function: ``(instance, token, values)`` -> the row's stored ``row_line``.

    ``RDATA <stream> <instance> <token> <values>\n``, the values as
    :meth:`StreamSchema.values_encoder` writes them: the line the master sends
    for a row that is not part of a batch (a batch's rows carry its token
    here too; the master builds ``batch`` lines for them from the values).
    """
    encode = schema.values_encoder()
    head = f"RDATA {schema.name} ".encode()

    def line(instance: str, token: int, values: Sequence[Any]) -> bytes:
        return b"%b%b %d %b\n" % (head, instance.encode(), token, encode(values))

    return line
