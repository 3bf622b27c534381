"""Both ways of encoding stored rows give the same RDATA lines, on both backends."""

from __future__ import annotations

import orjson
import pytest

from replication.rows import encode_json_rows, encode_rows, row_encoder
from storage.schema import Column, StreamSchema
from storage.store import open_store

SCHEMA = StreamSchema(
    "mixed",
    (
        Column("name", "text"),
        Column("n", "bigint", True),
        Column("x", "double", True),
        Column("ok", "boolean", True),
        Column("doc", "json", True),
    ),
)
ROWS = [
    ["plain", 1, 0.5, True, {"a": [1, "b"]}],
    ['quote " back \\ slash / tab \t nl \n é 😀', -(2**63), -1.25e-7, False, [None, True, 1.5]],
    ["nulls", None, None, None, None],
    ["big", 2**63 - 1, 1e300, True, "just a string"],
    ["int-like double", 3, 2.0, False, 42],
    ["17 digits", 0, 0.30000000000000004, None, 0.1],
]


@pytest.mark.parametrize("with_ts", [False, True])
def test_json_rows_equal_python_encoded_rows(db_url, with_ts: bool) -> None:
    """Each backend's ``read_rows_json`` (SQLite: json_array; PostgreSQL: orjson) gives the RDATA rows."""
    store = open_store(db_url)
    store.register_stream(SCHEMA)
    store.append("mixed", ROWS[:2], "w1")
    store.append("mixed", ROWS[2:], "w2", batch=True)
    python, last = encode_rows("mixed", store.read_rows("mixed", 0, 100, 100), row_encoder(SCHEMA), with_ts)
    built, last_json = encode_json_rows("mixed", store.read_rows_json("mixed", 0, 100, 100), with_ts)
    assert last == last_json == 3
    assert orjson.loads(built.splitlines()[-1].split(b" ", 4)[4])[2] == 0.30000000000000004
    python_lines, built_lines = python.splitlines(), built.splitlines()
    assert len(python_lines) == len(built_lines) == len(ROWS)
    for a, b in zip(python_lines, built_lines, strict=False):
        head_a, _, json_a = a.partition(b" [")
        head_b, _, json_b = b.partition(b" [")
        assert head_a == head_b  # RDATA mixed <instance> <token or batch>
        assert orjson.loads(b"[" + json_a) == orjson.loads(b"[" + json_b)
    assert b" batch " in built
