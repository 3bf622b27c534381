# Latency floor, "master" on Twisted: the LISTEN connection as a reader of the epoll reactor; each
# notification's payload sent as a line (straight on the socket, as tickline's send_now does).
import sys

from twisted.internet import epollreactor

epollreactor.install()  # before anything imports the default reactor
import psycopg2  # noqa: E402
from twisted.internet import protocol, reactor  # noqa: E402

src, port = sys.argv[1], int(sys.argv[2])
conn = psycopg2.connect(src)
conn.autocommit = True
conn.cursor().execute("LISTEN ch")


class Out(protocol.Protocol):
    def connectionMade(self):
        self.transport.setTcpNoDelay(True)
        reactor.addReader(Reader(self.transport))
        print("ready", flush=True)


class Reader:
    def __init__(self, transport):
        self.t = transport

    def fileno(self):
        return conn.fileno()

    def logPrefix(self):
        return "reader"

    def connectionLost(self, reason):
        pass

    def doRead(self):
        conn.poll()
        if conn.notifies:
            out = "".join(n.payload + "\n" for n in conn.notifies)
            conn.notifies.clear()
            self.t.socket.send(out.encode())


protocol.ClientCreator(reactor, Out).connectTCP("127.0.0.1", port)
reactor.run()
