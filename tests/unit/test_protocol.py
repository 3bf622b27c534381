"""The line protocol and the master's server protocol, on a fake clock and transport.

Timers (keepalive, ping timeout, max_pause, close grace) run on Twisted's
``MemoryReactorClock``; bytes go through ``StringTransport``. The master is the
real :class:`replication.master.Master` on a real SQLite store; instead of a
database thread pool it is given :class:`ManualDB`, which runs storage calls at
once or holds them until the test releases them (to interleave deterministically).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attr
import orjson
import pytest
from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer
from twisted.internet.testing import MemoryReactorClock, StringTransport

from replication.client import ClientProtocol, ReplicationHandler
from replication.commands import PositionCommand
from replication.limits import LimitedFactory
from replication.master import Master, MasterConfig
from replication.protocol import ProtocolConfig
from replication.server import ServerProtocol
from replication.streams import all_streams
from storage.store import open_store

EVENT = ["$e", "!r", "m.type", None, None]


def event(i: int) -> list[Any]:
    return [f"$e{i}", "!room", "m.type", None, None]


class ManualDB:
    """Stands in for ``DatabaseThreads``: runs calls at once, or holds them."""

    def __init__(self) -> None:
        # False: run at once; True: hold every call; a function name: hold only those.
        self.hold: bool | str = False
        self.held: list[tuple[Callable[..., Any], tuple, dict, defer.Deferred]] = []
        self.calls: list[str] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> defer.Deferred:
        name = getattr(fn, "__name__", repr(fn))
        self.calls.append(name)
        if self.hold is True or self.hold == name:
            d: defer.Deferred = defer.Deferred()
            self.held.append((fn, args, kwargs, d))
            return d
        return defer.maybeDeferred(fn, *args, **kwargs)

    def release(self) -> None:
        """Run every held call (and those they cause), in order."""
        self.hold = False
        while self.held:
            fn, args, kwargs, d = self.held.pop(0)
            try:
                result = fn(*args, **kwargs)
            except Exception:
                d.errback()
            else:
                d.callback(result)


class Conn:
    """One server-side connection with its transport."""

    def __init__(self, proto: ServerProtocol, transport: StringTransport) -> None:
        self.proto = proto
        self.transport = transport

    def send(self, *lines: str) -> None:
        self.proto.dataReceived(b"".join(line.encode() + b"\n" for line in lines))

    def lines(self) -> list[str]:
        """Every line written since the last call."""
        data = self.transport.value()
        self.transport.clear()
        assert data == b"" or data.endswith(b"\n"), data[-100:]
        return data.decode("utf-8").splitlines()

    def commands(self) -> list[str]:
        """Lines written since the last call, without keepalive PINGs."""
        return [line for line in self.lines() if not line.startswith("PING ")]

    @property
    def closing(self) -> bool:
        return self.transport.disconnecting


class Env:
    def __init__(self, tmp_path: Path, protocol: ProtocolConfig, master: MasterConfig) -> None:
        self.reactor = MemoryReactorClock()
        self.reactor.advance(1_700_000_000)  # a plausible Unix time for PING
        self.store = open_store(f"sqlite:///{tmp_path / 'unit.db'}")
        self.db = ManualDB()
        self.master = Master(master, protocol, self.store, all_streams(), self.reactor, db=self.db)
        started = defer.ensureDeferred(self.master.start())
        failures: list = []
        started.addErrback(failures.append)
        assert started.called and not failures, "master.start() should finish at once on ManualDB"
        factory = self.reactor.tcpServers[0][1]
        assert isinstance(factory, LimitedFactory)  # the master listens without TLS here
        self.factory: LimitedFactory = factory
        self._port = 40000

    def connect(self) -> Conn:
        self._port += 1
        proto = self.factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", self._port))
        assert isinstance(proto, ServerProtocol)  # within the connection limits
        transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", self._port))
        proto.makeConnection(transport)
        return Conn(proto, transport)

    def connected(self) -> Conn:
        """A connection whose handshake has been read."""
        conn = self.connect()
        lines = conn.lines()
        assert lines[0].startswith("SERVER ") and lines[1].startswith("PING "), lines
        return conn

    def write(self, stream: str, rows: list, batch: bool = False, instance: str = "writer") -> list[int]:
        return self.store.append(stream, rows, instance, batch=batch)

    def follow(self) -> None:
        """Let the master's poller look at the heads once."""
        self.reactor.advance(self.master.config.poll_interval)

    def advance_by(self, seconds: float, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
            self.reactor.advance(step)


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator[Callable[..., Env]]:
    envs: list[Env] = []

    def make(secret: str | None = None, **protocol: Any) -> Env:
        path = tmp_path / f"env{len(envs)}"
        path.mkdir()
        env = Env(path, ProtocolConfig(**protocol), MasterConfig(server_name="unit", secret=secret))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.master.stop_following()
        env.store.close()


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


def rdata(lines: list[str]) -> list[tuple[str, str, int | None, list]]:
    out = []
    for line in lines:
        if line.startswith("RDATA "):
            _, stream, instance, token, row = line.split(" ", 4)
            out.append((stream, instance, None if token == "batch" else int(token), orjson.loads(row)))
    return out


def tokens(lines: list[str]) -> list[int]:
    return [t for _, _, t, _ in rdata(lines) if t is not None]


# -- defaults ------------------------------------------------------------------------


def test_protocol_defaults_match_the_contract() -> None:
    config = ProtocolConfig()
    assert config.ping_interval == 5.0
    assert config.ping_timeout == 15.0
    assert config.max_line_bytes == 64 * 1024


# -- handshake ---------------------------------------------------------------------------


def test_handshake_is_server_then_ping(env: Env) -> None:
    conn = env.connect()
    lines = conn.lines()
    assert lines == ["SERVER unit", f"PING {int(env.reactor.seconds() * 1000)}"]
    assert not conn.closing


def test_server_is_a_half_closeable_push_producer(env: Env) -> None:
    conn = env.connect()
    assert IHalfCloseableProtocol.providedBy(conn.proto)
    assert IPushProducer.providedBy(conn.proto)
    assert conn.transport.producer is conn.proto
    assert conn.transport.streaming is True


def test_replicate_sends_a_position_for_every_stream(env: Env) -> None:
    env.write("events", [event(1), event(2)])
    env.follow()
    conn = env.connected()
    conn.send("REPLICATE")
    assert conn.commands() == ["POSITION caches master 0 0", "POSITION events master 2 2"]


# -- keepalive ---------------------------------------------------------------------------


def _max_silence(env: Env, conn: Conn, seconds: float, step: float = 0.05, poke_at: tuple[float, ...] = ()) -> float:
    """Advance the clock; return the longest time without a byte from the protocol."""
    start = env.reactor.seconds()
    last = start
    longest = 0.0
    size = len(conn.transport.value())
    pokes = sorted(poke_at)
    t = 0.0
    while t < seconds:
        env.reactor.advance(step)
        t = round(t + step, 6)
        if pokes and t >= pokes[0]:
            pokes.pop(0)
            # something else the server sends (a POSITION), at an awkward moment
            conn.send("REPLICATE caches 0")
        now_size = len(conn.transport.value())
        if now_size != size:
            longest = max(longest, env.reactor.seconds() - last)
            last = env.reactor.seconds()
            size = now_size
    return max(longest, env.reactor.seconds() - last)


def test_server_sends_a_command_at_least_every_ping_interval(env: Env) -> None:
    conn = env.connected()
    longest = _max_silence(env, conn, 40.0, poke_at=(0.55, 7.3, 13.05, 21.9))
    assert longest <= 5.0 + 1e-3
    pings = [line for line in conn.lines() if line.startswith("PING ")]
    assert len(pings) >= 5
    assert not conn.closing  # no PING from the client yet: never timed out


def test_ping_interval_is_configurable(make_env: Callable[..., Env]) -> None:
    env = make_env(ping_interval=1.0, ping_timeout=3.0)
    conn = env.connected()
    assert _max_silence(env, conn, 10.0, poke_at=(0.33, 4.71)) <= 1.0 + 1e-3


def test_pings_carry_the_clock_in_milliseconds(env: Env) -> None:
    conn = env.connected()
    env.advance_by(5.0)
    (ping,) = [line for line in conn.lines() if line.startswith("PING ")]
    sent_ms = int(ping.split()[1])
    assert abs(sent_ms - env.reactor.seconds() * 1000) <= 5000


def test_no_ping_timeout_before_the_peers_first_ping(env: Env) -> None:
    conn = env.connected()
    # A person typing in netcat, slowly: no ping timeout before their first PING
    # (only the idle timeout, master.idle_timeout = 60 s without any command).
    env.advance_by(55.0, step=1.0)
    assert not conn.closing
    assert not any(line.startswith("ERROR") for line in conn.lines())
    conn.send("REPLICATE")
    assert conn.commands()[0].startswith("POSITION ")


def test_ping_timeout_closes_with_error_after_silence(env: Env) -> None:
    conn = env.connected()
    conn.send("PING 1700000000000")
    env.advance_by(14.9)
    assert not conn.closing
    assert not any(line.startswith("ERROR") for line in conn.lines())
    env.advance_by(1.2)  # 16.1 s of silence: the timeout (15 s) is past
    assert conn.closing
    errors = [line for line in conn.lines() if line.startswith("ERROR")]
    assert errors == ["ERROR ping timeout: nothing received for 15 s"]


def test_any_command_keeps_the_connection_alive(env: Env) -> None:
    conn = env.connected()
    conn.send("PING 1")
    for _ in range(5):  # 50 s in all, a command every 10 s
        env.advance_by(10.0)
        conn.send("NAME still-here")
    assert not conn.closing
    env.advance_by(16.0)
    assert conn.closing


def test_ping_timeout_is_configurable(make_env: Callable[..., Env]) -> None:
    env = make_env(ping_interval=0.5, ping_timeout=2.0)
    conn = env.connected()
    conn.send("PING 1")
    env.advance_by(1.9)
    assert not conn.closing
    env.advance_by(0.5)
    assert conn.closing
    assert "ERROR ping timeout: nothing received for 2 s" in conn.lines()


def test_a_connection_that_does_not_flush_is_aborted_after_close_grace(make_env: Callable[..., Env]) -> None:
    env = make_env(close_grace=2.0)
    conn = env.connected()
    conn.send("PING 1")
    env.advance_by(16.0)
    assert conn.closing and not conn.transport.disconnected
    env.advance_by(2.0)
    assert conn.transport.disconnected  # abortConnection


def test_timers_stop_when_the_connection_is_lost(env: Env) -> None:
    conn = env.connected()
    before = len(env.reactor.getDelayedCalls())
    conn.proto.connectionLost(None)
    assert len(env.reactor.getDelayedCalls()) < before
    env.advance_by(30.0)
    assert conn.lines() == []


def test_client_sends_name_and_ping_and_keeps_alive() -> None:
    clock = MemoryReactorClock()
    clock.advance(1_700_000_000)
    proto = ClientProtocol(ReplicationHandler(), "worker1", ProtocolConfig(), clock)
    transport = StringTransport()
    proto.makeConnection(transport)
    assert transport.value().decode().splitlines() == ["NAME worker1", "PING 1700000000000"]
    transport.clear()
    last, longest = clock.seconds(), 0.0
    for i in range(400):
        clock.advance(0.1)
        if i == 7:
            proto.replicate("events", 0)
        if transport.value():
            longest = max(longest, clock.seconds() - last)
            last = clock.seconds()
            transport.clear()
    assert longest <= 5.0 + 1e-3
    # the server never pinged: the client does not time out either
    assert not transport.disconnecting
    proto.dataReceived(b"PING 1700000000000\n")
    for _ in range(170):
        clock.advance(0.1)
    assert transport.disconnecting
    assert b"ERROR ping timeout" in transport.value()


# -- framing -------------------------------------------------------------------------


def test_blank_and_whitespace_lines_are_ignored(env: Env) -> None:
    conn = env.connected()
    conn.proto.dataReceived(b"\n\n   \n\t\n \t \r\n\r\n")
    assert conn.lines() == []
    assert not conn.closing


def test_crlf_line_endings_are_accepted(env: Env) -> None:
    conn = env.connected()
    conn.proto.dataReceived(b"NAME w1\r\nREPLICATE\r\n")
    assert conn.commands() == ["POSITION caches master 0 0", "POSITION events master 0 0"]
    assert conn.proto.client_name == "w1"


def test_lines_split_across_reads_and_many_lines_in_one_read(env: Env) -> None:
    conn = env.connected()
    for byte in b"REPLICATE caches 0\n":
        conn.proto.dataReceived(bytes([byte]))
    assert conn.commands() == ["POSITION caches master 0 0"]
    conn.proto.dataReceived(b"REPLICATE caches 0\nREPLICATE events 0\nREPLI")
    assert conn.commands() == ["POSITION caches master 0 0", "POSITION events master 0 0"]
    conn.proto.dataReceived(b"CATE caches 0\n")
    assert conn.commands() == ["POSITION caches master 0 0"]


def test_line_of_exactly_the_limit_is_accepted(make_env: Callable[..., Env]) -> None:
    env = make_env(max_line_bytes=100)
    conn = env.connected()
    name = "n" * (100 - len("NAME "))
    conn.proto.dataReceived(f"NAME {name}\n".encode())
    conn.proto.dataReceived(f"NAME {name}\r\n".encode())  # \r is not counted
    assert conn.lines() == []
    assert not conn.closing
    assert conn.proto.client_name == name


def test_over_long_line_is_answered_with_error_and_closed(make_env: Callable[..., Env]) -> None:
    env = make_env(max_line_bytes=100)
    conn = env.connected()
    conn.proto.dataReceived(b"NAME " + b"n" * 96 + b"\nREPLICATE\n")
    lines = conn.lines()
    assert len(lines) == 1 and lines[0].startswith("ERROR line too long"), lines
    assert "100" in lines[0]
    assert conn.closing
    conn.proto.dataReceived(b"REPLICATE\n")  # nothing more is read
    assert conn.lines() == []


def test_over_long_partial_line_closes_without_waiting_for_a_newline(make_env: Callable[..., Env]) -> None:
    env = make_env(max_line_bytes=100)
    conn = env.connected()
    for _ in range(3):
        conn.proto.dataReceived(b"x" * 50)
        if conn.closing:
            break
    assert conn.closing
    assert conn.lines()[0].startswith("ERROR line too long")


def test_default_line_limit_is_64_kib(env: Env) -> None:
    conn = env.connected()
    # ERROR from a client is only logged, so the line itself gets no answer.
    conn.proto.dataReceived(b"ERROR " + b"n" * (65536 - 6) + b"\n")
    assert not conn.closing
    conn.proto.dataReceived(b"ERROR " + b"n" * (65536 - 5) + b"\n")
    assert conn.closing
    assert conn.lines()[0].startswith("ERROR line too long")


# -- bad input ---------------------------------------------------------------------------

BAD_INPUT = [
    ("FOO bar", "ERROR unknown command 'FOO'"),
    ("RDATA events master 1 []", "ERROR RDATA may not be sent by the client"),
    ("POSITION events master 1 2", "ERROR POSITION may not be sent by the client"),
    ("SERVER evil", "ERROR SERVER may not be sent by the client"),
    ("REPLICATE events abc", "ERROR malformed REPLICATE: token must be a non-negative integer, got 'abc'"),
    ("PING soon", "ERROR malformed PING: unix_ms must be a non-negative integer, got 'soon'"),
    ("RDATA events master 1 [1,", "ERROR malformed RDATA: bad row JSON"),
    ("USER_SYNC w1 @u:x sometimes 1", "ERROR malformed USER_SYNC: state must be 'start' or 'end'"),
    ("REPLICATE nosuch 0", "ERROR unknown stream 'nosuch' (streams: caches, events)"),
    ("REPLICATE events 5", "ERROR token 5 is above the head 0 of stream 'events'"),
]


@pytest.mark.parametrize("line, error", BAD_INPUT, ids=[line for line, _ in BAD_INPUT])
def test_bad_input_gets_error_and_the_connection_stays_open(env: Env, line: str, error: str) -> None:
    conn = env.connected()
    conn.send(line)
    lines = conn.commands()
    assert len(lines) == 1 and lines[0].startswith(error), lines
    assert not conn.closing
    conn.send("REPLICATE")
    assert conn.commands() == ["POSITION caches master 0 0", "POSITION events master 0 0"]


def test_committed_token_not_yet_followed_is_not_above_the_head(env: Env) -> None:
    conn = env.connected()
    env.write("events", [event(1), event(2)])  # committed; the poller has not run
    assert env.master.live_token("events") == 0
    conn.send("REPLICATE events 2", "REPLICATE events 1")
    lines = conn.commands()
    assert lines[0] == "POSITION events master 2 2"
    assert lines[1] == "POSITION events master 1 1"
    assert tokens(lines) == [2]
    conn.send("REPLICATE events 3")
    assert conn.commands() == ["ERROR token 3 is above the head 2 of stream 'events'"]


def test_replicate_answers_keep_the_order_of_requests(env: Env) -> None:
    conn = env.connected()
    env.write("events", [event(1), event(2), event(3)])  # not followed yet
    conn.send("REPLICATE events 3", "REPLICATE events 1", "REPLICATE caches 0", "REPLICATE nosuch 0")
    lines = conn.commands()
    assert [line for line in lines if not line.startswith("RDATA")] == [
        "POSITION events master 3 3",
        "POSITION events master 1 1",
        "POSITION caches master 0 0",
        "ERROR unknown stream 'nosuch' (streams: caches, events)",
    ]
    assert tokens(lines) == [2, 3]  # the last request for events wins
    env.write("events", [event(4)])
    env.follow()
    assert tokens(conn.commands()) == [4]


def test_a_replicate_by_time_is_answered_before_the_replicates_after_it(env: Env) -> None:
    """The look by time waits for the database; a token REPLICATE after it must not overtake it."""
    conn = env.connected()
    env.write("events", [event(1), event(2)])
    env.follow()
    env.db.hold = "first_token_at"  # the look by time waits; the master's passes do not
    conn.send("REPLICATE events @0", "REPLICATE caches 0", "REPLICATE nosuch 0")
    assert conn.commands() == []  # all three wait behind the look by time
    env.db.release()
    lines = conn.commands()
    assert [line for line in lines if not line.startswith("RDATA")][:3] == [
        "POSITION events master 0 0",
        "POSITION caches master 0 0",
        "ERROR unknown stream 'nosuch' (streams: caches, events)",
    ]
    assert tokens(lines) == [1, 2]


def test_stream_created_by_another_writer_is_found_on_replicate(env: Env) -> None:
    from storage.schema import Column, StreamSchema

    conn = env.connected()
    env.store.register_stream(StreamSchema("fresh", (Column("body", "text"),)))
    env.write("fresh", [["hello"]])
    conn.send("REPLICATE fresh 0")
    assert conn.commands() == ["POSITION fresh master 0 0", 'RDATA fresh writer 1 ["hello"]']


def test_half_close_waits_for_a_replicate_that_waits_for_the_store(env: Env) -> None:
    conn = env.connected()
    env.write("events", [event(1)])
    env.db.hold = True
    conn.proto.dataReceived(b"REPLICATE events 0\nREPLICATE events 1\n")
    conn.proto.readConnectionLost()
    assert not conn.closing
    env.db.release()
    lines = conn.commands()
    assert lines == [
        "POSITION events master 0 0",
        'RDATA events writer 1 ["$e1","!room","m.type",null,null]',
        "POSITION events master 1 1",
    ]
    assert conn.closing


def test_invalid_utf8_gets_error_and_the_connection_stays_open(env: Env) -> None:
    conn = env.connected()
    conn.proto.dataReceived(b"NAME caf\xe9\n\xff\xfe\n")
    assert conn.commands() == ["ERROR invalid UTF-8 at byte 8 of the line", "ERROR invalid UTF-8 at byte 0 of the line"]
    assert not conn.closing
    conn.send("REPLICATE caches 0")
    assert conn.commands() == ["POSITION caches master 0 0"]


def test_client_rejects_commands_only_a_client_may_send() -> None:
    clock = MemoryReactorClock()
    handler = ReplicationHandler()
    proto = ClientProtocol(handler, "w", ProtocolConfig(), clock)
    transport = StringTransport()
    proto.makeConnection(transport)
    transport.clear()
    proto.dataReceived(b"NAME sneaky\nREPLICATE\nGARBAGE\n")
    assert transport.value().decode().splitlines() == [
        "ERROR NAME may not be sent by the server",
        "ERROR REPLICATE may not be sent by the server",
        "ERROR unknown command 'GARBAGE'",
    ]
    assert not transport.disconnecting


def test_error_from_the_peer_is_logged_not_answered(env: Env) -> None:
    conn = env.connected()
    conn.send("ERROR something went wrong on my side")
    assert conn.lines() == []
    assert not conn.closing


# -- half-close (nc -q1) --------------------------------------------------------------------


def test_half_close_answers_the_last_line_then_closes(env: Env) -> None:
    conn = env.connected()
    conn.proto.dataReceived(b"REPLICATE")  # no newline, then EOF
    conn.proto.readConnectionLost()
    assert conn.commands() == ["POSITION caches master 0 0", "POSITION events master 0 0"]
    assert conn.closing


def test_half_close_finishes_a_replay_before_closing(env: Env) -> None:
    env.write("events", [event(i) for i in range(1, 6)])
    env.follow()
    conn = env.connected()
    env.db.hold = True
    conn.send("REPLICATE events 2")
    conn.proto.readConnectionLost()
    assert not conn.closing  # the replay is still being read
    env.db.release()
    lines = conn.commands()
    assert lines[0] == "POSITION events master 2 2"
    assert tokens(lines) == [3, 4, 5]
    assert conn.closing


# -- replay and live rows -------------------------------------------------------------------


def test_replay_then_live_in_token_order_without_duplicates(make_env: Callable[..., Env]) -> None:
    env = make_env(catchup_rows=7)
    env.write("events", [event(i) for i in range(1, 31)])
    env.follow()
    conn = env.connected()
    conn.send("REPLICATE events 4")
    env.write("events", [event(i) for i in range(31, 36)])
    env.follow()
    lines = conn.commands()
    assert lines[0] == "POSITION events master 4 4"
    assert tokens(lines) == list(range(5, 36))
    assert [row[0] for _, _, _, row in rdata(lines)] == [f"$e{i}" for i in range(5, 36)]


def test_live_rows_go_out_on_the_next_poll(env: Env) -> None:
    conn = env.connected()
    conn.send("REPLICATE")
    conn.lines()
    env.write("events", [event(1)])
    env.write("caches", [["cache_a", ["k1"], 1]], instance="w2")
    env.follow()
    assert sorted(conn.commands()) == [
        'RDATA caches w2 1 ["cache_a",["k1"],1]',
        'RDATA events writer 1 ["$e1","!room","m.type",null,null]',
    ]


def test_rows_sharing_a_token_go_out_as_a_batch(env: Env) -> None:
    conn = env.connected()
    conn.send("REPLICATE")
    conn.lines()
    (token, *_) = env.write("events", [event(1), event(2), event(3)], batch=True)
    env.follow()
    assert [(t, row[0]) for _, _, t, row in rdata(conn.commands())] == [(None, "$e1"), (None, "$e2"), (token, "$e3")]
    # the same in a replay
    conn2 = env.connected()
    conn2.send("REPLICATE events 0")
    assert [(t, row[0]) for _, _, t, row in rdata(conn2.commands())] == [(None, "$e1"), (None, "$e2"), (token, "$e3")]


def test_a_replay_never_splits_a_batch_across_reads(make_env: Callable[..., Env]) -> None:
    env = make_env(catchup_rows=2)
    env.write("events", [event(1)])
    env.write("events", [event(i) for i in range(2, 7)], batch=True)
    env.write("events", [event(7)])
    env.follow()
    conn = env.connected()
    conn.send("REPLICATE events 0")
    got = [(t, row[0]) for _, _, t, row in rdata(conn.commands())]
    assert got == [(1, "$e1")] + [(None, f"$e{i}") for i in range(2, 6)] + [(2, "$e6"), (3, "$e7")]


def test_options_ts_appends_the_row_timestamp(env: Env) -> None:
    env.write("events", [event(1)])
    env.follow()
    plain, with_ts = env.connected(), env.connected()
    with_ts.send("OPTIONS ts gzip")
    assert with_ts.commands() == ["OPTIONS ts"]  # what was accepted; gzip is unknown
    for conn in (plain, with_ts):
        conn.send("REPLICATE events 0")
    (plain_row,) = [row for *_, row in rdata(plain.commands())]
    (ts_row,) = [row for *_, row in rdata(with_ts.commands())]
    assert plain_row == event(1)
    assert ts_row[:-1] == event(1)
    assert isinstance(ts_row[-1], int) and ts_row[-1] > 0


def test_remote_server_up_is_relayed_to_every_other_connection(env: Env) -> None:
    a, b, c = env.connected(), env.connected(), env.connected()
    a.send("REMOTE_SERVER_UP other.example.org")
    assert a.commands() == []
    assert b.commands() == ["REMOTE_SERVER_UP other.example.org"]
    assert c.commands() == ["REMOTE_SERVER_UP other.example.org"]


def test_client_commands_are_accepted_and_recorded(env: Env) -> None:
    conn = env.connected()
    conn.send(
        "USER_SYNC w1 @alice:x start 100",
        "FEDERATION_ACK w1 17",
        "REMOVE_PUSHER m.http key one @alice:x",
        "NAME worker-one",
    )
    assert conn.lines() == []
    handlers = env.master.client_commands
    assert handlers.users_syncing() == {"w1": ["@alice:x"]}
    assert handlers.federation_acks == {"w1": 17}
    assert handlers.removed_pushers[-1] == ("m.http", "key one", "@alice:x")
    conn.send("CLEAR_USER_SYNC w1")
    assert handlers.users_syncing() == {}


# -- authentication ---------------------------------------------------------------------------


def test_auth_required_before_replicate(make_env: Callable[..., Env]) -> None:
    env = make_env(secret="s3cret")
    conn = env.connected()
    conn.send("PING 1")  # liveness needs no secret
    assert conn.lines() == []
    conn.send("REPLICATE")
    assert conn.commands() == ["ERROR authentication required: send AUTH <secret> before REPLICATE"]
    assert conn.closing


def test_auth_with_the_wrong_secret_closes(make_env: Callable[..., Env]) -> None:
    env = make_env(secret="s3cret")
    conn = env.connected()
    conn.send("AUTH guess")
    assert conn.commands() == ["ERROR authentication failed: wrong secret"]
    assert conn.closing


def test_auth_with_the_right_secret_allows_replication(make_env: Callable[..., Env]) -> None:
    env = make_env(secret="s3cret")
    conn = env.connected()
    conn.send("AUTH s3cret", "REPLICATE caches 0")
    assert conn.commands() == ["POSITION caches master 0 0"]
    assert not conn.closing


# -- flow control (IPushProducer) -----------------------------------------------------------------


def test_paused_live_connection_buffers_nothing_and_catches_up_on_resume(env: Env) -> None:
    slow, fast = env.connected(), env.connected()
    for conn in (slow, fast):
        conn.send("REPLICATE")
        conn.lines()
    slow.proto.pauseProducing()  # the transport's buffer is full
    env.write("events", [event(i) for i in range(1, 101)])
    env.follow()
    assert tokens(fast.commands()) == list(range(1, 101))
    assert slow.commands() == []  # nothing written for a client that is not reading
    env.write("events", [event(i) for i in range(101, 121)])
    env.follow()
    assert tokens(fast.commands()) == list(range(101, 121))
    assert slow.commands() == []
    slow.proto.resumeProducing()
    assert tokens(slow.commands()) == list(range(1, 121))  # from storage, in order, once
    env.write("events", [event(121)])
    env.follow()
    assert tokens(slow.commands()) == [121]  # and live again
    assert tokens(fast.commands()) == [121]


def test_master_stats_follow_the_subscriptions_transitions(env: Env) -> None:
    slow, fast = env.connected(), env.connected()
    slow.send("NAME slow", "REPLICATE")
    fast.send("REPLICATE events 0")
    env.write("events", [event(1), event(2)])
    env.follow()
    assert [(s.stream, s.state, s.sent_token) for s in fast.proto.subscriptions.stats()] == [("events", "live", 2)]
    slow.proto.pauseProducing()
    env.write("events", [event(3)])
    env.follow()
    # The paused live subscription stays in the fan-out, lagging at its last sent token.
    assert [(s.stream, s.state, s.sent_token) for s in slow.proto.subscriptions.stats()] == [
        ("caches", "live", 0),
        ("events", "lagging", 2),
    ]
    stats = env.master.stats()
    events = next(s for s in stats.streams if s.stream == "events")
    assert (events.safe, events.live) == (3, 3) and events.head >= 3
    assert stats.live_rows == 3 and stats.catchup_rows == 0
    by_name = {c.name: c for c in stats.connections}
    assert by_name["slow"].paused and not any(c.paused for n, c in by_name.items() if n != "slow")
    assert by_name["slow"].bytes_received == len(b"NAME slow\nREPLICATE\n")
    assert by_name["slow"].bytes_sent > len(slow.transport.value()) > 0  # the handshake was read already
    slow.proto.resumeProducing()
    assert tokens(slow.commands()) == [1, 2, 3]
    assert env.master.stats().catchup_rows == 0  # token 3 came from the window, not storage
    assert [(s.stream, s.state, s.sent_token) for s in slow.proto.subscriptions.stats()][1] == ("events", "live", 3)
    env.master.refresh_heads()
    assert next(s for s in env.master.stats().streams if s.stream == "events").head == 3


def test_paused_replay_reads_nothing_more_from_storage(make_env: Callable[..., Env]) -> None:
    env = make_env(catchup_rows=10)
    env.write("events", [event(i) for i in range(1, 101)])
    env.follow()
    conn = env.connected()
    env.db.hold = True
    conn.send("REPLICATE events 0")
    conn.proto.pauseProducing()  # paused while the first chunk is being read
    env.db.release()
    first = tokens(conn.commands())
    # At most what was in flight: nothing (the rows were read into the window
    # of recent rows, served on resume) or the first chunk read from storage.
    assert first in ([], list(range(1, 11)))
    reads = len(env.db.calls)
    env.advance_by(2.0)
    assert not {"_read_encoded", "read_lines_json"} & set(env.db.calls[reads:])  # only the heads poller ran
    assert tokens(conn.commands()) == []
    conn.proto.resumeProducing()
    assert tokens(conn.commands()) == list(range(len(first) + 1, 101))


def test_client_paused_longer_than_max_pause_is_dropped_with_error(make_env: Callable[..., Env]) -> None:
    env = make_env(max_pause=3.0)
    conn = env.connected()
    conn.send("REPLICATE")
    conn.lines()
    conn.proto.pauseProducing()
    env.advance_by(2.9)
    assert not conn.closing
    env.advance_by(0.2)
    assert conn.closing
    assert conn.commands() == ["ERROR client stopped reading: paused for more than 3 s"]


def test_resume_before_max_pause_keeps_the_connection(make_env: Callable[..., Env]) -> None:
    env = make_env(max_pause=3.0)
    conn = env.connected()
    conn.send("REPLICATE")
    for _ in range(5):
        conn.proto.pauseProducing()
        env.advance_by(2.0)
        conn.proto.resumeProducing()
    assert not conn.closing
    assert not any(line.startswith("ERROR") for line in conn.lines())


def test_variant_joining_during_a_fan_out_read_still_gets_every_row(env: Env) -> None:
    """A connection with OPTIONS ts that goes live while the fan-out reads rows
    for the other variant must not be left without rows."""
    plain = env.connected()
    plain.send("REPLICATE events 0")
    plain.lines()
    env.write("events", [event(1), event(2)])
    # The fan-out reads a stream's first rows in the wake-up's own database hop
    # (Master._wake: safe point, then rows): hold that hop.
    env.db.hold = "_wake"
    env.follow()  # the fan-out read for (0, 2] is in flight, for plain rows only
    assert len(env.db.held) == 1
    late = env.connected()
    late.send("OPTIONS ts", "REPLICATE events 0")  # live at once at token 0
    assert late.commands() == ["OPTIONS ts", "POSITION events master 0 0"]
    env.db.release()
    assert tokens(plain.commands()) == [1, 2]
    assert tokens(late.commands()) == [1, 2]
    env.write("events", [event(3)])
    env.follow()
    assert tokens(plain.commands()) == [3]
    late_rows = rdata(late.commands())
    assert [t for _, _, t, _ in late_rows] == [3]
    assert len(late_rows[0][3]) == len(EVENT) + 1  # with its timestamp


def test_variant_joining_during_a_later_fan_out_read_still_gets_every_row(make_env: Callable[..., Env]) -> None:
    """Rows beyond the wake-up's first read are read in hops of their own: the same holds there."""
    env = make_env()
    env.master.config = attr.evolve(env.master.config, fanout_rows=1)
    plain = env.connected()
    plain.send("REPLICATE events 0")
    plain.lines()
    env.write("events", [event(1)])
    env.write("events", [event(2)])
    env.db.hold = "_read_encoded"
    env.follow()  # token 1 came with the wake-up; the read of (1, 2] is in flight
    assert len(env.db.held) == 1
    assert tokens(plain.commands()) == [1]
    late = env.connected()
    late.send("OPTIONS ts", "REPLICATE events 1")
    assert late.commands() == ["OPTIONS ts", "POSITION events master 1 1"]
    env.db.release()
    assert tokens(plain.commands()) == [2]
    late_rows = rdata(late.commands())
    assert [t for _, _, t, _ in late_rows] == [2]
    assert len(late_rows[0][3]) == len(EVENT) + 1  # with its timestamp


def test_new_replicate_restarts_the_stream_on_the_connection(env: Env) -> None:
    env.write("events", [event(i) for i in range(1, 6)])
    env.follow()
    conn = env.connected()
    conn.send("REPLICATE events 3", "REPLICATE events 1")
    lines = conn.commands()
    assert lines[0] == "POSITION events master 3 3"
    assert tokens(lines) == [4, 5, 2, 3, 4, 5]
    env.write("events", [event(6)])
    env.follow()
    assert tokens(conn.commands()) == [6]  # one subscription, not two


def test_lost_connection_leaves_the_fan_out(env: Env) -> None:
    a, b = env.connected(), env.connected()
    for conn in (a, b):
        conn.send("REPLICATE")
        conn.lines()
    a.proto.connectionLost(None)
    env.write("events", [event(1)])
    env.follow()
    assert a.commands() == []
    assert tokens(b.commands()) == [1]
    assert a.proto not in env.master.connections


# -- the client side -----------------------------------------------------------------------


@attr.s(auto_attribs=True)
class RecordingHandler(ReplicationHandler):
    rows: list = attr.Factory(list)
    positions: list = attr.Factory(list)

    def on_position(self, client: ClientProtocol, command: PositionCommand) -> None:
        self.positions.append(command)

    def on_rows(self, client: ClientProtocol, stream: str, instance: str, token: int, rows: list) -> None:
        self.rows.append((stream, token, rows))


def test_client_holds_a_batch_until_its_token_and_drops_rows_before_position() -> None:
    handler = RecordingHandler()
    proto = ClientProtocol(handler, "w", ProtocolConfig(), MemoryReactorClock())
    proto.makeConnection(StringTransport())
    proto.dataReceived(b'RDATA events m 1 ["early"]\n')
    assert handler.rows == []  # before POSITION: dropped
    proto.dataReceived(b"POSITION events m 1 1\n")
    proto.dataReceived(b'RDATA events m batch ["a"]\nRDATA events m batch ["b"]\n')
    assert handler.rows == []  # nothing of a batch before its last line
    proto.dataReceived(b'RDATA events m 2 ["c"]\nRDATA events m 3 ["d"]\n')
    assert handler.rows == [("events", 2, [["a"], ["b"], ["c"]]), ("events", 3, [["d"]])]


# -- master-side API -------------------------------------------------------------------


def test_invalidate_cache_records_a_caches_row_and_fans_it_out_at_once(env: Env) -> None:
    conn = env.connected()
    conn.send("REPLICATE")
    conn.commands()
    tokens_written: list[int] = []
    env.master.invalidate_cache("members", ["!room"]).addCallback(tokens_written.append)
    env.master.invalidate_cache("state").addCallback(tokens_written.append)
    env.reactor.advance(0)  # the wake-up after the write, before the next poll
    assert tokens_written == [1, 2]
    rows = rdata(conn.commands())
    assert [(s, t, r[:2]) for s, _, t, r in rows] == [
        ("caches", 1, ["members", ["!room"]]),
        ("caches", 2, ["state", None]),
    ]
    assert all(isinstance(r[2], int) for _, _, _, r in rows)  # invalidation_ts in ms


def test_a_stall_of_our_own_is_not_the_peers_silence(env: Env) -> None:
    """A reactor blocked for 30 s (here: the clock jumps) times nobody out on its next tick;
    the peer gets the usual ping_timeout from then on."""
    conn = env.connected()
    conn.send("PING 1")
    env.reactor.advance(30.0)  # one late keepalive tick
    assert not conn.closing
    env.advance_by(14.0)
    assert not conn.closing
    env.advance_by(3.0)
    assert conn.closing
    assert [line for line in conn.lines() if line.startswith("ERROR")] == [
        "ERROR ping timeout: nothing received for 15 s"
    ]


def test_replicates_waiting_behind_a_look_by_time_are_bounded(env: Env) -> None:
    from replication.server import MAX_WAITING_REPLICATES

    conn = env.connected()
    env.db.hold = "first_token_at"
    conn.send("REPLICATE events @0", *["REPLICATE caches 0"] * (MAX_WAITING_REPLICATES + 1))
    assert conn.commands() == [
        f"ERROR more than {MAX_WAITING_REPLICATES} REPLICATE commands waiting; this one is ignored"
    ]
    env.db.release()
    lines = conn.commands()
    assert lines[0] == "POSITION events master 0 0"
    assert lines.count("POSITION caches master 0 0") == MAX_WAITING_REPLICATES
