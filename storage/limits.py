"""What a row may hold so that it can always be delivered: checked where rows are written.

The replication protocol refuses lines longer than ``protocol.max_line_bytes``
(without the line ending). A stored row that makes a longer ``RDATA`` line
could never be delivered and would stop every worker at it, so writers refuse
such a row before anything is stored. The limit is a plain number handed down
by the layer that read the configuration (storage does not know the wire).

The size is the worst case of the line a row can produce::

    RDATA <stream> <instance> <token> <row_json>

with the longest instance name (``MAX_NAME_BYTES``), a 20-digit token and the
row JSON as the master may send it: with the ``ts`` option (one more element,
a 20-digit timestamp), doubles written as SQLite's ``%!.17g`` does (up to 24
characters), and JSON columns as PostgreSQL's ``jsonb`` prints them (``", "``
and ``": "`` separators, numbers without exponent). ``tests/unit/test_limits.py``
checks this against the lines the master really builds on both backends.

JSON values are also bounded in depth (``MAX_JSON_DEPTH``): deeper values are
refused rather than failing later in a serializer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import orjson

from storage.schema import MAX_NAME_BYTES, RowError, StreamSchema

DEFAULT_MAX_LINE_BYTES = 65536  # protocol.max_line_bytes's default
MAX_JSON_DEPTH = 64  # nesting of arrays and objects inside one JSON column value
# Rows that share one token (a batch) at most. A client holds a batch whole
# until its last line (it is applied atomically), so a worker bounds what it
# holds by this number; writers refuse a longer batch, so that no stored batch
# is ever beyond what a worker accepts.
MAX_BATCH_ROWS = 100_000
TOKEN_DIGITS = 20  # the longest token (or "batch") on an RDATA line
TS_BYTES = 1 + 20  # ",<ts>" appended to the row JSON with the ts option
DOUBLE_BYTES = 24  # "-1.2345678901234567e-308": SQLite's %!.17g at its longest
_NULL_BYTES = 4

Row = Sequence[Any] | Mapping[str, Any]


def rdata_overhead(stream: str) -> int:
    """Bytes of an RDATA line besides its row JSON, at the worst: ``RDATA s i t `` and the ts element."""
    return len(b"RDATA ") + len(stream.encode("utf-8")) + 1 + MAX_NAME_BYTES + 1 + TOKEN_DIGITS + 1 + TS_BYTES


def _number_bytes(value: float) -> int:
    """A float as jsonb prints it (plain decimal) or as orjson does, whichever is longer."""
    if not math.isfinite(value):
        return _NULL_BYTES
    text = orjson.dumps(value).decode("ascii")
    return max(len(text), len(format(Decimal(text), "f")))


def json_value_bytes(value: Any, column: str) -> int:
    """The longest text a JSON column value is sent as (jsonb's spacing); RowError if too deep."""
    total = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            total += len(orjson.dumps(item))
        elif isinstance(item, bool) or item is None:
            total += 4 if item is True or item is None else 5
        elif isinstance(item, int):
            total += len(str(item))
        elif isinstance(item, float):
            total += _number_bytes(item)
        elif isinstance(item, (list, tuple, Mapping)):
            if depth > MAX_JSON_DEPTH:
                raise RowError(f"column {column!r}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
            n = len(item)
            total += 2 + 2 * max(n - 1, 0)  # brackets and ", " separators
            if isinstance(item, Mapping):
                for key, child in item.items():
                    total += len(orjson.dumps(str(key))) + 2  # '"key": '
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
        else:
            total += len(orjson.dumps(item))  # raises for what JSON cannot hold
    return total


def row_json_bytes(schema: StreamSchema, values: Sequence[Any], originals: Sequence[Any] | None = None) -> int:
    """The longest row JSON (without ts) that checked ``values`` can be sent as.

    ``originals`` are the values before checking (JSON columns as Python
    objects); without them the JSON columns' stored text is parsed again.
    """
    return _RowSizer(schema).row_json_bytes(values, originals)


def rdata_line_bytes(schema: StreamSchema, values: Sequence[Any], originals: Sequence[Any] | None = None) -> int:
    """The longest RDATA line (without its newline) a checked row can produce."""
    return rdata_overhead(schema.name) + row_json_bytes(schema, values, originals)


def max_row_json_bytes(stream: str, max_line_bytes: int) -> int:
    """The longest row JSON (without ts) a stream accepts under a line limit."""
    return max_line_bytes - rdata_overhead(stream)


class _RowSizer:
    """The size computation for one stream, its column positions looked up once."""

    __slots__ = ("double_columns", "json_columns", "names", "schema")

    def __init__(self, schema: StreamSchema) -> None:
        self.schema = schema
        self.json_columns = schema.json_columns
        self.double_columns = schema.double_columns
        self.names = schema.column_names

    def row_json_bytes(self, values: Sequence[Any], originals: Sequence[Any] | None) -> int:
        if not self.json_columns and not self.double_columns:
            return len(orjson.dumps(values))
        plain = list(values)
        extra = 0
        for i in self.double_columns:
            if plain[i] is not None:
                plain[i] = None
                extra += DOUBLE_BYTES - _NULL_BYTES
        for i in self.json_columns:
            if plain[i] is not None:
                value = originals[i] if originals is not None else orjson.loads(plain[i])
                plain[i] = None
                extra += max(json_value_bytes(value, self.names[i]), len(values[i])) - _NULL_BYTES
        return len(orjson.dumps(plain)) + extra

    def check(self, row: Row, max_line_bytes: int | None, overhead: int) -> tuple[Any, ...]:
        values = self.schema.check_row(row)
        if max_line_bytes is not None:
            originals = _originals(self.schema, row) if self.json_columns else None
            size = overhead + self.row_json_bytes(values, originals)
            if size > max_line_bytes:
                raise RowError(
                    f"stream {self.schema.name!r}: the row's RDATA line could be {size} bytes, "
                    f"over the line limit of {max_line_bytes} (protocol.max_line_bytes; "
                    f"row JSON up to {max_line_bytes - overhead} bytes as sent)"
                )
        return values


def check_batch_rows(stream: str, rows: int, steps: bool = False) -> None:
    """A batch of ``rows`` rows (one token) is within ``MAX_BATCH_ROWS``; else a RowError naming it.

    ``steps``: the rows of several batch appends of one transaction, which
    share one token unless another is allocated between them.
    """
    if rows > MAX_BATCH_ROWS:
        what = (
            f"{rows} rows of one transaction's batch appends (one token while no other is allocated between them) are"
            if steps
            else f"a batch of {rows} rows sharing one token is"
        )
        raise RowError(
            f"stream {stream!r}: {what} over the limit of {MAX_BATCH_ROWS} rows per batch "
            "(write them without batch: still one transaction)"
        )


def batch_step_rows(stream: str, rows_so_far: int, count: int, continues: bool) -> int:
    """The rows of a batch token once a batch append of ``count`` rows is in, checked against the bound.

    ``continues``: the append may continue the transaction's batch token
    (nothing of the stream allocated since that the writer knows of), so the
    token's ``rows_so_far`` count too; else it starts a token of its own.
    """
    rows = rows_so_far + count if continues else count
    check_batch_rows(stream, rows, steps=rows > count)
    return rows


def check_row(schema: StreamSchema, row: Row, max_line_bytes: int | None) -> tuple[Any, ...]:
    """One row checked against its columns and the line limit; the values as stored."""
    return _RowSizer(schema).check(row, max_line_bytes, rdata_overhead(schema.name))


def _originals(schema: StreamSchema, row: Row) -> Sequence[Any]:
    if isinstance(row, Mapping):
        return [row.get(name) for name in schema.column_names]
    return row  # check_row has verified it is a list or tuple of the right length


class RowChecker:
    """:func:`check_rows` of one row for one stream, what it looks up per stream done once.

    A writer keeps one per stream for its single-row appends: their check then
    builds no sizer and encodes no stream name per row.
    """

    __slots__ = ("_check", "_overhead", "schema")

    def __init__(self, schema: StreamSchema) -> None:
        self.schema = schema
        self._check = _RowSizer(schema).check
        self._overhead = rdata_overhead(schema.name)

    def one(self, row: Row, max_line_bytes: int | None) -> tuple[Any, ...]:
        """The row checked as the first of ``check_rows`` (a RowError names it as row 1)."""
        try:
            return self._check(row, max_line_bytes, self._overhead)
        except RowError as e:
            raise RowError(e.reason, index=0) from None


def check_rows(schema: StreamSchema, rows: Iterable[Row], max_line_bytes: int | None) -> list[tuple[Any, ...]]:
    """Every row checked; a RowError names the row (``index``: its position in ``rows``)."""
    sizer = _RowSizer(schema)
    overhead = rdata_overhead(schema.name)
    check = sizer.check
    checked = []
    for index, row in enumerate(rows):
        try:
            checked.append(check(row, max_line_bytes, overhead))
        except RowError as e:
            raise RowError(e.reason, index=index) from None
    return checked
