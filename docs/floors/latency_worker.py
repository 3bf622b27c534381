# Latency floor, "worker": each line applied with its token in one prepared statement, autocommit,
# synchronous_commit off (as tickline's worker and a subscription's apply worker).
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
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(1)
print("ready", flush=True)
s, _ = srv.accept()
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = b""
while True:
    data = s.recv(65536)
    if not data:
        break
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        f = line.decode().split("\t")
        cur.execute("EXECUTE ins (%s, %s, %s, %s, %s, %s, %s, %s)", [None if v == "\\N" else v for v in f])
