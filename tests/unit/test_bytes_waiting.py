"""``replication.client.bytes_waiting``: the bytes a socket holds unread (FIONREAD)."""

from __future__ import annotations

import socket

from twisted.internet.testing import StringTransport

from replication.client import bytes_waiting


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
