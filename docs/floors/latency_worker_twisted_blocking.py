# Latency floor, "worker" on Twisted with one reactor wake-up per commit (from the twentieth
# session's review): each line applied by a blocking prepared statement inside dataReceived, which
# tickline's rule excludes (no blocking database call on the reactor thread).
import sys

from twisted.internet import epollreactor

epollreactor.install()
import psycopg2  # noqa: E402
from twisted.internet import protocol, reactor  # noqa: E402

dst, port = sys.argv[1], int(sys.argv[2])
conn = psycopg2.connect(dst)
conn.autocommit = True
cur = conn.cursor()
cur.execute("SET synchronous_commit = off")
cur.execute(
    "PREPARE ins (bigint, text, bigint, text, text, text, text, text) AS WITH u AS (UPDATE applied SET token = $1) "
    "INSERT INTO replicated_events (token, instance_name, ts, event_id, room_id, type, state_key, redacts) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)


class In(protocol.Protocol):
    buf = b""

    def connectionMade(self):
        self.transport.setTcpNoDelay(True)

    def dataReceived(self, data):
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            f = line.decode().split("\t")
            cur.execute("EXECUTE ins (%s, %s, %s, %s, %s, %s, %s, %s)", [None if v == "\\N" else v for v in f])


f = protocol.Factory()
f.protocol = In
reactor.listenTCP(port, f, interface="127.0.0.1")
print("ready", flush=True)
reactor.run()
