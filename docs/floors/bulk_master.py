# End-to-end floor, "master": on a notification (payload: the last token), the new rows by COPY TO,
# sent as COPY text and an END line.
import io
import sys

from relay_common import COLUMNS, master_connections, notified_ranges

src, port = sys.argv[1], int(sys.argv[2])
listen, rc, sock = master_connections(src, port)
for last, top in notified_ranges(listen):
    buf = io.BytesIO()
    rc.copy_expert(
        f"COPY (SELECT {COLUMNS} FROM events WHERE token > {last} AND token <= {top} ORDER BY token) TO STDOUT",
        buf,
    )
    sock.sendall(buf.getvalue() + f"END {top}\n".encode())
