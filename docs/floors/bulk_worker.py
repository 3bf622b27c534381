# End-to-end floor, "worker": the lines up to each END line applied by one COPY and the applied
# token in one transaction, synchronous_commit off. The rows arrive as COPY text: found by the END
# line alone, not split line by line.
import sys

from relay_common import accept_master, apply_connection, copy_rows

dst, port = sys.argv[1], int(sys.argv[2])
conn, cur = apply_connection(dst, autocommit=False)
s = accept_master(port)
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
        copy_rows(conn, cur, rows, top)
