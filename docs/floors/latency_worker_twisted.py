# Latency floor, "worker" on Twisted: each line applied by one non-blocking statement (async
# psycopg2), its answer read by a reader of the epoll reactor.
import collections
import select
import sys

from twisted.internet import epollreactor

epollreactor.install()  # before anything imports the default reactor
import psycopg2  # noqa: E402
import psycopg2.extensions as ext  # noqa: E402
from relay_common import PREPARE_APPLY  # noqa: E402
from relay_twisted import ConnectionReader, serve_lines  # noqa: E402
from twisted.internet import reactor  # noqa: E402

dst, port = sys.argv[1], int(sys.argv[2])


def wait(c):
    while True:
        s = c.poll()
        if s == ext.POLL_OK:
            return
        if s == ext.POLL_READ:
            select.select([c.fileno()], [], [])
        elif s == ext.POLL_WRITE:
            select.select([], [c.fileno()], [])


conn = psycopg2.connect(dst, async_=1)
wait(conn)
cur = conn.cursor()
cur.execute("SET synchronous_commit = off")
wait(conn)
cur.execute(PREPARE_APPLY)
wait(conn)
queue = collections.deque()
busy = [False]
CUR = [None]


def lit(v):
    return "NULL" if v == "\\N" else "'" + v.replace("'", "''") + "'"


def start():
    if busy[0] or not queue:
        return
    f = queue.popleft()
    CUR[0] = conn.cursor()
    CUR[0].execute("EXECUTE ins (" + ", ".join(lit(v) for v in f) + ")")
    busy[0] = True


def answered():
    if busy[0] and conn.poll() == ext.POLL_OK:
        busy[0] = False
        start()


reactor.addReader(ConnectionReader(conn, answered))


def received(lines):
    for line in lines:
        queue.append(line.decode().split("\t"))
    start()


serve_lines(port, received)
