"""Commits notified with their rows while a pass runs (``Master.notified``).

While the pass waits for its wake-up's answer they are sent at once (the
pass then uses its answer's rows only if they still start at the live token);
while it fans out they are held and sent when it ends, with no second pass.

The master is the real one on a SQLite store with :class:`ManualDB` (see
``test_protocol``): a pass's database call is held so a notification arrives
while the pass is in flight, as it does on PostgreSQL (``Master.notified``,
docs/time.md "the commit's own claim").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replication.master import MAX_HELD_COMMITS, MasterConfig
from replication.protocol import ProtocolConfig
from storage.contracts import CommittedRows
from tests.unit.test_protocol import Conn, Env, event, tokens


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    # One row per read: a pass with two rows to send reads the second while it fans out.
    made = Env(tmp_path, ProtocolConfig(), MasterConfig(server_name="unit", fanout_rows=1))
    yield made
    made.master.stop_following()
    made.store.close()


def subscribed(env: Env) -> Conn:
    env.write("events", [event(1)])
    env.follow()
    conn = env.connected()
    conn.send("REPLICATE events 1")
    assert conn.commands() == ["POSITION events master 1 1"]
    return conn


def commit(env: Env, claim: int | None = None) -> CommittedRows:
    """A row written to the store, and the notification its commit would send (PostgreSQL's, faked)."""
    (token,) = env.write("events", [event(2)])
    ((_, _, _, ts, values),) = env.store.read_rows_json("events", token - 1, token, 1)
    return CommittedRows("events", "writer", token if claim is None else claim, [(token, ts, values)])


def pass_in_flight(env: Env) -> tuple[Any, ...]:
    """A pass started and waiting for its database answer (taken before the next writes)."""
    env.db.hold = "_wake"
    env.master.notify()
    ((fn, args, kwargs, d),) = env.db.held
    env.db.held.clear()
    env.db.hold = False
    return fn(*args, **kwargs), d


def pass_fanning_out(env: Env, conn: Conn) -> None:
    """A pass that sent token 2 and reads token 3 (held) to send it next."""
    env.write("events", [event(2), event(3)])
    env.db.hold = "_read_encoded"
    env.master.notify()
    assert tokens(conn.commands()) == [2]
    assert env.db.held and env.master._following


def wakes(env: Env) -> int:
    return env.db.calls.count("_wake")


def test_rows_notified_while_a_pass_waits_for_its_answer_are_sent_at_once(env: Env) -> None:
    conn = subscribed(env)
    answer, d = pass_in_flight(env)  # the pass's heads are read before the commit below
    before = wakes(env)
    env.master.notified(set(), [commit(env)])
    assert tokens(conn.commands()) == [2]  # not held behind the pass
    d.callback(answer)
    assert tokens(conn.commands()) == []  # the answer's older heads send nothing again
    assert wakes(env) == before  # sent from the notification, no read
    assert env.master.live_token("events") == 2


def test_an_answer_whose_rows_start_below_the_live_token_is_read_again_from_it(env: Env) -> None:
    conn = subscribed(env)
    env.db.hold = "_wake"
    env.master.notify()
    two = commit(env)
    env.write("events", [event(3)])  # committed before the pass reads, notified only later
    env.master.notified(set(), [two])  # token 2 goes out while the pass waits
    assert tokens(conn.commands()) == [2]
    env.db.release()  # its answer: heads 3, rows (1, 2]: stale, token 3 is read again
    assert tokens(conn.commands()) == [3]
    assert env.db.calls.count("_read_encoded") == 1
    assert env.master.live_token("events") == 3


def test_rows_notified_while_a_pass_fans_out_are_sent_when_it_ends_without_a_second_pass(env: Env) -> None:
    conn = subscribed(env)
    pass_fanning_out(env, conn)
    before = wakes(env)
    env.master.notified(set(), [commit(env)])  # token 4
    assert tokens(conn.commands()) == []  # held while the pass fans out
    env.db.release()
    assert tokens(conn.commands()) == [3, 4]
    assert wakes(env) == before  # sent from the notification, no read
    assert env.master.live_token("events") == 4


def test_commits_held_already_keep_later_ones_behind_them_while_the_next_pass_waits(env: Env) -> None:
    conn = subscribed(env)
    pass_fanning_out(env, conn)
    env.master.notified(set(), [commit(env)])  # token 4: held
    env.master.notified({"events"}, [])  # a plain notification: a second pass follows
    ((fn, args, kwargs, d),) = env.db.held
    env.db.held.clear()
    env.db.hold = "_wake"
    d.callback(fn(*args, **kwargs))  # token 3 sent; the second pass waits for its answer
    assert tokens(conn.commands()) == [3]
    assert env.master._waking and len(env.master._held) == 1
    env.master.notified(set(), [commit(env)])  # token 5: not before token 4
    assert tokens(conn.commands()) == []
    env.db.release()
    assert tokens(conn.commands()) == [4, 5]
    assert env.master.live_token("events") == 5


def test_held_rows_that_do_not_follow_what_was_sent_make_a_pass_read_them(env: Env) -> None:
    conn = subscribed(env)
    answer, d = pass_in_flight(env)
    before = wakes(env)
    env.master.notified(set(), [commit(env, claim=1)])  # the claim does not cover the row
    d.callback(answer)
    assert wakes(env) == before + 1  # a pass read it
    assert tokens(conn.commands()) == [2]


def test_rows_the_pass_sent_already_are_not_sent_twice(env: Env) -> None:
    conn = subscribed(env)
    env.db.hold = "_wake"
    env.master.notify()
    committed = commit(env)  # before the pass reads: it sends the row itself
    env.master.notified(set(), [committed])
    env.db.release()
    assert tokens(conn.commands()) == [2]
    env.master.notified(set(), [committed])
    assert tokens(conn.commands()) == []


def test_held_commits_are_bounded(env: Env) -> None:
    conn = subscribed(env)
    pass_fanning_out(env, conn)
    first = commit(env)
    env.master.notified(set(), [first] * MAX_HELD_COMMITS)
    assert len(env.master._held) == MAX_HELD_COMMITS
    env.master.notified(set(), [first])  # one more: none held, a pass reads them
    assert env.master._held == []
    env.db.release()
    assert tokens(conn.commands()) == [3, 4]


def test_rows_sent_from_a_notification_are_followed_by_a_tick_at_their_last_timestamp(env: Env) -> None:
    env.write("events", [event(1)])
    env.follow()
    conn = env.connected()
    conn.send("OPTIONS tick ts", "REPLICATE events 1")
    env.follow()
    conn.commands()
    committed = commit(env)
    token, ts, _ = committed.rows[0]
    env.master.notified(set(), [committed])
    lines = conn.commands()
    assert [line.split(" ")[0] for line in lines] == ["RDATA", "TICK"]
    assert lines[1] == f"TICK events {token} {ts}"
    env.master.notified(set(), [committed])  # nothing new: no second TICK
    assert conn.commands() == []
