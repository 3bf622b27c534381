"""send_batch / send_now: a commit's lines to a connection go out as one send, now, in order."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import cast

import pytest
from twisted.internet import tcp
from twisted.internet.interfaces import IProtocol, IReactorFDSet, ITransport
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport

from replication.protocol import LineCommandProtocol, ProtocolConfig, send_batch, send_now


class Proto(LineCommandProtocol):
    INBOUND = frozenset()


@pytest.fixture
def pair() -> Iterator[tuple[tcp.Connection, socket.socket, MemoryReactorClock]]:
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    peer.settimeout(5)
    reactor = MemoryReactorClock()
    # A bare protocol (nothing is read here); casts: Twisted types these as zope interfaces.
    conn = tcp.Connection(ours, cast(IProtocol, Protocol()), cast(IReactorFDSet, reactor))
    conn.connected = 1
    yield conn, peer, reactor
    ours.close()
    peer.close()


def _proto(transport: tcp.Connection | StringTransport) -> Proto:
    proto = Proto(ProtocolConfig(), MemoryReactorClock())
    proto.transport = cast(ITransport, transport)  # Twisted types it as the zope interface
    return proto


def test_lines_written_in_a_batch_go_out_as_one_send_at_its_end(pair) -> None:
    conn, peer, reactor = pair
    proto = _proto(conn)
    with send_batch:
        proto.write(b"RDATA a 1 [1]\n")
        with send_batch:  # nested: held until the outermost ends
            proto.write(b"TICK a 1 5\n")
        peer.setblocking(False)
        with pytest.raises(BlockingIOError):
            peer.recv(100)
        peer.settimeout(5)
    assert peer.recv(100) == b"RDATA a 1 [1]\nTICK a 1 5\n"
    assert conn not in reactor.writers  # sent at once: no writer registered, no reactor turn
    assert not conn.dataBuffer and not conn._tempDataBuffer


def test_a_batch_goes_behind_what_the_connection_had_queued(pair) -> None:
    conn, peer, reactor = pair
    proto = _proto(conn)
    proto.write(b"first\n")  # queued by Twisted, not sent yet
    assert conn in reactor.writers
    with send_batch:
        proto.write(b"second\n")
    assert conn._tempDataBuffer == [b"first\n", b"second\n"]
    conn.doWrite()
    assert peer.recv(100) == b"first\nsecond\n"


@pytest.mark.parametrize("split", [1, 3, 1000])
def test_what_the_kernel_does_not_take_is_queued_in_order(pair, split) -> None:
    """Pieces (one, a few, more than one sendmsg takes) the kernel takes in part: the rest queued, in order."""
    conn, peer, reactor = pair
    conn.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    data = bytes(i % 251 for i in range(2_000_000)) + b"\n"
    size = -(-len(data) // split)
    send_now(conn, [data[i : i + size] for i in range(0, len(data), size)])
    assert conn in reactor.writers and conn._tempDataLen > 0
    got = bytearray()
    while len(got) < len(data):
        conn.doWrite()
        got += peer.recv(1 << 20)
    assert bytes(got) == data


def test_a_large_commit_goes_out_whole_in_one_call(pair) -> None:
    """A 1000-row commit's RDATA (above Twisted's SEND_LIMIT of 128 KiB) and its TICK: all sent in the
    call, nothing left for the reactor's next turn, the bytes in order."""
    conn, peer, reactor = pair
    # Room for the whole commit whatever the machine's default (the kernel caps this at wmem_max, doubled).
    conn.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    proto = _proto(conn)
    rdata = b"RDATA events w 5 [" + b"x" * 150 + b"]\n"
    with send_batch:
        proto.write(rdata * 1000)
        proto.write(b"TICK events 5 9\n")
    assert conn not in reactor.writers and not conn._tempDataBuffer
    got = bytearray()
    while len(got) < len(rdata) * 1000 + 16:
        got += peer.recv(1 << 20)
    assert bytes(got) == rdata * 1000 + b"TICK events 5 9\n"


def test_a_lost_connection_is_left_to_twisted(pair) -> None:
    """The peer went away: the send fails, the bytes are queued and Twisted's write finds the loss."""
    conn, peer, _reactor = pair
    peer.close()
    proto = _proto(conn)
    with send_batch:
        proto.write(b"RDATA a 1 [1]\n" * 100)
    for _ in range(3):
        if conn.doWrite() is not None:
            break
        with send_batch:
            proto.write(b"RDATA a 1 [1]\n" * 100)
    else:
        raise AssertionError("the loss was not found")


def test_closing_inside_a_batch_sends_what_it_holds_first() -> None:
    transport = StringTransport()
    proto = _proto(transport)
    with send_batch:
        proto.write(b"RDATA a 1 [1]\n")
        proto.close()
        assert transport.value() == b"RDATA a 1 [1]\n"
        assert transport.disconnecting
    assert transport.value() == b"RDATA a 1 [1]\n"


def test_other_transports_are_written_as_before() -> None:
    transport = StringTransport()
    proto = _proto(transport)
    with send_batch:
        proto.write(b"a\n")
        proto.write(b"b\n")
        assert transport.value() == b""
    assert transport.value() == b"a\nb\n"


class _Producer:
    paused = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        pass


@pytest.mark.parametrize("batched", [False, True])
def test_a_connection_that_does_not_read_is_paused_after_one_write_in_a_batch_too(pair, batched) -> None:
    """A live stream writes only while its connection is not paused (subscriptions): in a batch the held
    bytes go out once they reach HELD_BYTES, so Twisted pauses the producer at the same write as without."""
    conn, _, _ = pair
    conn.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the peer reads nothing
    producer = _Producer()
    conn.registerProducer(producer, True)
    proto = _proto(conn)
    chunk = b"RDATA s w 1 [" + b"x" * 100_000 + b"]\n"
    written = 0

    def write_while_not_paused() -> None:
        nonlocal written
        for _ in range(20):
            if producer.paused:
                return
            proto.write(chunk)
            written += 1

    if batched:
        with send_batch:
            write_while_not_paused()
    else:
        write_while_not_paused()
    assert producer.paused
    assert written == 1
    assert conn._tempDataLen + len(conn.dataBuffer) < 2 * len(chunk)


def test_small_writes_in_a_batch_are_held_until_its_end_below_held_bytes(pair) -> None:
    conn, peer, _ = pair
    proto = _proto(conn)
    with send_batch:
        for i in range(10):
            proto.write(b"TICK s %d 1\n" % i)
        peer.setblocking(False)
        with pytest.raises(BlockingIOError):
            peer.recv(1 << 16)  # nothing sent yet
    peer.setblocking(True)
    got = b""
    while len(got) < sum(len(b"TICK s %d 1\n" % i) for i in range(10)):
        got += peer.recv(1 << 16)
    assert got == b"".join(b"TICK s %d 1\n" % i for i in range(10))


def test_every_connection_s_held_bytes_go_out_when_one_send_fails(pair) -> None:
    conn, peer, _ = pair

    class Broken(StringTransport):
        def writeSequence(self, data: list[bytes]) -> None:  # a transport whose send raises
            raise RuntimeError("broken transport")

    first, second = _proto(Broken()), _proto(conn)
    with pytest.raises(RuntimeError, match="broken transport"), send_batch:
        first.write(b"PING 1\n")
        second.write(b"PING 2\n")
    assert peer.recv(100) == b"PING 2\n"
    assert second._held is None and send_batch.held == []


def test_a_pass_s_writes_go_out_at_the_end_of_each_stretch_and_none_is_held_across_an_await(pair) -> None:
    from twisted.internet import defer

    from replication.master import _Stretches

    conn, peer, _ = pair
    proto = _proto(conn)
    peer.setblocking(False)
    awaited: defer.Deferred[None] = defer.Deferred()
    during: list[bool] = []

    async def a_pass() -> None:
        with _Stretches() as stretches:
            proto.write(b"RDATA s w 1 [1]\n")
            proto.write(b"TICK s 1 1\n")
            try:
                peer.recv(100)
                during.append(True)
            except BlockingIOError:
                during.append(False)  # held while the stretch runs
            await stretches.wait(awaited)
            proto.write(b"POSITION s w 1 2\n")

    finished = defer.ensureDeferred(a_pass())
    assert during == [False]
    assert peer.recv(100) == b"RDATA s w 1 [1]\nTICK s 1 1\n"  # sent before the await, in one piece
    assert send_batch.depth == 0  # what other events write meanwhile is not held back
    awaited.callback(None)
    assert finished.called
    assert peer.recv(100) == b"POSITION s w 1 2\n"
    assert send_batch.depth == 0
