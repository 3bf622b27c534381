"""PostgreSQL's line read (``storage.pg_lines``): ``COPY`` from a session's temporary function gives
byte for byte the Python encoder's lines, for all-text streams (one ``array_to_json``) and mixed ones,
batches marked, a long line refused, and the plan it is written for (index order, no sort)."""

from __future__ import annotations

import orjson
import psycopg2
import pytest

from replication.rows import encode_rows, row_encoder
from storage.pg_lines import lines_function_sql
from storage.pg_store import COPY_ROWS, PgStreamStore
from storage.schema import Column, StreamSchema
from storage.store import open_store

TEXTS = StreamSchema(
    "texts",
    (
        Column("a", "text"),
        Column("b", "text", True),
        Column("prefix", "text", True),
        Column("last_token", "text", True),
    ),
)
MIXED = StreamSchema(
    "mixed2",
    (
        Column("n", "bigint", True),
        Column("ok", "boolean", True),
        Column("t", "text", True),
        Column("x", "double", True),
    ),
)
# Every byte that JSON escapes, the CSV delimiter and quote bytes of the COPY, unicode, empty strings.
AWKWARD = ["ctl \x01\x02\x1f\x7f", 'q " b \\ / \t \n \r', "é ünï ☃ 🎉 \u2028", "", "\\N", "RDATA x 1 [\n"]
TEXT_ROWS = [[a, b, c, d] for a, b, c, d in zip(AWKWARD, [None, *AWKWARD[:-1]], AWKWARD[::-1], [None] * 6, strict=True)]
# The last value ends in brackets or is non-ASCII (the line with ts cuts the array's closing bracket as a byte).
TEXT_ROWS += [["a", None, None, "]]"], ["b", "x", "y", "☃]"], ["c", None, None, '"]']]
MIXED_ROWS = [
    [1, True, "x", 0.5],
    [-(2**63), False, None, 2.0],
    [2**63 - 1, None, "\x01", 0.0],
    [None, None, None, None],
    [0, True, "é", 1e14],
]


def _python(store: PgStreamStore, schema: StreamSchema, after: int, upto: int, with_ts: bool) -> bytes:
    rows = store.read_rows(schema.name, after, upto, 10**6)
    return encode_rows(schema.name, rows, row_encoder(schema), with_ts)[0]


@pytest.mark.parametrize("with_ts", [False, True])
@pytest.mark.parametrize(("schema", "rows"), [(TEXTS, TEXT_ROWS), (MIXED, MIXED_ROWS)])
def test_lines_are_the_python_encoders_bytes(pg_url, schema: StreamSchema, rows: list, with_ts: bool) -> None:
    store = open_store(pg_url)
    assert isinstance(store, PgStreamStore)
    store.register_stream(schema)
    store.append(schema.name, rows, "w1")
    store.append(schema.name, rows[:3], "w2", batch=True)  # one token, three rows
    store.append(schema.name, rows[3:], "w3")
    n = len(rows)
    last = n + 1 + len(rows[3:])
    prefix = f"RDATA {schema.name} "
    got = store.read_lines_json(schema.name, 0, last, 1000, prefix, with_ts)
    assert got == (_python(store, schema, 0, last, with_ts), last, n + 3 + len(rows[3:]))
    assert got is not None and got[0].count(b" batch ") == 2
    # Cut by the limit inside the batch: the whole token comes, never part of it.
    assert store.read_lines_json(schema.name, n - 1, last, 2, prefix, with_ts) == (
        _python(store, schema, n - 1, n + 1, with_ts),
        n + 1,
        4,
    )
    # Nothing in range; a range past the head.
    assert store.read_lines_json(schema.name, last, last + 5, 10, prefix, with_ts) == (b"", last, 0)


def test_a_line_over_the_limit_makes_the_caller_build_them(pg_url) -> None:
    store = open_store(pg_url)
    assert isinstance(store, PgStreamStore)
    store.register_stream(TEXTS)
    store.append("texts", [["short", None, None, None], ["x" * 300, None, None, None]], "w")
    store.max_line_bytes = 200
    assert store.read_lines_json("texts", 0, 2, 10, "RDATA texts ", False) is None
    short = store.read_lines_json("texts", 0, 1, 10, "RDATA texts ", False)
    assert short == (b'RDATA texts w 1 ["short",null,null,null]\n', 1, 1)
    store.max_line_bytes = None
    whole = store.read_lines_json("texts", 0, 2, 10, "RDATA texts ", False)
    assert whole is not None and whole[1:] == (2, 2)


def test_the_function_reads_the_index_in_order_without_a_sort(pg_url) -> None:
    """Even without statistics (a table just filled), the plan is the one the query is written for."""
    store = open_store(pg_url)
    assert isinstance(store, PgStreamStore)
    plain = StreamSchema("plain", (Column("a", "text"),))
    store.register_stream(plain)
    store.append("plain", [[f"r{i}"] for i in range(2000)], "w")
    body = lines_function_sql("x", plain, False).split("RETURN QUERY ")[1].split(";\nEND")[0]
    settings = "enable_sort = off, enable_hashjoin = off, enable_hashagg = off, enable_bitmapscan = off"

    conn = psycopg2.connect(pg_url)
    with conn, conn.cursor() as cur:
        for setting in settings.split(", "):
            cur.execute(f"SET {setting}")
        cur.execute("PREPARE p(bigint, bigint, integer, text, integer, bigint) AS " + body.replace("last_token", "$6"))
        cur.execute("SET plan_cache_mode = force_generic_plan")
        cur.execute("EXPLAIN EXECUTE p(0, 2000, 500, 'RDATA plain ', NULL, 500)")
        text = "\n".join(row[0] for row in cur.fetchall())
    conn.close()
    assert "Sort" not in text and "Index" in text
    # The function itself carries these settings.
    assert "SET " + settings.replace(", ", " SET ") in lines_function_sql("x", TEXTS, False)


DOUBLES = StreamSchema("doubles", (Column("x", "double", True),))
# Exact only with enough digits (0.1 + 0.2, 1/3); a zero with its sign; integral and halves.
EXACT_DOUBLES = [0.1 + 0.2, 1 / 3, -0.0, 0.0, -2.5, 2.0, -(2.0**52), 123456.789012345, 1e15, -9999999999999998.0]


def test_doubles_are_exact_and_keep_the_sign_of_zero_whatever_the_databases_float_digits(pg_url) -> None:
    """A database whose default rounds ``float8`` text (``extra_float_digits = 0``) still gets exact lines."""
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT current_database()")
        (name,) = cur.fetchone()
        cur.execute(f'ALTER DATABASE "{name}" SET extra_float_digits = 0')
    conn.close()
    store = open_store(pg_url)
    assert isinstance(store, PgStreamStore)
    store.register_stream(DOUBLES)
    # A small append (one INSERT statement) and a large one (COPY).
    values = EXACT_DOUBLES + EXACT_DOUBLES * (COPY_ROWS // len(EXACT_DOUBLES) + 1)
    store.append("doubles", [[x] for x in EXACT_DOUBLES], "w")
    store.append("doubles", [[x] for x in values[len(EXACT_DOUBLES) :]], "w")
    n = len(values)
    expected = b"".join(b"RDATA doubles w %d [%s]\n" % (i, orjson.dumps(x)) for i, x in enumerate(values, 1))
    assert b"[-0.0]" in expected
    assert store.read_lines_json("doubles", 0, n, 1000, "RDATA doubles ", False) == (expected, n, n)
    read = [row[-1] for row in store.read_rows("doubles", 0, n, 1000)]
    assert [orjson.dumps(x) for x in read] == [orjson.dumps(x) for x in values]
