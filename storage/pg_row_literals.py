"""One row's values as SQL literals, checked in the same pass (a writer's single-row appends)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from storage.schema import INT64_MAX, INT64_MIN, StreamSchema

RowLiterals = Callable[[Any, "int | None"], "str | None"]


def row_literals(schema: StreamSchema, overhead: int) -> RowLiterals | None:
    """A function giving a row's values as the literals of an ``EXECUTE``, or None to go the careful way.

    ``literals(row, max_line_bytes)`` reads as the values ``RowChecker.one``
    makes of a row that passes (as ``storage.pg_db.sql_literals`` writes them), in one
    generated pass with no call per value: for a list or tuple of exactly the
    column count whose values are ``str`` (no NUL, valid Unicode) in text
    columns, ``int`` in 64 bits (not ``bool``) in bigint columns, None where
    nullable, and whose RDATA line fits ``max_line_bytes`` (``overhead`` plus
    its JSON, measured as ``_RowSizer`` does). Anything else (a mapping, another
    type, a bad value, a row over the limit) gives None: the caller then checks
    the row the careful way, which names what is wrong. None (no function) for
    a stream with a column of another type. A string is written as
    ``E'...'`` with its backslashes and quotes doubled, which every session
    reads as the same text whatever its ``standard_conforming_strings`` (the
    append need not ask the connection for it: psycopg2 decodes the answer
    through a Python-level codec, about a µs per append).
    """
    columns = schema.columns
    if not columns or any(c.type not in ("text", "bigint") for c in columns):
        return None
    n = len(columns)
    body: list[str] = []
    parts: list[str] = []
    for i, c in enumerate(columns):
        v = f"v{i}"
        if c.type == "text":
            test = f'type({v}) is not str or "\\x00" in {v} or not ({v}.isascii() or valid({v}))'
            literal = f'"E\'" + {v}.replace("\\\\", "\\\\\\\\").replace("\'", "\'\'") + "\'"'
        else:
            test = f"type({v}) is not int or not MIN <= {v} <= MAX"
            literal = f"str({v})"  # after "(" or ", ": a minus sign never makes "--"
        if c.nullable:
            body.append(f"    if {v} is None:\n        l{i} = 'NULL'")
            body.append(f"    elif {test}:\n        return None\n    else:\n        l{i} = {literal}")
        else:
            body.append(f"    if {test}:\n        return None\n    l{i} = {literal}")
        parts.append(f"{{l{i}}}")
    source = "\n".join(
        [
            "def literals(row, max_line_bytes):",
            f"    if (type(row) is not list and type(row) is not tuple) or len(row) != {n}:",
            "        return None",
            f"    {', '.join(f'v{i}' for i in range(n))}{',' if n == 1 else ''} = row",
            *body,
            f"    if max_line_bytes is not None and {overhead} + len(dumps(row)) > max_line_bytes:",
            "        return None",
            f'    return f"{", ".join(parts)}"',
        ]
    )
    namespace: dict[str, Any] = {"MIN": INT64_MIN, "MAX": INT64_MAX, "dumps": orjson.dumps, "valid": _valid_unicode}
    exec(source, namespace)
    literals: RowLiterals = namespace["literals"]
    return literals


def _valid_unicode(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True
