# Latency floor, "master": LISTEN on the source, each notification's payload sent as a line (a select loop).
import select
import sys

from relay_common import connect, listen_connection

src, port = sys.argv[1], int(sys.argv[2])
conn = listen_connection(src)
sock = connect(port)
print("ready", flush=True)
while True:
    select.select([conn], [], [])
    conn.poll()
    if conn.notifies:
        out = "".join(n.payload + "\n" for n in conn.notifies)
        conn.notifies.clear()
        sock.sendall(out.encode())
