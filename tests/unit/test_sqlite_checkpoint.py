"""SQLite's WAL checkpoints: the master's after its passes, the writers' only past a backstop.

``storage.sqlite_db``: a writer's automatic checkpoint runs only once the WAL
holds ``WRITER_CHECKPOINT_BYTES``; the master (``Master._checkpoint``) runs a
passive checkpoint on a database thread after a pass once
``CHECKPOINT_FRAMES`` frames wait, so a large commit's checkpoint runs after
its rows went out. No row is lost, repeated or reordered by it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from replication.master import MasterConfig
from replication.protocol import ProtocolConfig
from storage.sqlite_db import CHECKPOINT_FRAMES, WRITER_CHECKPOINT_BYTES, SqliteChangeWatch, SqliteDatabase
from storage.store import open_store
from tests.unit.test_protocol import Env, event, tokens


def _waiting(watch: SqliteChangeWatch) -> int:
    frames = watch.wal_frames()
    assert frames is not None
    return frames[0] - frames[1]


def _frames_written(env: Env, first: int, frames: int) -> int:
    """Single-row appends until at least ``frames`` frames wait in the WAL; returns the next row's number."""
    watch = SqliteChangeWatch(env.store.path)
    try:
        n = first
        while _waiting(watch) < frames:
            env.write("events", [event(n)])
            n += 1
        return n
    finally:
        watch.close()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    made = Env(tmp_path, ProtocolConfig(), MasterConfig(server_name="unit"))
    yield made
    made.master.stop_following()
    made.store.close()


def test_a_writer_checkpoints_only_past_the_backstop(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'w.db'}")
    try:
        conn = store.database.connection()  # type: ignore[attr-defined]
        (pages,) = conn.execute("PRAGMA wal_autocheckpoint").fetchone()
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        assert pages == WRITER_CHECKPOINT_BYTES // page_size
    finally:
        store.close()
    other = SqliteDatabase(str(tmp_path / "w.db"))  # a worker's or a timeline's: SQLite's default
    try:
        assert other.connection().execute("PRAGMA wal_autocheckpoint").fetchone() == (1000,)
    finally:
        other.close()


def test_the_watch_counts_the_frames_waiting_and_checkpoints_them(tmp_path: Path) -> None:
    path = str(tmp_path / "m.db")
    watch = SqliteChangeWatch(path)
    store = open_store(f"sqlite:///{path}")
    try:
        from replication.streams import EVENTS

        store.register_stream(EVENTS)
        rows = [[f"$e{i}", "!room", "m.type", None, None] for i in range(200)]
        for row in rows:
            store.append("events", [row], "w")
        waiting = _waiting(watch)
        assert waiting >= CHECKPOINT_FRAMES  # SQLite's default would have checkpointed
        assert watch.checkpoint_due()
        busy, frames, done = watch.checkpoint()
        assert (busy, done) == (0, frames) and frames >= waiting
        assert watch.wal_frames() == (frames, frames) and not watch.checkpoint_due()
        # All checkpointed: the next write starts the WAL over (it does not grow).
        store.append("events", [rows[0]], "w")
        wal = watch.wal_frames()
        assert wal is not None and wal[0] < 10 and not watch.checkpoint_due()
        assert [r[1] for r in store.read_rows("events", 0, 1000, 1000)] == list(range(1, 202))
    finally:
        store.close()
        watch.close()


def test_an_unreadable_wal_index_makes_a_checkpoint_due(tmp_path: Path) -> None:
    watch = SqliteChangeWatch(str(tmp_path / "plain.db"))  # not in WAL mode: no WAL index to read
    try:
        assert watch.wal_frames() is None and watch.checkpoint_due()
        assert watch.checkpoint()[0] == 0  # harmless there
    finally:
        watch.close()


def test_the_master_checkpoints_after_a_pass_once_enough_frames_wait(env: Env) -> None:
    conn = env.connected()
    conn.send("REPLICATE events 0")
    env.follow()
    conn.commands()
    env.db.calls.clear()
    env.write("events", [event(1)])
    env.follow()
    assert "checkpoint" not in env.db.calls  # a few frames: SQLite's own threshold not reached
    last = _frames_written(env, 2, CHECKPOINT_FRAMES)
    env.follow()
    assert env.db.calls.count("checkpoint") == 1
    watch = env.master._watch
    assert isinstance(watch, SqliteChangeWatch) and _waiting(watch) == 0
    # The next write (here the master's own, at its next pass) starts the WAL over:
    # no checkpoint after the passes that follow.
    env.write("events", [event(last)])
    env.follow()
    env.follow()
    assert env.db.calls.count("checkpoint") == 1 and not watch.checkpoint_due()
    # Every row went out once, in order, checkpoint or not.
    assert tokens(conn.commands()) == list(range(1, last + 1))


def test_one_checkpoint_at_a_time_and_the_watch_closed_after_it(env: Env) -> None:
    _frames_written(env, 1, CHECKPOINT_FRAMES)
    env.db.hold = "checkpoint"
    env.follow()
    assert len(env.db.held) == 1
    env.master.notify()  # another pass while it runs: no second checkpoint
    assert len(env.db.held) == 1
    watch = env.master._watch
    assert watch is not None
    env.master.stop_following()
    assert watch._conn is not None  # still checkpointing: not closed under it
    env.db.release()
    assert watch._checkpointer is None and watch._conn is None
    assert env.master._checkpointing is None


def test_no_checkpoint_while_a_connection_is_paused(env: Env) -> None:
    conn = env.connected()
    conn.send("REPLICATE events 0")
    env.follow()
    last = _frames_written(env, 1, CHECKPOINT_FRAMES)
    conn.proto.pauseProducing()  # its client has not taken what was written yet
    env.follow()
    env.follow()
    assert "checkpoint" not in env.db.calls
    conn.proto.resumeProducing()
    env.follow()
    assert env.db.calls.count("checkpoint") == 1
    assert tokens(conn.commands()) == list(range(1, last))
