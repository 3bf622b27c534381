"""What the floors' Twisted relays share (imported after ``epollreactor.install()``)."""

from twisted.internet import protocol, reactor


class ConnectionReader:
    """A reader of the epoll reactor for a psycopg2 connection: ``on_readable()`` when it is readable."""

    def __init__(self, conn, on_readable):
        self.conn, self.on_readable = conn, on_readable

    def fileno(self):
        return self.conn.fileno()

    def logPrefix(self):
        return "db"

    def connectionLost(self, reason):
        pass

    def doRead(self):
        self.on_readable()


def serve_lines(port, on_lines):
    """Listen on ``port`` for the "master"; ``on_lines(lines)`` with each read's whole lines; say ``ready``
    and run the reactor."""

    class In(protocol.Protocol):
        buf = b""

        def connectionMade(self):
            self.transport.setTcpNoDelay(True)

        def dataReceived(self, data):
            self.buf += data
            *lines, self.buf = self.buf.split(b"\n")
            on_lines(lines)

    factory = protocol.Factory()
    factory.protocol = In
    reactor.listenTCP(port, factory, interface="127.0.0.1")
    print("ready", flush=True)
    reactor.run()
