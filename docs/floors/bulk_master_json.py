# End-to-end floor with JSON rows, "master": RDATA lines made by the read's SQL (json_build_array).
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
    rc.execute(
        f"SELECT string_agg('RDATA events ' || instance_name || ' ' || token || ' ' || json_build_array(event_id, room_id, type, state_key, redacts, ts)::text, E'\\n' ORDER BY token) FROM events WHERE token > {last} AND token <= {top}"
    )
    (text,) = rc.fetchone()
    sock.sendall(text.encode() + f"\nEND {top}\n".encode())
    last = top
