# End-to-end floor with JSON rows, "worker" as lean as tickline's own conversion (from the
# twentieth session's review): a group's JSON parsed by one orjson call, escapes ruled out by one
# backslash check of the group's JSON, each value's type and range checked, rows formatted plainly.
import sys

import orjson
from relay_common import accept_master, apply_connection, copy_escape, copy_groups

dst, port = sys.argv[1], int(sys.argv[2])
conn, cur = apply_connection(dst, autocommit=False)
s = accept_master(port)
N = "\\N"


def text(lines):
    parts = [line.split(b" ", 4) for line in lines]
    js = b",".join(p[4] for p in parts)
    rows = orjson.loads(b"[" + js + b"]")
    out = []
    if b"\\" not in js:
        for p, r in zip(parts, rows, strict=True):
            if (
                len(r) != 6
                or type(r[5]) is not int
                or type(r[0]) is not str
                or type(r[1]) is not str
                or type(r[2]) is not str
                or not (r[3] is None or type(r[3]) is str)
                or not (r[4] is None or type(r[4]) is str)
                or not 0 <= r[5] < 1 << 63
            ):
                raise SystemExit("bad row")
            out.append(
                f"{int(p[3])}\t{p[2].decode()}\t{r[5]}\t{r[0]}\t{r[1]}\t{r[2]}\t{N if r[3] is None else r[3]}\t{N if r[4] is None else r[4]}\n"
            )
    else:
        for p, r in zip(parts, rows, strict=True):
            out.append(f"{p[3].decode()}\t{p[2].decode()}\t{r[5]}\t" + "\t".join(copy_escape(v) for v in r[:5]) + "\n")
    return "".join(out).encode()


copy_groups(s, conn, cur, text)
