"""The timestamp oracle: layout, monotonic under clock steps, across processes and restarts."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from replication.streams import EVENTS
from scripts.pg_local import PostgresServer
from storage import tso
from storage.store import open_store
from tests.stores import pg_store


class SteppingClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def test_layout_46_physical_and_18_logical_bits() -> None:
    ts = tso.compose(1_700_000_000_000, 5)
    assert tso.physical_ms(ts) == 1_700_000_000_000
    assert tso.logical(ts) == 5
    assert ts < 2**64
    assert tso.LOGICAL_BITS == 18 and tso.PHYSICAL_BITS == 46
    with pytest.raises(ValueError):
        tso.compose(1, 1 << 18)


def test_allocate_follows_the_clock_when_it_moves_forward() -> None:
    last = tso.compose(1000, 7)
    assert tso.allocate(last, 2000) == tso.compose(2000, 0)


def test_allocate_counts_on_when_the_clock_stands_still_or_steps_back() -> None:
    last = tso.compose(5000, 3)
    assert tso.allocate(last, 5000) == tso.compose(5000, 4)
    assert tso.allocate(last, 4000) == tso.compose(5000, 4)


def test_logical_overflow_carries_into_physical_and_stays_increasing() -> None:
    last = tso.compose(5000, tso.LOGICAL_MASK)
    first = tso.allocate(last, 5000, 3)
    assert first == last + 1
    assert tso.physical_ms(first) == 5001


def test_store_timestamps_keep_increasing_when_the_clock_steps_back_10s(db_url) -> None:
    clock = SteppingClock(1_800_000_000.0)
    store = open_store(db_url, clock=clock)
    store.register_stream(EVENTS)
    seen = []
    for step in (0.0, 0.001, -10.0, 0.0, 5.0, -10.0):
        clock.now += step
        seen += store.allocate_timestamps(3)
        store.append("events", [["$e", "!r", "t", None, None]], "w")
        seen.append(store.read_rows("events", 0, 10**9, 10**6)[-1][3])
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    # Physical part never went back with the clock.
    assert tso.physical_ms(seen[-1]) >= 1_800_000_000_000


def test_store_timestamps_survive_a_restart_with_an_earlier_clock(db_url) -> None:
    first = open_store(db_url, clock=SteppingClock(1_800_000_100.0))
    before = first.allocate_timestamps(5)
    first.close()
    again = open_store(db_url, clock=SteppingClock(1_800_000_000.0))  # 100 s earlier
    after = again.allocate_timestamps(5)
    assert min(after) > max(before)


def _allocate_many(url: str, count: int, queue) -> None:
    store = open_store(url)
    queue.put([ts for _ in range(count) for ts in store.allocate_timestamps(2)])


def test_timestamps_unique_and_ordered_across_processes(db_url) -> None:
    path = db_url
    open_store(db_url).close()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allocate_many, args=(path, 200, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    everything = [ts for result in results for ts in result]
    assert len(set(everything)) == len(everything) == 3 * 200 * 2
    for result in results:
        assert result == sorted(result)


@pytest.fixture
def own_pg_url() -> Iterator[str]:
    """A database on a server of its own: transaction ids are counted across a whole cluster,
    and on the session's server another test's process (a master's time ticks, ...) can take one
    while they are counted (seen once in a full run)."""
    server = PostgresServer()
    server.start()
    try:
        yield server.new_database()
    finally:
        server.stop()


def test_postgresql_append_is_one_transaction_with_the_oracle_in_it(own_pg_url) -> None:
    """One append assigns one transaction id: the oracle costs no commit of its own."""
    import psycopg2

    pg_url = own_pg_url

    store = open_store(pg_url, report_interval=3600.0)
    store.register_stream(EVENTS)
    store.append("events", [["$e", "!r", "t", None, None]], "w")  # registers the writer
    probe = psycopg2.connect(pg_url)
    probe.autocommit = True
    with probe.cursor() as cur:
        cur.execute("SELECT txid_current()")
        (before,) = cur.fetchone()
        for n in (1, 3, 500):  # small statements and COPY
            store.append("events", [["$e", "!r", "t", None, None]] * n, "w")
        cur.execute("SELECT txid_current()")
        (after,) = cur.fetchone()
    probe.close()
    store.close()
    assert after - before == 3 + 1  # three appends and the second probe


def test_ts_increases_with_the_token_across_writer_processes(db_url) -> None:
    open_store(db_url).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(db_url, f"w{i}", 150)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    store = open_store(db_url)
    rows = store.read_rows("events", 0, 10**9, 10**6)
    store.close()
    assert len(rows) == 3 * 150 * 4
    by_token = sorted((row[1], row[0], row[3]) for row in rows)
    stamps = [ts for _token, _seq, ts in by_token]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)


def _append_many(url: str, instance: str, count: int) -> None:
    store = open_store(url)
    store.register_stream(EVENTS)
    for i in range(count):
        # single rows, a batch, a big append by COPY now and then
        store.append("events", [["$e", "!r", "t", None, None]] * 3, instance, batch=i % 2 == 0)
        store.append("events", [["$e", "!r", "t", None, None]], instance)
    store.close()


def test_oracle_survives_a_postgresql_server_crash() -> None:
    """Server killed (immediate stop: WAL replay) and the clock a minute back: the oracle still goes up."""
    from scripts.pg_local import PostgresServer

    server = PostgresServer()
    server.start()
    try:
        url = server.new_database()
        import psycopg2

        admin = psycopg2.connect(url)
        admin.autocommit = True
        with admin.cursor() as cur:  # the test server commits asynchronously; durable here
            cur.execute(f"ALTER DATABASE {url.rsplit('/', 1)[1]} SET synchronous_commit = on")
        admin.close()
        clock = SteppingClock(1_900_000_000.0)
        store = pg_store(open_store(url, clock=clock, report_interval=3600.0))
        store.register_stream(EVENTS)
        store.append("events", [["$e", "!r", "t", None, None]] * 5, "w")
        store.append("events", [["$e", "!r", "t", None, None]] * 300, "w")
        last_row = store.read_rows("events", 0, 10**9, 10**6)[-1][3]
        before = store.allocate_timestamps(2)
        store.database.close()
        server._run(server._pg_ctl(), "-D", str(server.datadir / "data"), "-m", "immediate", "stop")
        server._launch()
        clock.now -= 60.0
        again = open_store(url, clock=clock, report_interval=3600.0)
        again.append("events", [["$e", "!r", "t", None, None]], "w")
        after = again.read_rows("events", 0, 10**9, 10**6)[-1][3]
        assert after > max(before) > last_row
        assert again.allocate_timestamps(1)[0] > after
        again.close()
    finally:
        server.stop()
