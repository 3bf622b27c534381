"""The master's wake-up on PostgreSQL in one round trip, on a non-blocking connection.

When a commit wakes the master (``LISTEN``/``NOTIFY``), it needs the oracle's
mark, every stream's safe position (with the allocated head, whether a live
writer exists and the last timestamp at or below the position: the safe time
of ``storage.time_index.safe_point``) and the first rows of each stream with
live subscriptions, as whole ``RDATA`` lines. :class:`PgWake` asks all of it
in **one statement**: the call of a function generated for the streams the
master knows (``pg_temp.tickline_wake_<n>``, a temporary function of the
connection's own session, so masters never share or race on it), which runs

1. the oracle's mark (the larger of ``tickline_tso_seq`` and
   ``tickline_tso.last_ts``), then
2. one query: the positions (one snapshot), and per stream and variant
   (with or without ``ts``) the lines of the rows after the token fanned out
   so far up to the position just read, when they are at most ``limit``
   rows (the lines ``pg_lines`` builds, by the same SQL; the join that marks
   a batch's rows only when a token repeats). A larger range is left to the
   master's reads (``replication.read_ahead``: two at once on the database
   threads, the columns sent by ``storage.pg_columns_out``, about 1 µs of
   the server's CPU per row against the 1.25-1.4 of a line built here, and
   the fan-out starts after the first quarter chunk); a commit of up to
   ``limit`` rows still reaches the master in one round trip.

**Plain lines.** A stream whose columns are all text (the usual case:
``events``) has its lines read *plain*: each value between double quotes as
it is, not escaped (:func:`plain_line_sql`: one ``concat`` per row, a nullable
value as ``null`` or between quotes), the ``RDATA <stream> `` prefix put in
by the aggregate's separator. That is
the JSON line exactly when no value holds a quote, a backslash or a control
character, which the master checks on the whole answer with one byte count
(:func:`plain_lines`: those bytes are then two per non-NULL value, which the
server counts, and a newline per row). Measured on 1,000-row ranges of the
bench's rows (docs/benchmarks.md, wake6): about 1.55-1.6 µs of the backend
per row with ``ts`` against 2.0 by ``array_to_json`` (1.25 since the
twenty-first session: ``concat``, and the lines gathered in their
subquery's order, checked, not sorted again; see *Gathering* below), and 0.1 µs of the
master's per row for the check (0.03 since mw8: counted by numpy above 4 KB,
:func:`escaped_bytes`; on a UTF-8 session the answer's text is taken as the
bytes sent, not decoded and encoded again). An answer that fails the check is left to
the master's reads (which escape), and the stream's next ``ESCAPED_WAKES``
wake-ups build its lines escaped (``pg_lines``' SQL), so a stream whose
values often need escapes does not pay a second read each time.

**Gathering.** Each variant's lines are joined by one ``string_agg`` over
a subquery whose top is ``ORDER BY token, seq OFFSET 0``, without an
``ORDER BY`` of the aggregate's own: that one copied every line into a sort
(about 0.35 µs of the backend per row). PostgreSQL feeds a plain aggregate
over such a subquery in its order, but does not promise it ("will usually
work", its documentation says), so the same pass compares the tokens as
the aggregate took them with the same tokens sorted, and the ``seq`` values
as taken with the same values in ``(token, seq)`` order (``array_agg`` of
integers): both equal is exactly that order, whatever the data. A range
whose lines came in any other order is answered without its lines and with
the count ``OUT_OF_ORDER``, the master reads it itself (its reads are ``COPY`` of
a query whose top-level ``ORDER BY`` sets the order), and logs it once per
connection. Measured on PostgreSQL 15, where the plan feeds the aggregate
from the ordered join with no sort between.

**Order.** The proof of the safe time (docs/time.md) needs the mark read
before the live writers and the positions (a snapshot) and before the
allocated heads (sequences). One SQL statement does not order its parts, but
a ``VOLATILE`` PL/pgSQL function does: each statement in it runs after the
previous one ended and, in ``READ COMMITTED`` (set on the connection), takes
a new snapshot when it starts. Sequences are read when the statement reads
them, not from a snapshot: the mark (statement 1) is read before the heads
(statement 2). So step 1 precedes everything step 2 reads, as the three
separate statements of the threaded path did. The lines are read in the
positions' snapshot, where every row up to the position has committed.

The connection is asynchronous (psycopg2 ``async_``): :meth:`PgWake.start`
sends the call and never blocks, :meth:`PgWake.poll` reads what arrived and
says what to wait for, :meth:`PgWake.result` decodes the answer. Driving it
(a file descriptor watched by a reactor) is the caller's business
(``replication.pg_async``). Opening it (:func:`open_wake`) blocks: do it off
the reactor. A lost connection raises :class:`~storage.store.DatabaseUnavailable`
from :meth:`PgWake.poll`; the caller then reads the same things another way,
nothing having moved.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Any

import psycopg2
import psycopg2.extensions

from storage.contracts import WakeReads, WakeResult
from storage.pg_columns_out import longest_within
from storage.pg_db import lost_connection, quietly_close
from storage.pg_lines import PLAN_SETTINGS, first_tokens_sql, line_sql, lines_select_sql
from storage.pg_nonblocking import open_nonblocking, poll_word
from storage.pg_store import _ORACLE_LAST_SQL, PgStreamStore, _seq
from storage.schema import StreamSchema
from storage.store import DatabaseUnavailable
from storage.time_index import stream_safe_time

logger = logging.getLogger(__name__)

# After a plain read whose values needed escapes, the stream's next wake-ups build escaped lines
# (pg_lines' SQL): a stream whose values often hold quotes would otherwise pay a second read each time.
ESCAPED_WAKES = 100
# The bytes a JSON string escapes (quote, backslash, control characters). A plain answer holds
# only its own: two quotes per non-NULL value and a newline per row.
_ESCAPED = b'"\\' + bytes(range(32))
# From this many bytes on, those bytes are counted by numpy (three vectorized passes: about 28 µs for
# the 150 KB of a 1000-row answer against 94 by ``bytes.translate``, which copies what it keeps);
# below, by ``translate`` (a numpy call costs about a microsecond).
_NUMPY_COUNT_BYTES = 4096


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# The count of a stream's answer whose lines reached their aggregate out of order (see the module doc).
OUT_OF_ORDER = -2
# PostgreSQL's FUNC_MAX_ARGS: the most arguments a call takes (concat() and num_nulls() included).
FUNC_MAX_ARGS = 100
# num_nulls(), which counts a plain read's NULL values, takes one argument per column.
MAX_PLAIN_COLUMNS = FUNC_MAX_ARGS


def plain_text(schema: StreamSchema) -> bool:
    """Whether the wake-up may read the stream's lines plain (every column text, at most
    ``MAX_PLAIN_COLUMNS`` of them; see the module doc)."""
    columns = schema.columns
    return bool(columns) and len(columns) <= MAX_PLAIN_COLUMNS and all(c.type == "text" for c in columns)


def plain_line_sql(schema: StreamSchema, with_ts: bool) -> str:
    """SQL for a row's line after its ``RDATA <stream> `` prefix, its text values quoted but not escaped.

    One ``concat(...)`` per row (calls of at most ``FUNC_MAX_ARGS`` arguments,
    nested): it writes its arguments into one buffer, where a chain of ``||``
    made a new text per step (about 0.1 µs of the backend per row less on
    the bench's rows, docs/benchmarks.md). A ``NOT NULL`` value goes between
    quote literals; a nullable one is ``null`` or between quotes, by a
    ``CASE`` on each side that takes in the literal next to it (``concat``
    skips a NULL argument: the value itself then adds nothing). A NULL in a
    ``NOT NULL`` column, which the table refuses, would come out as ``""``,
    which :func:`plain_lines` refuses (its count of NULL values would not
    match the quotes). The row is ``t``, the batch marks ``b`` of
    ``pg_lines.lines_select_sql``; the head is ``pg_lines.line_sql``'s.
    """
    mark = "CASE WHEN t.seq < b.last_seq THEN 'batch' ELSE t.token::text END"
    # ("text", literal) | ("value", SQL) | ("open", column) | ("close", column), in order.
    items: list[tuple[str, str]] = [("value", "t.instance_name"), ("text", " "), ("value", mark), ("text", " [")]
    for i, c in enumerate(schema.columns):
        if i:
            items.append(("text", ","))
        if c.nullable:
            items += [("open", c.name), ("value", f"t.{c.name}"), ("close", c.name)]
        else:
            items += [("text", '"'), ("value", f"t.{c.name}"), ("text", '"')]
    if with_ts:
        items += [("text", ","), ("value", "t.ts")]
    items.append(("text", "]"))
    arguments: list[str] = []
    literal = ""  # text not written yet
    closing: str | None = None  # a nullable column whose closing quote is not written yet
    for kind, what in items:
        if kind == "text":
            literal += what
            continue
        if closing is not None:
            arguments.append(_either(closing, literal, '"' + literal))
            closing, literal = None, ""
        if kind == "close":
            closing = what
            continue
        if kind == "open":
            arguments.append(_either(what, literal + "null", literal + '"'))
        else:
            if literal:
                arguments.append(_literal(literal))
            arguments.append(what)
        literal = ""
    if closing is not None:
        arguments.append(_either(closing, literal, '"' + literal))
    elif literal:
        arguments.append(_literal(literal))
    return _concat(arguments)


def _either(column: str, if_null: str, if_not: str) -> str:
    """SQL: the literal ``if_null`` where ``t.<column>`` is NULL, else ``if_not``."""
    return f"CASE WHEN t.{column} IS NULL THEN {_literal(if_null)} ELSE {_literal(if_not)} END"


def _concat(arguments: list[str]) -> str:
    """``concat`` of the SQL ``arguments``, nested where there are more than a call may take."""
    while len(arguments) > FUNC_MAX_ARGS:
        arguments = [
            f"concat({', '.join(arguments[i : i + FUNC_MAX_ARGS])})" for i in range(0, len(arguments), FUNC_MAX_ARGS)
        ]
    return f"concat({', '.join(arguments)})"


def plain_lines(data: bytes, rows: int, columns: int, nulls: int) -> bool:
    """Whether a plain answer (:func:`plain_line_sql`) is the JSON lines: no value needed an escape.

    A value's JSON is its text between quotes exactly when it holds no
    ``"``, no backslash and no control character (the escapes of
    ``array_to_json`` and the Python encoder). The answer's own such bytes
    are two quotes per non-NULL value (``nulls``: the NULL values, counted
    by the server) and a newline per row; a value (or an instance name)
    holding one adds to that count.
    """
    return escaped_bytes(data) == 2 * (columns * rows - nulls) + rows


def escaped_bytes(data: bytes) -> int:
    """How many bytes of ``data`` a JSON string escapes: quotes, backslashes, control characters."""
    if len(data) < _NUMPY_COUNT_BYTES:
        return len(data) - len(data.translate(None, _ESCAPED))
    import numpy as np  # imported ahead by open_wake (a first import here would wait for it)

    codes = np.frombuffer(data, np.uint8)
    return int(np.count_nonzero(codes < 32)) + int(np.count_nonzero(codes == 34)) + int(np.count_nonzero(codes == 92))


def _lines_cte(index: int, schema: StreamSchema, variants: tuple[bool, ...], plain: bool) -> str:
    """The lines of stream ``index`` (1-based in the arrays) up to its position, in each variant asked.

    Two CTEs: ``u<index>``, the last token and the count of the first
    ``max_rows + 1`` rows after ``afters[index]``, and ``l<index>``, the
    lines of each variant gathered in their subquery's order, whether they
    came in it (``in_order``, see the module doc), the last token, the count, the
    longest line, that first count and the NULL values. Only a range of at most ``max_rows``
    rows is read (the lines of a larger one are left to the master's reads,
    cheaper per row: see the module doc), whole: every row up to the
    position. Escaped, the lines are built by ``storage.pg_lines`` (the same SQL as
    the master's reads of a ``json`` stream), each variant a column of the same rows;
    ``plain``, by :func:`plain_line_sql`, the prefix put in by the aggregate's
    separator (once per row, not a concatenation more), the longest line
    left to the caller.
    """
    after = f"afters[{index}]"
    position = f"(SELECT pos.position FROM pos WHERE pos.name = {_literal(schema.name)})"
    prefix = f"RDATA {schema.name} "
    if plain:
        built = {f"line_{int(v)}": plain_line_sql(schema, v) for v in variants}
        built["nulls"] = "num_nulls(" + ", ".join(f"t.{c.name}" for c in schema.columns) + ")"
    else:
        built = {f"line_{int(v)}": line_sql(schema, v, _literal(prefix)) for v in variants}
    select = lines_select_sql(
        schema,
        built,
        after,
        f"(SELECT CASE WHEN u{index}.found <= max_rows THEN u{index}.upper_token END FROM u{index})",
        f"(SELECT u{index}.repeats FROM u{index})",
    )

    def gathered(variant: bool) -> str:
        if variant not in variants:
            return "NULL::text"
        # In the subquery's order, not sorted again by an ORDER BY of the aggregate's own (which
        # copied every line into a sort: about 0.35 µs of the backend per row). PostgreSQL does not
        # promise an aggregate its subquery's order, so the CTE checks it (in_order) and the
        # master reads a range whose lines came in another order itself.
        if plain:
            return f"{_literal(prefix)} || string_agg(x.line_{int(variant)}, {_literal(chr(10) + prefix)}) || E'\\n'"
        return f"string_agg(x.line_{int(variant)}, E'\\n') || E'\\n'"

    # The longest line: the variant with ts where it is asked (the longer one).
    longest = "0" if plain else f"COALESCE(max(octet_length(x.line_{int(max(variants))})), 0)::integer"
    nulls = "sum(x.nulls)::bigint" if plain else "NULL::bigint"
    return (
        f"u{index} AS (SELECT max(x.token) AS upper_token, count(*) AS found, "
        f"count(*) > count(DISTINCT x.token) AS repeats FROM "
        f"({first_tokens_sql(schema.table, after, position, 'max_rows + 1')}) AS x), "
        f"l{index} AS (SELECT {gathered(False)} AS lines, {gathered(True)} AS lines_ts, "
        f"max(x.token) AS last, count(*) AS cnt, {longest} AS longest, {nulls} AS nulls, "
        # Whether the aggregates took the rows in (token, seq) order, exactly, with no assumption on
        # the data: the tokens as taken equal to them sorted puts each token's rows where that order
        # puts them, and the seqs as taken equal to them in (token, seq) order then orders the rows
        # of each token. (Seqs alone sorted would not do for rows written by hand, which need not
        # follow "seq increases with the token"; tickline's own writes do, docs/time.md.)
        "COALESCE(array_agg(x.token) = array_agg(x.token ORDER BY x.token) "
        "AND array_agg(x.seq) = array_agg(x.seq ORDER BY x.token, x.seq), true) AS in_order, "
        f"(SELECT u{index}.found FROM u{index}) AS found FROM ({select}) AS x)"
    )


def wake_function_sql(
    function: str, schemas: list[StreamSchema], reads: list[tuple[int, tuple[bool, ...], bool]]
) -> str:
    """``CREATE FUNCTION`` of the wake-up for these streams (see the module doc).

    ``reads``: the (1-based stream index, variants, plain) of the streams whose
    lines the function reads (``plain``: by :func:`plain_line_sql`); only those are in its plan
    (a plan's start-up costs in proportion to its nodes, read or not).
    """
    positions = " UNION ALL ".join(
        "SELECT p.name, p.position, p.head, p.live, "
        f"(SELECT ts FROM {s.table} WHERE token <= p.position ORDER BY token DESC LIMIT 1) AS last_ts FROM "
        f"(SELECT {_literal(s.name)}::text AS name, COALESCE((SELECT MIN(w.position) FROM tickline_writers w "
        f"WHERE w.alive AND w.stream = {_literal(s.name)}), (SELECT MAX(token) FROM {s.table}), 0)::bigint AS position, "
        f"(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {_seq(s)})::bigint AS head, "
        f"EXISTS (SELECT 1 FROM tickline_writers w WHERE w.alive AND w.stream = {_literal(s.name)}) AS live) AS p"
        for s in schemas
    )
    ctes = [f"pos AS MATERIALIZED ({positions})"]
    selects = [
        "SELECT pos.name, pos.position, pos.head, pos.live, pos.last_ts, mark, NULL::text, NULL::text, "
        "NULL::bigint, NULL::bigint, NULL::integer, NULL::bigint FROM pos"
    ]
    for index, variants, plain in reads:
        schema = schemas[index - 1]
        ctes.append(_lines_cte(index, schema, variants, plain))
        selects.append(
            f"SELECT {_literal(schema.name)}::text, NULL::bigint, NULL::bigint, NULL::boolean, NULL::bigint, "
            # Out of order (OUT_OF_ORDER): no lines sent, the master reads the range itself.
            f"NULL::bigint, CASE WHEN l{index}.in_order THEN l{index}.lines END, "
            f"CASE WHEN l{index}.in_order THEN l{index}.lines_ts END, l{index}.last, "
            f"CASE WHEN l{index}.found > max_rows THEN -1 WHEN NOT l{index}.in_order THEN {OUT_OF_ORDER} "
            f"ELSE l{index}.cnt END, "
            f"l{index}.longest, l{index}.nulls "
            f"FROM l{index} WHERE l{index}.cnt > 0 OR l{index}.found > max_rows"
        )
    query = "WITH " + ", ".join(ctes) + " " + " UNION ALL ".join(selects)
    return (
        f"CREATE FUNCTION pg_temp.{function}(read_mark boolean, max_rows integer, afters bigint[]) "
        "RETURNS TABLE(r_name text, r_position bigint, r_head bigint, r_live boolean, r_last_ts bigint, r_mark bigint, "
        "r_lines text, r_lines_ts text, r_last bigint, r_count bigint, r_longest integer, r_nulls bigint) "
        f"LANGUAGE plpgsql VOLATILE {PLAN_SETTINGS} AS $fn$\nDECLARE\n    mark bigint;\nBEGIN\n"
        f"    IF read_mark THEN\n        {_ORACLE_LAST_SQL} INTO mark;\n    END IF;\n"
        f"    RETURN QUERY {query};\nEND\n$fn$"
    )


class PgWake:
    """One non-blocking connection running the master's wake-up (see the module doc).

    Not thread-safe; one call at a time: :meth:`start`, :meth:`poll` until
    it returns ``"done"``, then :meth:`result`. The function for a shape of
    call (the streams known, which of them are read in which variants) is
    created by the first call of that shape, in the same round trip
    (``CREATE FUNCTION ...; SELECT ...``), and kept for the session.
    """

    def __init__(self, store: PgStreamStore, conn: Any) -> None:
        self._store = store
        self._conn = conn
        self._functions: dict[tuple[tuple[str, ...], tuple[tuple[int, tuple[bool, ...], bool], ...]], str] = {}
        self._cursor: Any = None
        self._pending: tuple[bool, WakeReads, dict[str, int]] | None = None
        self._out_of_order_logged = False
        # Per stream: the wake-ups left that build its lines escaped (ESCAPED_WAKES).
        self._escaped: dict[str, int] = {}
        # A UTF-8 session's text is taken as the bytes sent (psycopg2's BYTES caster): the lines are
        # bytes on the wire already, and were decoded and encoded again (two passes over a 1000-row
        # answer's 150 KB). Any other client encoding is decoded and encoded as UTF-8, as before,
        # and so is a UTF-8 session on a database that is not UTF-8 (SQL_ASCII passes any bytes
        # through unconverted: the decode refuses what is not UTF-8, as before).
        self._raw_text = conn.encoding == "UTF8" and conn.get_parameter_status("server_encoding") == "UTF8"
        if self._raw_text:  # the connection runs only the wake-up's calls: set once, for all of them
            psycopg2.extensions.register_type(psycopg2.extensions.BYTES, conn)

    def fileno(self) -> int:
        return int(self._conn.fileno())

    def start(self, read_mark: bool, reads: WakeReads, limit: int) -> None:
        """Send the wake-up (never blocks)."""
        schemas = self._store._catalog.known()
        afters: list[int] = []
        shape: list[tuple[int, tuple[bool, ...], bool]] = []
        plain: dict[str, int] = {}  # the streams read plain: their number of columns
        for index, schema in enumerate(schemas, 1):
            after, variants = reads.get(schema.name, (0, ()))
            afters.append(after)
            if variants:
                escaped = self._escaped.get(schema.name, 0)
                if escaped:
                    self._escaped[schema.name] = escaped - 1
                elif plain_text(schema):
                    plain[schema.name] = len(schema.columns)
                shape.append((index, tuple(sorted(set(variants))), schema.name in plain))
        key = (tuple(s.name for s in schemas), tuple(shape))
        function = self._functions.get(key)
        create = ""
        if function is None:
            # The function, and the call prepared once (no parse or plan of the call each time).
            function = f"tickline_wake_{len(self._functions) + 1}"
            create = (
                wake_function_sql(function, schemas, shape).replace("%", "%%")
                + f";\nPREPARE {function} AS SELECT * FROM pg_temp.{function}($1, $2, $3::bigint[]);\n"
            )
        self._pending = (read_mark, {name: reads[name] for name in reads if name in key[0]}, plain)
        try:
            self._cursor = self._conn.cursor()
            self._cursor.execute(f"{create}EXECUTE {function} (%s, %s, %s)", (read_mark, limit, afters))
        except psycopg2.Error as e:
            raise self._lost(e) from None
        if create:
            # Remembered now: if the call fails, the connection is dropped with it.
            self._functions[key] = function

    def poll(self) -> str:
        """Read what arrived: ``"read"`` or ``"write"`` (wait for that), or ``"done"``."""
        try:
            state = self._conn.poll()
        except psycopg2.Error as e:
            # Lost, or an error of the call: either way this connection is done.
            raise self._lost(e) from None
        return poll_word(state, self._lost)

    def result(self) -> WakeResult:
        """The answer of the call :meth:`start` sent, once :meth:`poll` said ``"done"``."""
        assert self._pending is not None and self._cursor is not None
        read_mark, reads, plain = self._pending
        rows = self._cursor.fetchall()
        self._cursor.close()
        self._cursor, self._pending = None, None
        times: dict[str, int] = {}
        positions: dict[str, int] = {}
        first: dict[str, tuple[int, tuple[dict[bool, bytes], int, int]]] = {}
        limit = self._store.max_line_bytes
        unread: set[str] = set()
        for raw_name, position, head, live, last_ts, mark, lines, lines_ts, last, count, longest, nulls in rows:
            name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
            if count is None:
                positions[name] = int(position)
                if mark is None:
                    continue
                found = stream_safe_time(
                    int(mark), int(head) <= position or not live, None if last_ts is None else int(last_ts)
                )
                if found is not None:
                    times[name] = found
                continue
            if count == OUT_OF_ORDER and not self._out_of_order_logged:
                self._out_of_order_logged = True  # once per connection: the plan is the connection's
                logger.warning(
                    "the wake-up's lines of %s reached their aggregate out of (token, seq) order; "
                    "the master reads such ranges itself (correct, slower)",
                    name,
                )
            if count < 0 or (limit is not None and longest > limit):
                # More rows than the limit, lines out of order, or a line too long: the master reads them.
                unread.add(name)
                continue
            encoded = {}
            if lines is not None:
                encoded[False] = lines if isinstance(lines, bytes) else lines.encode()
            if lines_ts is not None:
                encoded[True] = lines_ts if isinstance(lines_ts, bytes) else lines_ts.encode()
            columns = plain.get(name)
            if columns is not None and not self._plain(name, encoded, int(count), columns, int(nulls), limit):
                unread.add(name)  # a value needs an escape, or a line is too long: the master reads them
                continue
            first[name] = (reads[name][0], (encoded, int(last), int(count)))
        # Streams read whose range held no row (tokens rolled back): the master moves them on.
        for name, (after, variants) in reads.items():
            if name not in first and name not in unread and positions.get(name, after) > after:
                first[name] = (after, ({v: b"" for v in variants}, after, 0))
        return (times if read_mark else None), positions, first

    def _plain(
        self, name: str, encoded: dict[bool, bytes], rows: int, columns: int, nulls: int, limit: int | None
    ) -> bool:
        """Whether a plain answer's lines in ``encoded`` are the JSON lines; False if not (the master reads them).

        A value that needed an escape has the next ``ESCAPED_WAKES`` wake-ups build the stream's lines escaped.
        One variant is checked: both hold the same values, the one with ``ts`` (only digits more) the
        longer lines.
        """
        if not encoded:
            return True  # no rows
        data = encoded[max(encoded)]  # True (with ts) where it was asked
        if not plain_lines(data, rows, columns, nulls):
            self._escaped[name] = ESCAPED_WAKES
            return False
        return limit is None or longest_within(data, limit)

    def close(self) -> None:
        quietly_close(self._conn)

    def _lost(self, e: BaseException) -> DatabaseUnavailable:
        return lost_connection(self._store.database.dsn, self._conn, e)


def open_wake(store: PgStreamStore) -> PgWake:
    """Blocking (off the reactor): a new asynchronous connection for the master's wake-up.

    numpy (:func:`escaped_bytes`) is imported meanwhile on a thread of its own: its 80-170 ms
    neither lengthen the master's start nor fall on its first large wake-up. Once it is imported
    (or being imported), a new connection after a lost one starts no thread.
    """
    if "numpy" not in sys.modules:
        threading.Thread(target=importlib.import_module, args=("numpy",), name="tickline-import", daemon=True).start()
    return PgWake(store, open_nonblocking(store.database.dsn, "tickline-wake"))
