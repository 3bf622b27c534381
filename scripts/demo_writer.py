"""A demo writer: appends an ``events`` row every half second, and a batch now and then."""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time

from scripts.config import load_config
from storage.store import open_store


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-c", "--config", metavar="FILE")
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    config = load_config(args.config)
    store = open_store(config.database, max_line_bytes=config.protocol.max_line_bytes)
    for schema in config.streams.values():
        store.register_stream(schema)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for n in itertools.count(1):
        room = f"!room{n % 3}:demo"
        if n % 5 == 0:
            rows = [[f"$demo{n}.{i}", room, "m.room.member", f"@user{i}:demo", None] for i in range(3)]
            store.append("events", rows, "demo-writer", batch=True)
        else:
            store.append("events", [[f"$demo{n}", room, "m.room.message", None, None]], "demo-writer")
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
