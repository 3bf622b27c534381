"""Stored rows to the JSON that ``RDATA`` carries, and back.

A row on the wire is the JSON array of the stream's column values in their
declared order; with the ``ts`` option the row's timestamp follows as one
more element. JSON columns are stored as JSON text and embedded as they are
(``orjson.Fragment``), so a row is serialized exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

from replication.commands import BATCH
from storage.schema import StreamSchema
from storage.store import FIRST_VALUE, INSTANCE, TOKEN, TS, StoredRow

RowEncoder = Callable[[StoredRow, bool], bytes]
_BATCH = BATCH.encode("ascii")


def row_encoder(schema: StreamSchema) -> RowEncoder:
    """A function (stored row, with_ts) -> row JSON bytes for this stream (``StreamSchema.values_encoder``)."""
    values_json = schema.values_encoder()
    end = FIRST_VALUE + len(schema.columns)

    def encode(row: StoredRow, with_ts: bool) -> bytes:
        if with_ts:
            return b"%s,%d]" % (values_json(row[FIRST_VALUE:end])[:-1], row[TS])
        return values_json(row[FIRST_VALUE:end])

    return encode


def encode_rows(stream: str, rows: list[StoredRow], encode: RowEncoder, with_ts: bool) -> tuple[bytes, int]:
    """RDATA lines for rows in token order; returns (bytes, last token).

    Rows that share a token are sent as ``batch`` lines with the real token on
    the last one. ``rows`` must hold whole tokens (the store never splits one).
    The lines are byte for byte what ``replication.commands.encode_rdata``
    makes; this loop is the master's hot path, so the ``RDATA <stream>
    <instance> `` prefix is built once per instance rather than once per row.
    """
    if not rows:
        return b"", 0
    stream_bytes = stream.encode("utf-8")
    prefixes: dict[str, bytes] = {}
    lines: list[bytes] = []
    append = lines.append
    last = len(rows) - 1
    for i, row in enumerate(rows):
        instance = row[INSTANCE]
        prefix = prefixes.get(instance)
        if prefix is None:
            prefix = prefixes[instance] = b"RDATA %s %s " % (stream_bytes, instance.encode("utf-8"))
        token = row[TOKEN]
        if i < last and rows[i + 1][TOKEN] == token:
            append(b"%s%s %s\n" % (prefix, _BATCH, encode(row, with_ts)))
        else:
            append(b"%s%d %s\n" % (prefix, token, encode(row, with_ts)))
    return b"".join(lines), rows[-1][TOKEN]


def encode_json_rows(stream: str, rows: list[tuple], with_ts: bool) -> tuple[bytes, int]:
    """RDATA lines for rows whose JSON the store built: ``(seq, token, instance bytes, ts, json bytes)``.

    Same lines as :func:`encode_rows` (batches included); with ``ts`` the
    timestamp is spliced in as the array's last element.
    """
    if not rows:
        return b"", 0
    if len(rows) == 1:  # a single-row commit (the master's notified path): one format
        _, token, instance, ts, row_json = rows[0]
        if with_ts:
            row_json = b"%s,%d]" % (row_json[:-1], ts)
        return b"RDATA %s %s %d %s\n" % (stream.encode("utf-8"), instance, token, row_json), token
    stream_bytes = stream.encode("utf-8")
    prefixes: dict[bytes, bytes] = {}
    lines: list[bytes] = []
    append = lines.append
    last = len(rows) - 1
    for i, (_, token, instance, ts, row_json) in enumerate(rows):
        prefix = prefixes.get(instance)
        if prefix is None:
            prefix = prefixes[instance] = b"RDATA %s %s " % (stream_bytes, instance)
        if with_ts:
            row_json = b"%s,%d]" % (row_json[:-1], ts)
        if i < last and rows[i + 1][TOKEN] == token:
            append(b"%s%s %s\n" % (prefix, _BATCH, row_json))
        else:
            append(b"%s%d %s\n" % (prefix, token, row_json))
    return b"".join(lines), rows[-1][TOKEN]


def split_ts(row: list, with_ts: bool) -> tuple[list, int | None]:
    """A received row and its timestamp (``None`` without the ``ts`` option)."""
    if with_ts and row:
        return row[:-1], row[-1]
    return row, None
