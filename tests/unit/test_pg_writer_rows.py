"""PostgreSQL: ``tickline_writers`` holds the live writers only, and no epoch is ever live twice.

Every process that writes registers a row (its name carries host, pid and a
nonce). Rows of writers that left (``retire_writers``, ``tickline write`` at
exit) or were declared dead are deleted, so the table, which every single-row
append's claim scans, does not grow with the number of processes that ever
wrote. That is safe because a registration's epoch comes from one sequence: a
late statement of a deleted row's epoch finds no row and is fenced off, even
after the same process registered again. Rows of earlier versions (epochs
below ``EPOCH_BASE``, 1 and up) are only marked dead, as they were.
"""

from __future__ import annotations

import pytest

from replication.streams import EVENTS
from storage.pg_store import EPOCH_BASE, Fenced
from storage.store import open_store
from tests.pg_sql import query
from tests.stores import pg_store

ROW = ["$a", "!r", "m.room.message", None, None]


def _writer_rows(url: str) -> list[tuple]:
    return query(url, "SELECT instance_name, epoch, alive FROM tickline_writers ORDER BY instance_name")


@pytest.fixture
def url(pg_url: str) -> str:
    store = open_store(pg_url)
    store.register_stream(EVENTS)
    store.close()
    return pg_url


def test_writers_that_leave_leave_no_row(url) -> None:
    tokens = []
    for _ in range(20):  # twenty short-lived writer processes, as `tickline write` runs
        store = pg_store(open_store(url, report_interval=3600.0))
        tokens += store.append("events", [ROW], "w")
        assert len(_writer_rows(url)) == 1
        store.close()
    assert _writer_rows(url) == []
    assert tokens == list(range(1, 21))


def test_a_dead_writer_s_row_is_deleted_and_its_late_append_fenced_after_it_registered_again(url) -> None:
    store = pg_store(open_store(url, report_interval=3600.0))
    master = pg_store(open_store(url, report_interval=3600.0))
    try:
        first = store.append("events", [ROW], "w")
        old = store._writers[("events", "w")]
        assert old.epoch >= EPOCH_BASE
        query(url, "UPDATE tickline_writers SET heartbeat_ms = 0")
        assert master.safe_positions(expire_writers=True) == {"events": first[0]}
        assert _writer_rows(url) == []  # declared dead: deleted
        # The same process registers again (another instance name of it, then this one).
        store.append("events", [ROW], "w")
        again = store._writers[("events", "w")]
        assert again.epoch > old.epoch
        # A statement still carrying the dead epoch (a stalled transaction) is fenced off.
        store._writers[("events", "w")] = old
        with pytest.raises(Fenced):
            store._append_one_statement("events", [ROW], "w", False)
        store._writers[("events", "w")] = again  # its live registration, retired at close
    finally:
        master.close()
        store.close()
    assert _writer_rows(url) == []


def test_rows_of_earlier_versions_are_marked_dead_not_deleted(url) -> None:
    query(
        url,
        "INSERT INTO tickline_writers (stream, instance_name, epoch, position, heartbeat_ms, alive) "
        "VALUES ('events', 'old/h:1:x', 1, 0, 0, TRUE), ('events', 'old/h:2:y', 3, 0, 0, FALSE)",
    )
    master = pg_store(open_store(url, report_interval=3600.0))
    try:
        master.safe_positions(expire_writers=True)
    finally:
        master.close()
    # A deleted row of an earlier version could be registered again at epoch 1, which a
    # stalled transaction of it may still carry; so it stays, dead, its epoch moved on.
    assert _writer_rows(url) == [("old/h:1:x", 2, False), ("old/h:2:y", 3, False)]


def test_the_epoch_sequence_made_by_processes_at_once_is_made_once(pg_server) -> None:
    """``migrate`` creates the epoch sequence under the oracle's lock: IF NOT EXISTS alone lets two
    sessions both create it, and one fails with a unique violation (without the lock, about half
    of these rounds failed so). Ten new databases, four sessions each, started together."""
    import threading

    from storage.pg_db import PgDatabase
    from storage.pg_store import _create_writer_epochs

    for _ in range(10):
        url = pg_server.new_database()
        databases = [PgDatabase(url) for _ in range(4)]
        for database in databases:
            database.connection()  # connected before the barrier: the creations meet
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)

        def create(database: PgDatabase, errors: list = errors, barrier=barrier) -> None:
            barrier.wait(10)
            try:
                database.write(_create_writer_epochs)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=create, args=(database,)) for database in databases]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for database in databases:
            database.close()
        assert errors == []
        assert query(url, "SELECT last_value FROM tickline_writer_epochs") == [(EPOCH_BASE,)]


def test_a_writer_that_cannot_retire_closes_without_an_error(url, caplog) -> None:
    """Retiring is best effort (the master drops a silent writer after writer_timeout): a close with
    the server gone must not replace the error of the write that failed before it."""
    store = pg_store(open_store(url, report_interval=3600.0))
    store.append("events", [ROW], "w")
    # The server gone for this database: its sessions ended, no new one accepted (a closed idle
    # connection alone is replaced before the retirement is sent: pg_db.closed_while_idle).
    admin = url.rsplit("/", 1)[0] + "/postgres"
    name = url.rsplit("/", 1)[1].split("?")[0]
    query(admin, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
    try:
        query(
            admin,
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE application_name = 'tickline'",
        )
        store.close()
    finally:
        query(admin, f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
    assert "not retired" in caplog.text
