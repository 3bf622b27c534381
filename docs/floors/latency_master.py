# Latency floor, "master": LISTEN on the source, each notification's payload sent as a line (a select loop).
import select
import socket
import sys

import psycopg2

src, port = sys.argv[1], int(sys.argv[2])
conn = psycopg2.connect(src)
conn.autocommit = True
conn.cursor().execute("LISTEN ch")
sock = socket.create_connection(("127.0.0.1", port))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print("ready", flush=True)
while True:
    select.select([conn], [], [])
    conn.poll()
    if conn.notifies:
        out = "".join(n.payload + "\n" for n in conn.notifies)
        conn.notifies.clear()
        sock.sendall(out.encode())
