"""A writer process for the multi-writer tests (run with ``python -m``).

python -m tests.integration.writer_proc URL INSTANCE COUNT
    append COUNT events rows in small transactions, some of them batches
python -m tests.integration.writer_proc URL INSTANCE hold
    open a transaction, append one row, print "HOLDING <token>", and commit
    only when a line arrives on stdin (then print "COMMITTED")
"""

from __future__ import annotations

import random
import sys

from replication.streams import EVENTS
from storage.store import open_store


def row(instance: str, n: int) -> list:
    return [f"${instance}-{n}", f"!room{n % 5}", "m.room.message", None, None]


def main() -> int:
    url, instance, mode = sys.argv[1:4]
    store = open_store(url)
    store.register_stream(EVENTS)
    if mode == "hold":
        with store.writing("events", instance) as txn:
            (token,) = txn.append([row(instance, 0)])
            print(f"HOLDING {token}", flush=True)
            sys.stdin.readline()
        print("COMMITTED", flush=True)
        store.close()
        return 0
    count = int(mode)
    rng = random.Random(instance)
    n = 0
    while n < count:
        size = min(rng.choice((1, 1, 2, 5)), count - n)
        store.append(
            "events", [row(instance, n + i) for i in range(size)], instance, batch=size > 1 and rng.random() < 0.3
        )
        n += size
    store.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
