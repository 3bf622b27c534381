"""The master's lines built from PostgreSQL's columns (``storage.pg_columns_out``) are the server-built
lines of ``storage.pg_lines`` byte for byte, for arbitrary rows (unicode, quotes, backslashes, control
characters, NULLs, integers, booleans, doubles, batches, lines over ``max_line_bytes``), on a real server."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import psycopg2.extensions
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import pg_columns_out, pg_lines
from storage.pg_columns_out import lines_from_rows, longest_within
from storage.pg_lines import LineRange
from storage.pg_store import PgStreamStore
from storage.schema import INT64_MAX, INT64_MIN, Column, StreamSchema
from storage.store import open_store

TEXTS = (Column("a", "text"), Column("b", "text", True), Column("c", "text", True))
MIXED = (
    Column("n", "bigint", True),
    Column("t", "text", True),
    Column("ok", "boolean", True),
    Column("x", "double", True),
)
LAST_INT = (Column("t", "text", True), Column("n", "bigint", True))

# Text without NUL or lone surrogates (refused by the writer), weighted towards what CSV and JSON escape.
AWKWARD = st.sampled_from([*list('"\\,\n\r\t\x01\x0b\x1f\x7f []null'), "é", "☃", "🎉", "\u2028", "\\N", "\\v"])
TEXT = st.lists(st.one_of(AWKWARD, st.characters(exclude_categories=["Cs"], exclude_characters="\x00")), max_size=12)
TEXT_VALUE = st.one_of(st.none(), TEXT.map("".join))
# Printable ASCII, one word: with the CSV delimiter, quote and escape.
INSTANCE = st.text(st.sampled_from([*'w1,"\\x[]', "a"]), min_size=1, max_size=5)
DOUBLE = st.floats(allow_nan=False, allow_infinity=False)


def _value(column: Column) -> st.SearchStrategy[Any]:
    kind = {
        "text": TEXT.map("".join),
        "bigint": st.integers(INT64_MIN, INT64_MAX),
        "boolean": st.booleans(),
        "double": DOUBLE,
    }[column.type]
    return st.one_of(st.none(), kind) if column.nullable else kind


def _rows(columns: tuple[Column, ...]) -> st.SearchStrategy[list[list[Any]]]:
    return st.lists(st.tuples(*(_value(c) for c in columns)).map(list), min_size=1, max_size=6)


# Appends of a stream: (rows, instance, batch).
APPENDS = st.sampled_from([TEXTS, MIXED, LAST_INT]).flatmap(
    lambda columns: st.tuples(
        st.just(columns), st.lists(st.tuples(_rows(columns), INSTANCE, st.booleans()), min_size=1, max_size=4)
    )
)
_names = (f"prop{i}" for i in itertools.count())


@pytest.fixture
def store(pg_url: str) -> Iterator[PgStreamStore]:
    opened = open_store(pg_url)
    assert isinstance(opened, PgStreamStore)
    yield opened
    opened.close()


def _both(store: PgStreamStore, schema: StreamSchema, after: int, upto: int, limit: int, with_ts: bool, max_bytes):
    prefix = f"RDATA {schema.name} "
    with store._side_cursor() as cur:
        read = LineRange(schema, after, upto, limit, prefix, with_ts)
        server = pg_lines.read_lines(cur, read, max_bytes)
        columns = pg_columns_out.read_lines(cur, read, max_bytes)
        # Without the range statement first (and with it if the rows hold a batch), then with it.
        pg_columns_out._BATCHED_READS.clear()
        fast = pg_columns_out.read_columns(cur, read)
        pg_columns_out._BATCHED_READS[schema.table] = 1
        ranged = pg_columns_out.read_columns(cur, read)
        assert ranged == fast
        # Every read ends its own transaction (its SET LOCALs and snapshot go with it).
        assert cur.connection.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    return server, columns, fast


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    appends=APPENDS,
    with_ts=st.booleans(),
    limit=st.integers(1, 8),
    max_bytes=st.sampled_from([None, 65536, 60, 90]),
)
def test_lines_from_columns_are_the_servers_lines(store: PgStreamStore, appends, with_ts, limit, max_bytes) -> None:
    columns, writes = appends
    schema = StreamSchema(next(_names), columns)
    store.register_stream(schema)
    last = 0
    for rows, instance, batch in writes:
        last = max(store.append(schema.name, rows, instance, batch=batch))
    for after in range(last):
        server, built, fast = _both(store, schema, after, last, limit, with_ts, max_bytes)
        assert built == server
        if fast is not None:  # taken whenever the values allow it: then the same lines (long ones included)
            assert server is None or fast == server
            assert (server is None) == (max_bytes is not None and not longest_within(fast[0], max_bytes))


def test_values_that_json_escapes_as_csv_does_take_the_fast_path(store: PgStreamStore) -> None:
    """Quotes, backslashes, commas, unicode, empty strings, NULLs and every type but json: no fallback."""
    schema = StreamSchema("fast", (*MIXED, Column("u", "text", True)))
    store.register_stream(schema)
    rows: list[list[Any]] = [
        [1, 'q " b \\ / , ]', True, 0.5, "é ☃ 🎉 \u2028 \x7f"],
        [None, None, None, None, None],
        [-(2**63), "", False, -0.0, "null"],
        [2**63 - 1, "\\N", None, 1e300, "\\v"],
    ]
    store.append("fast", rows, "w1")
    store.append("fast", rows[:2], "w\\2]", batch=True)
    for with_ts in (False, True):
        server, built, fast = _both(store, schema, 0, 5, 100, with_ts, None)
        assert fast is not None and built == server == fast
        assert fast[0].count(b" batch ") == 1 and fast[1:] == (5, 6)


def test_a_read_without_the_range_statement_ends_at_whole_tokens_and_rereads_a_batch(store: PgStreamStore) -> None:
    """The row past the limit tells where the last whole token ends; two rows of a batch among the rows
    read (also its second row as the one past the limit) send the read through the range statement,
    and the stream's next reads with it."""
    schema = StreamSchema("plain", TEXTS)
    store.register_stream(schema)
    for n in range(1, 6):  # tokens 1-5, one row each
        store.append("plain", [[f"r{n}", None, None]], "w")
    store.append("plain", [["b1", None, None], ["b2", None, None]], "w", batch=True)  # token 6
    store.append("plain", [["r7", None, None]], "w")
    prefix = "RDATA plain "
    with store._side_cursor() as cur:
        for after, limit, end, count in (
            (0, 3, 3, 3),
            (0, 5, 5, 5),
            (4, 1, 5, 1),
            (4, 2, 6, 3),
            (5, 8, 7, 3),
            (0, 1, 1, 1),
        ):
            pg_columns_out._BATCHED_READS.clear()
            read = LineRange(schema, after, 7, limit, prefix, False)
            got = pg_columns_out.read_columns(cur, read)
            server = pg_lines.read_lines(cur, read, None)
            assert got == server and got is not None and got[1:] == (end, count)
            batch_read = after < 6 and 6 - after <= limit  # token 6's second row among the limit + 1 read
            assert pg_columns_out._BATCHED_READS.get(schema.table, 0) == (
                pg_columns_out.BATCH_MEMORY if batch_read else 0
            )
        # After a batch, the next reads take the range statement (counted down), then read without it again.
        pg_columns_out._BATCHED_READS["stream_plain"] = 2
        for left in (1, 0, 0):
            assert pg_columns_out.read_columns(cur, LineRange(schema, 0, 2, 5, prefix, False)) == (
                b'RDATA plain w 1 ["r1",null,null]\nRDATA plain w 2 ["r2",null,null]\n',
                2,
                2,
            )
            assert pg_columns_out._BATCHED_READS[schema.table] == left


def test_a_session_without_standard_conforming_strings_reads_the_same(store: PgStreamStore) -> None:
    schema = StreamSchema("nonstd", TEXTS)
    store.register_stream(schema)
    store.append("nonstd", [['a \\ "b"', None, "c"]], "w")
    with store._side_cursor() as cur:
        cur.execute("SET standard_conforming_strings = off")
        try:
            fast = pg_columns_out.read_columns(cur, LineRange(schema, 0, 1, 10, "RDATA nonstd ", False))
        finally:
            cur.execute("SET standard_conforming_strings = on")
    assert fast == (b'RDATA nonstd w 1 ["a \\\\ \\"b\\"",null,"c"]\n', 1, 1)


def test_control_characters_and_quoted_heads_fall_back_to_the_server(store: PgStreamStore) -> None:
    schema = StreamSchema("slow", TEXTS)
    store.register_stream(schema)
    store.append("slow", [["a\nb", None, None]], "w")
    store.append("slow", [["\x01", None, None]], "w")
    store.append("slow", [["x", "\x0b", None]], "w")
    store.append("slow", [["x", None, None]], 'w"')
    store.append("slow", [["x", None, None]], "w,")
    for after in range(5):
        server, built, fast = _both(store, schema, after, after + 1, 1, False, None)
        assert fast is None and built == server is not None


def test_lines_from_rows_refuses_control_bytes_and_quoted_heads() -> None:
    assert lines_from_rows([b'RDATA s w 1\x01,"a",null\n'], 1, b"") == b'RDATA s w 1 ["a",null]\n'
    assert lines_from_rows([b'RDATA s w 1\x01,"a\x1f"\n'], 1, b"") is None
    assert lines_from_rows([b'RDATA s w 1\x01,"a\nb"\n'], 1, b"") is None
    assert lines_from_rows([b'"RDATA s w,x 1\x01","a"\n'], 1, b"") is None


def test_longest_within_finds_a_long_line_anywhere() -> None:
    lines = [b"x" * n + b"\n" for n in (3, 10, 0, 7, 10)]
    assert longest_within(b"".join(lines), 10)
    for i in range(len(lines)):
        longer = [*lines[:i], b"y" * 11 + b"\n", *lines[i:]]
        assert not longest_within(b"".join(longer), 10)
    assert longest_within(b"", 0) and not longest_within(b"a\n", 0)
