"""A writer process for the time tests (run with ``python -m``).

python -m tests.integration.time_writer URL STREAM PLAN
    PLAN is a comma-separated list of steps: ``<n>x<gap_ms>`` writes n rows,
    one every gap_ms, and ``idle<ms>`` writes nothing for that long. Prints
    ``DONE <rows>`` at the end. Rows are ``[<stream>-<n>, ...]`` so each is unique.
"""

from __future__ import annotations

import sys
import time

from replication.streams import EVENTS
from storage.schema import Column, StreamSchema
from storage.store import open_store

NOTES = StreamSchema("notes", (Column("body", "text"),))


def main() -> int:
    url, stream, plan = sys.argv[1:4]
    store = open_store(url)
    schema = EVENTS if stream == "events" else NOTES
    store.register_stream(schema)
    n = 0
    for step in plan.split(","):
        if step.startswith("idle"):
            time.sleep(int(step[4:]) / 1000)
            continue
        count, gap = (int(x) for x in step.split("x"))
        for _ in range(count):
            body = f"{stream}-{n}"
            row = [body, "!r", "t", None, None] if stream == "events" else [body]
            store.append(stream, [row], f"w-{stream}")
            n += 1
            time.sleep(gap / 1000)
    store.close()
    print(f"DONE {n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
