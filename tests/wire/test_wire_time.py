"""Time on the wire: REPLICATE <stream> @<unix_ms> and TICK (OPTIONS tick), on real sockets."""

from __future__ import annotations

import time

import orjson
import pytest

from storage.tso import compose, physical_ms

TICK_CONFIG = "master:\n  tick_interval: 0.1\n"


def row(n: int) -> list:
    return [f"$e{n}", "!r", "t", None, None]


def rdata(lines: list[str]) -> list[tuple[int, list]]:
    out = []
    for line in lines:
        if line.startswith("RDATA "):
            _, _stream, _inst, token, body = line.split(" ", 4)
            out.append((int(token) if token != "batch" else -1, orjson.loads(body)))
    return out


def collect(client, until, timeout: float = 10.0) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        line = client.try_line(max(0.0, deadline - time.monotonic()))
        assert line is not None, f"timed out; got {lines[-5:]}"
        if line.startswith("PING"):
            continue
        lines.append(line)
        if until(line):
            return lines


def stored(m, stream: str = "events") -> list[tuple[int, int]]:
    from storage.store import open_store

    store = open_store(m.database)
    try:
        return [(r[1], r[3]) for r in store.read_rows(stream, 0, 10**12, 10**9)]
    finally:
        store.close()


def test_replicate_at_a_time_answers_the_token_before_and_replays_from_there(master, db_url) -> None:
    m = master(database=db_url)
    for n in range(3):
        m.append("events", [row(n)])
    time.sleep(0.01)  # the instant must fall strictly between two rows' milliseconds
    cut_ms = int(time.time() * 1000)
    time.sleep(0.01)
    tokens = [m.append("events", [row(n)])[0] for n in range(3, 6)]
    rows = stored(m)
    expected = [token for token, ts in rows if physical_ms(ts) >= cut_ms]
    assert expected == tokens
    client = m.connect()
    client.handshake()
    client.send("OPTIONS ts live", f"REPLICATE events @{cut_ms}")
    assert client.expect("OPTIONS") == "OPTIONS live ts"
    position = client.expect("POSITION")
    assert position.split()[1:] == ["events", "master", str(tokens[0] - 1), str(tokens[0] - 1)]
    lines = collect(client, lambda line: line.startswith("POSITION"))
    got = rdata(lines)
    assert [t for t, _ in got] == tokens
    assert all(physical_ms(body[-1]) >= cut_ms for _, body in got)
    # Then live.
    (new,) = m.append("events", [row(9)])
    assert rdata(collect(client, lambda line: line.startswith("RDATA")))[0][0] == new


def test_replicate_at_a_time_before_all_rows_and_after_all_rows(master) -> None:
    m = master()
    m.append("events", [row(n) for n in range(4)], batch=True)
    client = m.connect()
    client.handshake()
    client.send("OPTIONS live", "REPLICATE events @0")
    assert client.expect("OPTIONS") == "OPTIONS live"
    assert client.expect("POSITION").split()[3] == "0"
    lines = collect(client, lambda line: line.startswith("POSITION"))
    assert [line.split()[3] for line in lines if line.startswith("RDATA")] == ["batch"] * 3 + ["1"]
    future = int(time.time() * 1000) + 60_000
    other = m.connect()
    other.handshake()
    other.send(f"REPLICATE events @{future}")
    assert other.expect("POSITION").split()[3:] == ["1", "1"]


@pytest.mark.parametrize("since_ms", [1 << 45, (1 << 63) - 1])
def test_replicate_at_an_instant_past_what_a_row_can_hold_answers_the_live_token(master, db_url, since_ms) -> None:
    """From 2**45 ms on (year 3084) ``ms << 18`` no longer fits a 64-bit column: still after every row."""
    m = master(database=db_url)
    m.append("events", [row(n) for n in range(2)])
    client = m.connect()
    client.handshake()
    client.send(f"REPLICATE events @{since_ms}")
    assert client.expect("POSITION").split()[1:] == ["events", "master", "2", "2"]
    (new,) = m.append("events", [row(9)])
    assert rdata(collect(client, lambda line: line.startswith("RDATA")))[0][0] == new


@pytest.mark.parametrize(
    "line, error",
    [
        ("REPLICATE events @", "@<unix_ms> must be a non-negative integer"),
        ("REPLICATE events @-5", "@<unix_ms> must be a non-negative integer"),
        ("REPLICATE events @12x", "@<unix_ms> must be a non-negative integer"),
        ("REPLICATE nosuch @5", "unknown stream 'nosuch'"),
    ],
)
def test_replicate_at_bad_input(master, line: str, error: str) -> None:
    m = master()
    client = m.connect()
    client.handshake()
    client.send(line)
    assert error in client.expect("ERROR")
    client.send("PING 1")  # the connection stays usable


def test_tick_only_for_clients_that_ask(master, db_url) -> None:
    m = master(TICK_CONFIG, database=db_url)
    m.append("events", [row(0)])
    seed = m.connect()
    seed.handshake()
    seed.send("REPLICATE")
    ticking = m.connect()
    ticking.handshake()
    ticking.send("OPTIONS tick", "REPLICATE events 0")
    assert ticking.expect("OPTIONS") == "OPTIONS tick"
    lines = collect(ticking, lambda line: line.startswith("TICK"))
    assert rdata(lines)[0][0] == 1
    first = lines[-1].split()
    assert first[:3] == ["TICK", "events", "1"]
    # Idle: the safe time keeps advancing, at least every tick_interval (0.1 s).
    seen = [int(first[3])]
    start = time.monotonic()
    while len(seen) < 6:
        tick = collect(ticking, lambda line: line.startswith("TICK events"))[-1].split()
        assert tick[2] == "1"
        seen.append(int(tick[3]))
    elapsed = time.monotonic() - start
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert elapsed < 5 * 0.1 + 1.0
    assert physical_ms(seen[-1]) <= time.time() * 1000 + 5
    # A write: its row comes first, then a tick at or above its timestamp.
    (token,) = m.append("events", [row(1)])
    lines = collect(ticking, lambda line: line.startswith(f"TICK events {token} "))
    assert [t for t, _ in rdata(lines)] == [token]
    (row_ts,) = [t for tok, t in stored(m) if tok == token]
    assert int(lines[-1].split()[3]) >= row_ts
    # The seed client saw the row and no TICK at all.
    seen_by_seed = []
    while (line := seed.try_line(0.3)) is not None:
        seen_by_seed.append(line)
    assert any(line.startswith("RDATA events") for line in seen_by_seed)
    assert not any(line.startswith("TICK") for line in seen_by_seed)


def test_tick_is_a_server_command_only(master) -> None:
    m = master()
    client = m.connect()
    client.handshake()
    client.send("TICK events 1 2")
    assert "TICK may not be sent by the client" in client.expect("ERROR")
    client.send("OPTIONS tock tick")
    assert client.expect("OPTIONS") == "OPTIONS tick"  # an unknown option is not acknowledged


def test_compose_round_trip() -> None:
    assert physical_ms(compose(1234, 5)) == 1234


def test_tick_never_passes_a_row_still_in_flight_on_postgresql(master, pg_url) -> None:
    """Writer A holds a row open; B commits after it: no TICK may claim A's row's time."""
    from tests.integration.test_timeticks import writer

    m = master(TICK_CONFIG, database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("OPTIONS tick", "REPLICATE events 0")
    assert client.expect("OPTIONS") == "OPTIONS tick"
    collect(client, lambda line: line.startswith("TICK events"))
    a = writer(pg_url, "A", "hold")
    assert a.stdin is not None and a.stdout is not None  # both pipes
    try:
        held = int(a.stdout.readline().split()[1])
        (b_token,) = m.append("events", [row(2)], instance="B")
        assert b_token == held + 1
        ticks = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            line = client.try_line(0.1)
            if line and line.startswith("TICK events"):
                ticks.append(line.split())
            assert line is None or not line.startswith("RDATA"), line  # nothing passes the open row
        # The safe time stays below the open row (it may stop moving meanwhile).
        a.stdin.write("commit\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "COMMITTED"
    finally:
        if a.poll() is None:
            a.stdin.close()
            a.wait(10)
    lines = collect(client, lambda line: line.startswith("TICK events") and int(line.split()[2]) >= b_token)
    times = dict(stored(m))
    assert all(int(t[3]) < times[held] for t in ticks), (ticks, times)
    assert [t for t, _ in rdata(lines)] == [held, b_token]
    assert int(lines[-1].split()[3]) >= times[b_token] > times[held]


def test_tick_keeps_moving_after_a_rolled_back_write_once_its_writer_left(master, pg_url) -> None:
    """A rolled-back transaction burns a token; with no live writer left the safe time must not stall."""
    from storage.store import open_store

    m = master(TICK_CONFIG, database=pg_url)
    store = open_store(pg_url)
    store.append("events", [row(1)], "X")
    try:
        with store.writing("events", "X") as txn:
            txn.append([row(2)])
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    store.close()  # the writer leaves: no live writer, a burned token above the last row
    client = m.connect()
    client.handshake()
    client.send("OPTIONS tick", "REPLICATE events 0")
    assert client.expect("OPTIONS") == "OPTIONS tick"
    later_ms = int(time.time() * 1000) + 300
    lines = collect(
        client, lambda line: line.startswith("TICK events") and physical_ms(int(line.split()[3])) >= later_ms
    )
    assert [t for t, _ in rdata(lines)] == [1]


def test_an_idle_stream_ticks_on_while_another_is_written_with_no_allocation_on_postgresql(master, pg_url) -> None:
    """While events is written, caches (idle) gets a TICK each interval from the oracle's mark, no durable commit.

    The timer's allocation (a write of ``tickline_tso``) is left out while
    commits move the mark; once they stop, it resumes (docs/time.md, "How the
    master gets it").
    """
    from storage.store import open_store
    from tests.integration.procs import query_pg

    def allocated() -> int:
        return int(query_pg(pg_url, "SELECT last_ts FROM tickline_tso WHERE id = 1")[0][0])

    m = master(TICK_CONFIG, database=pg_url)
    client = m.connect()
    client.handshake()
    client.send("OPTIONS tick", "REPLICATE events 0", "REPLICATE caches 0")
    assert client.expect("OPTIONS") == "OPTIONS tick"
    collect(client, lambda line: line.startswith("TICK caches"))
    store = open_store(pg_url)
    caches: list[tuple[float, int]] = []  # (arrival, safe time)
    try:
        start = time.monotonic()
        allocated_early = None
        while (now := time.monotonic()) < start + 2.0:
            store.append("events", [row(int(now * 1000))], "W")
            if allocated_early is None and now > start + 0.5:
                allocated_early = allocated()
            while (line := client.try_line(0.005)) is not None:
                if line.startswith("TICK caches"):
                    caches.append((time.monotonic(), int(line.split()[3])))
        allocated_late = allocated()
        (last_ts,) = [ts for _, ts in stored(m)][-1:]
    finally:
        store.close()
    # No fresh timestamp was allocated once the writes flowed (about 15 timer passes) ...
    assert allocated_early is not None and allocated_late == allocated_early
    # ... and the idle stream's safe time moved on all along, about every interval.
    times = [ts for _, ts in caches]
    assert times == sorted(set(times)) and len(times) >= 8, caches
    gaps = [b - a for (a, _), (b, _) in zip(caches, caches[1:], strict=False)]
    assert max(gaps) < 1.0, gaps
    # Writes stopped: the timer allocates again, and caches ticks past the last row.
    collect(client, lambda line: line.startswith("TICK caches") and int(line.split()[3]) > last_ts)
    deadline = time.monotonic() + 5.0
    while allocated() == allocated_late:
        assert time.monotonic() < deadline, "no allocation once the writes stopped"
        client.try_line(0.05)


def test_replicate_at_a_time_inside_a_batch_appended_in_steps_sends_the_whole_batch(master, db_url) -> None:
    """A batch whose steps fall on both sides of the instant is replayed whole: a client applies a
    batch as one, so part of it would be applied as if it were all."""
    from storage.store import open_store

    m = master(database=db_url)
    (before,) = m.append("events", [row(0)])
    store = open_store(m.database)
    try:
        with store.writing("events", "writer") as txn:
            (batch, *_) = txn.append([row(n) for n in range(1, 4)], batch=True)
            time.sleep(0.01)  # the instant strictly between the two steps' milliseconds
            cut_ms = int(time.time() * 1000)
            time.sleep(0.01)
            assert set(txn.append([row(n) for n in range(4, 6)], batch=True)) == {batch}
    finally:
        store.close()
    (after,) = m.append("events", [row(6)])
    assert [physical_ms(ts) >= cut_ms for token, ts in stored(m) if token == batch] == [False] * 3 + [True] * 2
    client = m.connect()
    client.handshake()
    client.send(f"REPLICATE events @{cut_ms}")
    assert client.expect("POSITION").split()[3:] == [str(before), str(before)]
    lines = collect(client, lambda line: line.startswith("RDATA") and line.split()[3] == str(after))
    got = [(line.split()[3], orjson.loads(line.split(" ", 4)[4])[0]) for line in lines if line.startswith("RDATA")]
    assert got == [("batch", f"$e{n}") for n in range(1, 5)] + [(str(batch), "$e5"), (str(after), "$e6")]
