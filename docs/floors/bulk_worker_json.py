# End-to-end floor with JSON rows, "worker": each RDATA line's JSON made COPY text in Python.
import sys

import orjson
from relay_common import accept_master, apply_connection, copy_escape, copy_groups

dst, port = sys.argv[1], int(sys.argv[2])
conn, cur = apply_connection(dst, autocommit=False)
s = accept_master(port)


def text(lines):
    out = []
    for line in lines:
        _, _, inst, tok, js = line.split(b" ", 4)
        row = orjson.loads(js)
        out.append(f"{tok.decode()}\t{inst.decode()}\t{row[5]}\t" + "\t".join(copy_escape(v) for v in row[:5]) + "\n")
    return "".join(out).encode()


copy_groups(s, conn, cur, text)
