"""Rows as PostgreSQL ``COPY`` text (the writer's bulk appends and the worker's applies)."""

from __future__ import annotations

import functools
import io
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from storage.schema import INT64_MAX, INT64_MIN, StreamSchema

_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
NULL_COPY = "\\N"


def _copy_text(value: str) -> str:
    # Most values need no escape: four substring tests are much cheaper than a translate.
    if "\\" in value or "\t" in value or "\n" in value or "\r" in value:
        return value.translate(_COPY_ESCAPES)
    return value


def _copy_bool(value: bool) -> str:
    return "t" if value else "f"


def _copy_double(value: float) -> str:
    text = repr(value)
    return _SPECIAL.get(text, text)


_SPECIAL = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}
_COPY_FORMATS: dict[str, Callable[[Any], str]] = {
    "text": _copy_text,
    "json": _copy_text,
    "bigint": str,
    "double": _copy_double,
    "boolean": _copy_bool,
}


def copy_rows(cursor: Any, table: str, schema: StreamSchema, rows: Sequence[tuple[Any, ...]]) -> None:
    """``COPY`` rows ``(token, instance_name, ts, *checked values)`` into ``table``."""
    formats: list[Callable[[Any], str]] = [str, _copy_text, str]
    formats += [_COPY_FORMATS[c.type] for c in schema.columns]
    columns = formatter(schema, checked=True)
    lines = []
    for row in rows:
        text = columns(row[3:])
        if text is None:
            text = "\t".join([NULL_COPY if v is None else f(v) for f, v in zip(formats[3:], row[3:], strict=False)])
        lines.append(f"{row[0]}\t{_copy_text(row[1])}\t{row[2]}\t{text}")
    lines.append("")
    names = ", ".join(("token", "instance_name", "ts", *schema.column_names))
    cursor.copy_expert(f"COPY {table} ({names}) FROM STDIN", io.BytesIO("\n".join(lines).encode()), size=1 << 20)


def column_formatter(schema: StreamSchema, checked: bool = False, with_ts: bool = False) -> Callable[[Any], str | None]:
    """A function checking one row's values and returning its columns as COPY text, or None.

    Generated once per schema (one unrolled function, no per-value dispatch):
    it accepts only what :meth:`StreamSchema.check_row` stores unchanged (a
    list or tuple of exactly typed values; JSON values are encoded). Anything
    else, a wrong value included, gives None: the caller then checks the row
    with ``check_row``, which names the problem. With ``checked``, the values
    were checked already (JSON values are JSON text). With ``with_ts``, a row
    as a worker receives it: the values and then the row's timestamp (a
    non-negative 64-bit integer), the text ending in a column for it.
    """
    lines = ["def fmt(row):", "    if type(row) is not list and type(row) is not tuple:", "        return None"]
    lines += [f"    if len(row) != {len(schema.columns) + (1 if with_ts else 0)}:", "        return None"]
    names = [f"v{i}" for i in range(len(schema.columns))] + (["ts"] if with_ts else [])
    lines.append(f"    {', '.join(names)}{',' if len(names) == 1 else ''} = row")
    if with_ts:
        lines += ["    if type(ts) is not int or not 0 <= ts <= MAX:", "        return None"]
    for i, column in enumerate(schema.columns):
        v, s = f"v{i}", f"s{i}"
        lines.append(f"    if {v} is None:")
        lines.append(f"        {s} = NULL" if column.nullable else "        return None")
        kind = column.type
        if kind == "text" and checked:
            lines += [f"    elif type({v}) is str:", f"        {s} = esc({v})"]
        elif kind == "text":  # ASCII without NUL here; the rest is checked by check_row
            lines += [f"    elif type({v}) is str and {v}.isascii() and NUL not in {v}:", f"        {s} = esc({v})"]
        elif kind == "bigint":
            lines += [f"    elif type({v}) is int and MIN <= {v} <= MAX:", f"        {s} = str({v})"]
        elif kind == "double":
            lines += [f"    elif type({v}) is float and {v} - {v} == 0.0:", f"        {s} = dbl({v})"]  # finite
        elif kind == "boolean":
            lines += [f"    elif {v} is True:", f"        {s} = 't'", f"    elif {v} is False:", f"        {s} = 'f'"]
        elif kind == "json" and checked:
            lines += [f"    elif type({v}) is str:", f"        {s} = esc({v})"]
        elif kind == "json":
            lines += ["    else:", "        try:", f"            {s} = esc(dumps({v}).decode())"]
            lines += ["        except Exception:", "            return None"]
        if kind != "json" or checked:
            lines += ["    else:", "        return None"]
    texts = [f"s{i}" for i in range(len(schema.columns))] + (["str(ts)"] if with_ts else [])
    lines.append("    return " + ' + "\\t" + '.join(texts))
    namespace: dict[str, Any] = {
        "NULL": NULL_COPY,
        "NUL": "\x00",
        "esc": _copy_text,
        "dbl": _copy_double,
        "MIN": INT64_MIN,
        "MAX": INT64_MAX,
        "dumps": orjson.dumps,
    }
    exec("\n".join(lines), namespace)
    fmt: Callable[[Any], str | None] = namespace["fmt"]
    return fmt


_FORMATTERS: dict[tuple[StreamSchema, bool, bool], Callable[[Any], str | None]] = {}


def formatter(schema: StreamSchema, checked: bool = False, with_ts: bool = False) -> Callable[[Any], str | None]:
    found = _FORMATTERS.get((schema, checked, with_ts))
    if found is None:
        found = _FORMATTERS[(schema, checked, with_ts)] = column_formatter(schema, checked, with_ts)
    return found


def _value_lines(schema: StreamSchema, indent: str, fail: str) -> tuple[list[str], list[str]]:
    """Generated code checking ``v0 .. v<n-1>`` are exactly typed and making each its COPY text (unescaped).

    Returns the code lines and the f-string parts. A nullable None becomes
    ``\\N`` and counts in ``nulls``; a value that is not exactly typed runs
    ``fail``.
    """
    code: list[str] = []
    parts = []
    for i, column in enumerate(schema.columns):
        v = f"v{i}"
        wrong = {
            "text": f"type({v}) is not str",
            "bigint": f"type({v}) is not int or not MIN <= {v} <= MAX",
            "double": f"type({v}) is not float or {v} - {v} != 0.0",  # not finite
            "boolean": f"{v} is not True and {v} is not False",
        }[column.type]
        if column.nullable:
            code += [f"if {v} is None:", f"    {v} = NULL", "    nulls += 1", f"elif {wrong}:", f"    {fail}"]
        else:
            code += [f"if {wrong}:", f"    {fail}"]
        if column.type == "boolean":
            code += [f"if {v} is True:", f"    {v} = 't'", f"elif {v} is False:", f"    {v} = 'f'"]
        elif column.type == "double":
            code += [f"if {v} is not NULL:", f"    {v} = repr({v})"]
        parts.append(f"{{{v}}}")
    return [indent + line for line in code], parts


def _compile(lines: list[str], name: str) -> Any:
    namespace: dict[str, Any] = {
        "NULL": NULL_COPY,
        "MIN": INT64_MIN,
        "MAX": INT64_MAX,
        "esc": _copy_text,
        "repeat": itertools.repeat,
    }
    exec("\n".join(lines), namespace)
    return namespace[name]


def received_chunk_formatter(schema: StreamSchema) -> Callable[..., tuple[list[str] | None, int]] | None:
    """A worker's COPY lines ``token, instance, *values, ts`` for rows as received, unescaped (None: JSON streams).

    ``chunk(received)`` takes ``[(token, instance, [[*values, ts], ...]), ...]``
    (``token`` may be a list, one per row: a run of single-row tokens)
    and gives ``(lines, nulls)``, or ``(None, 0)`` if a row is not exactly
    typed or an instance name holds a backslash: the caller then makes the
    lines the careful way. As :func:`chunk_formatter`, the caller checks the
    whole text once (:func:`lines_need_escapes`).
    """
    if schema.json_columns:
        return None
    n = len(schema.columns)
    values, parts = _value_lines(schema, "            ", "return None, 0")
    names = ", ".join(f"v{i}" for i in range(n))
    line = 'append(f"{token}\\t{name}\\t' + "\\t".join(parts) + '\\t{ts}")'
    lines = [
        "def chunk(received):",
        "    out = []",
        "    append = out.append",
        "    nulls = 0",
        "    for tokens, name, rows in received:",
        "        if type(name) is not str or '\\\\' in name:",
        "            return None, 0",
        "        if type(tokens) is int:",
        "            pairs = zip(repeat(tokens), rows)",
        "        elif type(tokens) is list and len(tokens) == len(rows):",
        "            pairs = zip(tokens, rows)",
        "        else:",
        "            return None, 0",
        "        for token, row in pairs:",
        f"            if type(row) is not list or len(row) != {n + 1} or type(token) is not int:",
        "                return None, 0",
        f"            {names}, ts = row",
        "            if type(ts) is not int or not 0 <= ts <= MAX:",
        "                return None, 0",
        *values,
        "            " + line,
        "    return out, nulls",
    ]
    chunk: Callable[..., tuple[list[str] | None, int]] = _compile(lines, "chunk")
    return chunk


def chunk_formatter(schema: StreamSchema) -> Callable[..., tuple[list[str] | None, int]] | None:
    """A function making a writer's ``COPY`` lines for many rows at once, unescaped (None for JSON streams).

    ``chunk(rows, first_ts, first_token, step, instance)`` gives ``(lines,
    nulls)``: per row ``seq`` (its timestamp), token, instance, ``ts`` and
    the values, rows ``i = 0, 1, ...`` with timestamp ``first_ts + i`` and
    token ``first_token + i * step``; or ``(None, index)`` at the first row
    that is not exactly typed (a list or tuple of ``str`` / ``int`` in 64
    bits / finite ``float`` / ``bool`` / None where nullable). One generated
    loop, one f-string per row, no call per value. Text values are put in
    as they are: the caller checks the whole text once
    (:func:`lines_need_escapes`) and makes the lines the careful way when a
    value would need an escape (or holds NUL, or is not valid Unicode).
    """
    if schema.json_columns:
        return None
    n = len(schema.columns)
    values, parts = _value_lines(schema, "        ", "return None, len(out)")
    lines = [
        "def chunk(rows, first_ts, first_token, step, name):",
        "    out = []",
        "    append = out.append",
        "    nulls = 0",
        "    ts = first_ts",
        "    tok = first_token",
        "    for row in rows:",
        f"        if (type(row) is not list and type(row) is not tuple) or len(row) != {n}:",
        "            return None, len(out)",
        f"        {', '.join(f'v{i}' for i in range(n))}{',' if n == 1 else ''} = row",
        *values,
        '        append(f"{ts}\\t{tok}\\t{name}\\t{ts}\\t' + "\\t".join(parts) + '")',
        "        ts += 1",
        "        tok += step",
        "    return out, nulls",
    ]
    chunk: Callable[..., tuple[list[str] | None, int]] = _compile(lines, "chunk")
    return chunk


def lines_need_escapes(text: str, lines: int, columns: int, backslashes: int) -> bool:
    """Whether ``lines`` COPY lines of ``columns`` columns joined by newlines hold anything a value must not.

    ``backslashes`` is how many the lines hold by themselves (one per NULL,
    those of the instance name). Anything more, a tab or newline more than
    the separators, a carriage return or a NUL came from a value: the lines
    must then be made with escapes (and checked value by value). A few
    passes over the text in C, no work per value.
    """
    return (
        "\r" in text
        or "\x00" in text
        or text.count("\t") != lines * (columns - 1)
        or text.count("\n") != lines - 1
        or text.count("\\") != backslashes
    )


# -- a worker's received rows, column by column ----------------------------------------------
#
# Not used by the worker: measured alone about 10% faster than the generated per-row loop
# (storage.pg_worker.rows_copy_text), no cheaper in a worker's catch-up (docs/benchmarks.md,
# wk2: transposing visits every row once per column, and a backlog's rows are out of the
# caches by then). Kept with its property tests (byte for byte the per-row text) for a
# column-shaped input, such as rows parsed column by column from the wire.
#
# The per-row formatters above run one generated Python loop iteration per row. A catch-up
# applies groups of thousands of rows of one stream whose columns are each of one type, so
# each column is checked and turned into text by a few calls that loop in C (``set(map(type,
# ...))``, ``min``/``max``, ``map(str, ...)``, one ``join`` and substring tests over the whole
# column), and the lines are joined from the columns at the end. Anything such a pass cannot
# take exactly as the per-row path would (a value of another type, a NUL, a non-finite
# double, an int in a double column) gives None: the caller then takes the per-row path, which
# makes the same bytes or names the bad row.

_NONE = type(None)
_not_none = functools.partial(operator.is_not, None)
_BOOL_TEXT = {True: "t", False: "f", None: NULL_COPY}


_NULL_FOR_NONE = {None: NULL_COPY}.get  # (value, value): NULL for None, else the value itself


def _types_fit(values: Sequence[Any], nullable: bool, kind: type) -> bool | None:
    """Whether any value is None if every value is of ``kind`` (or None where ``nullable``); None if not."""
    types = set(map(type, values))
    if types == {kind}:
        return False
    if nullable and types <= {kind, _NONE}:
        return True
    return None


def _ints_text(values: Sequence[int]) -> list[str] | None:
    """Exact ints in 64 bits as text (orjson writes a list of them faster than ``map(str, ...)``)."""
    try:
        return orjson.dumps(values).decode()[1:-1].split(",")
    except TypeError:  # orjson.JSONEncodeError: an int beyond 64 bits
        return None


def _text_column(values: Sequence[Any], nullable: bool) -> Sequence[str] | None:
    nulls = _types_fit(values, nullable, str)
    if nulls is None:
        return None
    texts: Sequence[str] = list(map(_NULL_FOR_NONE, values, values)) if nulls else values
    joined = "".join(texts)
    if "\x00" in joined:
        return None  # refused by check_row, by name
    # The text holds one backslash per NULL and no other unless a value needs an escape.
    if "\t" in joined or "\n" in joined or "\r" in joined or joined.count("\\") != (values.count(None) if nulls else 0):
        texts = [NULL_COPY if v is None else _copy_text(v) for v in values]
    return texts


def _bigint_column(values: Sequence[Any], nullable: bool) -> Sequence[str] | None:
    nulls = _types_fit(values, nullable, int)
    if nulls is None:
        return None
    if not nulls:
        if min(values) < INT64_MIN or max(values) > INT64_MAX:
            return None
        return _ints_text(values)
    numbers = list(filter(_not_none, values))
    if numbers and (min(numbers) < INT64_MIN or max(numbers) > INT64_MAX):
        return None
    return [NULL_COPY if v is None else str(v) for v in values]


def _double_column(values: Sequence[Any], nullable: bool) -> Sequence[str] | None:
    nulls = _types_fit(values, nullable, float)
    if nulls is None:
        return None
    numbers = list(filter(_not_none, values)) if nulls else values
    if not all(map(math.isfinite, numbers)):
        return None
    if nulls:
        return [NULL_COPY if v is None else repr(v) for v in values]
    return list(map(repr, values))


def _boolean_column(values: Sequence[Any], nullable: bool) -> Sequence[str] | None:
    if _types_fit(values, nullable, bool) is None:
        return None
    return list(map(_BOOL_TEXT.__getitem__, values))


def _json_column(values: Sequence[Any], nullable: bool) -> Sequence[str] | None:
    # orjson escapes every control character inside strings, so its text never holds a raw
    # \x01 (the separator here), tab, newline or carriage return: only backslashes need one.
    try:
        joined = b"\x01".join(map(orjson.dumps, values)).decode()
    except (TypeError, UnicodeDecodeError):
        return None
    if "\\" in joined:
        if "\\u0000" in joined:
            return None  # a NUL in a JSON string: refused by check_row, by name, where the per-row path checks
        joined = joined.replace("\\", "\\\\")
    texts = joined.split("\x01")
    if None in values:
        if not nullable:
            return None
        return [NULL_COPY if v is None else t for v, t in zip(values, texts, strict=True)]
    return texts


_COLUMN_TEXT: dict[str, Callable[[Sequence[Any], bool], Sequence[str] | None]] = {
    "text": _text_column,
    "bigint": _bigint_column,
    "double": _double_column,
    "boolean": _boolean_column,
    "json": _json_column,
}


def received_columns_text(schema: StreamSchema, received: Sequence[Any]) -> bytes | None:
    """A worker's ``COPY`` text (lines ``token, instance, *values, ts``) for rows as received, or None.

    ``received``: ``[(token or a list of tokens, instance, [[*values, ts], ...]), ...]`` as
    :data:`storage.contracts.ReceivedRows`. The text is made column by column (one pass per
    column with a formatter for its type) and joined row by row at the end; it is byte for
    byte what the per-row path makes. None for anything these passes do not take: the
    caller then makes the text row by row (which names a bad row).
    """
    tokens: list[str] = []
    names: list[str] = []
    rows: list[Any] = []
    for token, instance, group in received:
        if type(instance) is not str or type(group) is not list:
            return None
        count = len(group)
        if type(token) is int:
            tokens += [str(token)] * count
        elif type(token) is list and len(token) == count and set(map(type, token)) == {int}:
            text = _ints_text(token)
            if text is None:
                return None
            tokens += text
        else:
            return None
        names += [_copy_text(instance)] * count
        rows += group
    if not rows or set(map(type, rows)) != {list}:
        return None
    try:
        columns = list(zip(*rows, strict=True))
    except ValueError:  # rows of different lengths
        return None
    if len(columns) != len(schema.columns) + 1:
        return None
    texts: list[Sequence[str]] = [tokens, names]
    for column, values in zip(schema.columns, columns, strict=False):
        made = _COLUMN_TEXT[column.type](values, column.nullable)
        if made is None:
            return None
        texts.append(made)
    stamps = columns[-1]
    if set(map(type, stamps)) != {int} or min(stamps) < 0 or max(stamps) > INT64_MAX:
        return None
    stamp_texts = _ints_text(stamps)
    if stamp_texts is None:
        return None
    texts.append(stamp_texts)
    try:
        return ("\n".join(map("\t".join, zip(*texts, strict=True))) + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate: refused row by row, by name
        return None
