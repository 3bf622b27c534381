# End-to-end floor, "worker": the lines up to each END line applied by one COPY and the applied
# token in one transaction, synchronous_commit off.
import io
import socket
import sys

import psycopg2

dst, port = sys.argv[1], int(sys.argv[2])
conn = psycopg2.connect(dst)
cur = conn.cursor()
cur.execute("SET synchronous_commit = off")
conn.commit()
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(1)
print("ready", flush=True)
s, _ = srv.accept()
buf = b""
while True:
    data = s.recv(262144)
    if not data:
        break
    buf += data
    while True:
        i = buf.find(b"END ")
        if i < 0 or (i > 0 and buf[i - 1] != 10):
            if i > 0 and buf[i - 1] != 10:
                raise SystemExit("END inside a row")
            break
        j = buf.find(b"\n", i)
        if j < 0:
            break
        top = int(buf[i + 4 : j])
        rows = buf[:i]
        buf = buf[j + 1 :]
        cur.copy_expert(
            "COPY replicated_events (token, instance_name, ts, event_id, room_id, type, state_key, redacts) FROM STDIN",
            io.BytesIO(rows),
        )
        cur.execute("UPDATE applied SET token = %s", (top,))
        conn.commit()
