"""``WorkerStore.apply_replicated``: received rows copied into ``replicated_<stream>`` with the token.

On PostgreSQL one statement takes the rows as JSON and the server expands
them; rows that do not fit (a value of another type, a row of another width)
are applied the general way, which names the bad row; nothing is half applied.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from storage.schema import Column, RowError, StreamSchema
from storage.store import StaleApply
from storage.worker_store import expand_received, open_worker_store
from tests.stores import backend_worker_store

MIXED = StreamSchema(
    "mixed",
    (
        Column("t", "text", True),
        Column("n", "bigint", True),
        Column("x", "double", True),
        Column("ok", "boolean"),
        Column("j", "json", True),
    ),
)
TEXTS = ["tab\there", "new\nline\r", "back\\slash \\N", "ünïcode ☃ 'q' \"dq\"", "", "%s %(x)s"]


def _effects(schema: StreamSchema, received):
    """The general form of the same apply (as the table replicator does it)."""

    def run(txn) -> None:
        rows = [
            (token, instance, row[-1], *schema.check_row(row[:-1])) for token, instance, rs in received for row in rs
        ]
        txn.replicate(schema, rows)

    return run


def _not_called(txn) -> None:
    raise AssertionError("PostgreSQL took these rows in one statement: the general way is not needed")


def _back(store):
    return store.database.read(
        lambda c: c.execute(
            "SELECT token, instance_name, ts, t, n, x, ok, j FROM replicated_mixed ORDER BY ts"
        ).fetchall()
    )


@pytest.mark.parametrize("count", [1, 3, 120])
def test_received_rows_round_trip_every_value(db_url, count) -> None:
    store = open_worker_store(db_url)
    store.create_replicated_table(MIXED)
    values: list[list[Any]] = [
        [
            TEXTS[i % len(TEXTS)] if i % 4 else None,
            [None, 0, -(2**63), 2**63 - 1, 12345678901234][i % 5],
            [None, 0.1, 1 / 3, 1e300, -5e-324, 7][i % 6],
            i % 2 == 0,
            [None, {"k": TEXTS[i % len(TEXTS)], "n": [1, 2.5, None]}, "s", 3][i % 4],
        ]
        for i in range(count)
    ]
    received = [(10 + i, "w\\1 x", [[*v, 1000 + i]]) for i, v in enumerate(values)]
    effects = _effects(MIXED, received) if db_url.startswith("sqlite") else _not_called
    store.apply_replicated("mixed", 10 + count - 1, MIXED, received, effects)
    assert store.applied_tokens() == {"mixed": 10 + count - 1}
    back = _back(store)
    assert len(back) == count
    for i, (v, got) in enumerate(zip(values, back, strict=True)):
        assert tuple(got[:3]) == (10 + i, "w\\1 x", 1000 + i)
        assert got[3] == v[0] and got[4] == v[1] and bool(got[6]) is v[3]
        assert got[5] == v[2] if v[2] is None else math.isclose(got[5], float(v[2]), rel_tol=0) or got[5] == v[2]
        j = got[7]
        assert (orjson.loads(j) if j is not None and db_url.startswith("sqlite") else j) == v[4]
    store.close()


def test_a_batch_token_keeps_all_its_rows(db_url) -> None:
    store = open_worker_store(db_url)
    store.create_replicated_table(MIXED)
    received = [
        (5, "w", [["a", 1, 1.0, True, None, 1], ["b", 2, 2.0, False, None, 2]]),
        (6, "v", [["c", 3, 3.0, True, None, 3]]),
    ]
    store.apply_replicated("mixed", 6, MIXED, received, _effects(MIXED, received))
    assert [(r[0], r[1], r[3]) for r in _back(store)] == [(5, "w", "a"), (5, "w", "b"), (6, "v", "c")]
    store.close()


def test_the_token_moves_only_forwards_and_a_stale_apply_writes_nothing(db_url) -> None:
    store = open_worker_store(db_url)
    store.create_replicated_table(MIXED)
    received = [(5, "w", [["a", 1, 1.0, True, None, 1]])]
    store.apply_replicated("mixed", 5, MIXED, received, _effects(MIXED, received))
    with pytest.raises(StaleApply):
        store.apply_replicated("mixed", 5, MIXED, received, _effects(MIXED, received))
    with pytest.raises(StaleApply):
        store.apply_replicated("mixed", 4, MIXED, [(4, "w", received[0][2])], _effects(MIXED, received))
    assert store.applied_tokens() == {"mixed": 5}
    assert len(_back(store)) == 1
    store.close()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ([7, 1, 1.0, True, None, 1], "'t' expects text"),
        (["a", "1", 1.0, True, None, 1], "'n' expects bigint"),
        (["a", 1.5, 1.0, True, None, 1], "'n' expects bigint"),
        (["a", 1, "x", True, None, 1], "'x' expects double"),
        (["a", 1, 1.0, 1, None, 1], "'ok' expects boolean"),
        (["a", 1, 1.0, None, None, 1], "'ok' may not be null"),
        (["a", 1, 1.0, True, 1], "expects 5 values"),
        (["a\x00b", 1, 1.0, True, None, 1], "NUL"),
    ],
)
@pytest.mark.parametrize("pad", [0, 60])  # one statement; COPY
def test_a_row_that_does_not_fit_is_named_and_nothing_is_applied(db_url, row, message, pad) -> None:
    store = open_worker_store(db_url)
    store.create_replicated_table(MIXED)
    good = ["a", 1, 1.0, True, None, 1]
    received = [(5, "w", [good] * (pad + 1)), (6, "w", [row]), (7, "w", [good])]
    with pytest.raises(RowError, match=message):
        store.apply_replicated("mixed", 7, MIXED, received, _effects(MIXED, received))
    assert store.applied_tokens() == {}
    assert _back(store) == []
    store.close()


PLAIN = StreamSchema("plain", (Column("t", "text"), Column("n", "bigint", True), Column("ok", "boolean")))


@pytest.mark.parametrize("schema", [MIXED, PLAIN], ids=["json-careful", "chunk"])
@pytest.mark.parametrize("count", [3, 120])  # one statement; COPY
def test_a_run_of_single_row_tokens_applies_as_its_tokens(db_url, schema, count) -> None:
    """A run (one entry, its tokens as a list, one per row) stores exactly what one entry per token does."""
    store = backend_worker_store(open_worker_store(db_url))
    store.create_replicated_table(schema)
    if schema is MIXED:
        rows = [[TEXTS[i % len(TEXTS)], i, 0.5 + i, i % 2 == 0, {"i": i}, 1000 + i] for i in range(count)]
    else:
        rows = [[f"row {i}", None if i % 3 else i, i % 2 == 0, 1000 + i] for i in range(count)]
    tokens = list(range(10, 10 + count))
    run = [(tokens, "w", rows)]
    effects = _effects(schema, expand_received(run)) if db_url.startswith("sqlite") else _not_called
    store.apply_replicated(schema.name, tokens[-1], schema, run, effects)
    assert store.applied_tokens() == {schema.name: tokens[-1]}
    names = ", ".join(("token", "instance_name", "ts", *schema.column_names))
    back = store.database.read(
        lambda c: c.execute(f"SELECT {names} FROM {schema.replicated_table} ORDER BY token").fetchall()
    )
    assert [(r[0], r[1], r[2]) for r in back] == [(t, "w", 1000 + i) for i, t in enumerate(tokens)]
    assert [r[3] for r in back] == [row[0] for row in rows]
    with pytest.raises(StaleApply):  # the same run again: nothing written
        store.apply_replicated(schema.name, tokens[-1], schema, run, effects)
    assert len(store.database.read(lambda c: c.execute(f"SELECT 1 FROM {schema.replicated_table}").fetchall())) == count
    store.close()


def test_a_stale_copy_apply_leaves_the_connection_ready_for_the_next(db_url) -> None:
    """The COPY apply sends BEGIN, the move and the COPY as one request: a stale token stops it before the COPY."""
    store = backend_worker_store(open_worker_store(db_url))
    store.create_replicated_table(PLAIN)
    rows = [[f"row {i}", i, True, 1000 + i] for i in range(120)]  # a COPY-sized apply
    store.apply_replicated("plain", 200, PLAIN, [(200, "w", rows)], _effects(PLAIN, [(200, "w", rows)]))
    stale = [(150, "w", rows)]
    with pytest.raises(StaleApply):
        store.apply_replicated("plain", 150, PLAIN, stale, _effects(PLAIN, stale))
    after = [(201, "w", rows[:60])]
    store.apply_replicated("plain", 201, PLAIN, after, _effects(PLAIN, after))
    assert store.applied_tokens() == {"plain": 201}
    tokens = store.database.read(lambda c: c.execute("SELECT token FROM replicated_plain").fetchall())
    assert sorted(t for (t,) in tokens) == [200] * 120 + [201] * 60
    store.close()


def test_expand_received_splits_runs_into_their_tokens() -> None:
    assert expand_received([([3, 4], "w", [["a"], ["b"]]), (5, "v", [["c"], ["d"]])]) == [
        (3, "w", [["a"]]),
        (4, "w", [["b"]]),
        (5, "v", [["c"], ["d"]]),
    ]


@pytest.mark.parametrize("count", [1, 120])  # one statement; COPY
def test_a_negative_zero_keeps_its_sign_on_postgresql(db_url, count) -> None:
    """Both ways of applying (the server's JSON statement or COPY, and ``replicate``'s VALUES)."""
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite itself stores -0.0 as 0 (docs/protocol.md)")
    store = open_worker_store(db_url)
    store.create_replicated_table(MIXED)
    received = [(10 + i, "w", [["a", 1, -0.0, True, None, 1000 + i]]) for i in range(count)]
    store.apply_replicated("mixed", 10 + count - 1, MIXED, received, _not_called)
    general = [(1000 + i, "w", [["b", 2, -0.0, False, None, 5000 + i]]) for i in range(count)]
    store.apply("mixed", 1000 + count - 1, _effects(MIXED, general))
    doubles = [row[5] for row in _back(store)]
    assert len(doubles) == 2 * count
    assert all(x == 0 and math.copysign(1.0, x) == -1.0 for x in doubles)
    store.close()
