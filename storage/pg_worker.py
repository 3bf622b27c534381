"""A worker's database on PostgreSQL: the worker store and the snapshot reader.

Imported only for PostgreSQL URLs (it imports psycopg2).
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson
import psycopg2
import psycopg2.errors
import psycopg2.extensions

from storage.contracts import Effects, EscapeFreeRows, ReceivedRows, ReplicatedValues, SnapshotView
from storage.pg_copy import (
    _COPY_FORMATS,
    NULL_COPY,
    SPECIAL_CHARACTERS,
    _copy_text,
    copy_rows,
    data_needs_escapes,
    formatter,
    received_chunk_formatter,
)
from storage.pg_db import (
    Cursor,
    PgDatabase,
    lost_connection,
    prepared,
    quietly_close,
    rollback_explicit,
    sql_literals,
)
from storage.pg_nonblocking import open_nonblocking, poll_word
from storage.schema import COLUMN_TYPES, INT64_MAX, INT64_MIN, StreamSchema
from storage.store import ApplyRefused, DatabaseUnavailable, StaleApply, error_line
from storage.urls import redact_url
from storage.worker_store import expand_received, move_applied_token, move_applied_token_sql, token_bounds

logger = logging.getLogger(__name__)
T = TypeVar("T")
COPY_ROWS = 50  # applies of at least this many rows go by COPY
MISFIT_FUNCTION = "tickline_misfit_v1"
_MISFIT_SQL = f"""
CREATE FUNCTION {MISFIT_FUNCTION}(what text) RETURNS boolean LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'a received row does not fit the declared stream: %', what USING ERRCODE = '22023';
END
$fn$
"""
# JSON types a column's received value may have (besides null where nullable).
_JSON_TYPES = {"text": "string", "bigint": "number", "double": "number", "boolean": "boolean"}


def replicate_json_sql(schema: StreamSchema) -> str:
    """One statement: move the applied token and insert received rows given as one JSON parameter.

    Parameters: stream, token, then ``[[token, instance, [[*values, ts], ...]], ...]``
    as JSON text. PostgreSQL expands the rows (no Python object per row or value
    here); each value's JSON type is checked against the column's (a value of
    another type, a row of another width, a null where the column may not
    hold one fail the statement, and the caller applies the rows the general
    way, which names the row). The rows are inserted only if the token moved;
    the statement returns whether it did. Atomic as any single statement.
    The rows are read as ``json``, not ``jsonb``: ``jsonb`` holds numbers as
    ``numeric``, which has no negative zero (a ``-0.0`` would arrive as 0).
    """
    width = len(schema.columns)
    values = []
    for k, column in enumerate(schema.columns):
        value = f"r->{k}"
        kind, sql_type = column.type, COLUMN_TYPES[column.type][1]
        if kind == "json":
            expr = f"CASE WHEN json_typeof({value}) = 'null' THEN NULL ELSE ({value})::jsonb END"
        else:
            text = f"r->>{k}" if kind == "text" else f"(r->>{k})::{sql_type}"
            expected = _JSON_TYPES[kind]
            expr = (
                f"CASE json_typeof({value}) WHEN '{expected}' THEN {text} WHEN 'null' THEN NULL "
                f"ELSE {MISFIT_FUNCTION}('column {column.name}')::text::{sql_type} END"
            )
        values.append(expr)
    return _moved_then_inserted(
        schema,
        move_applied_token_sql("%s"),
        f"SELECT (i->>0)::bigint, i->>1, (r->>{width})::bigint, {', '.join(values)} "
        "FROM moved, json_array_elements(%s::json) AS i, json_array_elements(i->2) AS r "
        f"WHERE json_array_length(r) = {width + 1} OR {MISFIT_FUNCTION}('row width')",
    )


def _moved_then_inserted(schema: StreamSchema, move: str, rows: str) -> str:
    """One statement: the applied token moved by ``move``, then, only if it moved, ``rows`` (a
    ``SELECT ... FROM moved``) inserted into the replicated table; it returns whether the token moved."""
    names = ", ".join(("token", "instance_name", "ts", *schema.column_names))
    return (
        f"WITH moved AS ({move} RETURNING 1), ins AS (INSERT INTO {schema.replicated_table} ({names}) {rows}) "
        "SELECT count(*) FROM moved"
    )


def _numbered(sql: str) -> str:
    """``sql`` with its ``%s`` placeholders as ``$1``, ``$2``, ... (for ``PREPARE``)."""
    parts = sql.split("%s")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]


def replicate_one_sql(schema: StreamSchema) -> str:
    """:func:`replicate_json_sql` for one row given as typed parameters (``PREPARE`` text, ``$n``).

    Parameters: stream, token (the applied token's new value), the row's
    token, instance and ``ts``, then one per column, each of its column's SQL
    type, given as text (:func:`one_row_params`). No JSON to expand: the
    server's work for the commonest apply, one row, is a parameter's input
    function per value. The rows are inserted only if the token moved; the
    statement returns whether it did.
    """
    sql_types = [COLUMN_TYPES[c.type][1] for c in schema.columns]
    values = ", ".join(f"${i}" for i in range(6, 6 + len(sql_types)))
    statement = _moved_then_inserted(
        schema, _numbered(move_applied_token_sql("%s")), f"SELECT $3, $4, $5, {values} FROM moved"
    )
    return f"({', '.join(('text', 'bigint', 'bigint', 'text', 'bigint', *sql_types))}) AS {statement}"


def _text_value(v: Any) -> Any:
    return v if v is None or (type(v) is str and "\x00" not in v) else _MISFIT


def _bigint_value(v: Any) -> Any:
    if v is None:
        return None
    return str(v) if type(v) is int and INT64_MIN <= v <= INT64_MAX else _MISFIT


def _double_value(v: Any) -> Any:
    if v is None:
        return None
    if type(v) is int:
        return str(v)
    return repr(v) if type(v) is float and math.isfinite(v) else _MISFIT


def _boolean_value(v: Any) -> Any:
    if v is None:
        return None
    return ("false", "true")[v] if type(v) is bool else _MISFIT


def _json_value(v: Any) -> Any:
    if v is None:
        return None
    try:
        return orjson.dumps(v).decode()
    except TypeError:  # orjson's JSONEncodeError (an integer beyond 64 bits, ...)
        return _MISFIT


_MISFIT = object()  # a value the one-row statement does not take: the JSON statement decides
_ONE_ROW_VALUES: dict[str, Callable[[Any], Any]] = {
    "text": _text_value,
    "bigint": _bigint_value,
    "double": _double_value,
    "boolean": _boolean_value,
    "json": _json_value,
}


def one_row_params(schema: StreamSchema, received: Sequence[ReceivedRows]) -> list[Any] | None:
    """The parameters of :func:`replicate_one_sql` after stream and token; None unless one plain row.

    Only values whose JSON type the JSON statement takes for the column
    (a string for text, an integer for bigint, a finite number for double, a
    boolean for boolean, anything for json; null anywhere), each given as
    the text the JSON statement would cast (a double by its shortest repr,
    as orjson writes it, so ``-0.0`` keeps its sign). Anything else (a row
    of another width, a ``ts`` that is not a non-negative integer, a NUL in
    a text, a float for a bigint) goes the JSON way, which refuses what it
    refused before: this path changes no row's fate, only its cost.
    """
    if len(received) != 1:
        return None
    token, instance, rows = received[0]
    if type(token) is list:
        if len(token) != 1:
            return None
        token = token[0]
    if len(rows) != 1:
        return None
    row = rows[0]
    columns = schema.columns
    if type(row) is not list or len(row) != len(columns) + 1:
        return None
    ts = row[-1]
    if type(ts) is not int or not 0 <= ts <= INT64_MAX or type(instance) is not str or "\x00" in instance:
        return None
    params: list[Any] = [token, instance, ts]
    for column, value in zip(columns, row, strict=False):
        text = _ONE_ROW_VALUES[column.type](value)
        if text is _MISFIT:
            return None
        params.append(text)
    return params


class PgAsyncApply:
    """Implements :class:`storage.contracts.AsyncApply`: a small apply's one statement, non-blocking.

    The same statement as :meth:`PgWorkerStore.apply_replicated` for fewer
    than ``COPY_ROWS`` rows (:func:`replicate_json_sql`: the applied token and
    the rows in one autocommit statement, prepared once per stream on this
    connection, in the same round trip as its first use), sent without
    blocking so the worker's reactor drives it with no thread hop.
    """

    def __init__(self, conn: Any, dsn: str) -> None:
        self._conn = conn
        self._dsn = dsn
        # (statement kind, stream) -> its EXECUTE text (prepared on this connection)
        self._prepared: dict[tuple[str, StreamSchema], str] = {}
        self._cursor: Any = None
        self._refused: psycopg2.Error | None = None

    def fileno(self) -> int:
        return int(self._conn.fileno())

    def start(self, stream: str, token: int, schema: StreamSchema, received: Sequence[ReceivedRows]) -> bool:
        if sum(len(rows) for _, _, rows in received) >= COPY_ROWS:
            return False
        one = one_row_params(schema, received)
        if one is not None and self._start_one(stream, token, schema, one):
            return True
        try:
            self._execute_prepared(
                "json",
                schema,
                lambda: f"AS {_numbered(replicate_json_sql(schema))}",
                [stream, token, orjson.dumps(expand_received(received)).decode()],
            )
        except psycopg2.Error as e:
            raise self._lost(e) from None
        return True

    def _start_one(self, stream: str, token: int, schema: StreamSchema, params: list[Any]) -> bool:
        """One row by :func:`replicate_one_sql`, its values written as literals (:func:`sql_literals`).

        False, nothing sent, if a value cannot be sent that way (a lone
        surrogate, which the connection's encoding refuses before anything
        is sent): the JSON statement then takes the row.
        """
        try:
            self._execute_prepared(
                "one", schema, lambda: replicate_one_sql(schema), [stream, token, *params], literals=True
            )
        except (ValueError, UnicodeEncodeError):
            self._cursor = None
            return False
        except psycopg2.Error as e:
            raise self._lost(e) from None
        return True

    def _execute_prepared(
        self, kind: str, schema: StreamSchema, statement: Callable[[], str], params: list[Any], literals: bool = False
    ) -> None:
        """Send ``EXECUTE`` of the ``kind`` statement for ``schema``, ``PREPARE``d in the same round trip the first time.

        ``statement()``: what follows ``PREPARE <name>`` (parameter types and
        ``AS ...``), made only then. ``literals``: the parameters written by
        :func:`sql_literals` (str, int or None only), not by psycopg2's
        adaptation, which costs about 2 µs a value.
        """
        key = (kind, schema)
        name = self._prepared.get(key)
        prepare = ""
        if name is None:
            name = f"tickline_apply_{len(self._prepared) + 1}"
            prepare = f"PREPARE {name} {statement()};\n"
        self._cursor = self._conn.cursor()
        if literals:
            self._cursor.execute(f"{prepare}EXECUTE {name} ({sql_literals(params)})")
        else:
            self._cursor.execute(
                f"{prepare.replace('%', '%%')}EXECUTE {name} ({', '.join(['%s'] * len(params))})", params
            )
        if prepare:
            self._prepared[key] = name  # if the call fails, the connection goes with it

    def poll(self) -> str:
        try:
            state = self._conn.poll()
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            raise self._lost(e) from None
        except psycopg2.Error as e:
            # The statement refused the rows (nothing committed); the connection stays usable.
            self._cursor = None
            self._refused = e
            return "done"
        return poll_word(state, self._lost)

    def result(self) -> None:
        refused = self._refused
        if refused is not None:
            self._refused = None
            raise ApplyRefused(error_line(refused))
        ((moved,),) = self._cursor.fetchall()
        self._cursor.close()
        self._cursor = None
        if moved != 1:
            raise StaleApply("the token is not above the applied token")

    def close(self) -> None:
        quietly_close(self._conn)

    def _lost(self, e: BaseException) -> DatabaseUnavailable:
        # DatabaseUnavailable, not CommitUnknown, although the one statement commits on its own:
        # the worker takes any loss of this connection as an apply of unknown outcome and applies
        # the rows again by its threads at once (Worker._async_apply_failed).
        return lost_connection(self._dsn, self._conn, e)


class PgApplyTransaction:
    """Implements :class:`storage.contracts.ApplyTransaction` on an open PostgreSQL transaction."""

    __slots__ = ("connection",)
    placeholder = "%s"

    def __init__(self, connection: Cursor) -> None:
        self.connection = connection

    def replicate(self, schema: StreamSchema, rows: Sequence[ReplicatedValues]) -> None:
        # Many rows per statement: by COPY from COPY_ROWS rows, else one multi-row INSERT.
        if len(rows) >= COPY_ROWS:
            copy_rows(self.connection.cursor, schema.replicated_table, schema, rows)
        else:
            self.connection.execute_values(
                schema.insert_replicated_values_sql(), rows, template=schema.replicated_values_template()
            )


class PgWorkerStore:
    """Implements :class:`storage.contracts.WorkerStore`; holds its :class:`PgDatabase`."""

    # Each thread has its own connection (PgDatabase.autocommit_connection): two groups of a
    # backlog are copied at once on two threads, their commits in token order (apply_after).
    concurrent_applies = True

    def __init__(self, dsn: str, synchronous_commit: bool = False) -> None:
        # synchronous_commit off (the default, as PostgreSQL's own apply workers):
        # a commit returns before its WAL is flushed. Exactly once still holds,
        # since the applied token commits in the same transaction as the
        # effects; a crash of the server may lose the last applies, token and
        # effects together, and the worker fetches those rows again.
        self.database = PgDatabase(dsn, settings={"synchronous_commit": "on" if synchronous_commit else "off"})
        self._replicate_sql: dict[StreamSchema, str] = {}

    def migrate(self) -> list[int]:
        applied = self.database.migrate()
        self.database.write(_create_misfit)
        return applied

    def close(self) -> None:
        self.database.close()

    def hand_over_connection(self) -> None:
        self.database.hand_over()

    def applied_tokens(self) -> dict[str, int]:
        rows = self.database.read(lambda cur: cur.execute("SELECT stream, token FROM tickline_applied").fetchall())
        return dict(rows)

    def create_replicated_table(self, schema: StreamSchema) -> None:
        def run(cur: Cursor) -> None:
            for statement in schema.create_replicated_table_sql("postgresql"):
                cur.execute(statement)

        self.database.write(run)

    def apply(self, stream: str, token: int, effects: Effects) -> None:
        def run(cur: Cursor) -> None:
            move_applied_token(cur.execute, "%s", stream, token)
            effects(PgApplyTransaction(cur))

        self.database.write(run)

    def open_async_apply(self) -> PgAsyncApply:
        """Blocking (off the reactor): a non-blocking connection for small applies (:class:`PgAsyncApply`)."""
        # The same session settings as the store's connections (synchronous_commit),
        # and the quoting sql_literals writes for.
        settings = {**self.database._settings, "standard_conforming_strings": "on"}
        return PgAsyncApply(open_nonblocking(self.database.dsn, "tickline-apply", settings), self.database.dsn)

    def prepare_replicated(self, schema: StreamSchema, received: Sequence[ReceivedRows]) -> bytes | None:
        """The ``COPY`` text :meth:`apply_replicated` sends for ``received``, or None (below ``COPY_ROWS``
        rows, or rows that go the general way). Pure: any thread may make it, so the text of a group
        queued behind another is made while the other is applied."""
        if sum(len(rows) for _, _, rows in received) < COPY_ROWS:
            return None
        return self._copy_text(schema, received)

    def apply_replicated(
        self,
        stream: str,
        token: int,
        schema: StreamSchema,
        received: Sequence[ReceivedRows],
        effects: Effects,
        prepared: bytes | None = None,
    ) -> None:
        """The rows as received, with no Python object per row.

        Few rows (fewer than ``COPY_ROWS``): one statement, one round trip
        (:func:`replicate_json_sql`); rows the statement refuses are applied by
        ``effects`` in a transaction of their own, which checks each row and
        names the bad one (nothing of the refused statement committed). More
        rows: ``COPY`` text made by one generated function per row
        (``storage.pg_copy``), which the server parses faster than JSON; a
        row that function does not take (non-ASCII text, say) is checked by
        ``check_row``. ``prepared``: that text, made beforehand from the same
        ``received`` by :meth:`prepare_replicated`.
        """
        if prepared is not None or sum(len(rows) for _, _, rows in received) >= COPY_ROWS:
            text = prepared if prepared is not None else self._copy_text(schema, received)
            if text is None:
                self.apply(stream, token, effects)
                return

            self._copy_apply(stream, token, schema, text)
            return
        sql = self._replicate_sql.get(schema)
        if sql is None:
            sql = self._replicate_sql[schema] = replicate_json_sql(schema)
        payload = orjson.dumps(expand_received(received)).decode()
        try:
            ((moved,),) = self.database.query(sql, (stream, token, payload), prepare=True, writes=True)
        except DatabaseUnavailable:
            raise
        except psycopg2.Error as e:
            logger.debug("%s: rows up to token %s applied the general way: %s", stream, token, e)
            self.apply(stream, token, effects)
            return
        if moved != 1:
            raise StaleApply(f"stream {stream!r}: token {token} is not above the applied token")

    def _copy_apply(self, stream: str, token: int, schema: StreamSchema, text: bytes) -> None:
        """The applied token and the rows by ``COPY`` in one transaction, in one round trip.

        On this thread's autocommit connection: ``BEGIN``, the token's move
        (prepared), ``COPY ... FROM STDIN`` and ``COMMIT`` as one request (it
        was three, then two: ``COMMIT`` on its own). The server runs a
        request's statements in order and skips the rest at the first error:
        a move that does not move (a stale token) fails by a division by zero,
        which stops the request before the ``COPY`` (nothing is written,
        :class:`StaleApply` is raised); a row the ``COPY`` refuses stops it
        before the ``COMMIT`` (the transaction is rolled back here). Exactly
        once as before: the token commits with the rows or neither does. A
        connection lost during the request may have lost the ``COMMIT``'s
        answer, not only the ``COPY``'s: its outcome is unknown
        (:class:`CommitUnknown`, settled by the caller).
        """
        conn = self.database.autocommit_connection()
        committing = False
        try:
            with conn.cursor() as cur:
                # BEGIN, the move, the COPY and the COMMIT in one request: neither the move nor the
                # COPY is awaited on its own (a stale token fails the move with a division by zero,
                # so nothing of the COPY runs), and no second request waits for the reactor to let
                # this thread take the GIL back between the COPY's answer and the COMMIT.
                move = cur.mogrify(prepared(cur, _MOVE_CHECKED_SQL), (stream, token)).decode()
                committing = True
                try:
                    cur.copy_expert(f"{BEGIN}{move}; {_copy_sql(schema)}; COMMIT", io.BytesIO(text), size=1 << 20)
                except psycopg2.errors.DivisionByZero:
                    rollback_explicit(conn)
                    raise StaleApply(f"stream {stream!r}: token {token} is not above the applied token") from None
        except psycopg2.OperationalError as e:
            raise self.database.lost_autocommit(conn, e, committing) from None
        except BaseException:
            rollback_explicit(conn)
            raise

    def apply_after(
        self,
        stream: str,
        token: int,
        before: int,
        schema: StreamSchema,
        prepared_text: bytes,
        ready: Callable[[], bool],
    ) -> bool:
        """The rows by ``COPY`` while the group ending at ``before`` may still be applied on another
        thread's connection; the token moves from exactly ``before`` to ``token``, after that group committed.

        On this thread's autocommit connection: ``BEGIN`` and the ``COPY``
        (one request); then ``ready()`` blocks until the group before is
        settled: False (it did not commit), ``ROLLBACK`` and False, nothing
        applied; True, the token's row locked (``FOR UPDATE``: it waits for
        a transaction that still holds it), the exact move (``UPDATE ...
        WHERE token = before``, on a snapshot taken after that lock, under
        READ COMMITTED) and ``COMMIT``, as one request. A move that
        does not move (the applied token is not ``before``) fails by a
        division by zero, which stops the request before the ``COMMIT``:
        rolled back, :class:`StaleApply`. So the commits follow the token
        order, a failed group is never skipped and nothing is applied twice.
        """
        conn = self.database.autocommit_connection()
        committing = False
        try:
            with conn.cursor() as cur:
                # PREPAREd outside the transaction (the first time only)
                lock, move = prepared(cur, _LOCK_APPLIED_SQL), prepared(cur, _MOVE_AFTER_SQL)
                cur.copy_expert(f"{BEGIN}{_copy_sql(schema)}", io.BytesIO(prepared_text), size=1 << 20)
                if not ready():
                    rollback_explicit(conn)
                    return False
                committing = True
                try:
                    cur.execute(f"{lock}; {move}; COMMIT", (stream, token, stream, before))
                except psycopg2.errors.DivisionByZero:
                    committing = False
                    rollback_explicit(conn)
                    raise StaleApply(
                        f"stream {stream!r}: the applied token is not {before}, the group before {token}"
                    ) from None
        except psycopg2.OperationalError as e:
            raise self.database.lost_autocommit(conn, e, committing) from None
        except BaseException:
            rollback_explicit(conn)
            raise
        return True

    @staticmethod
    def _copy_text(schema: StreamSchema, received: Sequence[ReceivedRows]) -> bytes | None:
        """COPY lines ``token, instance, *values, ts``; None if a row is not ``[*values, ts]`` (the general way).

        Rows of exactly typed values whose text needs no escape are made by one
        generated loop (``storage.pg_copy.received_chunk_formatter``), the
        escapes checked once over the encoded text
        (:func:`storage.pg_copy.data_needs_escapes`), or not at all for rows
        known to hold none (:func:`_escape_free`); otherwise row by row.
        The same text made column by column was about 10% faster measured
        alone but no cheaper in a worker's catch-up (docs/benchmarks.md, wk2).
        """
        chunk = _received_chunk(schema)
        if chunk is not None:
            quick, nulls = chunk(received)
            if quick:
                count = len(quick)
                # The last line's newline by the join itself: no copy of the whole text for it
                # (about a third of the join and encoding of a group's 0.8 MB).
                quick.append("")
                try:
                    data = "\n".join(quick).encode()
                except UnicodeEncodeError:  # a lone surrogate: refused row by row
                    data = None
                # Per line, as many tabs as columns but one and a newline; a backslash per NULL (the
                # chunk refuses instance names with one).
                if data is not None and (
                    _escape_free(received) or not data_needs_escapes(data, count * (len(schema.columns) + 3), nulls)
                ):
                    return data
        fmt = formatter(schema, with_ts=True)
        width = len(schema.columns)
        lines = []
        for token, instance, rows in expand_received(received):
            prefix = f"{token}\t{_copy_text(instance)}\t"
            for row in rows:
                text = fmt(row)
                if text is None:
                    ts = row[-1] if type(row) is list and len(row) == width + 1 else None
                    if type(ts) is not int or not 0 <= ts <= INT64_MAX:
                        return None
                    text = _checked_copy_text(schema, row[:-1]) + f"\t{ts}"
                lines.append(prefix + text)
        lines.append("")
        return "\n".join(lines).encode()


def _escape_free(received: Sequence[ReceivedRows]) -> bool:
    """Whether no value of ``received`` needs a ``COPY`` escape, known without looking at the values.

    Rows parsed from JSON text without a backslash (:class:`EscapeFreeRows`)
    hold none in their text values; the instance names are checked here. The
    rest of a line is integers and the ``\\N`` of a NULL. Saves
    :func:`storage.pg_copy.data_needs_escapes`' pass over the text.
    """
    return all(
        type(rows) is EscapeFreeRows and not SPECIAL_CHARACTERS.intersection(instance) for _, instance, rows in received
    )


BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED; "
_MOVE_SQL = move_applied_token_sql("%s")  # prepared: its parameters typed by the insert's columns
# The same move failing when it does not move (1 / 0): sent with the COPY, its answer not awaited alone.
_MOVE_CHECKED_SQL = f"WITH moved AS ({_MOVE_SQL} RETURNING 1) SELECT 1 / count(*) FROM moved"
# The move of a group copied while the group before it was applied: only from exactly that group's
# last token (parameters: token, stream, before), failing by 1 / 0 when it does not move.
# Its row locked first: an UPDATE alone would not wait for a transaction that moved the token and
# has not committed (the version it sees does not match "token = before"); this waits for it,
# and the move's own snapshot, taken after, sees the token that transaction committed.
_LOCK_APPLIED_SQL = "SELECT 1 FROM tickline_applied WHERE stream = %s FOR UPDATE"
_MOVE_AFTER_SQL = (
    "WITH moved AS (UPDATE tickline_applied SET token = %s WHERE stream = %s AND token = %s RETURNING 1) "
    "SELECT 1 / count(*) FROM moved"
)


def _copy_sql(schema: StreamSchema) -> str:
    names = ", ".join(("token", "instance_name", *schema.column_names, "ts"))
    return f"COPY {schema.replicated_table} ({names}) FROM STDIN"


_RECEIVED_CHUNKS: dict[StreamSchema, Callable[..., tuple[list[str] | None, int]] | None] = {}


def _received_chunk(schema: StreamSchema) -> Callable[..., tuple[list[str] | None, int]] | None:
    if schema not in _RECEIVED_CHUNKS:
        _RECEIVED_CHUNKS[schema] = received_chunk_formatter(schema)
    return _RECEIVED_CHUNKS[schema]


def _checked_copy_text(schema: StreamSchema, values: list[Any]) -> str:
    """One row's columns as COPY text after ``check_row`` (RowError names a bad value)."""
    checked = schema.check_row(values)
    return formatter(schema, checked=True)(checked) or "\t".join(
        NULL_COPY if v is None else _COPY_FORMATS[c.type](v) for c, v in zip(schema.columns, checked, strict=True)
    )


def _create_misfit(cur: Cursor) -> None:
    """The function the one-statement apply raises its error with (created once per database)."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (MISFIT_FUNCTION,))
    if cur.execute("SELECT 1 FROM pg_proc WHERE proname = %s", (MISFIT_FUNCTION,)).fetchone() is None:
        cur.cursor.execute(_MISFIT_SQL)  # no parameters: the % in it is literal


class _PgView:
    """Implements :class:`storage.contracts.SnapshotView` inside one REPEATABLE READ transaction."""

    def __init__(self, cur: Any) -> None:
        self._cur = Cursor(cur)

    def has_table(self, table: str) -> bool:
        return self._cur.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None

    def table_columns(self, table: str) -> set[str]:
        rows = self._cur.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = %s AND table_schema = ANY (current_schemas(false))",
            (table,),
        ).fetchall()
        return {row[0] for row in rows}

    def applied_token(self, stream: str) -> int:
        found = self._cur.execute("SELECT token FROM tickline_applied WHERE stream = %s", (stream,)).fetchone()
        return 0 if found is None else int(found[0])

    def token_bounds(self, table: str, after: int | None, upto: int) -> tuple[int | None, int | None]:
        return token_bounds(self._cur.execute, "%s", table, after, upto)


class PgSnapshotReader:
    """Implements :class:`storage.contracts.SnapshotReader`: read-only REPEATABLE READ transactions."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def describe(self) -> str:
        return f"PostgreSQL database {redact_url(self.dsn)}"

    def read(self, fn: Callable[[SnapshotView], T]) -> T:
        try:
            conn = psycopg2.connect(self.dsn, connect_timeout=5, application_name="tickline-snapshot")
        except psycopg2.Error as e:
            raise DatabaseUnavailable(
                redact_url(f"cannot connect to PostgreSQL at {self.dsn}: {error_line(e)}")
            ) from None
        try:
            # REPEATABLE READ: every statement sees the same snapshot.
            conn.set_session(isolation_level=psycopg2.extensions.ISOLATION_LEVEL_REPEATABLE_READ, readonly=True)
            with conn.cursor() as cur:
                result = fn(_PgView(cur))
            conn.commit()
            return result
        except psycopg2.Error as e:
            raise DatabaseUnavailable(redact_url(f"cannot read PostgreSQL at {self.dsn}: {error_line(e)}")) from None
        finally:
            conn.close()

    def close(self) -> None:
        """Nothing stays open between reads."""
