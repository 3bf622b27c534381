# End-to-end floor with JSON rows, "worker": each RDATA line's JSON made COPY text in Python.
import io
import socket
import sys

import orjson
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
out = []


def esc(v):
    if v is None:
        return "\\N"
    v = str(v)
    if "\\" in v or "\t" in v or "\n" in v or "\r" in v:
        v = v.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    return v


while True:
    data = s.recv(262144)
    if not data:
        break
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        if line.startswith(b"END "):
            cur.copy_expert(
                "COPY replicated_events (token, instance_name, ts, event_id, room_id, type, state_key, redacts) FROM STDIN",
                io.BytesIO("".join(out).encode()),
            )
            cur.execute("UPDATE applied SET token = %s", (int(line[4:]),))
            conn.commit()
            out = []
            continue
        _, _, inst, tok, js = line.split(b" ", 4)
        row = orjson.loads(js)
        out.append(f"{tok.decode()}\t{inst.decode()}\t{row[5]}\t" + "\t".join(esc(v) for v in row[:5]) + "\n")
