"""``RDATA`` lines built in the master from the columns PostgreSQL sends by ``COPY``.

``storage.pg_lines`` has the server build every line (JSON escaping by
``array_to_json``, concatenations): 1.5-1.8 µs of the backend's CPU per row,
which bounded the master's reads on PostgreSQL. Here the server sends each
row's columns and the master turns a whole ``COPY`` buffer into lines with a
handful of bytes operations, no Python object per row or value.

**The read** (:func:`read_columns`) first takes two round trips on the
thread's connection (the ``COPY``, then its ``COMMIT``) (:func:`_read_plain`, sixteenth session): a transaction
whose ``SET LOCAL`` statements steer the plan to the ``(token, seq)`` index
(``pg_lines.PLAN_SETTINGS``: left alone, the planner sorts a bitmap scan's
rows) and a plain ``COPY (SELECT ... ORDER BY token, seq LIMIT <limit + 1>)``
of the range with its bounds as literals (:func:`range_copy_sql`, ``limited``), in
one query string. The row past the limit says where the last whole token
ends (it is dropped unless it continues the last row's token), and two
consecutive rows with the same head say that a token of several rows (a
batch) is in the range: then the range is read again the way it was before
(:func:`_read_ranged`), and so are the stream's next ``BATCH_MEMORY`` reads:
in a read-only ``REPEATABLE READ`` transaction a prepared statement
(:func:`range_statement_sql`) finds the range's last token and whether a
batch may be in it, then the same plain ``COPY`` up to that token
(:func:`range_copy_sql`), or, with a batch, a session function
(:func:`columns_function_sql`) that joins the rows to the range's multi-row
tokens (the ``batch`` marks, as ``pg_lines``). No function for the plain
reads: ``RETURN QUERY`` puts every row in a tuple store first. Measured
(docs/benchmarks.md, pgread3 and pgread5): the range statement cost
0.10-0.15 µs of the backend per row (its scan visits every row's heap tuple
once more), the whole read with it 0.85-0.95, without it about 0.7.

**The format does the JSON.** ``COPY ... (FORMAT csv, DELIMITER ',', QUOTE
'"', ESCAPE '\\', NULL 'null', FORCE_QUOTE (<text columns>))`` writes a
text value as ``"..."`` with ``"`` and ``\\`` escaped by a backslash (JSON's
escapes for them), a NULL as ``null`` unquoted, and an unquoted column (a
bigint, ``ts``, a boolean or double given as its JSON text by SQL, NULL for
NULL) as its text, unless it holds the delimiter, the quote or a line break.
Only control characters differ: CSV sends them raw, JSON escapes them. So
each output row is ``<instance> <token or batch>\x01,<v1>,...,<vn>\n``
with the values already JSON (the lines' constant prefix, ``RDATA
<stream> ``, is the master's: the backend saves its concatenation per row),
and the lines are the prefix, then that with ``\x01,`` made `` [`` and each
newline ``]\n`` followed by the next line's prefix, when the rows hold no
control byte but one ``\x01`` and one newline each (``copy_expert`` gives
one call per row: the count). :func:`lines_from_rows` finds the control
bytes and turns the heads' ends in numpy (one vectorized pass; the join before it and the replace after it hold the GIL),
then makes the newlines with one one-byte ``replace``. Non-ASCII text is
UTF-8 in both; ``DEL`` is not escaped by either. A head that CSV quoted (an
instance name with a comma or a quote) has a ``"`` after its ``\x01``.

A buffer with a control character in a value, or a quoted head (rare), is
read again by the server-built path (``pg_lines.read_lines``), whose bytes
these are (tests/unit/test_pg_columns_out.py compares both on arbitrary
rows). A stream with a ``json`` column (its text holds quotes, which
``pg_lines`` takes as they are) always takes that path. A line longer than
``max_line_bytes`` gives None, as there (found without a look at each line:
:func:`longest_within`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import Any, Literal

from storage import pg_lines
from storage.pg_db import committed
from storage.pg_lines import (
    PLAN_SETTINGS,
    CopyChunks,
    LineRange,
    SessionFunctions,
    first_tokens_sql,
    last_line_token,
    lines_select_sql,
    value_json_sql,
)
from storage.schema import StreamSchema

HEAD_END = b"\x01"
_SPACE, _BRACKET, _COMMA = ord(" "), ord("["), ord(",")


def handles(schema: StreamSchema) -> bool:
    """Whether this path can build the stream's lines (else ``pg_lines`` builds them in the server)."""
    return bool(schema.columns) and all(c.type != "json" for c in schema.columns)


def _value_sql(column: str, kind: str) -> str:
    """A non-text value's JSON text, NULL for NULL (``COPY`` writes ``null``)."""
    if kind == "bigint":
        return column
    if kind == "boolean":
        return f"CASE WHEN {column} THEN 'true' WHEN NOT {column} THEN 'false' END"
    return f"CASE WHEN {column} IS NOT NULL THEN {value_json_sql(column, kind)} END"


def columns_sql(schema: StreamSchema, with_ts: bool, batched: bool = True) -> dict[str, str]:
    """Output name -> SQL expression of one row's output columns: the head, then the values.

    ``batched``: the rows are joined to their multi-row tokens (``b``), whose rows below the last say ``batch``.
    """
    mark = "CASE WHEN t.seq < b.last_seq THEN 'batch' ELSE t.token::text END" if batched else "t.token::text"
    out = {"o_head": f"$4 || t.instance_name || ' ' || {mark} || E'\\x01'"}
    for i, c in enumerate(schema.columns, 1):
        column = f"t.{c.name}"
        out[f"o_{i}"] = column if c.type == "text" else _value_sql(column, c.type)
    if with_ts:
        out["o_ts"] = "t.ts"
    return out


def copy_options(schema: StreamSchema) -> str:
    """``COPY``'s options: CSV, every text value quoted, ``"`` and ``\\`` escaped by a backslash, NULL as ``null``."""
    quoted = ", ".join(f"o_{i}" for i, c in enumerate(schema.columns, 1) if c.type == "text")
    force = f", FORCE_QUOTE ({quoted})" if quoted else ""
    # E'\\' is one backslash whatever the session's standard_conforming_strings.
    return f"(FORMAT csv, DELIMITER ',', QUOTE '\"', ESCAPE E'\\\\', NULL 'null'{force})"


def range_statement_sql(name: str, schema: StreamSchema, _with_ts: bool) -> str:
    """``PREPARE <name>(after, upto, max_rows)``: the range's last token, and whether a batch may be in it.

    ``last`` as in ``pg_lines.lines_function_sql`` (the token of the
    ``max_rows``-th row after ``after``, at most ``upto``; NULL if none);
    ``batched`` if a token repeats among those rows (they come sorted, so the
    distinct count is cheap) or the last token has more than one row (its
    rows may go past the limit). One statement, planned once per connection.
    """
    table = schema.table
    return (
        f"PREPARE {name}(bigint, bigint, integer) AS SELECT x.last, x.repeats OR ("
        f"SELECT count(*) > 1 FROM (SELECT 1 FROM {table} r WHERE r.token = x.last LIMIT 2) AS y) FROM ("
        "SELECT max(z.token) AS last, count(*) > count(DISTINCT z.token) AS repeats FROM ("
        f"{first_tokens_sql(table, '$1', '$2', '$3')}) AS z) AS x"
    )


@functools.lru_cache(maxsize=256)
def range_copy_sql(schema: StreamSchema, with_ts: bool, limited: bool = False) -> str:
    """The ``COPY`` of the rows ``%(after)s < token <= %(last)s`` of a range without batches, for ``mogrify``.

    Its heads lack the lines' prefix (:func:`lines_from_rows` adds it).
    ``limited``: only the first ``%(limit)s`` rows, for a read without the
    range statement (:func:`read_columns`), which asks one row more than it
    keeps, so it knows where the last whole token ends.

    A plain query, not a function: ``RETURN QUERY`` puts every row in a
    tuple store first (about 0.15 us per row of the backend's 1.0). Planned
    on each call, with the range as literals (a few tens of microseconds per
    read); its ``ORDER BY`` is the index's, whatever plan the planner picks.
    """
    columns = columns_sql(schema, with_ts, batched=False)
    # The lines' constant prefix is the master's (lines_from_rows): about 0.05 us per row of the
    # backend's concatenations, free in the newline's replace there.
    columns["o_head"] = columns["o_head"].removeprefix("$4 || ")
    listed = ", ".join(f"{expression} AS {name}" for name, expression in columns.items())
    return (
        f"COPY (SELECT {listed} FROM {schema.table} t WHERE t.token > %(after)s AND t.token <= %(last)s "
        f"ORDER BY t.token, t.seq{' LIMIT %(limit)s' if limited else ''}) TO STDOUT WITH {copy_options(schema)}"
    )


def columns_function_sql(function: str, schema: StreamSchema, with_ts: bool) -> str:
    """``CREATE FUNCTION pg_temp.<function>(after, last, prefix) RETURNS TABLE (...)``: a range with batches.

    The rows with ``after < token <= last`` in ``(token, seq)`` order, each
    as the columns of :func:`columns_sql`, joined to the range's multi-row
    tokens (``pg_lines.lines_select_sql``) so a batch's rows below the last
    say ``batch``.
    """
    columns = columns_sql(schema, with_ts)
    select = lines_select_sql(schema, columns, "$1", "$2")
    kinds = {"o_ts": "bigint"} | {f"o_{i}": "bigint" for i, c in enumerate(schema.columns, 1) if c.type == "bigint"}
    returns = ", ".join(f"{name} {kinds.get(name, 'text')}" for name in columns)
    listed = ", ".join(f"l.{name}" for name in columns)
    return (
        f"CREATE FUNCTION pg_temp.{function}(bigint, bigint, text) RETURNS TABLE ({returns}) "
        f"LANGUAGE plpgsql STABLE {PLAN_SETTINGS} AS $fn$\n"
        f"BEGIN\n    RETURN QUERY SELECT {listed} FROM ({select.replace('$4', '$3')}) AS l ORDER BY l.token, l.seq;\n"
        "END\n$fn$"
    )


# The plan the plain COPY is written for, as pg_lines.PLAN_SETTINGS: the (token, seq) index in order.
# Left to itself the planner takes a bitmap scan and a sort (about 0.2 us per row more, and a sort
# of 20,000 wide rows spills past work_mem), with statistics or without.
_STEER = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; " + "".join(
    f"SET LOCAL {setting.strip()}; " for setting in PLAN_SETTINGS.removeprefix("SET ").split(" SET ")
)


_COLUMNS_FUNCTIONS = SessionFunctions("tickline_columns", columns_function_sql)
_RANGE_STATEMENTS = SessionFunctions("tickline_range", range_statement_sql)


def lines_from_rows(chunks: Sequence[bytes], rows: int, prefix: bytes) -> bytes | None:
    """The ``RDATA`` lines of ``rows`` ``COPY`` rows (``chunks`` joined) whose heads lack ``prefix``; None if they need more escaping.

    Each row is ``<head>\x01,<values>\n``: its line is ``prefix``, the head,
    `` [``, the values and ``]\n``. The rows' control bytes are found in one
    vectorized pass (numpy, without the GIL: the other read's thread runs
    meanwhile): exactly two per row, the head's end followed by ``,`` (else
    a value holds a control byte, or CSV quoted the head). The head's end and
    the comma after it become `` [`` in place (a two-byte pattern's
    ``bytes.replace`` cost 0.13 us per row, the control count by
    ``translate`` 0.07: docs/benchmarks.md, pgread5), then one one-byte
    replace makes each newline ``]\n`` and the next line's prefix.
    """
    rows_read = _Rows.of(chunks, rows)
    return None if rows_read is None else rows_read.lines(prefix)


class _Rows:
    """``COPY`` rows of :func:`columns_sql` joined, and where each head ends (see :func:`lines_from_rows`)."""

    def __init__(self, buf: bytearray, data: Any, controls: Any) -> None:
        self.buf = buf
        self.data = data  # the bytes of buf as a numpy array (a view: edits change buf)
        self.heads = controls[0::2]
        self.ends = controls[1::2]

    @classmethod
    def of(cls, chunks: Sequence[bytes], rows: int) -> _Rows | None:
        """None if a value holds a control byte or CSV quoted a head."""
        # Imported here: only a master's reads need it, and it takes ~140 ms and 16 MiB at import
        # (a worker's start on PostgreSQL imports this module and never reads lines).
        import numpy as np

        buf = bytearray().join(chunks)
        data = np.frombuffer(buf, np.uint8)
        controls = np.flatnonzero(data < 32)
        if len(controls) != 2 * rows:
            return None  # a control byte in a value (CSV sends it raw)
        heads = controls[0::2]
        if not (np.all(data[heads] == 1) and np.all(data[heads + 1] == _COMMA)):
            return None  # a head CSV quoted (an instance name with a comma or a quote)
        return cls(buf, data, controls)

    def repeats(self) -> bool:
        """Whether two rows in a row have the same head (a token of several rows: a batch).

        Consecutive tokens differ in their last digit: only rows whose heads
        have the same length and last byte are compared whole (usually none).
        """
        import numpy as np

        heads, data = self.heads, self.data
        starts = np.concatenate(([0], self.ends[:-1] + 1))
        lengths = heads - starts
        alike = np.flatnonzero((lengths[1:] == lengths[:-1]) & (data[heads[1:] - 1] == data[heads[:-1] - 1]))
        buf = self.buf
        return any(buf[starts[i] : heads[i]] == buf[starts[i + 1] : heads[i + 1]] for i in alike.tolist())

    def lines(self, prefix: bytes) -> bytes:
        """The rows' lines (the buffer is changed in place: once)."""
        heads, data = self.heads, self.data
        data[heads] = _SPACE
        data[heads + 1] = _BRACKET
        lines = self.buf.replace(b"\n", b"]\n" + prefix)
        # The replace put a prefix after the last newline: the first line's goes before it instead.
        return prefix + memoryview(lines)[: len(lines) - len(prefix)]


def longest_within(data: bytes, limit: int) -> bool:
    """Whether every line of ``data`` (newline-terminated) is at most ``limit`` bytes before its newline.

    Jumps to the last newline within ``limit + 1`` bytes of each line's start: one search per
    ``limit`` bytes or so, not one per line.
    """
    end, start = len(data), 0
    while end - start > limit + 1:
        newline = data.rfind(b"\n", start, start + limit + 1)
        if newline < 0:
            return False
        start = newline + 1
    return True


# Streams (by table) whose reads found a batch lately: reads left through the range statement.
# A read without it that finds a batch is made again with it (about twice the backend's work for
# that range); after one, the next reads of the stream take the statement at once.
_BATCHED_READS: dict[str, int] = {}
BATCH_MEMORY = 16


class _Found(enum.Enum):
    BATCH = "a read without the range statement found a batch"


def read_columns(cursor: Any, read: LineRange) -> tuple[bytes, int, int] | None:
    """``(lines, last token, rows)`` built here from the columns, or None if they need the server's escaping.

    No check of ``max_line_bytes``: :func:`read_lines` makes it. A range is
    first read without the range statement (:func:`_read_plain`); if it
    holds a batch, again with it.
    """
    table = read.schema.table
    # Read and written by several database threads without a lock: a lost update only costs a
    # read more or less by the statement (every plain read finds a batch by itself).
    left = _BATCHED_READS.get(table, 0)
    if left > 0 or read.limit < 1:
        _BATCHED_READS[table] = max(left - 1, 0)
    else:
        got = _read_plain(cursor, read)
        if got is not _Found.BATCH:
            return got
        _BATCHED_READS[table] = BATCH_MEMORY
    return _read_ranged(cursor, read)


def _read_plain(cursor: Any, read: LineRange) -> tuple[bytes, int, int] | Literal[_Found.BATCH] | None:
    """The range by one ``COPY`` of its first ``limit + 1`` rows, without the range statement; ``BATCH`` if it holds a batch.

    The range statement scans the range's rows once before the ``COPY`` does
    (0.10-0.15 us of the backend per row, docs/benchmarks.md, pgread3): here
    the rows say themselves whether a token repeats (two consecutive rows
    with one head), and the row past the limit where the last whole token
    ends (the rows before it, if its token is not theirs). Two round trips:
    the transaction's start, its plan settings and the ``COPY`` in one
    query string, then the ``COMMIT``.
    """
    sql = cursor.mogrify(
        range_copy_sql(read.schema, read.with_ts, limited=True),
        {"after": read.after, "last": read.upto, "limit": read.limit + 1},
    )
    chunks = CopyChunks()
    with committed(cursor):
        cursor.copy_expert(_STEER + sql.decode(), chunks)
    if not chunks:
        return b"", read.after, 0
    if len(chunks) > read.limit:
        # The row past the limit: kept out, unless it continues the last row's token.
        past, last = chunks.pop(), chunks[-1]
        if past[: past.find(HEAD_END)] == last[: last.find(HEAD_END)]:
            return _Found.BATCH
    rows = _Rows.of(chunks, len(chunks))
    if rows is None:
        return None
    if rows.repeats():
        return _Found.BATCH
    return _with_last(rows.lines(read.prefix.encode()), read.prefix, len(chunks))


def _with_last(lines: bytes, prefix: str, count: int) -> tuple[bytes, int, int]:
    """``(lines, the last line's token, count)``."""
    return lines, last_line_token(lines, prefix), count


def _read_ranged(cursor: Any, read: LineRange) -> tuple[bytes, int, int] | None:
    """The range through the range statement: its last token and whether a batch may be in it, then its ``COPY``."""
    # Both made outside the transaction below (its rollback would take a function made in it).
    schema, after = read.schema, read.after
    statement = _RANGE_STATEMENTS.name(cursor, schema, False)
    function = _COLUMNS_FUNCTIONS.name(cursor, schema, read.with_ts)
    chunks = CopyChunks()
    with committed(cursor):
        # One transaction: its SET LOCAL steers the plain COPY's plan (the function's SET clause
        # does the same for a range with batches) and ends with it.
        cursor.execute(f"{_STEER}EXECUTE {statement}(%s, %s, %s)", (after, read.upto, read.limit))
        last, batched = cursor.fetchone()
        if last is not None and batched:
            # The function's heads without the prefix too (lines_from_rows adds it).
            query = cursor.mogrify(f"SELECT * FROM pg_temp.{function}(%s, %s, %s)", (after, last, "")).decode()
            cursor.copy_expert(f"COPY ({query}) TO STDOUT WITH {copy_options(schema)}", chunks)
        elif last is not None:
            sql = range_copy_sql(schema, read.with_ts)
            cursor.copy_expert(cursor.mogrify(sql, {"after": after, "last": last}).decode(), chunks)
    if not chunks:
        return b"", after, 0
    rows = len(chunks)
    lines = lines_from_rows(chunks, rows, read.prefix.encode())
    if lines is None:
        return None
    return _with_last(lines, read.prefix, rows)


def read_lines(cursor: Any, read: LineRange, max_line_bytes: int | None) -> tuple[bytes, int, int] | None:
    """``pg_lines.read_lines``'s answer, byte for byte: built here from the columns when they allow it.

    Otherwise (see the module doc) the server builds them (``pg_lines``).
    """
    got = read_columns(cursor, read) if handles(read.schema) else None
    if got is None:
        return pg_lines.read_lines(cursor, read, max_line_bytes)
    if max_line_bytes is not None and not longest_within(got[0], max_line_bytes):
        return None
    return got
