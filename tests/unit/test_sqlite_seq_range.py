"""SQLite's ``read_lines_json`` scans a token range as a rowid (``seq``) range: for a stream in rowid
order, found by binary search (``storage.sqlite_order``); for a stream marked out of order, where it can
prove it is the same rows in the same order, and through the token index wherever it cannot."""

from __future__ import annotations

import random

import pytest

from replication.rows import encode_rows, row_encoder
from storage.bulk import write_rows
from storage.schema import Column, StreamSchema
from storage.sqlite_store import SqliteStreamStore
from storage.store import open_store

SCHEMA = StreamSchema("ev", (Column("name", "text"), Column("n", "bigint", True)))
PREFIX = "RDATA ev "


def _store(tmp_path) -> SqliteStreamStore:
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    assert isinstance(store, SqliteStreamStore)
    store.register_stream(SCHEMA)
    return store


def _rows(first: int, count: int) -> list[list[object]]:
    return [[f"row {i}", i] for i in range(first, first + count)]


def _expected(store: SqliteStreamStore, after: int, upto: int, with_ts: bool) -> bytes:
    """The lines of the Python encoder for the rows of ``(after, upto]`` in ``(token, seq)`` order."""
    return encode_rows("ev", store.read_rows("ev", after, upto, 10**6), row_encoder(SCHEMA), with_ts)[0]


def _marked(store: SqliteStreamStore) -> bool:
    return bool(store.database.query("SELECT 1 FROM tickline_unordered WHERE stream = 'ev'"))


class Paths:
    """Counts which way ``read_lines_json`` read (an ordered stream's rowid range; a marked one's seq range, or its token index)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seq = self.seq_used = self.token = self.ordered = 0
        seq_range = SqliteStreamStore._read_seq_range
        token_range = SqliteStreamStore._read_token_range
        ordered_range = SqliteStreamStore._read_ordered_lines

        def ordered(*args, **kwargs):
            self.ordered += 1
            return ordered_range(*args, **kwargs)

        def by_seq(*args, **kwargs):
            self.seq += 1
            got = seq_range(*args, **kwargs)
            self.seq_used += got is not None
            return got

        def by_token(*args, **kwargs):
            self.token += 1
            return token_range(*args, **kwargs)

        monkeypatch.setattr(SqliteStreamStore, "_read_seq_range", staticmethod(by_seq))
        monkeypatch.setattr(SqliteStreamStore, "_read_token_range", staticmethod(by_token))
        monkeypatch.setattr(SqliteStreamStore, "_read_ordered_lines", staticmethod(ordered))


@pytest.mark.parametrize("with_ts", [False, True])
def test_rows_written_by_tickline_are_read_as_a_seq_range(tmp_path, monkeypatch, with_ts: bool) -> None:
    store = _store(tmp_path)
    store.append("ev", _rows(0, 3), "w1")  # tokens 1-3
    store.append("ev", _rows(3, 2), "w1", batch=True)  # token 4: two rows, so token - seq changes after it
    with store.writing("ev", "w2") as txn:  # tokens 5-7, another writer
        txn.append(_rows(5, 2))
        txn.append(_rows(7, 1))
    write_rows(store, "ev", ((f"line {i}", row) for i, row in enumerate(_rows(8, 5))), "w1", chunk_rows=2)  # 8-12
    paths = Paths(monkeypatch)
    for after, upto, limit, last, count in (
        (4, 12, 100, 12, 8),
        (0, 3, 100, 3, 3),
        (5, 12, 3, 8, 3),
        (7, 9, 100, 9, 2),
    ):
        got = store.read_lines_json("ev", after, upto, limit, PREFIX, with_ts)
        assert got == (_expected(store, after, last, with_ts), last, count)
    assert paths.ordered == 4 and paths.seq == paths.token == 0 and not _marked(store)
    # The batch in range: more rows than tokens, which says so.
    assert store.read_lines_json("ev", 2, 6, 100, PREFIX, with_ts) is None
    assert paths.ordered == 5 and paths.seq == paths.token == 0


def test_rows_deleted_by_hand_are_a_seq_range_with_holes(tmp_path, monkeypatch) -> None:
    store = _store(tmp_path)
    store.append("ev", _rows(0, 10), "w1")
    store.database.write(lambda conn: conn.execute("DELETE FROM stream_ev WHERE token IN (1, 4, 5, 10)"))
    paths = Paths(monkeypatch)
    assert store.read_lines_json("ev", 0, 10, 100, PREFIX, False) == (_expected(store, 0, 10, False), 9, 6)
    assert store.read_lines_json("ev", 3, 10, 3, PREFIX, False) == (_expected(store, 3, 8, False), 8, 3)
    # Deleting keeps the order: still one rowid range, found by binary search.
    assert paths.ordered == 2 and paths.seq == paths.token == 0 and not _marked(store)


def test_a_row_inserted_by_hand_out_of_seq_order_is_read_in_token_order(tmp_path, monkeypatch) -> None:
    """A row whose seq is below rows with smaller tokens: the seq range would put it first; the index does not."""
    store = _store(tmp_path)
    store.append("ev", _rows(0, 6), "w1")  # tokens 1-6, seq 1-6
    store.database.write(lambda conn: conn.execute("DELETE FROM stream_ev WHERE token = 1"))
    # Token 4 moved by hand to seq 1 (before tokens 2 and 3).
    store.database.write(lambda conn: conn.execute("UPDATE stream_ev SET seq = 1 WHERE token = 4"))
    assert _marked(store)  # read through the indexes, as before storage.sqlite_order
    paths = Paths(monkeypatch)
    for after in (0, 1, 2):
        got = store.read_lines_json("ev", after, 6, 100, PREFIX, False)
        assert got is not None and got[0] == _expected(store, after, 6, False)
        tokens = [int(line.split()[3]) for line in got[0].splitlines()]
        assert tokens == sorted(tokens) and tokens[-1] == 6
    assert paths.seq_used == 0 and paths.token == 3


def test_tokens_swapped_by_hand_are_read_in_token_order(tmp_path, monkeypatch) -> None:
    """Each end of the range in place, two rows in between swapped: only the per-row check can tell."""
    store = _store(tmp_path)
    store.append("ev", _rows(0, 6), "w1")
    store.database.write(lambda conn: conn.execute("UPDATE stream_ev SET token = 7 - token WHERE token IN (3, 4)"))
    assert _marked(store)  # read through the indexes, as before storage.sqlite_order
    paths = Paths(monkeypatch)
    got = store.read_lines_json("ev", 0, 6, 100, PREFIX, False)
    assert got == (_expected(store, 0, 6, False), 6, 6)
    assert [int(line.split()[3]) for line in got[0].splitlines()] == [1, 2, 3, 4, 5, 6]
    assert paths.seq == 1 and paths.seq_used == 0 and paths.token == 1


def test_a_row_outside_the_seq_range_with_a_token_in_range_is_not_lost(tmp_path, monkeypatch) -> None:
    """A hand-written row after every other, with a token inside the range: the index count finds it."""
    store = _store(tmp_path)
    store.append("ev", _rows(0, 6), "w1")
    store.database.write(lambda conn: conn.execute("DELETE FROM stream_ev WHERE token = 3"))
    store.database.write(
        lambda conn: conn.execute(
            "INSERT INTO stream_ev (seq, token, instance_name, ts, name, n, row_json) "
            "SELECT 100, 3, instance_name, ts, name, n, row_json FROM stream_ev WHERE token = 2"
        )
    )
    assert _marked(store)  # read through the indexes, as before storage.sqlite_order
    paths = Paths(monkeypatch)
    got = store.read_lines_json("ev", 0, 6, 100, PREFIX, False)
    assert got == (_expected(store, 0, 6, False), 6, 6)
    assert [int(line.split()[3]) for line in got[0].splitlines()] == [1, 2, 3, 4, 5, 6]
    assert paths.seq == 1 and paths.seq_used == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_writes_and_deletes_read_exactly(tmp_path, seed: int) -> None:
    """Whatever the writes (batches, writers, transactions) and hand deletions: every chunked read of
    every range gives the Python encoder's lines of whole tokens in order, or None only where a batch is."""
    rng = random.Random(seed)
    store = _store(tmp_path)
    n = 0
    for _ in range(30):
        count = rng.randint(1, 4)
        with store.writing("ev", rng.choice(["w1", "w2", "w3"])) as txn:
            for _ in range(rng.randint(1, 2)):
                txn.append(_rows(n, count), batch=count > 1 and rng.random() < 0.3)
                n += count
    head = store.heads()["ev"]
    doomed = rng.sample(range(1, head + 1), head // 6)
    store.database.write(lambda conn: conn.executemany("DELETE FROM stream_ev WHERE token = ?", [(t,) for t in doomed]))
    batched = {t for (t,) in store.database.query("SELECT token FROM stream_ev GROUP BY token HAVING count(*) > 1")}
    for _ in range(60):
        after = rng.randint(0, head)
        upto = rng.randint(after, head + 2)
        limit = rng.randint(1, 12)
        with_ts = rng.random() < 0.5
        got = store.read_lines_json("ev", after, upto, limit, PREFIX, with_ts)
        if got is None:
            assert batched & set(range(after + 1, upto + 1))
            continue
        data, last, count = got
        if count == 0:
            assert data == b"" and last == after and not store.read_rows("ev", after, upto, 1)
            continue
        assert after < last <= upto
        assert data == _expected(store, after, last, with_ts)
        assert count == len(store.read_rows("ev", after, last, 10**6))


def test_a_gap_beside_a_batch_of_as_many_rows_is_still_a_batch(tmp_path, monkeypatch) -> None:
    """Tokens 1, 3, 3 (token 2 deleted by hand, token 3 a batch of two): three rows for three tokens, yet a batch."""
    store = _store(tmp_path)
    store.append("ev", _rows(0, 2), "w1")
    store.append("ev", _rows(2, 2), "w1", batch=True)
    store.database.write(lambda conn: conn.execute("DELETE FROM stream_ev WHERE token = 2"))
    paths = Paths(monkeypatch)
    assert store.read_lines_json("ev", 0, 3, 100, PREFIX, False) is None
    assert paths.ordered == 1 and paths.seq == paths.token == 0 and not _marked(store)
    assert store.read_lines_json("ev", 0, 2, 100, PREFIX, False) == (_expected(store, 0, 1, False), 1, 1)
