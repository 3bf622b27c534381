# End-to-end floor, "master": on a notification (payload: the last token), the new rows by COPY TO,
# sent as COPY text and an END line.
import io
import select
import socket
import sys

import psycopg2

src, port = sys.argv[1], int(sys.argv[2])
listen = psycopg2.connect(src)
listen.autocommit = True
listen.cursor().execute("LISTEN ch")
read = psycopg2.connect(src)
read.autocommit = True
rc = read.cursor()
sock = socket.create_connection(("127.0.0.1", port))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print("ready", flush=True)
last = 0
while True:
    select.select([listen], [], [])
    listen.poll()
    if not listen.notifies:
        continue
    top = max(int(n.payload) for n in listen.notifies)
    listen.notifies.clear()
    buf = io.BytesIO()
    rc.copy_expert(
        f"COPY (SELECT token, instance_name, ts, event_id, room_id, type, state_key, redacts FROM events WHERE token > {last} AND token <= {top} ORDER BY token) TO STDOUT",
        buf,
    )
    sock.sendall(buf.getvalue() + f"END {top}\n".encode())
    last = top
