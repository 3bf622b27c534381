"""Within a stream, ``ts`` increases with the token, also for a transaction's batch appended in steps.

The batch appends of one write transaction share its batch token. A later
one after another token of the stream was allocated (the transaction's own
row outside the batch; on PostgreSQL also another writer's row) would give
its rows timestamps above that token's: it starts a new batch token instead
(on PostgreSQL ``storage.pg_store.BATCH_FUNCTION``, decided under the
oracle's lock; SQLite's write transaction holds the write lock throughout).
What relies on the rule (the ordered lanes, ``first_token_at``) then holds
around such a batch too (docs/time.md).
"""

from __future__ import annotations

import threading

import pytest

from replication.streams import EVENTS
from storage import limits
from storage.schema import RowError
from storage.store import open_store
from tests.stores import pg_store, sqlite_store

ROW = ["$e", "!room", "m.room.message", None, None]


def _rows(n: int) -> list[list]:
    return [[f"$e{i}", "!room", "m.room.message", None, None] for i in range(n)]


def _assert_ts_increases_with_token(store, stream: str = "events") -> list[tuple]:
    """Every row of the stream in (token, seq) order has a later ts than the row before; the rows."""
    rows = sorted(store.read_rows(stream, 0, 10**18, 10**6), key=lambda r: (r[1], r[0]))
    pairs = [(r[1], r[3]) for r in rows]
    slips = [(a, b) for a, b in zip(pairs, pairs[1:], strict=False) if b[1] <= a[1]]
    assert not slips, f"(token, ts) out of order: {slips[:5]}"
    return rows


@pytest.fixture
def stores(pg_url):
    writer, other = open_store(pg_url), open_store(pg_url)
    writer.register_stream(EVENTS)
    yield writer, other
    other.close()
    writer.close()


@pytest.mark.parametrize("size", [2, 20, 150], ids=["prepared", "statement", "copy"])
def test_a_batch_continued_after_another_writers_token_gets_a_new_token(stores, size) -> None:
    writer, other = stores
    with writer.writing("events", "w") as txn:
        first = txn.append(_rows(size), batch=True)
        (between,) = other.append("events", [ROW], "w2")
        later = txn.append(_rows(size), batch=True)
        last = txn.append(_rows(size), batch=True)
    assert len(set(first)) == len(set(later)) == 1
    assert first[0] < between < later[0], (first[0], between, later[0])
    assert last == later  # nothing allocated in between: the new batch token continues
    rows = _assert_ts_increases_with_token(writer)
    assert len(rows) == 3 * size + 1


@pytest.fixture
def writer(db_url):
    """A store of either backend (the rules below hold on both)."""
    store = open_store(db_url)
    store.register_stream(EVENTS)
    yield store
    store.close()


def test_a_batch_continued_after_its_own_row_gets_a_new_token(writer) -> None:
    with writer.writing("events", "w") as txn:
        first = txn.append(_rows(3), batch=True)
        (own,) = txn.append([ROW])
        later = txn.append(_rows(3), batch=True)
        last = txn.append(_rows(2), batch=True)
    assert first[0] < own < later[0] == last[0]
    _assert_ts_increases_with_token(writer)


def test_a_batch_appended_in_steps_with_nothing_between_shares_one_token(writer) -> None:
    with writer.writing("events", "w") as txn:
        tokens = (
            txn.append(_rows(2), batch=True) + txn.append(_rows(150), batch=True) + txn.append(_rows(5), batch=True)
        )
    assert len(set(tokens)) == 1 and len(tokens) == 157
    assert writer.heads()["events"] == tokens[0]  # one token taken
    rows = _assert_ts_increases_with_token(writer)
    assert [r[4] for r in rows] == [r[0] for r in _rows(2) + _rows(150) + _rows(5)]  # in the order appended


def test_the_time_lookup_finds_the_new_batch_token_after_the_other_writers(stores) -> None:
    writer, other = stores
    with writer.writing("events", "w") as txn:
        txn.append(_rows(2), batch=True)
        (between,) = other.append("events", [ROW], "w2")
        (later, *_) = txn.append(_rows(2), batch=True)
    rows = {r[1]: r[3] for r in writer.read_rows("events", 0, 10**18, 100)}  # token -> a ts of it
    between_ts = rows[between]
    # The first row at or after the other writer's ts is its own: no row of the batch before it.
    assert writer.first_token_at("events", between_ts).token == between
    assert writer.first_token_at("events", between_ts + 1).token == later


def test_a_new_batch_token_counts_its_own_rows_against_the_bound(stores, monkeypatch) -> None:
    writer, other = stores
    monkeypatch.setattr(limits, "MAX_BATCH_ROWS", 10)
    with writer.writing("events", "w") as txn:
        txn.append(_rows(6), batch=True)
        other.append("events", [ROW], "w2")
        later = txn.append(_rows(4), batch=True)  # 10 rows so far: checked before the new token shows
        more = txn.append(_rows(5), batch=True)  # the new token's 9 rows
    assert later[0] == more[0]
    with (
        pytest.raises(RowError, match="11 rows of one transaction's batch appends"),
        writer.writing("events", "w") as txn,
    ):
        txn.append(_rows(6), batch=True)
        txn.append(_rows(5), batch=True)  # one token of 11 rows
    assert len(writer.read_rows("events", 0, 10**18, 100)) == 6 + 1 + 4 + 5


def test_a_step_after_the_transactions_own_rows_counts_alone(writer, monkeypatch) -> None:
    """Its own rows since the batch's last step make a new token certain: the step is not refused
    for rows it will never share a token with."""
    monkeypatch.setattr(limits, "MAX_BATCH_ROWS", 10)
    with writer.writing("events", "w") as txn:
        first = txn.append(_rows(6), batch=True)
        txn.append([ROW])
        later = txn.append(_rows(5), batch=True)
    assert later[0] > first[0] and len(writer.read_rows("events", 0, 10**18, 100)) == 12


def test_a_refused_step_adds_nothing_to_the_batch(writer, monkeypatch) -> None:
    monkeypatch.setattr(limits, "MAX_BATCH_ROWS", 10)
    with writer.writing("events", "w") as txn:
        tokens = txn.append(_rows(6), batch=True)
        with pytest.raises(RowError, match="11 rows of one transaction's batch appends"):
            txn.append(_rows(5), batch=True)  # refused before anything is sent: the transaction goes on
        tokens += txn.append(_rows(4), batch=True)
    assert len(set(tokens)) == 1 and len(writer.read_rows("events", 0, 10**18, 100)) == 10


def test_a_write_after_a_new_batch_token_continues_from_it(stores) -> None:
    """The writer's record of its next allocation (what a large append proposes) follows the new token."""
    writer, other = stores
    with writer.writing("events", "w") as txn:
        txn.append(_rows(2), batch=True)
        other.append("events", [ROW], "w2")
        (later, *_) = txn.append(_rows(150), batch=True)
    (state,) = [s for key, s in pg_store(writer)._writers.items() if key == ("events", "w")]
    assert state.next_token == later + 1
    tokens = writer.append("events", _rows(150), "w")  # proposed, and taken
    assert tokens[0] == later + 1 and state.propose
    _assert_ts_increases_with_token(writer)


def test_concurrent_writers_keep_ts_increasing_with_the_token(stores, pg_url) -> None:
    """Batches appended in steps while another writer appends single rows: the order holds throughout."""
    writer, other = stores
    stop = threading.Event()
    errors: list[BaseException] = []

    def single_rows() -> None:
        try:
            while not stop.is_set():
                other.append("events", [ROW], "w2")
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=single_rows)
    thread.start()
    try:
        tokens: list[int] = []
        for _ in range(60):
            with writer.writing("events", "w") as txn:
                for size in (1, 3, 120, 2):
                    tokens += txn.append(_rows(size), batch=True)
    finally:
        stop.set()
        thread.join(30)
    assert not errors
    rows = _assert_ts_increases_with_token(writer)
    mine = [r for r in rows if r[2] == "w"]
    assert len(mine) == 60 * 126 and sorted(r[1] for r in mine) == sorted(tokens)
    assert len({r[1] for r in mine}) > 60  # the other writer did come between some steps


def test_a_database_made_by_an_earlier_version_gets_the_batch_function(pg_url) -> None:
    from storage.pg_store import BATCH_FUNCTION

    store = open_store(pg_url)
    store.register_stream(EVENTS)
    pg_store(store).database.write(lambda cur: cur.execute(f"DROP FUNCTION {BATCH_FUNCTION}"))
    store.close()
    again = open_store(pg_url)  # migrates: the function made again
    try:
        with again.writing("events", "w") as txn:
            tokens = txn.append(_rows(2), batch=True) + txn.append(_rows(2), batch=True)
        assert len(set(tokens)) == 1
    finally:
        again.close()


def test_a_batch_step_after_a_failed_append_the_caller_went_on_from_takes_a_new_token(tmp_path) -> None:
    """SQLite: an append whose insert fails after its tokens were taken (a trigger here), caught by
    the caller who goes on in the same transaction: the next batch step still takes a token after
    those (on PostgreSQL a failed statement ends the transaction)."""
    store = sqlite_store(open_store(f"sqlite:///{tmp_path}/s.db"))
    store.register_stream(EVENTS)
    store.database.write(
        lambda conn: conn.execute(
            f"CREATE TRIGGER boom BEFORE INSERT ON {EVENTS.table} WHEN NEW.event_id = '$boom' "
            "BEGIN SELECT RAISE(ABORT, 'boom'); END"
        )
    )
    try:
        with store.writing("events", "w") as txn:
            (first, _) = txn.append(_rows(2), batch=True)
            with pytest.raises(Exception, match="boom"):
                txn.append([ROW, ["$boom", "!room", "m.room.message", None, None]])
            (later,) = txn.append(_rows(1), batch=True)
        assert later > first + 1  # past the failed append's tokens
        _assert_ts_increases_with_token(store)
    finally:
        store.close()
