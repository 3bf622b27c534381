"""Rows as PostgreSQL ``COPY`` text (the writer's bulk appends and the worker's applies)."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

from storage.schema import StreamSchema

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
    lines = ["\t".join([NULL_COPY if v is None else f(v) for f, v in zip(formats, row, strict=False)]) for row in rows]
    lines.append("")
    names = ", ".join(("token", "instance_name", "ts", *schema.column_names))
    cursor.copy_expert(f"COPY {table} ({names}) FROM STDIN", io.BytesIO("\n".join(lines).encode()), size=1 << 20)
