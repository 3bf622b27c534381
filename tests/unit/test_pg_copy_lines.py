"""The writer's COPY data on PostgreSQL: the quick whole-chunk path makes exactly the careful path's
bytes, falls back on anything that needs an escape or a check value by value, and a bad row is
refused by name with nothing stored."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.contracts import Row
from storage.limits import DEFAULT_MAX_LINE_BYTES
from storage.pg_copy import SPECIAL_CHARACTERS, chunk_formatter, data_needs_escapes
from storage.pg_store import _statements
from storage.schema import Column, RowError, StreamSchema
from storage.store import open_store
from tests.stores import pg_store, pg_worker_store

MIXED = StreamSchema(
    "mixed",
    (
        Column("t", "text"),
        Column("n", "bigint", nullable=True),
        Column("d", "double", nullable=True),
        Column("b", "boolean", nullable=True),
        Column("s", "text", nullable=True),
    ),
)
GOOD: list[Row] = [
    ["plain", 1, 1.5, True, None],
    ["x", -(2**63), -0.0, False, "s"],
    ["y", 2**63 - 1, 1e300, None, "é ünïcode ☃ 🎉"],
    ["z", None, None, None, None],
    ("tuple", 0, 2.0, True, ""),
]
NEEDS_ESCAPES = ["tab\there", "new\nline", "back\\slash", "cr\rhere", "\\N", "a\\tb"]


def careful(schema: StreamSchema, rows: list, instance: str = "w") -> bytes:
    statements = _statements(schema)
    columns = statements.columns_text(rows, DEFAULT_MAX_LINE_BYTES)
    return statements.copy_text(columns, instance, 10, 1, 1000).encode()


def quick(schema: StreamSchema, rows: list, instance: str = "w", step: int = 1) -> bytes:
    return _statements(schema).copy_lines(rows, instance, 10, step, 1000, DEFAULT_MAX_LINE_BYTES)


def test_the_quick_path_makes_the_careful_paths_bytes() -> None:
    rows = GOOD * 30
    chunk = chunk_formatter(MIXED)
    assert chunk is not None
    lines, nulls = chunk(rows, 1000, 10, 1, "w")
    assert lines is not None and nulls == 30 * 6
    text = "\n".join(lines)
    assert not data_needs_escapes((text + "\n").encode(), len(lines) * 9, nulls)
    assert quick(MIXED, rows) == careful(MIXED, rows)
    assert quick(MIXED, rows, "in\\st") == careful(MIXED, rows, "in\\st")
    batch = _statements(MIXED).copy_lines(rows, "w", 10, 0, 1000, DEFAULT_MAX_LINE_BYTES)
    assert {line.split(b"\t")[1] for line in batch.splitlines()} == {b"10"}


@pytest.mark.parametrize("value", NEEDS_ESCAPES)
def test_a_value_that_needs_an_escape_is_escaped(value: str) -> None:
    rows = [*GOOD, [value, 1, 1.0, True, value], *GOOD]
    data = quick(MIXED, rows)
    assert data == careful(MIXED, rows)
    assert len(data.decode().splitlines()) == len(rows)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (["t", 2**63, None, None, None], "does not fit in 64 bits"),
        (["t", None, float("inf"), None, None], "is not a finite number"),
        (["t", None, float("nan"), None, None], "is not a finite number"),
        (["t", True, None, None, None], "expects bigint"),
        (["t", None, None, 1, None], "expects boolean"),
        ([None, None, None, None, None], "may not be null"),
        (["nul\x00", None, None, None, None], "may not contain NUL"),
        (["\ud800", None, None, None, None], "lone surrogate"),
        (["t", None, None, None], "expects 5 values"),
        ("t", "must be a JSON array or object"),
        (["t" * DEFAULT_MAX_LINE_BYTES, None, None, None, None], "the row's"),
    ],
)
def test_a_bad_row_is_named(bad: object, reason: str) -> None:
    rows = [*GOOD, *GOOD, bad, *GOOD]
    with pytest.raises(RowError) as e:
        quick(MIXED, rows)
    assert e.value.index == 2 * len(GOOD) and reason in str(e.value), e.value
    assert str(e.value).startswith(f"row {2 * len(GOOD) + 1}: ")


# Text with every character a COPY line treats specially (and NUL, which the careful path refuses).
_TEXT = st.lists(st.sampled_from(["a", "é", "☃", "\t", "\n", "\\", "\r", "\x00", "N", "\\N"]), max_size=6).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_TEXT, st.none() | st.integers(-(2**63), 2**63 - 1), st.none(), st.booleans(), _TEXT | st.none()),
        min_size=1,
        max_size=6,
    ),
    instance=st.sampled_from(["w", "in\\st", "a\\\\b"]),
    step=st.sampled_from([0, 1]),
)
def test_the_quick_path_is_the_careful_one_for_any_text(rows: list, instance: str, step: int) -> None:
    """The one-pass check of the encoded bytes finds exactly the values that need an escape: the
    quick data is the careful path's bytes, and a row the careful path refuses is refused by name."""
    chunk = chunk_formatter(MIXED)
    assert chunk is not None
    lines, nulls = chunk(rows, 1000, 10, step, instance.replace("\\", "\\\\"))
    assert lines is not None
    text = "\n".join(lines)
    backslashes = nulls + len(lines) * instance.replace("\\", "\\\\").count("\\")
    # Exactly when a text value holds a tab, newline, backslash, carriage return or NUL.
    assert data_needs_escapes((text + "\n").encode(), len(lines) * 9, backslashes) == any(
        type(v) is str and not SPECIAL_CHARACTERS.isdisjoint(v) for row in rows for v in row
    )
    statements = _statements(MIXED)
    try:
        columns = statements.columns_text(rows, DEFAULT_MAX_LINE_BYTES)
    except RowError as refused:
        with pytest.raises(RowError) as e:
            statements.copy_lines(rows, instance, 10, step, 1000, DEFAULT_MAX_LINE_BYTES)
        assert (e.value.index, e.value.reason) == (refused.index, refused.reason)
        return
    expected = statements.copy_text(columns, instance, 10, step, 1000).encode()
    assert statements.copy_lines(rows, instance, 10, step, 1000, DEFAULT_MAX_LINE_BYTES) == expected


def test_ints_for_doubles_and_objects_take_the_careful_path() -> None:
    rows = [*GOOD, ["i", None, 3, None, None], {"t": "o", "s": "x"}]
    assert quick(MIXED, rows) == careful(MIXED, rows)


def test_copy_appends_store_exactly_what_was_given(pg_url) -> None:
    store = open_store(pg_url)
    try:
        store.register_stream(MIXED)
        odd = [[v, 7, 0.1, False, v] for v in NEEDS_ESCAPES]
        rows = [list(r) for r in GOOD * 40] + odd
        tokens = store.append("mixed", rows, "w")
        stored = [list(r[4:]) for r in store.read_rows("mixed", 0, tokens[-1], 10_000)]
        assert stored == [list(r) for r in rows]
        with pytest.raises(RowError, match="row 150: "):
            store.append("mixed", [*rows[:149], ["t", "not a number", None, None, None], *rows], "w")
        assert store.read_rows("mixed", tokens[-1], 10**9, 10) == []  # nothing of the refused write
        again = store.append("mixed", rows, "w")
        assert again[0] > tokens[-1]
    finally:
        store.close()


def test_the_workers_quick_lines_are_the_careful_ones() -> None:
    from storage.pg_copy import received_chunk_formatter
    from storage.pg_worker import PgWorkerStore

    received = [(10 + i, "w", [[*row, 1000 + i]]) for i, row in enumerate([list(r) for r in GOOD] * 20)]
    chunk = received_chunk_formatter(MIXED)
    assert chunk is not None and chunk(received)[0] is not None
    quick = PgWorkerStore._copy_text(MIXED, received)
    careful_lines = [
        f"{token}\tw\t" + _statements(MIXED).columns_text([row[:-1]], None)[0] + f"\t{row[-1]}"
        for token, _, rows in received
        for row in rows
    ]
    assert quick == ("\n".join(careful_lines) + "\n").encode()
    odd = [(token, "w\\x", rows) for token, _, rows in received]  # an instance name with a backslash
    assert PgWorkerStore._copy_text(MIXED, odd) == quick.replace(b"\tw\t", b"\tw\\\\x\t")


@pytest.mark.parametrize("value", [*NEEDS_ESCAPES, "ünï ☃"])
def test_the_worker_applies_rows_that_need_escapes_exactly(pg_url, value: str) -> None:
    from storage.worker_store import open_worker_store

    store = pg_worker_store(open_worker_store(pg_url))
    try:
        store.create_replicated_table(MIXED)
        rows = [[value if i % 7 == 3 else f"r{i}", i, 0.5, i % 2 == 0, value] for i in range(120)]
        received = [(1 + i, "w", [[*row, 1000 + i]]) for i, row in enumerate(rows)]
        store.apply_replicated("mixed", 120, MIXED, received, lambda txn: None)
        back = store.database.read(
            lambda c: c.execute("SELECT token, ts, t, n, d, b, s FROM replicated_mixed ORDER BY token").fetchall()
        )
        assert [list(r[2:]) for r in back] == rows
        assert [(r[0], r[1]) for r in back] == [(1 + i, 1000 + i) for i in range(120)]
    finally:
        store.close()


@pytest.mark.parametrize(
    "bad, message",
    [
        ([7, None, None, None, None], "'t' expects text"),
        (["a", 2**63, None, None, None], "does not fit in 64 bits"),
        (["a\x00", None, None, None, None], "NUL"),
        (["a", None, None, 1, None], "'b' expects boolean"),
    ],
)
def test_the_worker_names_a_bad_row_and_applies_nothing(pg_url, bad, message) -> None:
    from storage.worker_store import open_worker_store

    store = open_worker_store(pg_url)
    try:
        store.create_replicated_table(MIXED)
        good = [[f"r{i}", i, 0.5, True, None, 1000 + i] for i in range(60)]
        received = [(1, "w", good), (2, "w", [[*bad, 2000]]), (3, "w", good)]

        def effects(txn) -> None:
            txn.replicate(MIXED, [(t, i, r[-1], *MIXED.check_row(r[:-1])) for t, i, rs in received for r in rs])

        with pytest.raises(RowError, match=message):
            store.apply_replicated("mixed", 3, MIXED, received, effects)
        assert store.applied_tokens() == {}
    finally:
        store.close()


def test_a_fenced_bulk_write_commits_nothing_and_append_retries_with_new_tokens(pg_url) -> None:
    """A writer declared dead while its COPY transaction is open: the commit refuses, nothing is stored."""
    from storage.pg_store import Fenced

    store = pg_store(open_store(pg_url))
    other = open_store(pg_url)
    try:
        store.register_stream(MIXED)
        rows = [list(r) for r in GOOD * 40]
        first = store.append("mixed", rows, "w")
        with pytest.raises(Fenced), store.writing("mixed", "w") as txn:
            doomed = txn.append(rows)
            store.database.query("UPDATE tickline_writers SET heartbeat_ms = 0 RETURNING 1")
            other.safe_positions(expire_writers=True)  # the master's sweep: this writer is dead
        assert store.read_rows("mixed", first[-1], 10**9, 10) == []
        again = store.append("mixed", rows, "w")  # registers again: new epoch, new tokens
        assert again[0] > doomed[-1]
        stored = store.read_rows("mixed", 0, 10**9, 10_000)
        assert [r[1] for r in stored] == first + again
    finally:
        other.close()
        store.close()


LARGE = [list(r) for r in GOOD * 40]  # enough rows for an append by COPY (a proposed allocation)


@pytest.fixture
def two_writers(pg_url):
    """Two stores (two writer processes) of one database, the ``mixed`` stream registered."""
    store, other = open_store(pg_url), open_store(pg_url)
    try:
        store.register_stream(MIXED)
        yield store, other
    finally:
        other.close()
        store.close()


def _count_proposals(monkeypatch) -> dict[str, int]:
    """How many large appends had their allocation taken as proposed (one round trip), how many not."""
    from storage import pg_store

    seen = {"taken": 0, "not": 0}
    original = pg_store.WriteTransaction._append_copy_proposed

    def spy(self, *args):
        took = original(self, *args)
        seen["taken" if took is not None else "not"] += 1
        return took

    monkeypatch.setattr(pg_store.WriteTransaction, "_append_copy_proposed", spy)
    return seen


def _check_stream(store, appends: list[list[int]]) -> None:
    """Every append's tokens consecutive, all of them one dense range, ``ts`` strictly increasing with the token."""
    for tokens in appends:
        assert tokens == list(range(tokens[0], tokens[0] + len(tokens)))
    everything = sorted(t for tokens in appends for t in tokens)
    stored = store.read_rows("mixed", 0, 10**9, 100_000)
    assert [r[1] for r in stored] == everything
    ts = [r[3] for r in stored]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)


def test_large_appends_propose_their_allocation_and_fall_back_when_another_allocated(two_writers, monkeypatch) -> None:
    """A writer alone proposes its next tokens and timestamps (BEGIN, allocation, COPY and COMMIT in one round
    trip); after another writer of the stream, or the master's oracle, allocated, the proposal is refused,
    nothing is taken and the append allocates as usual: no gap, no token twice, ts still in token order."""
    seen = _count_proposals(monkeypatch)
    store, other = two_writers
    rows = LARGE
    appends = [store.append("mixed", rows, "w") for _ in range(3)]
    assert seen == {"taken": 2, "not": 1}  # the first allocation tells the writer what comes next
    appends.append(other.append("mixed", rows, "v"))  # another process's writer takes the next tokens
    appends.append(store.append("mixed", rows, "w"))  # refused: falls back
    appends.append(store.append("mixed", rows, "w"))  # not proposed; shows a proposal would have been right
    appends.append(store.append("mixed", rows, "w"))
    assert seen == {"taken": 3, "not": 4}  # the other writer's first append counts too
    # A writer whose clock is far behind the oracle's proposes its last timestamps + 1: refused
    # whenever the oracle handed out others meanwhile (the master's fresh times), and not
    # proposed again while that lasts.
    store._clock = lambda: 0.0
    for _ in range(3):
        other.allocate_timestamps(1)
        appends.append(store.append("mixed", rows, "w"))
    assert seen == {"taken": 3, "not": 7}
    appends.append(store.append("mixed", rows, "w"))  # alone: a proposal would have been taken
    appends.append(store.append("mixed", rows, "w"))
    assert seen == {"taken": 4, "not": 8}
    appends.append(other.append("mixed", [rows[0]], "v"))  # a small append between
    appends.append(store.append("mixed", rows, "w"))
    _check_stream(store, appends)


def test_a_fenced_writer_whose_append_is_one_round_trip_commits_nothing_and_retries(two_writers, monkeypatch) -> None:
    seen = _count_proposals(monkeypatch)
    store, other = two_writers
    rows = LARGE
    appends = [store.append("mixed", rows, "w")]
    store.database.query("UPDATE tickline_writers SET heartbeat_ms = 0 RETURNING 1")
    other.safe_positions(expire_writers=True)  # the master's sweep: this writer is dead
    appends.append(store.append("mixed", rows, "w"))  # fenced at its commit, retried with new tokens
    assert seen == {"taken": 0, "not": 2}  # the proposed append raised Fenced; the retry allocated anew
    stored = store.read_rows("mixed", 0, 10**9, 10_000)
    assert [r[1] for r in stored] == appends[0] + appends[1]
    assert appends[1][0] > appends[0][-1] + len(rows)  # the fenced attempt's tokens are skipped


def test_a_bad_row_in_a_proposed_append_commits_nothing(two_writers, monkeypatch) -> None:
    seen = _count_proposals(monkeypatch)
    store, _ = two_writers  # one writer here
    rows = LARGE
    first = store.append("mixed", rows, "w")
    with pytest.raises(RowError, match="row 151"):
        store.append("mixed", [*rows[:150], ["ok", "not a number", None, None, None]], "w")
    assert store.read_rows("mixed", first[-1], 10**9, 10) == []
    again = store.append("mixed", rows, "w")
    _check_stream(store, [first, again])
    # The bad append's proposal was taken (its tokens then rolled back and skipped); the next one's too.
    assert seen == {"taken": 1, "not": 1}
    assert again[0] == first[-1] + 151 + 1  # after the 151 skipped tokens
