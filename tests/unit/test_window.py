"""The window of recent rows and shared replay reads: bounded bytes, whole
tokens, replays served from memory or storage, concurrent reads shared, and a
lagging live connection that stays in (or drops out of) the shared fan-out."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import defer

from replication.master import MasterConfig
from replication.protocol import ProtocolConfig
from replication.rows import encode_json_rows
from replication.streams import EVENTS
from replication.window import CHUNK_OVERHEAD, Read, RecentWindow, SharedReads, WindowFiller
from tests.unit.test_protocol import Env, event, rdata, tokens


def rows_bytes(first: int, last: int, batch_of: int = 1, ts: bool = False) -> bytes:
    """RDATA lines for tokens first..last, each token holding ``batch_of`` rows."""
    rows = []
    seq = 0
    for token in range(first, last + 1):
        for _ in range(batch_of):
            seq += 1
            rows.append((seq, token, b"w", 1000 + token, b'["r%d"]' % token))
    return encode_json_rows("s", rows, ts)[0]


def test_window_reads_whole_chunks_and_joins_them() -> None:
    w = RecentWindow(1 << 20)
    w.append("s", 0, 3, 3, {False: rows_bytes(1, 3)})
    w.append("s", 3, 5, 2, {False: rows_bytes(4, 5)})
    assert w.read("s", 0, 5, 100, False) == (rows_bytes(1, 5), 5, 5)
    assert w.read("s", 0, 5, 2, False) == (rows_bytes(1, 3), 3, 3)  # a chunk is never cut
    assert w.read("s", 3, 5, 100, False) == (rows_bytes(4, 5), 5, 2)
    assert w.read("s", 5, 5, 100, False) is None  # nothing after the end
    assert w.read("s", 0, 5, 100, True) is None  # a variant the fan-out did not encode
    assert w.read("other", 0, 5, 100, False) is None


def test_window_starts_inside_a_chunk_on_whole_tokens() -> None:
    w = RecentWindow(1 << 20)
    data = rows_bytes(1, 4, batch_of=3)  # every token a batch of 3 lines
    w.append("s", 0, 4, 12, {False: data})
    read = w.read("s", 2, 4, 100, False)
    assert read is not None
    got, last, count = read
    assert (got, last, count) == (rows_bytes(3, 4, batch_of=3), 4, 6)
    assert got.startswith(b"RDATA s w batch ") and got.count(b"\n") == 6
    # A start between tokens (no row at 10) in a chunk with sparse tokens.
    sparse = encode_json_rows("s", [(1, 5, b"w", 0, b"[1]"), (2, 20, b"w", 0, b"[2]")], False)[0]
    w.append("t", 0, 20, 2, {False: sparse})
    assert w.read("t", 10, 20, 100, False) == (b"RDATA s w 20 [2]\n", 20, 1)


def test_window_spans_without_rows_answer_with_no_rows() -> None:
    w = RecentWindow(1 << 20)
    w.append("s", 0, 2, 2, {False: rows_bytes(1, 2)})
    w.append("s", 2, 7, 0, {False: b"", True: b""})
    w.append("s", 7, 9, 0, {False: b"", True: b""})  # merged with the previous span
    w.append("s", 9, 10, 1, {False: rows_bytes(10, 10)})
    assert w.read("s", 0, 10, 100, False) == (rows_bytes(1, 2), 2, 2)  # stops before the span
    assert w.read("s", 2, 10, 100, False) == (b"", 9, 0)
    assert w.read("s", 4, 10, 100, False) == (b"", 9, 0)
    assert w.read("s", 9, 10, 100, False) == (rows_bytes(10, 10), 10, 1)


def test_window_is_bounded_in_bytes_and_drops_the_oldest_whole_chunks() -> None:
    size = len(rows_bytes(91, 100)) + CHUNK_OVERHEAD  # the largest chunk
    w = RecentWindow(3 * size)
    for i in range(10):
        w.append("s", i * 10, i * 10 + 10, 10, {False: rows_bytes(i * 10 + 1, i * 10 + 10)})
        assert w.size <= 3 * size
    assert w.start("s") == 70  # the last three chunks
    assert w.read("s", 69, 100, 1000, False) is None  # older than the window: storage
    assert w.read("s", 70, 100, 1000, False) == (rows_bytes(71, 100), 100, 30)
    # Streams share the budget.
    w.append("u", 0, 10, 10, {False: rows_bytes(1, 10)})
    assert w.size <= 3 * size and w.start("s") == 80
    # A chunk that does not follow the last one drops the stream's chunks.
    w.append("s", 150, 160, 10, {False: rows_bytes(151, 160)})
    assert w.start("s") == 150 and w.read("s", 100, 160, 100, False) is None
    # A chunk larger than the whole window is not kept.
    w.append("s", 160, 170, 10, {False: b"x" * (4 * size)})
    assert w.start("s") is None and w.size <= 3 * size


def test_shared_reads_share_one_read_in_flight_and_keep_answers() -> None:
    shared = SharedReads(1 << 20)
    started: list[defer.Deferred[tuple[bytes, int, int]]] = []

    def start() -> defer.Deferred[tuple[bytes, int, int]]:
        started.append(defer.Deferred())
        return started[-1]

    answers: list[Any] = []
    for _ in range(5):
        shared.read("s", 0, 10, False, start).addCallback(answers.append)
    assert len(started) == 1 and answers == []
    started[0].callback((b"rows", 10, 10))
    assert answers == [(b"rows", 10, 10)] * 5
    # A later replay of the same range is answered from the kept answer ...
    shared.read("s", 0, 12, False, start).addCallback(answers.append)
    assert len(started) == 1 and answers[-1] == (b"rows", 10, 10)
    # ... but not one that must stop lower, nor the other variant.
    shared.read("s", 0, 8, False, start)
    shared.read("s", 0, 10, True, start)
    assert len(started) == 3
    # Failures reach every waiter and are not kept.
    failures: list[Any] = []
    for _ in range(2):
        shared.read("s", 50, 60, False, start).addErrback(failures.append)
    started[-1].errback(RuntimeError("gone"))
    assert len(failures) == 2
    shared.read("s", 50, 60, False, start)
    assert len(started) == 5


def test_shared_reads_are_bounded_in_bytes() -> None:
    shared = SharedReads(100)
    for i in range(10):

        def start(i: int = i) -> defer.Deferred[Read]:
            return defer.succeed((b"x" * 30, i + 1, 1))

        shared.read("s", i, 100, False, start)
        assert shared.size <= 100


# -- through the master ------------------------------------------------------------------


@pytest.fixture
def window_env(tmp_path: Path) -> Iterator[Callable[..., Env]]:
    envs: list[Env] = []

    def make(recent_bytes: int = 1 << 20, **protocol: Any) -> Env:
        path = tmp_path / f"env{len(envs)}"
        path.mkdir()
        env = Env(path, ProtocolConfig(**protocol), MasterConfig(server_name="unit", recent_bytes=recent_bytes))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.master.stop_following()
        env.store.close()


def reads(env: Env) -> int:
    return env.db.calls.count("_read_encoded")


def test_replay_inside_the_window_reads_no_storage(window_env: Callable[..., Env]) -> None:
    env = window_env()
    live = env.connected()
    live.send("REPLICATE")
    for i in range(1, 21):
        env.write("events", [event(i)])
        env.follow()
    assert tokens(live.commands()) == list(range(1, 21))
    fan_out_reads = reads(env)
    conn = env.connected()
    conn.send("REPLICATE events 7")
    lines = conn.commands()
    assert lines[0] == "POSITION events master 7 7"
    assert tokens(lines) == list(range(8, 21))
    assert reads(env) == fan_out_reads  # all from memory
    assert env.master.stats().catchup_rows == 13
    # The ts variant was not encoded by the fan-out: storage, once.
    ts = env.connected()
    ts.send("OPTIONS ts", "REPLICATE events 7")
    assert tokens(ts.commands()) == list(range(8, 21))
    assert reads(env) == fan_out_reads + 1


def test_replay_older_than_the_window_reads_storage_then_the_window(window_env: Callable[..., Env]) -> None:
    env = window_env(recent_bytes=2000, catchup_rows=5)
    live = env.connected()
    live.send("REPLICATE")
    for i in range(1, 41):
        env.write("events", [event(i)])
        env.follow()
    start = env.master.window.start("events")
    assert start is not None and 10 < start < 40
    before = reads(env)
    conn = env.connected()
    conn.send("REPLICATE events 0")
    assert tokens(conn.commands()) == list(range(1, 41))
    storage_reads = reads(env) - before
    assert 0 < storage_reads <= start // 5 + 1  # storage up to the window, then memory


def fills(env: Env) -> int:
    return env.db.calls.count("read_lines_json")


def test_concurrent_replays_of_one_range_share_each_read(window_env: Callable[..., Env]) -> None:
    # A window too small for the range: the replays read storage, sharing each read.
    env = window_env(recent_bytes=2000, catchup_rows=10)
    env.write("events", [event(i) for i in range(1, 101)])
    env.follow()
    conns = [env.connected() for _ in range(20)]
    env.db.hold = "_read_encoded"
    for conn in conns:
        conn.send("REPLICATE events 0")
    while env.db.held:
        env.db.hold = "_read_encoded"
        held, env.db.held = env.db.held, []
        assert len(held) == 1  # one read for twenty replays
        fn, args, kwargs, d = held[0]
        d.callback(fn(*args, **kwargs))
    # Ten chunks, each read once (the last rows, which fit, by one fill of the window).
    assert reads(env) + fills(env) == 10 and reads(env) >= 9
    for conn in conns:
        assert tokens(conn.commands()) == list(range(1, 101))


def test_concurrent_replays_below_the_window_share_one_fill(window_env: Callable[..., Env]) -> None:
    env = window_env(catchup_rows=10)
    env.write("events", [event(i) for i in range(1, 101)])
    env.follow()
    conns = [env.connected() for _ in range(20)]
    env.db.hold = "read_lines_json"
    for conn in conns:
        conn.send("REPLICATE events 0")
    assert len(env.db.held) == 1  # one fill for twenty replays
    env.db.release()
    # One fill for all of them: a first read of 64 tokens (the row size is not
    # known yet), then one for the rest.
    assert reads(env) == 0 and fills(env) == 2
    assert env.master.window.start("events") == 0
    for conn in conns:
        assert tokens(conn.commands()) == list(range(1, 101))
    # The next replay is served from memory.
    late = env.connected()
    late.send("REPLICATE events 50")
    assert tokens(late.commands()) == list(range(51, 101))
    assert reads(env) == 0 and fills(env) == 2


def test_a_lagging_connection_stays_in_the_fan_out_up_to_max_lag_bytes(window_env: Callable[..., Env]) -> None:
    env = window_env(max_lag_bytes=2000)
    slow, other = env.connected(), env.connected()
    slow.send("REPLICATE events 0")
    other.send("REPLICATE events 0")
    slow.commands(), other.commands()
    slow.proto.pauseProducing()
    env.write("events", [event(1)])
    env.follow()
    assert [s.state for s in slow.proto.subscriptions.stats()] == ["lagging"]
    slow.proto.resumeProducing()
    assert tokens(slow.commands()) == [1]
    assert [s.state for s in slow.proto.subscriptions.stats()] == ["live"]
    # Paused past the bound: it leaves the fan-out and catches up on its own.
    slow.proto.pauseProducing()
    for i in range(2, 40):
        env.write("events", [event(i)])
        env.follow()
    assert [s.state for s in slow.proto.subscriptions.stats()] == ["catching_up"]
    assert env.master.stats().live_rows > 0 and tokens(other.commands()) == list(range(1, 40))
    reads_before = reads(env)
    slow.proto.resumeProducing()
    lines = slow.commands()
    assert tokens(lines) == list(range(2, 40))  # every row, once, in order
    assert reads(env) == reads_before  # the window still held them
    assert [s.state for s in slow.proto.subscriptions.stats()] == ["live"]
    env.write("events", [event(40)])
    env.follow()
    assert tokens(slow.commands()) == [40]  # back in the shared fan-out


def test_a_connection_that_joins_during_a_fan_out_read_gets_every_row_once(window_env: Callable[..., Env]) -> None:
    env = window_env()
    live = env.connected()
    live.send("REPLICATE events 0")
    live.commands()
    env.write("events", [event(1), event(2)])
    env.db.hold = "_read_encoded"
    env.follow()  # the fan-out read is in flight
    late = env.connected()
    late.send("OPTIONS ts", "REPLICATE events 0")  # the other variant, live at once
    env.db.release()
    assert tokens(live.commands()) == [1, 2]
    got = rdata(late.commands())
    assert [t for _, _, t, _ in got] == [1, 2] and all(len(row) == 6 for *_, row in got)


def test_window_prepend_takes_older_rows_only_where_they_join_and_fit() -> None:
    size = len(rows_bytes(21, 30)) + CHUNK_OVERHEAD  # the largest chunk here
    w = RecentWindow(2 * size + CHUNK_OVERHEAD)
    assert not w.prepend("s", 0, 10, 10, {False: rows_bytes(1, 10)}, live=20)  # must end at the live token
    assert w.prepend("s", 10, 20, 10, {False: rows_bytes(11, 20)}, live=20)
    assert not w.prepend("s", 0, 9, 9, {False: rows_bytes(1, 9)}, live=20)  # a gap below the window
    assert w.prepend("s", 0, 10, 10, {False: rows_bytes(1, 10)}, live=20)
    assert w.start("s") == 0 and w.read("s", 0, 20, 100, False) == (rows_bytes(1, 20), 20, 20)
    # New rows push the oldest (prepended) chunk out first; older rows never push newer ones out.
    w.append("s", 20, 30, 10, {False: rows_bytes(21, 30)})
    assert w.start("s") == 10 and w.size <= 2 * size + CHUNK_OVERHEAD
    assert not w.prepend("s", 0, 10, 10, {False: rows_bytes(1, 10)}, live=30)  # full: not taken
    assert w.start("s") == 10 and w.read("s", 10, 30, 100, False) == (rows_bytes(11, 30), 30, 20)


def test_the_fan_out_keeps_a_stream_the_window_holds_when_nobody_is_live(window_env: Callable[..., Env]) -> None:
    env = window_env()
    live = env.connected()
    live.send("REPLICATE events 0")
    live.commands()
    env.write("events", [event(1), event(2)])
    env.follow()
    assert tokens(live.commands()) == [1, 2]
    live.proto.connectionLost(None)  # nobody live on events any more
    env.write("events", [event(3), event(4)])
    env.follow()
    assert env.master.window.read("events", 0, 4, 100, False) is not None  # read on into the window
    before = reads(env)
    conn = env.connected()
    conn.send("REPLICATE events 0")
    assert tokens(conn.commands()) == [1, 2, 3, 4]
    assert reads(env) == before and fills(env) == 0  # all from memory


def test_rows_committed_after_the_last_live_connection_left_are_kept_in_its_variant(
    window_env: Callable[..., Env],
) -> None:
    """A worker (``OPTIONS ts``) caught up on an empty stream stops; rows are written; it comes back.

    Nothing was in the window when it left (no row was ever sent): the rows
    are still read into the window as they commit, in the variant it took,
    and its catch-up is served from memory, each row once and in order.
    """
    env = window_env()
    worker = env.connected()
    worker.send("OPTIONS ts", "REPLICATE events 0")
    worker.commands()
    assert env.master.window.start("events") is None
    worker.proto.connectionLost(None)
    env.write("events", [event(i) for i in range(1, 6)])
    env.follow()
    assert reads(env) == 1  # read once, as committed
    assert env.master.window.read("events", 0, 5, 100, True) is not None
    assert env.master.window.read("events", 0, 5, 100, False) is None  # the variant nobody took: not built
    back = env.connected()
    back.send("OPTIONS ts", "REPLICATE events 0")
    lines = back.commands()
    assert tokens(lines) == [1, 2, 3, 4, 5]
    rdata_lines = [line for line in lines if line.startswith("RDATA")]
    assert all(len(json.loads(line.split(" ", 4)[4])) == len(EVENTS.columns) + 1 for line in rdata_lines)  # with ts
    assert reads(env) == 1 and fills(env) == 0  # the catch-up: all from memory


def test_a_stream_nobody_reads_and_the_window_does_not_hold_is_not_read(window_env: Callable[..., Env]) -> None:
    env = window_env()
    env.write("events", [event(1), event(2)])
    env.follow()
    assert reads(env) == 0 and env.master.live_token("events") == 2


def test_a_fill_read_cut_short_of_its_range_leaves_no_hole_in_the_window() -> None:
    """A store that ends a read at a row count (PostgreSQL, batches of several rows per token)
    may answer fewer tokens than asked: the fill must not claim the tokens it did not get."""
    w = RecentWindow(1 << 20)
    w.append("s", 20, 30, 10, {False: rows_bytes(21, 30)})
    asked: list[tuple[int, int]] = []

    def read_range(stream: str, after: int, upto: int, with_ts: bool) -> defer.Deferred[Any]:
        asked.append((after, upto))
        # Every token holds two rows; the store ends the range at the token of
        # the ``upto - after``-th row, all of whose rows it includes.
        last = after + (upto - after + 1) // 2
        return defer.succeed((rows_bytes(after + 1, last, batch_of=2), last, 2 * (last - after)))

    filler = WindowFiller(w, read_range, live_token=lambda stream: 30)
    filler.first_tokens = 10
    done = filler.fill("s", 10, False)
    assert done is not None and done.called
    # A cut-short read is tried again on the upper half of its range, down to
    # what the store answers whole; nothing it cut short is prepended.
    assert asked[:4] == [(10, 20), (15, 20), (18, 20), (19, 20)]
    assert len(asked) <= 3 * 10  # every token a batch: the worst case, a few reads per token
    assert w.start("s") == 10
    assert w.read("s", 10, 30, 100, False) == (rows_bytes(11, 20, batch_of=2) + rows_bytes(21, 30), 30, 30)


def test_a_fill_read_with_fewer_rows_than_its_limit_covers_its_range() -> None:
    """Tokens without rows at the end of a read (a rolled-back write's) are not a hole."""
    w = RecentWindow(1 << 20)
    w.append("s", 20, 30, 10, {False: rows_bytes(21, 30)})

    def read_range(stream: str, after: int, upto: int, with_ts: bool) -> defer.Deferred[Any]:
        return defer.succeed((rows_bytes(after + 1, upto - 3), upto - 3, upto - 3 - after))

    filler = WindowFiller(w, read_range, live_token=lambda stream: 30)
    filler.first_tokens = 10
    done = filler.fill("s", 10, False)
    assert done is not None and done.called
    assert w.start("s") == 10
    assert w.read("s", 10, 30, 100, False) == (rows_bytes(11, 17) + rows_bytes(21, 30), 30, 17)


def test_a_fill_reaches_down_to_a_batch_and_stops_there() -> None:
    """A read whose range holds a batch is not offered as whole lines (None): the fill reads the
    tokens above the batch in halves, so the window still holds everything above it."""
    w = RecentWindow(1 << 20)
    w.append("s", 900, 1000, 100, {False: rows_bytes(901, 1000)})
    batch = 120
    asked: list[tuple[int, int]] = []

    def read_range(stream: str, after: int, upto: int, with_ts: bool) -> defer.Deferred[Any]:
        asked.append((after, upto))
        if after < batch <= upto:
            return defer.succeed(None)
        return defer.succeed((rows_bytes(after + 1, upto), upto, upto - after))

    filler = WindowFiller(w, read_range, live_token=lambda stream: 1000)
    filler.first_tokens = 100
    done = filler.fill("s", 0, False, whole=False)
    assert done is not None and done.called
    assert w.start("s") == batch
    assert w.read("s", batch, 1000, 2000, False) == (rows_bytes(batch + 1, 1000), 1000, 1000 - batch)
    assert len(asked) < 40
    assert filler.fill("s", 0, False, whole=False) is None  # not again from the batch
