# Latency floor, "master" on Twisted: the LISTEN connection as a reader of the epoll reactor; each
# notification's payload sent as a line (straight on the socket, as tickline's send_now does).
import sys

from twisted.internet import epollreactor

epollreactor.install()  # before anything imports the default reactor
from relay_common import listen_connection  # noqa: E402
from relay_twisted import ConnectionReader  # noqa: E402
from twisted.internet import protocol, reactor  # noqa: E402

src, port = sys.argv[1], int(sys.argv[2])
conn = listen_connection(src)


class Out(protocol.Protocol):
    def connectionMade(self):
        self.transport.setTcpNoDelay(True)
        reactor.addReader(ConnectionReader(conn, self.notified))
        print("ready", flush=True)

    def notified(self):
        conn.poll()
        if conn.notifies:
            out = "".join(n.payload + "\n" for n in conn.notifies)
            conn.notifies.clear()
            self.transport.socket.send(out.encode())


protocol.ClientCreator(reactor, Out).connectTCP("127.0.0.1", port)
reactor.run()
