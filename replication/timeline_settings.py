"""Settings of the master's timeline: plain attrs values, no Twisted.

The configuration loader (``scripts/config.py``, section ``timeline:``) fills
these; their defaults are the configuration's defaults.
"""

from __future__ import annotations

import attr

DEFAULT_TOPIC = "jobs"


def _with_default_topic(topics: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys((DEFAULT_TOPIC, *topics)))


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TimelineSettings:
    """The master's timeline; these defaults are the configuration's defaults."""

    topics: tuple[str, ...] = attr.ib(default=(DEFAULT_TOPIC,), converter=_with_default_topic)  # `jobs` always exists
    batch: int = 64  # new leases per consumer per cycle, plus the credit its DELETEs free (paces bursts)
    max_batch: int = 500  # changes in one cycle (one transaction, one commit) at most
    batch_flights: int = 2  # cycles in flight at once (one gathers while one commits)
    max_pending: int = 1000  # timeline commands in flight per connection before reading pauses
    remove_interval: float = 5.0  # seconds between batch removals of deleted messages (and counts for metrics)
    remove_batch: int = 5000  # deleted messages removed per transaction (more while full, 20 at most)
    buckets: int = 1  # buckets a topic's messages are spread over (chosen at random when scheduled)
    db_threads: int = 4  # the timeline's own database threads
