"""When the timer's pass takes a fresh oracle timestamp, and when the oracle's mark does (``TimeTicker``).

While commits flow they move the oracle's mark, so a pass that reads it
moves every idle stream's safe time on without a durable allocation (docs/time.md,
"How the master gets it"); with nothing written the timer allocates, so idle
streams' safe time follows the clock. The master is the real one on a SQLite
store with :class:`ManualDB` on Twisted's clock (see ``test_protocol``); commits
arrive as PostgreSQL's notifications with their rows would (``Master.notified``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from replication.master import MasterConfig
from replication.protocol import ProtocolConfig
from storage import time_index
from storage.contracts import CommittedRows
from storage.sqlite_store import SqliteStreamStore
from tests.unit.test_protocol import Conn, Env, event

INTERVAL = 0.2
STEP = 0.05  # between commits; the timer fires every INTERVAL / STEP steps


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    made = Env(tmp_path, ProtocolConfig(), MasterConfig(server_name="unit", tick_interval=INTERVAL))
    yield made
    made.master.stop_following()
    made.store.close()


def ticking(env: Env) -> Conn:
    """A connection with ``OPTIONS tick``, live on ``events`` (written) and ``caches`` (idle)."""
    conn = env.connected()
    conn.send("OPTIONS tick", "REPLICATE events 0", "REPLICATE caches 0")
    env.advance_by(INTERVAL, STEP)
    conn.commands()
    return conn


def ticks(conn: Conn, stream: str) -> list[int]:
    """The safe times of the ``TICK`` lines for ``stream`` written since the last look."""
    return [int(line.split()[3]) for line in conn.commands() if line.startswith(f"TICK {stream} ")]


def mark(env: Env) -> int:
    """The oracle's high-water mark (SQLite: moved by appends and by the timer's allocations)."""
    assert isinstance(env.store, SqliteStreamStore)
    return time_index.oracle_last(env.store)


def commit(env: Env, i: int) -> int:
    """A row written to events and its commit's notification (PostgreSQL's, faked): its timestamp."""
    (token,) = env.write("events", [event(i)])
    ((_, _, _, ts, values),) = env.store.read_rows_json("events", token - 1, token, 1)
    env.master.notified(set(), [CommittedRows("events", "writer", token, [(token, ts, values)])])
    return int(ts)


def test_while_all_is_idle_the_timer_allocates_a_fresh_time_every_interval(env: Env) -> None:
    conn = ticking(env)
    seen = []
    for _ in range(5):
        before = mark(env)
        env.advance_by(INTERVAL, STEP)
        assert mark(env) > before  # nothing was written: the oracle moved by the timer's allocation
        (tick,) = ticks(conn, "caches")
        seen.append(tick)
    assert seen == sorted(set(seen))


def test_while_commits_flow_no_allocation_and_the_idle_stream_still_ticks_each_interval(env: Env) -> None:
    conn = ticking(env)
    commit(env, 0)  # the first interval's decision sees writes from here on
    env.advance_by(INTERVAL, STEP)
    conn.commands()
    last_tick = -1
    for n in range(10):
        written = []
        for i in range(round(INTERVAL / STEP)):
            written.append(commit(env, 10 * n + i))
            env.reactor.advance(STEP)
            # No durable allocation: the oracle's mark is the last commit's timestamp ...
            assert mark(env) == written[-1]
        # ... and the idle stream got a TICK in this interval at or above a commit of it,
        # above its last one (the timer's pass read the mark).
        got = ticks(conn, "caches")
        assert got, f"no TICK for the idle stream in interval {n}"
        assert got[-1] > last_tick and got[-1] >= written[0]
        last_tick = got[-1]


def test_once_commits_stop_the_timer_allocates_again(env: Env) -> None:
    conn = ticking(env)
    commit(env, 0)
    env.advance_by(INTERVAL, STEP)
    for i in range(8):
        last = commit(env, i)
        env.reactor.advance(STEP)
        assert mark(env) == last
    ticks(conn, "caches")
    env.advance_by(2 * INTERVAL, STEP)  # the decision after the writes sees none: a fresh time
    assert mark(env) > last
    got = ticks(conn, "caches")
    assert got and got[-1] > last


def test_a_write_the_timer_pass_has_covered_does_not_skip_the_next_allocation(env: Env) -> None:
    """A stream written once and then idle: its own write is no reason to skip (it is not newer)."""
    conn = ticking(env)
    last = commit(env, 0)
    env.advance_by(INTERVAL, STEP)  # a decision that skips (the write is newer than the idle streams' time)
    ticks(conn, "caches")
    before = mark(env)
    assert before == last
    env.advance_by(INTERVAL, STEP)  # nothing new written: every stream's safe time covers the write
    assert mark(env) > before
