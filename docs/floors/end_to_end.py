"""The end-to-end floor: tickline's path (notify, read back, relay, apply with the token) with do-nothing relays.

    flock /work/bench.lock .venv/bin/python docs/floors/end_to_end.py 3

Per round, on one pair of the benchmark's clusters, 200,000 rows in 1000-row
transactions, rows/s from the first commit to the last row applied:
``floor`` (the rows read back by ``COPY TO`` and applied by ``COPY FROM`` as
that text), ``floor-json`` (the rows read back as ``RDATA`` lines of JSON
made by SQL, made ``COPY`` text again in Python, naively), ``floor-json-lean``
(the same with a worker as lean as tickline's conversion), ``tickline`` and ``copy``
(logical replication written by ``COPY``; ``bench_pg.end_to_end_once``). The
floors' writer is the baseline's (``COPY``, durable) with a ``pg_notify`` of
the last token in each transaction. An experiment of the twentieth session
(docs/benchmarks.md), kept to be run again; it uses ``scripts.bench_pg``'s
helpers as they were then.
"""

import io
import sys
import tempfile
import time

from floors_common import b, floor_databases, start_relays, stop

ROWS = 200_000


def floor_once(clusters, json_rows, worker_suffix=None):
    src, dst, s, d = floor_databases(clusters, applied_trigger=False)
    suffix = "_json" if json_rows else ""
    worker = worker_suffix if worker_suffix is not None else suffix
    relays = start_relays({"worker": f"bulk_worker{worker}.py", "master": f"bulk_master{suffix}.py"}, src, dst)
    try:
        started = time.perf_counter()
        conn = b._connect(src, autocommit=False)
        token = 1
        with conn.cursor() as cur:
            for start in range(0, ROWS, b.TXN_ROWS):
                chunk = b.make_rows(start, b.TXN_ROWS)
                text = b._copy_text(token, chunk, "base").encode()
                cur.copy_expert(f"COPY events ({b.NAMES}) FROM STDIN", io.BytesIO(text))
                token += len(chunk)
                cur.execute("SELECT pg_notify('ch', %s)", (str(token - 1),))
                conn.commit()
        conn.close()
        b._wait(lambda: int(b._scalar(d, "SELECT token FROM applied")) >= token - 1, "the floor's apply")
        return ROWS / (time.perf_counter() - started)
    finally:
        stop(relays)
        s.close()
        d.close()


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as workdir, b.Clusters() as clusters:
        for _ in range(rounds):
            for which in ("floor", "floor-json", "floor-json-lean", "tickline", "copy"):
                if which == "floor-json-lean":
                    rate = floor_once(clusters, True, "_json_lean")
                elif which.startswith("floor"):
                    rate = floor_once(clusters, which == "floor-json")
                else:
                    rate = b.end_to_end_once(clusters, workdir, ROWS, which)
                print(f"{which:11s} {rate:,.0f} rows/s", flush=True)


if __name__ == "__main__":
    main()
