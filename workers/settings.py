"""Settings of a worker: plain attrs values, no Twisted.

The configuration loader fills these; their defaults are the configuration's
defaults.
"""

from __future__ import annotations

import attr


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ApplySettings:
    apply_rows: int = 5000  # most rows per apply transaction
    # PostgreSQL, during a backlog: 2 copies every other full group on a second database thread
    # and connection while the group before commits (workers.worker, Worker._chain_in_db); 1: one.
    apply_connections: int = 1
    # The table replicator's applies (PostgreSQL COPY, SQLite): with at least apply_linger_rows rows
    # queued but not a full group, wait up to apply_linger seconds for more before applying
    # (workers.consumer, StreamConsumer.kick); None (the default): apply at once. Each COPY costs its
    # backend about 0.35 ms beyond its rows; 0.01 cut the CPU per row of bench end-to-end by 8 % but
    # not its wall time, and delays bulk rows (docs/benchmarks.md, e2e7).
    apply_linger: float | None = None
    apply_linger_rows: int = 256
    retry_initial: float = 0.5  # first delay after a failed apply, doubling
    retry_max: float = 30.0


@attr.s(slots=True, frozen=True, auto_attribs=True)
class WorkerConfig:
    """Worker settings; these defaults are the configuration's defaults."""

    name: str = "worker"
    master_host: str = "127.0.0.1"
    master_port: int = 9322
    database: str = "sqlite:///worker.db"
    server_name: str | None = None  # expected SERVER name; None accepts any
    replicate: tuple[str, ...] = ()  # streams copied into replicated_<stream>
    handlers: tuple[tuple[str, str], ...] = ()  # (stream, dotted path)
    invalidate_caches: bool = True  # follow the caches stream into the registry
    reconnect_initial: float = 0.1
    reconnect_max: float = 5.0
    replicate_retry: float = 5.0  # retry a REPLICATE the master refused
    max_pending_rows: int = 50000
    synchronous_commit: bool = False  # PostgreSQL worker database: wait for each apply's WAL flush
    ordered: bool | None = None  # timestamp order across streams; None: when 2+ streams have handlers
    start_at_ms: int | None = None  # a stream never applied here starts at this Unix ms (worker.start_at)
    apply: ApplySettings = ApplySettings()
    timeline: tuple[TimelineWorkerSettings, ...] = ()  # timeline topics consumed with handlers


@attr.s(slots=True, frozen=True, auto_attribs=True)
class TimelineWorkerSettings:
    """``worker.timeline``: consume a timeline topic with a handler; defaults are the config's."""

    handler: str  # dotted path: package.module:function, called with a TimelineJob
    topic: str = "jobs"
    consumer: str | None = None  # consumer id; None: the worker's name (keep it across restarts)
    credit: int = 10  # handlers running at once (active leases)
    lease_ms: int = 30_000  # extended automatically at half while the handler runs
    backoff_initial_ms: int = 1_000  # first RELEASE delay after a handler raised
    backoff_max_ms: int = 300_000  # the delay doubles per failure up to this


DEFAULT_POSTGRESQL_JAR = "/usr/share/java/postgresql.jar"  # Debian: libpostgresql-jdbc-java
DEFAULT_SQLITE_JAR = "/usr/share/java/sqlite-jdbc.jar"  # Debian: libxerial-sqlite-jdbc-java


@attr.s(slots=True, frozen=True, auto_attribs=True)
class SparkSettings:
    """The ``spark:`` section of the configuration (``tickline snapshot``, ``workers.snapshot``).

    Here, not in ``workers.snapshot``, so reading a configuration does not import
    what a snapshot needs (``tempfile`` and with it ``shutil``, ``bz2``, ``lzma``).
    """

    num_partitions: int = 4  # token ranges read in parallel (one JDBC connection each)
    postgresql_jar: str = DEFAULT_POSTGRESQL_JAR
    sqlite_jar: str = DEFAULT_SQLITE_JAR
    fetchsize: int = 10000  # rows per JDBC fetch; PostgreSQL streams through a cursor
