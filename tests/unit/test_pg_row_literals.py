"""A single-row append's values checked and written as literals in one pass (``storage.pg_row_literals``).

Whatever it writes is what the careful way (``RowChecker.one``, then
``sql_literals``) makes of the same row; whatever that would refuse, or any
row it is not sure of, it leaves to the careful way (None).
"""

from __future__ import annotations

from typing import Any

import pytest

from replication.streams import EVENTS
from storage.limits import RowChecker, rdata_overhead
from storage.pg_db import sql_literals
from storage.pg_row_literals import row_literals
from storage.pg_store import PgStreamStore
from storage.schema import Column, RowError, StreamSchema
from storage.store import FIRST_VALUE, open_store
from tests.unit.test_apply_replicated import MIXED, TEXTS

NUMBERS = StreamSchema("numbers", (Column("t", "text"), Column("n", "bigint", True), Column("m", "bigint")))
LIMIT = 400


def _careful(schema: StreamSchema, row: Any, limit: int | None) -> str | None:
    try:
        values = RowChecker(schema).one(row, limit)
        sql_literals(values)  # refuses what no literal holds
    except (RowError, ValueError):
        return None
    # The one-pass text: each string as E'...' with backslashes and quotes doubled (the same text
    # whatever standard_conforming_strings), a number without sql_literals's leading space (a
    # number there always follows "(" or ", ").
    return ", ".join(
        "NULL" if v is None else str(v) if type(v) is int else "E'" + v.replace("\\", "\\\\").replace("'", "''") + "'"
        for v in values
    )


GOOD_EVENTS = [[text, "!r:x", "m.type", text, None] for text in [*TEXTS, "it's", "a\\b\\'c", "''", "--x", "E'x'"]]
GOOD_NUMBERS = [["a'b", None, 0], ("x", -5, 2**63 - 1), ["", 7, -(2**63)]]
BAD_EVENTS = [
    ["a\x00b", "!r:x", "m.type", None, None],  # NUL
    ["\ud800", "!r:x", "m.type", None, None],  # a lone surrogate
    [None, "!r:x", "m.type", None, None],  # null where not nullable
    ["$e", "!r:x", "m.type", 5, None],  # a number in a text column
    ["$e", "!r:x", "m.type", None],  # too short
    {"event_id": "$e", "room_id": "!r:x", "type": "m.type"},  # an object: the careful way
    ["x" * LIMIT, "!r:x", "m.type", None, None],  # over the line limit
    "not a row",
]
BAD_NUMBERS = [["a", True, 1], ["a", 2**63, 1], ["a", 1.0, 1], ["a", None, None], ["a", "1", 1]]


@pytest.mark.parametrize(("schema", "row"), [(EVENTS, r) for r in GOOD_EVENTS] + [(NUMBERS, r) for r in GOOD_NUMBERS])
def test_a_row_it_writes_is_written_as_the_careful_way_writes_it(schema: StreamSchema, row: Any) -> None:
    literals = row_literals(schema, rdata_overhead(schema.name))
    assert literals is not None
    careful = _careful(schema, row, LIMIT)
    assert careful is not None
    assert literals(row, LIMIT) == careful
    assert literals(row, None) == careful


@pytest.mark.parametrize(("schema", "row"), [(EVENTS, r) for r in BAD_EVENTS] + [(NUMBERS, r) for r in BAD_NUMBERS])
def test_a_row_the_careful_way_refuses_or_may_adapt_otherwise_is_left_to_it(schema: StreamSchema, row: Any) -> None:
    literals = row_literals(schema, rdata_overhead(schema.name))
    assert literals is not None
    assert literals(row, LIMIT) is None


def test_the_line_limit_is_the_careful_way_s_to_the_byte() -> None:
    literals = row_literals(EVENTS, rdata_overhead(EVENTS.name))
    assert literals is not None
    refused = []
    for size in range(LIMIT - rdata_overhead(EVENTS.name)):
        row = ["é" * size, "!r:x", "m.type", None, None]  # two bytes each in UTF-8
        refused.append(literals(row, LIMIT) is None)
        assert refused[-1] == (_careful(EVENTS, row, LIMIT) is None)
    assert not refused[0] and refused[-1]


def test_a_stream_with_doubles_booleans_or_json_has_no_one_pass_literals() -> None:
    assert row_literals(MIXED, rdata_overhead(MIXED.name)) is None


def test_single_row_appends_of_texts_and_numbers_store_every_value_as_written(pg_url: str) -> None:
    store = open_store(pg_url)
    try:
        store.register_stream(NUMBERS)
        store.register_stream(EVENTS)
        tokens = [store.append("numbers", [row], "w")[0] for row in GOOD_NUMBERS]
        stored = store.read_rows("numbers", 0, tokens[-1], 10)
        assert [list(r[FIRST_VALUE:]) for r in stored] == [list(row) for row in GOOD_NUMBERS]
        last = [store.append("events", [row], "w")[0] for row in GOOD_EVENTS][-1]
        assert [list(r[FIRST_VALUE:]) for r in store.read_rows("events", 0, last, 100)] == GOOD_EVENTS
        with pytest.raises(RowError, match=r"row 1: .*may not be null"):
            store.append("numbers", [["a", None, None]], "w")
        assert store.read_rows("numbers", tokens[-1], tokens[-1] + 10, 10) == []
    finally:
        store.close()


@pytest.mark.parametrize("conforming", ["on", "off"])
def test_the_literals_read_as_the_values_whatever_standard_conforming_strings(pg_url: str, conforming: str) -> None:
    """The append no longer asks the session for the setting: its literals must not depend on it."""
    literals = row_literals(EVENTS, rdata_overhead(EVENTS.name))
    assert literals is not None
    store = open_store(pg_url)
    try:
        store.register_stream(EVENTS)
        store.append("events", [GOOD_EVENTS[0]], "w")  # the writer's connection is open
        assert isinstance(store, PgStreamStore)
        with store._side.conn.cursor() as cur:
            cur.execute(f"SET standard_conforming_strings = {conforming}")
            for row in GOOD_EVENTS:
                cur.execute(f"SELECT {literals(row, None)}")
                assert list(cur.fetchone()) == row
        first = store.append("events", [GOOD_EVENTS[0]], "w")[0]
        last = [store.append("events", [row], "w")[0] for row in GOOD_EVENTS][-1]
        assert [list(r[FIRST_VALUE:]) for r in store.read_rows("events", first, last, 100)] == GOOD_EVENTS
    finally:
        store.close()
