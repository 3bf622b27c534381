# End-to-end floor with JSON rows, "master": RDATA lines made by the read's SQL (json_build_array).
import sys

from relay_common import master_connections, notified_ranges

src, port = sys.argv[1], int(sys.argv[2])
listen, rc, sock = master_connections(src, port)
for last, top in notified_ranges(listen):
    rc.execute(
        f"SELECT string_agg('RDATA events ' || instance_name || ' ' || token || ' ' || json_build_array(event_id, room_id, type, state_key, redacts, ts)::text, E'\\n' ORDER BY token) FROM events WHERE token > {last} AND token <= {top}"
    )
    (text,) = rc.fetchone()
    sock.sendall(text.encode() + f"\nEND {top}\n".encode())
