"""Settings of the protocol and the master: plain attrs values, no Twisted.

The configuration loader (``scripts/config.py``) fills these; their defaults
are the configuration's defaults. They live apart from the Twisted code so
that tools which only read the configuration (``tickline write``) start fast.
"""

from __future__ import annotations

import attr

from storage.limits import DEFAULT_MAX_LINE_BYTES


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ProtocolConfig:
    """Protocol settings; these defaults are the configuration's defaults."""

    ping_interval: float = 5.0  # seconds between our PINGs
    ping_timeout: float = 15.0  # drop a peer silent this long (after its first PING)
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES  # longest accepted line (and RDATA line written), without its ending
    max_pause: float = 30.0  # drop a client that has not read for this long
    close_grace: float = 5.0  # after an ERROR and close, abort if still not flushed
    catchup_rows: int = 5000  # rows per storage read when replaying
    max_lag_bytes: int = 16 << 20  # a live connection this far behind the fan-out catches up on its own


@attr.s(slots=True, frozen=True, auto_attribs=True)
class MasterConfig:
    """Master settings; these defaults are the configuration's defaults."""

    server_name: str = "tickline"
    instance_name: str = "master"
    listen_host: str = "127.0.0.1"
    listen_port: int = 9322
    secret: str | None = None
    poll_interval: float = 0.05  # seconds between full passes over the store's heads (SQLite)
    change_check_interval: float = 0.005  # seconds between cheap looks for commits (SQLite: PRAGMA data_version)
    writer_timeout: float = 5.0  # drop a writer silent this long from the safe position (PostgreSQL)
    fanout_rows: int = 10000  # rows per storage read for live fan-out
    db_threads: int = 4
    recent_bytes: int = 64 << 20  # recent rows kept encoded in memory, all streams together
    tick_interval: float = 0.2  # seconds: the longest gap between TICKs of an idle stream


@attr.s(slots=True, frozen=True, auto_attribs=True)
class LimitsConfig:
    """Limits on what peers may hold on the master (``limits:``-style keys).

    The configuration loader fills these from ``master:`` and ``protocol:``
    keys of the same names; these defaults are the configuration's defaults,
    chosen for a port reachable from the internet. ``docs/operations.md``
    explains each one.
    """

    max_connections: int = 1000  # open connections in total; more are refused
    max_connections_per_address: int = 64  # open connections from one IP address
    auth_timeout: float = 30.0  # with a secret: close a connection not authenticated by then
    idle_timeout: float = 60.0  # close a connection that sent no valid command for this long
    line_timeout: float = 30.0  # close a connection whose line stays incomplete this long
    max_queued_bytes: int = 1048576  # replies queued for a peer that does not read; past it: ERROR, close
    max_name_bytes: int = 256  # longest NAME, instance, user id, app id, push key, server name
    max_instances_per_connection: int = 16  # distinct instance names one connection may use
    max_users_per_connection: int = 10000  # users one connection may mark as syncing
    log_lines_per_second: int = 10  # log lines about one peer per second; the rest is summarized
    max_log_lines_per_second: int = 100  # the same, over every peer together


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TLSConfig:
    """TLS for the master's port and for its clients (the ``tls:`` section).

    The master listens with TLS when ``cert`` and ``key`` are set, and then
    requires client certificates signed by ``client_ca`` when that is set.
    Clients (workers, ``tickline tail``) connect with TLS when ``ca`` is set
    (or the file also gives the master a ``cert``), verify the master's
    certificate against ``ca`` and its name or IP address against
    ``server_hostname`` (default: the host they connect to), and present
    ``client_cert``/``client_key`` when set.
    """

    cert: str | None = None  # the master's certificate chain (PEM)
    key: str | None = None  # the master's private key (PEM)
    client_ca: str | None = None  # CA(s) (PEM) that client certificates must be signed by
    ca: str | None = None  # CA(s) (PEM) a client verifies the master against
    client_cert: str | None = None  # the certificate a client presents (PEM)
    client_key: str | None = None  # its private key (PEM)
    server_hostname: str | None = None  # name or IP checked in the master's certificate

    @property
    def server_enabled(self) -> bool:
        return self.cert is not None

    @property
    def client_enabled(self) -> bool:
        return self.ca is not None or self.cert is not None
