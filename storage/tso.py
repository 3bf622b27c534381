"""The timestamp oracle's arithmetic: 46 bits of Unix milliseconds, 18 of counter.

A timestamp is ``physical_ms << 18 | logical``. Allocation takes the last
timestamp handed out (persisted by the caller before the new ones are used)
and the wall clock, and never goes back: if the clock steps backwards the
logical counter keeps counting on from the last value, and if the counter
overflows it carries into the physical part, which is still strictly
increasing. The persisted last value lives in the database (see
``storage.sqlite_store`` and ``storage.pg_store``), so the order holds across processes and restarts.
"""

from __future__ import annotations

PHYSICAL_BITS = 46
LOGICAL_BITS = 18
LOGICAL_MASK = (1 << LOGICAL_BITS) - 1
MAX_TIMESTAMP = (1 << (PHYSICAL_BITS + LOGICAL_BITS)) - 1


def compose(physical_ms: int, logical: int = 0) -> int:
    if not 0 <= logical <= LOGICAL_MASK:
        raise ValueError(f"logical part {logical} does not fit in {LOGICAL_BITS} bits")
    return (physical_ms << LOGICAL_BITS) | logical


def physical_ms(ts: int) -> int:
    """The Unix milliseconds of a timestamp."""
    return ts >> LOGICAL_BITS


def logical(ts: int) -> int:
    return ts & LOGICAL_MASK


def allocate(last: int, now_ms: int, count: int = 1) -> int:
    """The first of ``count`` consecutive timestamps after ``last`` at time ``now_ms``.

    The caller hands out ``first .. first + count - 1`` and persists the last one.
    """
    if count < 1:
        raise ValueError("count must be at least 1")
    first = max(last + 1, compose(max(now_ms, 0)))
    if first + count - 1 > MAX_TIMESTAMP:
        raise OverflowError("timestamp space exhausted")
    return first
