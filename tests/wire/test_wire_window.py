"""The window of recent rows filled from storage, on real sockets and both
backends: a master started on existing rows warms its window with the newest
of them (within half of ``recent_bytes``); replays that start below the window
have the rows up to it read into it once, however many replay at the same
time, and later replays are served from memory; a replay too large for the
window reads storage as before. Every client gets every row once, in order."""

from __future__ import annotations

import re

from storage.schema import Column, StreamSchema
from storage.store import open_store
from tests.wire.test_wire_fanout import BODY, Reader, pump

RECENT_BYTES = 2 << 20  # a fill takes at most 1 MiB of it
CONFIG = f"""
streams:
  blobs:
    columns:
      - {{name: body, type: text}}
master:
  recent_bytes: {RECENT_BYTES}
"""
BLOBS = StreamSchema("blobs", (Column("body", "text"),))
FILLED = re.compile(
    r"window of blobs filled for (.+?): tokens (\d+)\.\.(\d+), (\d+) bytes of (\d+) in all, (\d+) storage reads"
)


def rows(first: int, last: int) -> list[list[str]]:
    return [[f"{i:06d}{BODY}"] for i in range(first, last + 1)]


def fills(log: str) -> list[tuple[str, int, int, int, int, int]]:
    return [(m[0], int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in FILLED.findall(log)]


def test_a_master_started_on_existing_rows_warms_its_window_within_its_bytes(master, db_url) -> None:
    store = open_store(db_url)
    store.register_stream(BLOBS)
    total = 12_000  # about 2.6 MB of lines: more than a fill may take
    for start in range(1, total + 1, 3000):
        store.append("blobs", rows(start, start + 2999), "writer")
    store.close()
    m = master(CONFIG, database=db_url)
    log = m.wait_for_log("window of blobs filled for the start")
    ((_, first, last, stream_bytes, all_bytes, reads),) = fills(log)
    assert last == total and 1 < first <= total  # the newest rows, not all of them
    assert stream_bytes <= RECENT_BYTES // 2 and all_bytes <= RECENT_BYTES
    assert (total - first + 1) * len(BODY) > RECENT_BYTES // 4  # it did fill most of what it may
    assert reads >= 2  # a small first read, then reads sized from it
    # A replay inside the window: every row once, in order, and no fill.
    inside = Reader(m.host, m.port, "inside", b"REPLICATE blobs %d\n" % (first - 1))
    inside.expected = first
    pump([inside], total, timeout=30)
    assert inside.expected == total + 1
    # A replay from the start (older than the window, too large for it): storage, every row.
    old = Reader(m.host, m.port, "old", b"REPLICATE blobs 0\n")
    pump([old], total, timeout=60)
    assert old.expected == total + 1
    assert len(fills(m.log())) == 1
    for r in (inside, old):
        r.sock.close()


def test_concurrent_replays_below_the_window_share_one_fill(master, db_url) -> None:
    m = master(CONFIG, database=db_url)
    total = 3000  # about 0.7 MB: fits in a fill
    m.append("blobs", rows(1, total))
    # The master has followed the rows (a REPLICATE above its live token makes it look).
    probe = m.connect()
    probe.handshake()
    probe.send(f"REPLICATE blobs {total}")
    assert probe.next_command() == f"POSITION blobs master {total} {total}"
    replays = [Reader(m.host, m.port, f"replay{i}", b"REPLICATE blobs 0\n") for i in range(10)]
    pump(replays, total, timeout=60)
    assert all(r.expected == total + 1 for r in replays)
    filled = [f for f in fills(m.log()) if f[0] == "a replay"]
    assert len(filled) == 1, filled  # one fill for the ten replays
    assert filled[0][1:3] == (1, total)
    # Later replays are served from the window: no other fill, every row.
    late = [Reader(m.host, m.port, f"late{i}", b"REPLICATE blobs 0\n") for i in range(3)]
    pump(late, total, timeout=30)
    assert all(r.expected == total + 1 for r in late)
    assert len(fills(m.log())) == 1
    for r in [*replays, *late]:
        r.sock.close()
