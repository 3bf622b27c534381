"""Whole ``RDATA`` lines built by PostgreSQL: the master's storage read on PostgreSQL.

Since the thirteenth session the master reads the columns instead and
builds the lines itself (``storage.pg_columns_out``, cheaper in all); it
comes here for chunks whose values need escapes that path does not make and
for streams with a ``json`` column. The wake-up (``storage.pg_wake``) uses
this module's SQL.

``PgStreamStore.read_lines_json`` asks the server for the lines of about
``limit`` rows after a token, never part of a token. Measured on a 200,000-row
stream (5,000-row reads, docs/benchmarks.md), the server's time per row was
what bounded the master; it went to three things, and each has its remedy
here:

- **The value expressions.** ``to_json(text)`` looks the type up on every
  call. A stream whose columns are all text builds the whole JSON array with
  one ``array_to_json(ARRAY[...])`` (the same escaping, ``null`` for NULL,
  no spaces: the Python encoder's bytes; with ``ts``, that array with ``,<ts>``
  put before its closing bracket, the bracket cut as a byte, since
  ``left(text, -1)`` counts every character of the line twice); other types get cheaper forms
  (``bigint::text``, a ``CASE`` for booleans).
- **Batch or token.** A line ends in ``batch`` when the next row has the
  same token. A ``lead()`` window copied every wide row into a tuple store;
  instead, the tokens of the range that hold more than one row (found from
  the ``(token, seq)`` index alone, usually none) are joined to the rows, and
  a row below its token's last ``seq`` says ``batch``.
- **Ordering and gathering.** ``string_agg(... ORDER BY token, seq)`` sorted
  every line again and grew one large string (about 0.75 MB per 5,000 rows,
  new pages on every call). The lines are sent by ``COPY (SELECT ... ORDER
  BY token, seq) TO STDOUT`` instead: the order is the top-level ``ORDER
  BY`` of the query ``COPY`` runs (which the planner must honour; with the
  index it needs no sort), one row per line, no aggregate.

``COPY`` takes no parameters and a ``COPY`` of a plain query would be
planned anew on each call (on a fresh table without statistics, into a plan
that scans the whole rest of the stream). So the query lives in a temporary
PL/pgSQL function of the session (``pg_temp.tickline_lines_<n>``, created on
first use per connection and stream variant), whose statements are planned
once and kept (generic plans: ``PgDatabase`` connections set
``plan_cache_mode``); ``COPY (SELECT * FROM pg_temp.tickline_lines_<n>(...))``
only passes the arguments. ``STABLE``: both statements of the function read
the calling statement's snapshot. The function's ``SET`` clause steers its
planner to the plan the query is written for (the ``(token, seq)`` index in
order, no sort) even on a table without statistics yet.

**The output format.** ``COPY ... (FORMAT csv)`` with ``DELIMITER`` ``\\x01``
and ``QUOTE`` ``\\x02``: one column per row, so the delimiter never appears;
a value is quoted only if it holds the delimiter, the quote, a newline or a
carriage return, or is empty. A line never does: the JSON of every value
escapes all control characters (``to_json``, ``array_to_json``, ``jsonb``'s
text), instance names are printable ASCII, stream names identifiers. So every
output row is exactly ``line\\n``, the bytes the Python encoder makes. A line
longer than ``max_line_bytes`` is sent as an empty string, which ``COPY``
writes quoted (``\\x02\\x02``): one byte search finds it, and the caller then
builds the lines itself (the long line is refused there, as before).

The count is the number of newlines; the last token is read from the last
line (it is always the last row of its token, so it names the token).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attr

from storage.schema import StreamSchema

CSV_DELIMITER = "\x01"
CSV_QUOTE = "\x02"
_QUOTE_BYTE = CSV_QUOTE.encode()
_COPY_OPTIONS = "(FORMAT csv, DELIMITER E'\\x01', QUOTE E'\\x02')"

# The plan the statement is written for: the (token, seq) index read in order, the few multi-row
# tokens merged in, no sort. Without statistics (a table just filled) a generic plan would
# scan by bitmap, hash and sort (about 1.4x the time); these settings hold only while the
# function runs (a function's SET clause), and only steer: a plan they rule out stays possible.
PLAN_SETTINGS = "SET enable_sort = off SET enable_hashjoin = off SET enable_hashagg = off SET enable_bitmapscan = off"


def value_json_sql(column: str, kind: str) -> str:
    """SQL for one value's JSON text (the Python encoder's bytes), ``null`` for NULL."""
    if kind == "json":
        return f"coalesce({column}::text, 'null')"
    if kind == "double":
        # orjson writes integral doubles as 2.0; to_json would write 2. The integer's text has no
        # sign for -0.0, whose own text ('-0', exact under the session's extra_float_digits) does.
        return (
            f"CASE WHEN {column} IS NULL THEN 'null' WHEN {column} = 0 THEN {column}::text || '.0'"
            f" WHEN {column} = trunc({column}) AND abs({column}) < 1e16"
            f" THEN trunc({column})::bigint::text || '.0' ELSE to_json({column})::text END"
        )
    if kind == "bigint":
        return f"coalesce({column}::text, 'null')"
    if kind == "boolean":
        return f"CASE WHEN {column} THEN 'true' WHEN NOT {column} THEN 'false' ELSE 'null' END"
    return f"coalesce(to_json({column})::text, 'null')"


def row_json_sql(schema: StreamSchema, with_ts: bool, alias: str = "t") -> str:
    """SQL for a row's JSON array text ``[v1,...,vn]`` (``ts`` last when ``with_ts``)."""
    columns = [f"{alias}.{c.name}" for c in schema.columns]
    if schema.columns and all(c.type == "text" for c in schema.columns):
        # One call for the whole array: the type is looked up once, not per value.
        array = f"array_to_json(ARRAY[{', '.join(columns)}]::text[])::text"
        if not with_ts:
            return array
        # With ts: the array without its closing bracket, then the ts. The bracket is cut as a byte
        # (rtrim of bytea): left(text, -1) counts the characters of the whole line twice (about
        # 0.45 us per row of the wake-up's 0.7 us for the ts). The array ends in exactly one ']'
        # (its last value is a JSON string or null). In a UTF8 database convert_to and convert_from
        # only check the bytes (fast); in another they convert there and back, losing nothing.
        return (
            f"convert_from(rtrim(convert_to({array}, 'UTF8'), '\\x5d'::bytea), 'UTF8') "
            f"|| ',' || {alias}.ts::text || ']'"
        )
    values = [value_json_sql(name, c.type) for name, c in zip(columns, schema.columns, strict=True)]
    if with_ts:
        values.append(f"{alias}.ts::text")
    return "'[' || " + " || ',' || ".join(values) + " || ']'"


def line_sql(schema: StreamSchema, with_ts: bool, prefix: str) -> str:
    """SQL for a row's whole line without its newline: ``<prefix><instance> <token or batch> [values]``.

    ``prefix`` is an SQL expression (``RDATA <stream> ``); the row is ``t``,
    the batch marks ``b`` of :func:`lines_select_sql`. The one place that
    says how PostgreSQL builds a line (the master's reads and its wake-up).
    """
    return (
        f"{prefix} || t.instance_name || ' ' || CASE WHEN t.seq < b.last_seq THEN 'batch' ELSE t.token::text END"
        f" || ' ' || {row_json_sql(schema, with_ts)}"
    )


def first_tokens_sql(table: str, after: str, upto: str, limit: str) -> str:
    """SQL for the tokens of the first ``limit`` rows after ``after`` (at most ``upto``), by the token index.

    The arguments are SQL expressions (literals, ``$n`` or a variable).
    """
    return f"SELECT r.token FROM {table} r WHERE r.token > {after} AND r.token <= {upto} ORDER BY r.token LIMIT {limit}"


def last_token_sql(table: str, after: str, upto: str, limit: str) -> str:
    """SQL for the token of the ``limit``-th row after ``after`` (at most ``upto``; NULL if none)."""
    return f"SELECT max(x.token) AS upper_token FROM ({first_tokens_sql(table, after, upto, limit)}) AS x"


def lines_select_sql(
    schema: StreamSchema, lines: dict[str, str], after: str, last: str, batched: str | None = None
) -> str:
    """``SELECT t.token, t.seq, <line> AS <name>, ...`` of the rows ``after < token <= last`` in ``(token, seq)`` order.

    ``lines``: output name -> line expression (:func:`line_sql`); ``after``
    and ``last`` are SQL expressions. Rows below their token's last ``seq``
    are marked by joining the range's multi-row tokens (``b``), found from
    the ``(token, seq)`` index alone. ``OFFSET 0`` keeps the query whole when
    it is a subquery: pulled up, each reference to a line would build it again.
    ``batched``: an SQL condition that holds (or the multi-row tokens are not
    looked for: a one-time filter, so the grouping, about 0.3 us per row, is
    not run) if the range may hold a token of more than one row.
    """
    table = schema.table
    built = ", ".join(f"{expression} AS {name}" for name, expression in lines.items())
    gate = f"({batched}) AND " if batched else ""
    return (
        f"SELECT t.token, t.seq, {built} FROM {table} t LEFT JOIN ("
        f"SELECT s.token, max(s.seq) AS last_seq FROM {table} s WHERE {gate}s.token > {after} AND s.token <= {last} "
        "GROUP BY s.token HAVING count(*) > 1) AS b ON b.token = t.token "
        f"WHERE t.token > {after} AND t.token <= {last} ORDER BY t.token, t.seq OFFSET 0"
    )


def lines_function_sql(function: str, schema: StreamSchema, with_ts: bool) -> str:
    """``CREATE FUNCTION pg_temp.<function>(after, upto, max_rows, prefix, max_bytes) RETURNS SETOF text``.

    The lines of the rows with ``after < token <= last``, ``last`` the token
    of the ``max_rows``-th row after ``after`` (at most ``upto``), in
    ``(token, seq)`` order; a line over ``max_bytes`` (NULL: no limit) is
    returned empty. Every column reference is qualified (a stream column may
    have any name): the only names left bare are the function's own. The
    rows of the subquery come in its order already, so the outer ``ORDER
    BY`` costs no sort.
    """
    select = lines_select_sql(schema, {"line": line_sql(schema, with_ts, "$4")}, "$1", "last_token")
    return (
        f"CREATE FUNCTION pg_temp.{function}(bigint, bigint, integer, text, integer) RETURNS SETOF text "
        f"LANGUAGE plpgsql STABLE {PLAN_SETTINGS} AS $fn$\n#variable_conflict use_variable\n"
        "DECLARE\n    last_token bigint;\nBEGIN\n"
        f"    {last_token_sql(schema.table, '$1', '$2', '$3')} INTO last_token;\n"
        "    RETURN QUERY SELECT CASE WHEN octet_length(l.line) > $5 THEN '' ELSE l.line END FROM ("
        f"{select}) AS l ORDER BY l.token, l.seq;\n"
        "END\n$fn$"
    )


class SessionFunctions:
    """Temporary functions (or prepared statements) of each connection's session, one per stream table and variant, made on first use.

    ``build(name, schema, with_ts)`` gives the ``CREATE FUNCTION``; names are
    ``<stem>_<n>``, so two sets with different stems never collide on one
    connection. Forgotten with the connection (a new session has none).
    """

    def __init__(self, stem: str, build: Callable[[str, StreamSchema, bool], str]) -> None:
        self._stem = stem
        self._build = build
        # Per connection: (table, with_ts) -> the name of its function.
        self._known: weakref.WeakKeyDictionary[Any, dict[tuple[str, bool], str]] = weakref.WeakKeyDictionary()

    def name(self, cursor: Any, schema: StreamSchema, with_ts: bool) -> str:
        """The function's name on ``cursor``'s connection, created there first if it is new."""
        conn = cursor.connection
        known = self._known.get(conn)
        if known is None:
            known = self._known[conn] = {}
        key = (schema.table, with_ts)
        name = known.get(key)
        if name is None:
            name = f"{self._stem}_{len(known) + 1}"
            cursor.execute(self._build(name, schema, with_ts))
            known[key] = name
        return name


class CopyChunks(list[bytes]):
    """A file for ``copy_expert``: keeps what each call gives (a row) without copying; joined once."""

    write = list.append


_LINES_FUNCTIONS = SessionFunctions("tickline_lines", lines_function_sql)


@attr.s(slots=True, frozen=True, auto_attribs=True)
class LineRange:
    """One read of a stream's ``RDATA`` lines: about ``limit`` rows in ``(after, upto]``, never part
    of a token, each line ``prefix`` then its instance, token and row (with ``ts`` if ``with_ts``)."""

    schema: StreamSchema
    after: int
    upto: int
    limit: int
    prefix: str
    with_ts: bool


def read_lines(cursor: Any, read: LineRange, max_line_bytes: int | None) -> tuple[bytes, int, int] | None:
    """``(lines, last token, rows)`` of the range (see the module doc).

    None if a line came out over ``max_line_bytes`` (the caller builds them).
    ``cursor``: on an autocommit connection (the function is created on it once).
    """
    function = _LINES_FUNCTIONS.name(cursor, read.schema, read.with_ts)
    query = cursor.mogrify(
        f"SELECT * FROM pg_temp.{function}(%s, %s, %s, %s, %s)",
        (read.after, read.upto, read.limit, read.prefix, max_line_bytes),
    )
    chunks = CopyChunks()
    cursor.copy_expert(f"COPY ({query.decode()}) TO STDOUT WITH {_COPY_OPTIONS}", chunks)
    if not chunks:
        return b"", read.after, 0
    data = b"".join(chunks)
    if max_line_bytes is not None and _QUOTE_BYTE in data:
        return None
    return data, last_line_token(data, read.prefix), data.count(b"\n")


def last_line_token(lines: bytes, prefix: str) -> int:
    """The token named by the last of ``lines`` (``<prefix><instance> <token> ...``): a read's last row
    is its token's last, so its line names the token."""
    start = lines.rfind(b"\n", 0, len(lines) - 1) + 1 + len(prefix.encode())
    return int(lines[start:].split(b" ", 2)[1])
