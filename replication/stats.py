"""Process-wide protocol counters, cheap enough for the hot path.

Plain integers and dicts updated on the reactor thread; the metrics endpoint
(``scripts/metrics.py``) reads them at scrape time.
"""

from __future__ import annotations

import collections


class ProtocolStats:
    def __init__(self) -> None:
        self.sent: collections.Counter[str] = collections.Counter()  # commands by name
        self.received: collections.Counter[str] = collections.Counter()
        self.bytes_sent = 0
        self.bytes_received = 0


STATS = ProtocolStats()
