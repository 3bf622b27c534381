"""Settings of the protocol and the master: plain attrs values, no Twisted.

The configuration loader (``scripts/config.py``) fills these; their defaults
are the configuration's defaults. They live apart from the Twisted code so
that tools which only read the configuration (``tickline write``) start fast.
"""

from __future__ import annotations

import attr


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ProtocolConfig:
    """Protocol settings; these defaults are the configuration's defaults."""

    ping_interval: float = 5.0  # seconds between our PINGs
    ping_timeout: float = 15.0  # drop a peer silent this long (after its first PING)
    max_line_bytes: int = 65536  # longest accepted line, without its line ending
    max_pause: float = 30.0  # drop a client that has not read for this long
    close_grace: float = 5.0  # after an ERROR and close, abort if still not flushed
    catchup_rows: int = 5000  # rows per storage read when replaying


@attr.s(slots=True, frozen=True, auto_attribs=True)
class MasterConfig:
    """Master settings; these defaults are the configuration's defaults."""

    server_name: str = "tickline"
    instance_name: str = "master"
    listen_host: str = "127.0.0.1"
    listen_port: int = 9322
    secret: str | None = None
    poll_interval: float = 0.05  # seconds between looks at the store's heads (SQLite)
    writer_timeout: float = 5.0  # drop a writer silent this long from the safe position (PostgreSQL)
    fanout_rows: int = 10000  # rows per storage read for live fan-out
    db_threads: int = 4
    tick_interval: float = 0.2  # seconds: the longest gap between TICKs of an idle stream
