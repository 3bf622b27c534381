"""No poison row: the line limit is enforced where rows are written, on both backends.

The worst case that ``storage.limits`` computes is checked against the RDATA
lines the master really builds from stored rows (both encoding paths), and a
row over the limit is refused with its index and sizes, nothing stored.
"""

from __future__ import annotations

import random

import pytest

from replication.commands import MAX_TOKEN, encode_rdata
from replication.rows import encode_json_rows, encode_rows, row_encoder
from replication.settings import ProtocolConfig
from replication.streams import CACHES, EVENTS, cache_invalidation_row
from storage.limits import (
    DEFAULT_MAX_LINE_BYTES,
    MAX_JSON_DEPTH,
    check_row,
    rdata_line_bytes,
    rdata_overhead,
)
from storage.schema import MAX_NAME_BYTES, Column, RowError, StreamSchema
from storage.store import open_store

MIXED = StreamSchema(
    "mixed",
    (
        Column("name", "text"),
        Column("n", "bigint", True),
        Column("x", "double", True),
        Column("ok", "boolean", True),
        Column("doc", "json", True),
    ),
)


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randrange(-(2**63), 2**63)
    if kind == 2:
        return rng.choice([0.1, 1e300, 1e-7, -2.5e-300, 1.5e-5, 123456.789, -0.0, 5e-324, 1.7976931348623157e308])
    if kind in (3, 4):
        return "".join(rng.choice('ab "\\\t\n\x01é😀\u2028') for _ in range(rng.randrange(6)))
    if kind in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}{rng.choice('xy')}": _random_json(rng, depth + 1) for i in range(rng.randrange(4))}


def _random_row(rng: random.Random) -> list:
    return [
        "".join(rng.choice('xy "\\\n\x02é') for _ in range(rng.randrange(10))),
        rng.choice([None, 0, -(2**63), 2**63 - 1, rng.randrange(-1000, 1000)]),
        rng.choice([None, 0.1, -1.2345678901234567e-308, 1e300, 2.0, 5e-324, 0.30000000000000004]),
        rng.choice([None, True, False]),
        _random_json(rng),
    ]


def test_the_fixed_part_is_exactly_the_wire_form() -> None:
    longest = "i" * MAX_NAME_BYTES
    line = encode_rdata("mixed", longest, MAX_TOKEN, b"[]").rstrip(b"\n")
    # 19 digits of MAX_TOKEN, one more kept in reserve; the ts element is ",<20 digits>".
    assert rdata_overhead("mixed") == len(line) - len(b"[]") + 1 + 21


def test_the_default_limit_is_the_protocol_default() -> None:
    assert ProtocolConfig().max_line_bytes == DEFAULT_MAX_LINE_BYTES


def test_worst_case_covers_every_line_the_master_builds(db_url) -> None:
    """Random rows, both backends, both encoders, with and without ts: never longer than computed."""
    rng = random.Random(10)
    rows = [_random_row(rng) for _ in range(300)]
    store = open_store(db_url)
    store.register_stream(MIXED)
    instance = "w" * MAX_NAME_BYTES
    store.append("mixed", rows, instance)
    stored = store.read_rows("mixed", 0, 10**6, 10**6)
    assert len(stored) == len(rows)
    encoders = [lambda ts: encode_rows("mixed", stored, row_encoder(MIXED), ts)[0]]
    if hasattr(store, "read_rows_json"):
        json_rows = store.read_rows_json("mixed", 0, 10**6, 10**6)
        encoders.append(lambda ts: encode_json_rows("mixed", json_rows, ts)[0])
    for encode in encoders:
        for with_ts in (False, True):
            lines = encode(with_ts).split(b"\n")[:-1]
            for row, line in zip(rows, lines, strict=True):
                computed = rdata_line_bytes(MIXED, MIXED.check_row(row), row)
                assert len(line) <= computed, (row, line)
    store.close()


def test_a_row_just_at_the_limit_is_taken_one_byte_more_is_refused(db_url) -> None:
    schema = StreamSchema("notes", (Column("body", "text"),))
    limit = 1000
    fits = limit - rdata_overhead("notes") - len('[""]')
    store = open_store(db_url, max_line_bytes=limit)
    store.register_stream(schema)
    assert check_row(schema, ["x" * fits], limit) == ("x" * fits,)
    store.append("notes", [["x" * fits]], "w")
    with pytest.raises(RowError) as e:
        store.append("notes", [["ok"], ["x" * (fits + 1)], ["ok"]], "w")
    message = str(e.value)
    assert e.value.index == 1 and message.startswith("row 2: ")
    assert f"could be {limit + 1} bytes, over the line limit of {limit} (protocol.max_line_bytes" in message
    assert [r[4] for r in store.read_rows("notes", 0, 100, 100)] == ["x" * fits]  # the good rows did not go in
    store.close()


def test_the_default_store_refuses_a_row_over_the_default_limit(db_url) -> None:
    store = open_store(db_url)
    store.register_stream(EVENTS)
    with pytest.raises(RowError, match="over the line limit of 65536"):
        store.append("events", [["$e" * 40000, "!r", "t", None, None]], "w")
    assert store.heads().get("events", 0) == 0
    store.close()


def test_jsonb_spacing_and_plain_decimals_count(db_url) -> None:
    """A JSON value that is small as written can be long as PostgreSQL prints it: counted so."""
    assert rdata_line_bytes(CACHES, CACHES.check_row(["c", [1e300], 1]), ["c", [1e300], 1]) > 300
    keys = [1] * 30000  # 60 KB compact, 90 KB as jsonb prints it ("1, 1, ...")
    row = cache_invalidation_row("c", keys, 1)
    store = open_store(db_url)
    store.register_stream(CACHES)
    with pytest.raises(RowError, match="over the line limit"):
        store.append("caches", [row], "master")  # the master's cache invalidations go through here too
    store.close()


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "row, message",
    [
        (["c", [[[[1]]]], 1], None),
        (["c", _nested(MAX_JSON_DEPTH + 1), 1], "nested deeper than 64"),
        (["c", _nested(400), 1], "not storable as JSON"),
        (["c", {"k": "nul\x00"}, 1], "may not contain NUL"),
        (["c\x00", None, 1], "text may not contain NUL"),
        (["\ud800", None, 1], "lone surrogate"),
        (["c", {1, 2}, 1], "not storable as JSON"),
        (["c", None, 2**64], "does not fit in 64 bits"),
    ],
)
def test_hostile_values_are_row_errors(row, message) -> None:
    if message is None:
        check_row(CACHES, row, DEFAULT_MAX_LINE_BYTES)
        return
    with pytest.raises(RowError, match=message):
        check_row(CACHES, row, DEFAULT_MAX_LINE_BYTES)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400])
def test_doubles_must_be_finite(value) -> None:
    schema = StreamSchema("m", (Column("x", "double"),))
    with pytest.raises(RowError, match="is not a finite number"):
        schema.check_row([value])
