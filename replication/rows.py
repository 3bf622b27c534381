"""Stored rows to the JSON that ``RDATA`` carries, and back.

A row on the wire is the JSON array of the stream's column values in their
declared order; with the ``ts`` option the row's timestamp follows as one
more element. JSON columns are stored as JSON text and embedded as they are
(``orjson.Fragment``), so a row is serialized exactly once.
"""

from __future__ import annotations

from typing import Callable, Optional

import orjson

from replication.commands import encode_rdata
from storage.schema import StreamSchema
from storage.store import FIRST_VALUE, INSTANCE, TOKEN, TS, StoredRow

RowEncoder = Callable[[StoredRow, bool], bytes]


def row_encoder(schema: StreamSchema) -> RowEncoder:
    """A function (stored row, with_ts) -> row JSON bytes for this stream."""
    json_columns = schema.json_columns
    boolean_columns = schema.boolean_columns
    end = FIRST_VALUE + len(schema.columns)
    dumps = orjson.dumps
    fragment = orjson.Fragment

    if not json_columns and not boolean_columns:

        def encode(row: StoredRow, with_ts: bool) -> bytes:
            values = list(row[FIRST_VALUE:end])
            if with_ts:
                values.append(row[TS])
            return dumps(values)

        return encode

    def encode_typed(row: StoredRow, with_ts: bool) -> bytes:
        values = list(row[FIRST_VALUE:end])
        for i in json_columns:
            if values[i] is not None:
                values[i] = fragment(values[i])
        for i in boolean_columns:
            if values[i] is not None:
                values[i] = bool(values[i])
        if with_ts:
            values.append(row[TS])
        return dumps(values)

    return encode_typed


def encode_rows(
    stream: str, rows: list[StoredRow], encode: RowEncoder, with_ts: bool
) -> tuple[bytes, int]:
    """RDATA lines for rows in token order; returns (bytes, last token).

    Rows that share a token are sent as ``batch`` lines with the real token on
    the last one. ``rows`` must hold whole tokens (the store never splits one).
    """
    lines = []
    count = len(rows)
    last_token = 0
    for i, row in enumerate(rows):
        token = row[TOKEN]
        last_of_token = i + 1 == count or rows[i + 1][TOKEN] != token
        lines.append(encode_rdata(stream, row[INSTANCE], token if last_of_token else None, encode(row, with_ts)))
        last_token = token
    return b"".join(lines), last_token


def split_ts(row: list, with_ts: bool) -> tuple[list, Optional[int]]:
    """A received row and its timestamp (``None`` without the ``ts`` option)."""
    if with_ts and row:
        return row[:-1], row[-1]
    return row, None
