"""Both ways of encoding stored rows give the same RDATA lines, on both backends."""

from __future__ import annotations

import orjson
import pytest

from replication.rows import encode_json_rows, encode_rows, row_encoder
from storage.contracts import Row
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
ROWS: list[Row] = [
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


def _same_lines(a: bytes, b: bytes) -> bool:
    """The same RDATA lines: equal heads, equal row JSON (a double may print differently, as 1e+300 / 1e300)."""
    lines_a, lines_b = a.splitlines(), b.splitlines()
    if len(lines_a) != len(lines_b) or not a.endswith(b"\n"):
        return False
    for x, y in zip(lines_a, lines_b, strict=True):
        head_x, _, json_x = x.partition(b" [")
        head_y, _, json_y = y.partition(b" [")
        if head_x != head_y or orjson.loads(b"[" + json_x) != orjson.loads(b"[" + json_y):
            return False
    return True


@pytest.mark.parametrize("with_ts", [False, True])
def test_lines_built_by_the_store_equal_the_json_rows(db_url, with_ts: bool) -> None:
    """``read_lines_json`` (the store builds whole lines) gives the lines of ``read_rows_json``, or None (SQLite)."""
    store = open_store(db_url)
    store.register_stream(SCHEMA)
    for row in ROWS:
        store.append("mixed", [row], "w1")
    store.append("mixed", ROWS[:2], "w2", batch=True)  # token 7: two rows
    built = store.read_lines_json("mixed", 0, 6, 100, "RDATA mixed ", with_ts)
    if db_url.startswith("postgresql"):
        # PostgreSQL builds every line itself, batches included, and never cuts a token.
        for after, upto, limit, last, count in (
            (0, 7, 100, 7, 8),
            (2, 4, 100, 4, 2),
            (5, 7, 100, 7, 3),
            (6, 7, 1, 7, 2),
        ):
            expected, _ = encode_json_rows("mixed", store.read_rows_json("mixed", after, upto, 10**6), with_ts)
            got = store.read_lines_json("mixed", after, upto, limit, "RDATA mixed ", with_ts)
            assert got is not None and got[1:] == (last, count)
            assert _same_lines(got[0], expected)
            # Integral doubles as the Python encoder writes them (2.0, not 2): byte for byte.
            assert [x for x in got[0].splitlines() if b"int-like" in x] == [
                x for x in expected.splitlines() if b"int-like" in x
            ]
        assert store.read_lines_json("mixed", 7, 100, 100, "RDATA mixed ", with_ts) == (b"", 7, 0)
        limited = store.read_lines_json("mixed", 0, 100, 3, "RDATA mixed ", with_ts)
        assert limited is not None and limited[1:] == (3, 3)
        return
    expected, _ = encode_json_rows("mixed", store.read_rows_json("mixed", 0, 6, 100), with_ts)
    assert built == (expected, 6, 6)
    assert store.read_lines_json("mixed", 2, 4, 100, "RDATA mixed ", with_ts) == (
        encode_json_rows("mixed", store.read_rows_json("mixed", 2, 4, 100), with_ts)[0],
        4,
        2,
    )
    limited = store.read_lines_json("mixed", 0, 100, 3, "RDATA mixed ", with_ts)
    assert limited is not None and limited[1:] == (3, 3)
    assert store.read_lines_json("mixed", 7, 100, 100, "RDATA mixed ", with_ts) == (b"", 7, 0)
    # A batch in range, or cut by the limit: the caller encodes.
    assert store.read_lines_json("mixed", 5, 7, 100, "RDATA mixed ", with_ts) is None
    assert store.read_lines_json("mixed", 6, 7, 1, "RDATA mixed ", with_ts) is None


@pytest.mark.parametrize("with_ts", [False, True])
def test_lines_built_by_the_store_with_several_writers_in_range(db_url, with_ts: bool) -> None:
    store = open_store(db_url)
    store.register_stream(SCHEMA)
    for i, row in enumerate(ROWS):
        store.append("mixed", [row], f"w{i % 2}")
    built = store.read_lines_json("mixed", 0, 6, 100, "RDATA mixed ", with_ts)
    expected, _ = encode_json_rows("mixed", store.read_rows_json("mixed", 0, 6, 100), with_ts)
    assert built is not None and built[1:] == (6, 6)
    got, want = built[0].splitlines(), expected.splitlines()
    assert [line.split(b" [")[0] for line in got] == [line.split(b" [")[0] for line in want]
    assert [orjson.loads(line.split(b" ", 4)[4]) for line in got] == [
        orjson.loads(line.split(b" ", 4)[4]) for line in want
    ]
    if db_url.startswith("sqlite"):
        assert built[0] == expected


def test_lines_built_by_the_store_step_over_a_gap_in_the_tokens(db_url) -> None:
    """A rolled-back write leaves no rows for its tokens (PostgreSQL): the read moves to the next row."""
    store = open_store(db_url)
    store.register_stream(SCHEMA)
    store.append("mixed", [ROWS[0]], "w1")
    with pytest.raises(RuntimeError), store.writing("mixed", "w1") as txn:
        txn.append([ROWS[1], ROWS[2], ROWS[3]])
        raise RuntimeError("roll back")
    (token,) = store.append("mixed", [ROWS[4]], "w1")
    got = store.read_lines_json("mixed", 1, token, 2, "RDATA mixed ", False)
    assert got is not None and got[1:] == (token, 1)
    assert got[0].startswith(b"RDATA mixed w1 %d [" % token)
    assert store.read_lines_json("mixed", token, token + 5, 2, "RDATA mixed ", False) == (b"", token, 0)


@pytest.mark.parametrize("with_ts", [False, True])
def test_a_single_row_is_encoded_as_in_a_longer_run(with_ts: bool) -> None:
    """The one-row shortcut (a notified single-row commit) gives the line the loop gives that row."""
    rows = [(0, 7, b"w1", 123456789, b'["a",null,1]'), (0, 8, b"w2", 5, b'["b"]')]
    both, _ = encode_json_rows("mixed", rows, with_ts)
    for i, row in enumerate(rows):
        line, last = encode_json_rows("mixed", [row], with_ts)
        assert (line, last) == (both.splitlines(keepends=True)[i], row[1])
    assert encode_json_rows("mixed", rows[:1], True)[0] == b'RDATA mixed w1 7 ["a",null,1,123456789]\n'
