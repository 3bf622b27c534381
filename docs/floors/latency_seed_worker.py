# A minimal seed-protocol worker behind tickline's own master: NAME, REPLICATE, then each
# `RDATA events` line applied by one prepared statement with its token (synchronous_commit off).
import json
import sys

from relay_common import EXECUTE_APPLY, apply_connection, connect, received_lines

dst, port = sys.argv[1], int(sys.argv[2])
conn, cur = apply_connection(dst, autocommit=True, prepare=True)
s = connect(port)
s.sendall(b"NAME relay-c\nREPLICATE\n")
print("ready", flush=True)
for line in received_lines(s, 65536):
    if line.startswith(b"RDATA events "):
        _, _, inst, tok, js = line.split(b" ", 4)
        row = json.loads(js)
        cur.execute(EXECUTE_APPLY, [int(tok), inst.decode() or "x", 0, *row[:5]])
