"""SQLite's WAL checkpoints: the master's after its passes, the writers' only past a backstop.

``storage.sqlite_db``: a writer's automatic checkpoint runs only once the WAL
holds ``WRITER_CHECKPOINT_BYTES``; the master (``Master._checkpoint``) runs a
passive checkpoint through SQLite on a database thread after a pass once it
delivered ``CHECKPOINT_ROWS`` rows live since its last one (or
``CHECKPOINT_SECONDS`` went by), and not while a connection is paused, so a
large commit's checkpoint runs after its rows went out. The master never opens
SQLite's files itself. No row is lost, repeated or reordered by it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from replication.master import MasterConfig
from replication.protocol import ProtocolConfig
from replication.streams import EVENTS
from storage.sqlite_db import (
    CHECKPOINT_FRAMES,
    CHECKPOINT_RETRY_SECONDS,
    CHECKPOINT_ROWS,
    CHECKPOINT_SECONDS,
    WRITER_CHECKPOINT_BYTES,
    CheckpointSchedule,
    SqliteChangeWatch,
    SqliteDatabase,
    checkpoint_due,
)
from storage.store import open_store
from tests.stores import sqlite_store
from tests.unit.test_protocol import Env, event, tokens


def _wal_size(env: Env) -> int:
    """The WAL file's size (a stat: SQLite's files are never opened here)."""
    return os.path.getsize(sqlite_store(env.store).path + "-wal")


def _checkpoint_held_after_live_rows(env: Env) -> None:
    """A live connection takes ``CHECKPOINT_ROWS`` rows; the checkpoint that follows is held (``env.db.held``)."""
    env.connected().send("REPLICATE events 0")
    env.follow()
    env.write("events", [event(n) for n in range(1, CHECKPOINT_ROWS + 1)])
    env.db.hold = "checkpoint"
    env.follow()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    made = Env(tmp_path, ProtocolConfig(), MasterConfig(server_name="unit"))
    yield made
    made.master.stop_following()
    made.store.close()


def test_a_writer_checkpoints_only_past_the_backstop(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'w.db'}")
    try:
        conn = sqlite_store(store).database.connection()
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


def test_when_a_checkpoint_is_due() -> None:
    assert not checkpoint_due(CHECKPOINT_ROWS - 1, 1.0, True, False)
    assert checkpoint_due(CHECKPOINT_ROWS, 0.0, True, False)
    assert not checkpoint_due(CHECKPOINT_ROWS, 1.0, True, True)  # a delivery not over
    assert checkpoint_due(0, CHECKPOINT_SECONDS, True, True)  # whatever the clients do
    # One that could not copy everything: tried again, not at once.
    assert not checkpoint_due(CHECKPOINT_ROWS, CHECKPOINT_RETRY_SECONDS / 2, False, False)
    assert checkpoint_due(CHECKPOINT_ROWS, CHECKPOINT_RETRY_SECONDS, False, False)
    # A WAL of SQLite's 1000 frames not started over yet: again, until it was.
    assert not checkpoint_due(0, CHECKPOINT_RETRY_SECONDS / 2, True, False, CHECKPOINT_FRAMES)
    assert checkpoint_due(0, CHECKPOINT_RETRY_SECONDS, True, False, CHECKPOINT_FRAMES)
    assert not checkpoint_due(0, CHECKPOINT_RETRY_SECONDS, True, True, CHECKPOINT_FRAMES)
    assert not checkpoint_due(0, CHECKPOINT_RETRY_SECONDS, True, False, CHECKPOINT_FRAMES - 1)


def test_the_schedule_counts_rows_and_keeps_an_incomplete_checkpoints_rows_due() -> None:
    schedule = CheckpointSchedule(at=100.0)
    schedule.delivered(CHECKPOINT_ROWS - 1)
    assert not schedule.due(100.5, paused=False)
    schedule.delivered(1)
    assert schedule.due(100.5, paused=False)
    assert not schedule.due(100.5, paused=True)  # a delivery not over
    rows = schedule.begin(101.0)
    assert rows == CHECKPOINT_ROWS and schedule.rows == 0 and schedule.at == 101.0
    schedule.delivered(5)  # rows delivered while it runs
    schedule.finished(rows, (0, 10, 5))  # a reader's snapshot kept 5 frames: its rows due again
    assert (schedule.rows, schedule.complete, schedule.frames) == (CHECKPOINT_ROWS + 5, False, 10)
    assert not schedule.due(101.0 + CHECKPOINT_RETRY_SECONDS / 2, paused=False)
    assert schedule.due(101.0 + CHECKPOINT_RETRY_SECONDS, paused=False)
    rows = schedule.begin(102.0)
    schedule.finished(rows, (0, 10, 10))
    assert (schedule.rows, schedule.complete, schedule.frames) == (0, True, 10)
    schedule.finished(schedule.begin(103.0), None)  # it failed: tried again later
    assert not schedule.complete and schedule.frames == 0
    schedule.finished(schedule.begin(104.0), (0, -1, -1))  # not in WAL mode: nothing to copy
    assert schedule.complete and schedule.frames == 0


def test_the_watch_checkpoints_through_sqlite_and_the_wal_starts_over(tmp_path: Path) -> None:
    path = str(tmp_path / "m.db")
    store = open_store(f"sqlite:///{path}")
    watch = SqliteChangeWatch(path)
    try:
        store.register_stream(EVENTS)
        # Enough single-row commits for more than SQLite's 1000 frames (each writes the table's
        # pages and the heads' and the oracle's; stream tables have no index: storage.sqlite_order).
        rows = [[f"$e{i}", "!room", "m.type", None, None] for i in range(400)]
        for row in rows:
            store.append("events", [row], "w")
        size = os.path.getsize(path + "-wal")
        busy, frames, done = watch.checkpoint()
        assert busy == 0 and frames == done and frames >= 1000  # SQLite's default would have checkpointed
        # All checkpointed: the next writes start the WAL over (the file does not grow).
        for row in rows:
            store.append("events", [row], "w")
        assert os.path.getsize(path + "-wal") == size
        assert [r[1] for r in store.read_rows("events", 0, 1000, 1000)] == list(range(1, 801))
    finally:
        store.close()
        watch.close()


def test_a_database_not_in_wal_mode_is_harmless(tmp_path: Path) -> None:
    watch = SqliteChangeWatch(str(tmp_path / "plain.db"))
    try:
        assert watch.checkpoint() == (0, -1, -1)
    finally:
        watch.close()


def test_the_master_checkpoints_after_a_pass_once_enough_rows_came(env: Env) -> None:
    conn = env.connected()
    conn.send("REPLICATE events 0")
    env.follow()
    conn.commands()
    env.db.calls.clear()
    env.write("events", [event(1)])
    env.follow()
    assert "checkpoint" not in env.db.calls  # one row: not due
    env.write("events", [event(n) for n in range(2, CHECKPOINT_ROWS + 1)])
    env.follow()
    assert env.db.calls.count("checkpoint") == 1
    wal = _wal_size(env)
    # The next writes start the WAL over; no checkpoint until enough rows came again.
    env.write("events", [event(CHECKPOINT_ROWS + 1)])
    env.follow()
    env.follow()
    assert env.db.calls.count("checkpoint") == 1
    assert _wal_size(env) == wal
    # Every row went out once, in order, checkpoint or not.
    assert tokens(conn.commands()) == list(range(1, CHECKPOINT_ROWS + 2))


def test_the_master_checkpoints_when_a_while_went_by(env: Env) -> None:
    # Rows nobody takes live from this master (another may be delivering them): the timer's.
    env.write("events", [event(n) for n in range(1, CHECKPOINT_ROWS + 1)])
    env.follow()
    assert "checkpoint" not in env.db.calls
    env.advance_by(CHECKPOINT_SECONDS, step=1.0)
    assert env.db.calls.count("checkpoint") == 1


def test_one_checkpoint_at_a_time_and_the_watch_closed_after_it(env: Env) -> None:
    _checkpoint_held_after_live_rows(env)
    assert len(env.db.held) == 1
    env.write("events", [event(n) for n in range(CHECKPOINT_ROWS + 1, 2 * CHECKPOINT_ROWS + 1)])
    env.follow()  # another pass while it runs, rows enough: no second checkpoint
    assert len(env.db.held) == 1
    watch = env.master._watch
    assert isinstance(watch, SqliteChangeWatch)
    env.master.stop_following()
    assert watch._conn is not None  # still checkpointing: not closed under it
    env.db.release()
    assert watch._checkpointer is None and watch._conn is None
    assert env.master._checkpointing is None


def test_an_incomplete_checkpoint_is_tried_again_later(env: Env) -> None:
    _checkpoint_held_after_live_rows(env)
    env.db.held[0][3].callback((0, 10, 5))  # a reader's snapshot kept 5 frames
    env.db.held.clear()
    env.db.hold = False
    env.follow()
    assert env.db.calls.count("checkpoint") == 1  # not at once
    env.advance_by(CHECKPOINT_RETRY_SECONDS, step=0.05)
    assert env.db.calls.count("checkpoint") == 2


def test_no_checkpoint_while_a_connection_is_paused(env: Env) -> None:
    conn = env.connected()
    conn.send("REPLICATE events 0")
    env.follow()
    env.write("events", [event(n) for n in range(1, CHECKPOINT_ROWS + 1)])
    conn.proto.pauseProducing()  # its client has not taken what was written yet
    env.follow()
    env.follow()
    assert "checkpoint" not in env.db.calls
    conn.proto.resumeProducing()
    env.follow()
    assert env.db.calls.count("checkpoint") == 1
    assert tokens(conn.commands()) == list(range(1, CHECKPOINT_ROWS + 1))


def test_a_large_wal_is_checkpointed_again_until_a_write_started_it_over(env: Env) -> None:
    _checkpoint_held_after_live_rows(env)
    # Every frame copied, but the WAL was not started over (a write beside a read): again later.
    env.db.held.pop()[3].callback((0, 5 * CHECKPOINT_FRAMES, 5 * CHECKPOINT_FRAMES))
    env.follow()
    assert env.db.calls.count("checkpoint") == 1 and not env.db.held
    env.advance_by(CHECKPOINT_RETRY_SECONDS, step=0.05)
    assert env.db.calls.count("checkpoint") == 2
    env.db.held.pop()[3].callback((0, 3, 3))  # started over: a few frames
    env.advance_by(3 * CHECKPOINT_RETRY_SECONDS, step=0.05)
    assert env.db.calls.count("checkpoint") == 2
