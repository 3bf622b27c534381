"""Rows as PostgreSQL ``COPY`` text (the writer's bulk appends and the worker's applies)."""

from __future__ import annotations

import io
import itertools
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
    encoded text once (:func:`data_needs_escapes`).
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
    as they are: the caller checks the whole data once
    (:func:`data_needs_escapes`, on the encoded bytes) and makes the lines the careful way when a
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
        "        t = str(ts)",  # seq and ts: the one text, converted once (about 10 % of the loop)
        '        append(f"{t}\\t{tok}\\t{name}\\t{t}\\t' + "\\t".join(parts) + '")',
        "        ts += 1",
        "        tok += step",
        "    return out, nulls",
    ]
    chunk: Callable[..., tuple[list[str] | None, int]] = _compile(lines, "chunk")
    return chunk


# What a value must not hold in the quick COPY text: each is a separator, an escape's start, or
# (carriage return, NUL) something COPY or the stream refuses. In UTF-8 none of these bytes is part
# of another character, so the encoded text has them exactly where the characters are.
_SPECIAL_BYTES = b"\t\n\\\r\x00"
SPECIAL_CHARACTERS = frozenset(_SPECIAL_BYTES.decode())  # the same, as characters of a str


def data_needs_escapes(data: bytes, separators: int, backslashes: int) -> bool:
    """Whether encoded ``COPY`` lines hold a special byte a value put there.

    ``separators``: the tabs and newlines the lines hold by themselves (per
    line, one fewer tab than columns and a newline); ``backslashes``: the
    backslashes they hold by themselves (one per NULL, those of the instance
    name). Those are always there, so any more special bytes came from a
    value. One pass in C (``bytes.translate`` deleting them): about half the
    CPU of three ``str.count`` passes over the text before encoding.
    """
    return len(data) - len(data.translate(None, _SPECIAL_BYTES)) != separators + backslashes
