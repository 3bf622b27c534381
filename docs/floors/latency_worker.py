# Latency floor, "worker": each line applied with its token in one prepared statement, autocommit,
# synchronous_commit off (as tickline's worker and a subscription's apply worker).
import sys

from relay_common import EXECUTE_APPLY, accept_master, apply_connection, received_lines

dst, port = sys.argv[1], int(sys.argv[2])
conn, cur = apply_connection(dst, autocommit=True, prepare=True)
s = accept_master(port, nodelay=True)
for line in received_lines(s, 65536):
    f = line.decode().split("\t")
    cur.execute(EXECUTE_APPLY, [None if v == "\\N" else v for v in f])
