"""Rows parsed from backslash-free JSON skip the worker's escape check, and their COPY text is the same."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.commands import parse_rdata_block
from replication.streams import EVENTS
from storage.contracts import EscapeFreeRows
from storage.pg_worker import PgWorkerStore
from storage.schema import RowError

TS = 470_000_000_000_000_000
# Text of any character, the ones COPY escapes and JSON escapes among them.
_TEXT = st.text(
    alphabet=st.sampled_from(["a", "é", "$", " ", ",", "[", '"', "\\", "\t", "\n", "\r", "\x00", "\x7f", "N"])
)
_ROW = st.tuples(_TEXT, _TEXT, _TEXT, st.none() | _TEXT, st.none() | _TEXT, st.integers(0, 2**63 - 1))


def _block(instance: str, rows: list[tuple[Any, ...]]) -> bytes:
    return b"".join(
        b"RDATA events %s %d %s\n" % (instance.encode(), 1 + i, orjson.dumps(r)) for i, r in enumerate(rows)
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(_ROW, min_size=1, max_size=60), st.sampled_from(["master", "w1"]))
def test_the_copy_text_of_escape_free_rows_is_the_checked_one(rows: list[tuple[Any, ...]], instance: str) -> None:
    parsed = parse_rdata_block(_block(instance, rows), 1 << 20)
    assert parsed is not None
    _, name, tokens, entries = parsed
    block_has_backslash = b"\\" in _block(instance, rows)
    assert (type(entries) is EscapeFreeRows) == (not block_has_backslash)
    tokens_int = [int(t) for t in tokens]
    marked = _outcome([(tokens_int, name, entries)])
    assert marked == _outcome([(tokens_int, name, list(entries))])
    if not any("\x00" in v for row in rows for v in row[:5] if v is not None):
        assert isinstance(marked, bytes)
        assert marked.count(b"\n") == len(rows)  # a line per row: every tab and newline in a value escaped


def _outcome(received: list[Any]) -> Any:
    try:
        return PgWorkerStore._copy_text(EVENTS, received)
    except RowError as e:  # a NUL: PostgreSQL's text cannot hold one, refused either way
        return ("refused", str(e))


def test_an_instance_name_that_needs_an_escape_is_checked() -> None:
    rows = EscapeFreeRows([["$e", "!r", "m.t", None, None, TS]])
    text = PgWorkerStore._copy_text(EVENTS, [([1], "a\tb", rows)])
    assert text == PgWorkerStore._copy_text(EVENTS, [([1], "a\tb", list(rows))])
    assert text is not None and text.startswith(b"1\ta\\tb\t")


def test_a_slice_is_not_marked() -> None:
    assert type(EscapeFreeRows([[1], [2]])[1:]) is list
