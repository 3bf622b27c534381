"""PostgreSQL: the single-row append's one call (allocation, position, claim) and the oracle's floor.

The allocation no longer reads ``tickline_tso.last_ts`` (the floor): a trigger
lifts the oracle's sequence to every new floor before it commits. A writer
declared dead cannot commit an append afterwards: the call's position update
finds no live row of its epoch, or waits for the fencing's commit and then
finds none (docs/time.md).
"""

from __future__ import annotations

import threading
import time

import psycopg2
import pytest

from replication.streams import EVENTS
from scripts.pg_local import PostgresServer
from storage import tso
from storage.pg_store import FLOOR_TRIGGER, ORACLE_SEQUENCE, Fenced, PgStreamStore
from storage.schema import RowError
from storage.store import open_store
from tests.integration.procs import wait_for
from tests.pg_sql import query
from tests.stores import pg_store

ROW = ["$a", "!r", "m.room.message", None, None]


@pytest.fixture
def store(pg_url):
    s = pg_store(open_store(pg_url, report_interval=3600.0))
    s.register_stream(EVENTS)
    yield s
    s.close()


def _admin(url: str):
    conn = psycopg2.connect(url)
    conn.autocommit = True
    return conn


def _far_floor() -> int:
    """A floor an hour ahead of the clock: only the floor can put the oracle there."""
    return tso.compose(int(time.time() * 1000) + 3_600_000, 12)


def _stored_ts(store: PgStreamStore) -> list[int]:
    return [row[3] for row in store.read_rows("events", 0, 10**9, 10**6)]


@pytest.mark.parametrize("count", [1, 3])
def test_an_oracle_sequence_never_called_hands_out_its_next_value_first(store, pg_url, count) -> None:
    """``setval(..., false)``: the sequence's value is the next one (pg_sequence_last_value is NULL)."""
    ahead = _far_floor()
    with _admin(pg_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT setval(%s, %s, false)", (ORACLE_SEQUENCE, ahead))
    rows = [ROW] * count
    store.append("events", rows, "w")
    store.append("events", rows, "w")
    assert _stored_ts(store) == list(range(ahead, ahead + 2 * count))


def test_the_floor_moved_by_an_operator_is_respected_by_the_next_append(store, pg_url) -> None:
    store.append("events", [ROW], "w")
    floor = _far_floor()
    query(pg_url, "UPDATE tickline_tso SET last_ts = %s WHERE id = 1", (floor,))
    store.append("events", [ROW], "w")  # one statement (the append function)
    store.append("events", [ROW] * 3, "w", batch=True)  # one statement (the allocation function)
    store.append("events", [ROW] * 150, "w")  # COPY
    stamps = _stored_ts(store)
    assert stamps[0] < floor < stamps[1]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert store.allocate_timestamps(1)[0] > stamps[-1]


def test_a_large_append_s_proposal_below_a_new_floor_is_refused(store, pg_url) -> None:
    """The proposal's function does not read the floor either: a floor raised between two large
    appends lifts the sequence, so the writer's proposal (below it) is refused, and the rows are
    stamped above the floor by the usual allocation; later proposals are taken again."""
    rows = [ROW] * 150
    store.append("events", rows, "w")
    store.append("events", rows, "w")
    (state,) = store._writers.values()
    assert state.propose  # alone: the second append's proposal was taken
    floor = _far_floor()
    query(pg_url, "UPDATE tickline_tso SET last_ts = %s WHERE id = 1", (floor,))
    store.append("events", rows, "w")
    assert not state.propose  # refused, allocated as usual
    store.append("events", rows, "w")
    assert state.propose  # the usual allocation gave what a proposal would have: propose again
    store.append("events", rows, "w")
    assert state.propose  # proposed above the floor, and taken
    stamps = _stored_ts(store)
    assert max(stamps[:300]) < floor < min(stamps[300:])
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps) == 750


def test_a_floor_rolled_back_still_leaves_the_oracle_above_what_it_handed_out(store, pg_url) -> None:
    """setval is not transactional: the sequence stays lifted (timestamps skipped, never repeated)."""
    before = store.allocate_timestamps(1)[0]
    floor = _far_floor()
    conn = psycopg2.connect(pg_url)
    with conn.cursor() as cur:
        cur.execute("UPDATE tickline_tso SET last_ts = %s WHERE id = 1", (floor,))
    conn.rollback()
    conn.close()
    assert query(pg_url, "SELECT last_ts FROM tickline_tso")[0][0] < floor
    store.append("events", [ROW], "w")
    (ts,) = _stored_ts(store)
    assert ts > floor > before


def test_the_master_s_own_floor_does_not_take_the_oracle_s_lock(store, pg_url) -> None:
    """allocate_timestamps writes a floor the sequence has reached: the trigger's check is enough."""
    holder = _admin(pg_url)
    try:
        with holder.cursor() as cur:
            # Holding the oracle's lock blocks every allocation, so block only the trigger's path:
            # a floor below the sequence must not wait for the lock.
            cur.execute("SELECT last_value FROM " + ORACLE_SEQUENCE)
            (last,) = cur.fetchone()
            cur.execute("SELECT pg_advisory_lock(%s)", (0x74736F,))
            other = _admin(pg_url)
            with other.cursor() as cur2:
                cur2.execute("SET statement_timeout = 5000")
                cur2.execute("UPDATE tickline_tso SET last_ts = %s WHERE id = 1", (last,))  # returns at once
            other.close()
            cur.execute("SELECT pg_advisory_unlock(%s)", (0x74736F,))
    finally:
        holder.close()


def test_an_older_database_gets_the_floor_trigger_and_its_floor_on_migrate(pg_url) -> None:
    """A database made before the trigger: migrate creates it and lifts the sequence to the floor."""
    store = pg_store(open_store(pg_url, report_interval=3600.0))
    store.register_stream(EVENTS)
    store.close()
    query(pg_url, f"DROP TRIGGER {FLOOR_TRIGGER} ON tickline_tso")
    floor = _far_floor()
    query(pg_url, "UPDATE tickline_tso SET last_ts = %s WHERE id = 1", (floor,))  # no trigger: the sequence stays
    assert query(pg_url, f"SELECT last_value FROM {ORACLE_SEQUENCE}")[0][0] < floor
    again = pg_store(open_store(pg_url, report_interval=3600.0))  # migrates
    try:
        assert query(pg_url, "SELECT count(*) FROM pg_trigger WHERE tgname = %s", (FLOOR_TRIGGER,)) == [(1,)]
        again.append("events", [ROW], "w")
        (ts,) = _stored_ts(again)
        assert ts > floor
    finally:
        again.close()


def test_a_raised_floor_survives_a_server_crash() -> None:
    """The trigger's setval is flushed by the floor's commit: after an immediate stop the oracle is above it."""
    server = PostgresServer()
    server.start()
    try:
        url = server.new_database()
        query(url, f"ALTER DATABASE {url.rsplit('/', 1)[1]} SET synchronous_commit = on")
        store = pg_store(open_store(url, report_interval=3600.0))
        store.register_stream(EVENTS)
        store.append("events", [ROW], "w")
        store.database.close()
        floor = _far_floor()
        query(url, "UPDATE tickline_tso SET last_ts = %s WHERE id = 1", (floor,))
        server._run(server._pg_ctl(), "-D", str(server.datadir / "data"), "-m", "immediate", "stop")
        server._launch()
        again = pg_store(open_store(url, report_interval=3600.0))
        again.append("events", [ROW], "w")
        assert _stored_ts(again)[-1] > floor
        again.close()
    finally:
        server.stop()


def test_a_fenced_writer_s_single_row_append_fails_and_writes_nothing(store, pg_url) -> None:
    first = store.append("events", [ROW], "w")
    state = store._writers[("events", "w")]
    query(pg_url, "UPDATE tickline_writers SET heartbeat_ms = 0")
    other = open_store(pg_url)
    try:
        other.safe_positions(expire_writers=True)  # the master's sweep: this writer is dead
    finally:
        other.close()
    with pytest.raises(Fenced):
        store._append_one_statement("events", [ROW], "w", False)  # the one statement, no retry
    assert store.read_rows("events", 0, 10**9, 10) == store.read_rows("events", 0, first[0], 10)
    assert ("events", "w") not in store._writers  # registers again on its next write
    again = store.append("events", [ROW], "w")  # new epoch, new tokens
    assert again[0] > first[0] + 1  # the fenced attempt's token is skipped
    assert [r[1] for r in store.read_rows("events", 0, 10**9, 10)] == first + again
    assert store._writers[("events", "w")].epoch > state.epoch  # declared dead (its row deleted), then registered


def test_an_append_racing_the_fencing_waits_for_it_and_commits_nothing(store, pg_url) -> None:
    """The fencing holds the writer's row; the append's position update waits, then finds it dead."""
    first = store.append("events", [ROW], "w")
    fencer = psycopg2.connect(pg_url)
    try:
        with fencer.cursor() as cur:
            cur.execute("UPDATE tickline_writers SET alive = FALSE, epoch = epoch + 1 WHERE stream = 'events'")
        outcome: list[object] = []

        def append() -> None:
            try:
                outcome.append(store._append_one_statement("events", [ROW], "w", False))
            except Exception as e:  # the outcome is checked below
                outcome.append(e)

        thread = threading.Thread(target=append)
        thread.start()
        wait_for(
            lambda: query(pg_url, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")[0][0] == 1,
            10,
            "the append to wait for the writer's row",
        )
        fencer.commit()
        thread.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], Fenced)
    finally:
        fencer.close()
    assert [r[1] for r in store.read_rows("events", 0, 10**9, 10)] == first
    again = store.append("events", [ROW], "w")
    assert [r[1] for r in store.read_rows("events", 0, 10**9, 10)] == first + again


@pytest.mark.parametrize("count", [1, 3, 20])
def test_an_instance_name_with_quotes_backslashes_and_percent_signs(store, count) -> None:
    """The writer's names are written into its statement as literals (prepared up to 8 rows, then not)."""
    instance = "w%s'x\\y%"
    notifier = store.notifier()
    try:
        tokens = store.append("events", [ROW] * count, instance)
        again = store.append("events", [ROW] * count, instance)
        stored = store.read_rows("events", 0, 10**9, 100)
        assert [r[1] for r in stored] == tokens + again == list(range(1, 2 * count + 1))
        assert {r[2] for r in stored} == {instance}
        committed: list = []

        def both() -> bool:
            committed.extend(notifier.drain_committed()[1])
            return len(committed) == 2

        wait_for(both, 10, "both notifications")
        assert [(c.stream, c.instance, c.safe) for c in committed] == [
            ("events", instance, count),
            ("events", instance, 2 * count),
        ]
        assert [token for c in committed for token, _, _ in c.rows] == tokens + again
    finally:
        notifier.close()


def test_single_row_appends_from_threads_of_one_writer_each_take_their_own_connection(store) -> None:
    """The single-row plan is shared by threads; its statement is prepared per connection (each thread's own)."""
    store.append("events", [ROW], "w")
    tokens: list[int] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(200):
                tokens.extend(store.append("events", [ROW], "w"))
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(tokens) == len(set(tokens)) == 600
    stored = [row[1] for row in store.read_rows("events", 0, 10**9, 10**6)]
    assert sorted(tokens) == stored[1:]


def test_a_bad_single_row_is_refused_as_row_1_and_writes_nothing(store) -> None:
    store.append("events", [ROW], "w")
    with pytest.raises(RowError, match=r"row 1: .*may not be null"):
        store.append("events", [[None, "!r", "m.room.message", None, None]], "w")
    with pytest.raises(RowError, match="bad instance name"):
        store.append("events", [ROW], "two words")
    assert len(store.read_rows("events", 0, 10**9, 10**6)) == 1


@pytest.mark.parametrize("count", [1, 3])
def test_a_writer_whose_idle_connections_were_terminated_reconnects_before_its_next_append(
    store, pg_url, count
) -> None:
    """The single-row path (``_append_row``) and the transaction's path find an idle connection closed
    by its server before they send anything on it (``pg_db.closed_while_idle``): the next append is
    written on a new connection, no error, nothing half written. (A connection lost once a statement
    was sent: tests/unit/test_pg_write_commit_unknown.py.)"""
    store.append("events", [ROW] * count, "w")
    backends = query(
        pg_url,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND backend_type = 'client backend'",
    )
    for (pid,) in backends:
        query(pg_url, "SELECT pg_terminate_backend(%s)", (pid,))
    wait_for(
        lambda: not query(pg_url, "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", ([p for (p,) in backends],)),
        10.0,
        "the writer's backends to end",
    )
    tokens = store.append("events", [ROW] * count, "w")
    stored = [row[1] for row in store.read_rows("events", 0, 10**9, 10**6)]
    assert len(stored) == len(set(stored)) == 2 * count
    assert stored[-count:] == tokens
