"""The worker's young-generation threshold: a backlog's rows never start a collection by themselves."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from scripts.run_worker import DEFAULT_YOUNG_THRESHOLD, MAX_YOUNG_THRESHOLD, young_threshold
from workers.settings import WorkerConfig

PENDING = WorkerConfig().max_pending_rows  # the default bound of the queue


def test_the_threshold_is_above_what_the_queue_holds_and_bounded() -> None:
    pending = PENDING
    assert young_threshold(pending) == 2 * pending
    assert young_threshold(1) == DEFAULT_YOUNG_THRESHOLD
    assert young_threshold(10_000_000) == MAX_YOUNG_THRESHOLD


@contextmanager
def _collections(threshold: int) -> Iterator[list[int]]:
    seen: list[int] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(threshold, *old[1:])
    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*old)


def _backlog(rows: int) -> None:
    """Rows as the client parses them (a list each), queued, then freed as their groups are applied."""
    queue = []
    for start in range(0, rows, 500):
        queue.append([["$event", "!room:example.org", "m.room.message", None, None, start + i] for i in range(500)])
    while queue:
        queue.pop(0)


def test_a_full_queue_of_rows_starts_no_collection() -> None:
    rows = PENDING
    with _collections(young_threshold(rows)) as seen:
        _backlog(rows)
    assert seen == []
    with _collections(DEFAULT_YOUNG_THRESHOLD) as seen:
        _backlog(rows)
    assert len(seen) > rows // DEFAULT_YOUNG_THRESHOLD // 2  # what the default threshold did
