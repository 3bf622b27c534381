# A minimal seed-protocol worker behind tickline's own master: NAME, REPLICATE, then each
# `RDATA events` line applied by one prepared statement with its token (synchronous_commit off).
import json
import socket
import sys

import psycopg2

dst, port = sys.argv[1], int(sys.argv[2])
conn = psycopg2.connect(dst)
conn.autocommit = True
cur = conn.cursor()
cur.execute("SET synchronous_commit = off")
cur.execute(
    "PREPARE ins (bigint, text, bigint, text, text, text, text, text) AS WITH u AS (UPDATE applied SET token = $1) "
    "INSERT INTO replicated_events (token, instance_name, ts, event_id, room_id, type, state_key, redacts) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.sendall(b"NAME relay-c\nREPLICATE\n")
print("ready", flush=True)
buf = b""
while True:
    data = s.recv(65536)
    if not data:
        break
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        if line.startswith(b"RDATA events "):
            _, _, inst, tok, js = line.split(b" ", 4)
            row = json.loads(js)
            cur.execute("EXECUTE ins (%s, %s, %s, %s, %s, %s, %s, %s)", [int(tok), inst.decode() or "x", 0, *row[:5]])
