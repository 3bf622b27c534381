"""``replication.client.bytes_waiting``: the bytes a socket holds unread (FIONREAD); how much a read takes."""

from __future__ import annotations

import socket

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from replication.client import READ_BYTES, ClientProtocol, ReplicationHandler, bytes_waiting
from replication.protocol import ProtocolConfig


class _Handle:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def getHandle(self) -> socket.socket:
        return self.sock


def test_bytes_waiting_counts_what_the_socket_holds_unread() -> None:
    a, b = socket.socketpair()
    try:
        assert bytes_waiting(_Handle(a)) == 0
        b.sendall(b"x" * 100)
        assert bytes_waiting(_Handle(a)) == 100
        assert a.recv(60) == b"x" * 60
        assert bytes_waiting(_Handle(a)) == 40
    finally:
        a.close()
        b.close()


def test_a_transport_without_a_socket_or_a_closed_one_has_nothing_waiting() -> None:
    assert bytes_waiting(StringTransport()) == 0
    assert bytes_waiting(None) == 0
    a, b = socket.socketpair()
    b.sendall(b"x")
    a.close()
    b.close()
    assert bytes_waiting(_Handle(a)) == 0


class _ReadingTransport(StringTransport):
    bufferSize = 65536  # as twisted.internet.tcp.Connection: the most one read takes


def test_the_client_reads_up_to_read_bytes_at_once() -> None:
    """A commit's 140 KB of RDATA is mostly one read, not three of Twisted's 64 KiB."""
    transport = _ReadingTransport()
    ClientProtocol(ReplicationHandler(), "w", ProtocolConfig(), Clock()).makeConnection(transport)
    assert transport.bufferSize == READ_BYTES >= 256 * 1024
    plain = StringTransport()  # a transport that reads no socket: left alone
    ClientProtocol(ReplicationHandler(), "w", ProtocolConfig(), Clock()).makeConnection(plain)
    assert not hasattr(plain, "bufferSize")
