# Latency floor, "worker" on Twisted with one reactor wake-up per commit (from the twentieth
# session's review): each line applied by a blocking prepared statement inside dataReceived, which
# tickline's rule excludes (no blocking database call on the reactor thread).
import sys

from twisted.internet import epollreactor

epollreactor.install()
from relay_common import EXECUTE_APPLY, apply_connection  # noqa: E402
from relay_twisted import serve_lines  # noqa: E402

dst, port = sys.argv[1], int(sys.argv[2])
conn, cur = apply_connection(dst, autocommit=True, prepare=True)


def apply(lines):
    for line in lines:
        f = line.decode().split("\t")
        cur.execute(EXECUTE_APPLY, [None if v == "\\N" else v for v in f])


serve_lines(port, apply)
