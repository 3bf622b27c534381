"""A worker's COPY text made column by column (``received_columns_text``) is byte for byte what the
per-row path (``rows_copy_text``) makes, for arbitrary received values; where it cannot make it,
it says so (None) and the worker's text is the per-row path's, its error included."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replication.streams import EVENTS
from storage.contracts import ReceivedRows
from storage.pg_copy import received_columns_text
from storage.pg_worker import PgWorkerStore, rows_copy_text
from storage.schema import INT64_MAX, INT64_MIN, Column, StreamSchema

KINDS = ("text", "bigint", "double", "boolean", "json")
# Text with what COPY must escape, NUL, non-ASCII and (rarely) lone surrogates.
ANY_CHAR = st.characters(codec=None, exclude_categories=())
TEXT = st.one_of(
    st.text(alphabet=st.sampled_from("ab \\\t\n\rN\x00é☃🎉"), max_size=8),
    st.text(max_size=8),
    st.text(alphabet=ANY_CHAR, max_size=4),
)
BIGINT = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.integers(), st.sampled_from([INT64_MIN - 1, INT64_MAX + 1]))
DOUBLE = st.one_of(st.floats(), st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(INT64_MIN, INT64_MAX) | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
FITTING = {"text": TEXT, "bigint": BIGINT, "double": DOUBLE, "boolean": st.booleans(), "json": JSON}
ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), TEXT, st.lists(st.integers(), max_size=2))


@st.composite
def schemas(draw: Any) -> StreamSchema:
    kinds = draw(st.lists(st.tuples(st.sampled_from(KINDS), st.booleans()), min_size=1, max_size=5))
    return StreamSchema("s", tuple(Column(f"c{i}", kind, nullable) for i, (kind, nullable) in enumerate(kinds)))


@st.composite
def received_rows(draw: Any, schema: StreamSchema, odd: bool) -> list[Any]:
    """Groups ``(token or tokens, instance, rows)``; with ``odd``, sometimes values of another type,
    rows of another length, timestamps out of range, token lists that do not fit."""

    def value(column: Column) -> Any:
        if column.nullable and draw(st.integers(0, 4)) == 0:
            return None
        if odd and draw(st.integers(0, 9)) == 0:
            return draw(ANYTHING)
        if column.type == "json" and not column.nullable:  # JSON null is SQL NULL
            return draw(JSON.filter(lambda v: v is not None))
        return draw(FITTING[column.type])

    def row() -> list[Any]:
        values = [value(c) for c in schema.columns]
        if odd and draw(st.integers(0, 19)) == 0:
            values = values[:-1] if draw(st.booleans()) else [*values, 1]
        ts = draw(st.integers(0, INT64_MAX))
        if odd and draw(st.integers(0, 19)) == 0:
            ts = draw(st.one_of(st.integers(), st.just(1.0), st.none()))
        return [*values, ts]

    groups = []
    token = draw(st.integers(1, 2**40))
    for _ in range(draw(st.integers(1, 4))):
        rows = [row() for _ in range(draw(st.integers(1, 5)))]
        instance = draw(st.sampled_from(["master", "w1", "in\\st", "tab\there"]))
        if draw(st.booleans()):
            groups.append((token, instance, rows))
            token += 1
        else:
            tokens = list(range(token, token + len(rows)))
            token += len(rows)
            if odd and draw(st.integers(0, 9)) == 0:
                tokens = tokens[:-1] if draw(st.booleans()) else [*tokens[:-1], True]
            groups.append((tokens, instance, rows))
    return groups


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # the per-row path names a bad row; the same error must come out
        return type(e), str(e)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_columns_text_is_the_per_row_text_for_arbitrary_values(data: Any) -> None:
    schema = data.draw(schemas())
    received = data.draw(received_rows(schema, odd=data.draw(st.booleans())))
    columns = outcome(received_columns_text, schema, received)
    rows = outcome(rows_copy_text, schema, received)
    assert columns is None or columns == rows
    # The worker's text (columns, else rows) is always the per-row path's, errors included.
    assert outcome(PgWorkerStore._copy_text, schema, received) == rows


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_exactly_typed_rows_are_made_column_by_column(data: Any) -> None:
    schema = data.draw(schemas())
    received = data.draw(received_rows(schema, odd=False))
    values = [v for _, _, rows in received for row in rows for v in row[:-1]]

    def storable(v: Any) -> bool:
        if isinstance(v, str):
            return "\x00" not in v and v.encode("utf-8", "surrogatepass").decode("utf-8", "replace") == v
        if isinstance(v, float):
            return v - v == 0.0
        if isinstance(v, int) and not isinstance(v, bool):
            return INT64_MIN <= v <= INT64_MAX
        if isinstance(v, list):
            return all(map(storable, v))
        if isinstance(v, dict):
            return all(map(storable, v)) and all(map(storable, v.values()))
        return True

    if not all(map(storable, values)):
        return
    text = received_columns_text(schema, received)
    assert text is not None
    assert text == rows_copy_text(schema, received)


def test_the_benchmarks_rows_are_made_column_by_column() -> None:
    from scripts.benchmark import make_rows

    rows = [[*row, 10**17 + i] for i, row in enumerate(make_rows(0, 2000))]
    received: list[ReceivedRows] = [(list(range(5, 1005)), "master", rows[:1000]), (2000, "master", rows[1000:])]
    text = received_columns_text(EVENTS, received)
    assert text is not None and text == rows_copy_text(EVENTS, received)
    assert text.count(b"\n") == 2000 and text.count(b"\\N") > 0
