"""Spark snapshots of a worker's replicated tables, consistent as of one token.

A worker copies each replicated stream into ``replicated_<stream>`` (the
stream's columns plus ``token``, ``instance_name`` and ``ts``) and moves the
stream's applied token in ``tickline_applied`` in the same transaction as the
rows. The table is append-only. So once the worker has applied token ``T``,
the set of rows with ``token <= T`` never changes again, and any number of
connections reading ``token <= T`` at any later moment see exactly the same
rows, however long they take and however fast the worker keeps writing.

A snapshot therefore takes two steps:

1. :func:`read_bounds`: one read transaction on the worker's database (plain
   Python, no Spark) reads the applied token ``T`` for the stream and the
   lowest and highest token of the rows in range.
2. :func:`load`: Spark's JDBC source reads ``token <= T`` (or
   ``after < token <= T`` for an incremental read), split into
   ``num_partitions`` ranges of ``token`` (``partitionColumn=token``, bounds
   from step 1). Each partition is its own connection and transaction.

:func:`snapshot` and :func:`incremental` do both::

    from workers.snapshot import spark_session, snapshot, incremental

    spark = spark_session()                      # local[2], 127.0.0.1, the Debian JDBC jars
    df, token = snapshot(spark, "sqlite:////var/lib/tickline/worker.db", "events")
    newer, token2 = incremental(spark, "sqlite:////var/lib/tickline/worker.db", "events", after=token)

Columns carry the stream's types on PostgreSQL and SQLite alike (see
:data:`SPARK_TYPES`); ``json`` columns arrive as JSON text: parse them with
:func:`parse_json` (``from_json`` with a schema) or
``pyspark.sql.functions.get_json_object``.

PySpark is imported only inside the functions that need it, so this module
loads fast. :class:`SparkSettings` (the ``spark:`` section) lives in
``workers.settings``, so the configuration does not import this module; it is
importable from here too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

import attr

from storage.contracts import SnapshotView
from storage.schema import StreamSchema
from storage.store import StorageError
from storage.urls import DatabaseUrl, parse_database_url, redact_url
from storage.worker_store import open_snapshot_reader
from workers.settings import DEFAULT_POSTGRESQL_JAR as DEFAULT_POSTGRESQL_JAR
from workers.settings import DEFAULT_SQLITE_JAR as DEFAULT_SQLITE_JAR
from workers.settings import SparkSettings as SparkSettings

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession

POSTGRESQL_DRIVER = "org.postgresql.Driver"
SQLITE_DRIVER = "org.sqlite.JDBC"

# tickline column type -> Spark SQL type. SQLite needs these spelled out
# (customSchema): through JDBC its BIGINT reads as decimal(20,0) and INTEGER as
# a 32-bit int. PostgreSQL's jsonb reads as a string as well.
SPARK_TYPES: dict[str, str] = {
    "text": "STRING",
    "bigint": "BIGINT",
    "double": "DOUBLE",
    "boolean": "BOOLEAN",
    "json": "STRING",
}
META_COLUMNS = (("token", "BIGINT"), ("instance_name", "STRING"), ("ts", "BIGINT"))


class SnapshotError(ValueError):
    """A snapshot that cannot be taken; the message says why and what to do."""


def require_spark() -> None:
    """Fail with one line naming the extra when PySpark is not installed."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise SnapshotError(
            "Spark support is not installed (pyspark is missing): pip install 'tickline[spark]'"
        ) from None


# -- step 1: the bounds, in one transaction ---------------------------------------------------------


@attr.s(slots=True, frozen=True, auto_attribs=True)
class SnapshotBounds:
    """What a snapshot reads: rows of ``stream`` with ``after < token <= token``."""

    url: DatabaseUrl
    schema: StreamSchema
    token: int  # the upper bound, inclusive
    after: int | None  # the lower bound, exclusive; None: from the start (a full snapshot)
    applied: int  # the worker's applied token for the stream when the bounds were read
    min_token: int | None  # lowest token of the rows in range; None: no rows
    max_token: int | None

    @property
    def stream(self) -> str:
        return self.schema.name

    @property
    def is_empty(self) -> bool:
        return self.min_token is None


def resolve_schema(
    stream: str, schema: StreamSchema | None = None, streams: Mapping[str, StreamSchema] | None = None
) -> StreamSchema:
    """The stream's schema: given, else from ``streams``, else a built-in stream."""
    if schema is not None:
        if schema.name != stream:
            raise SnapshotError(f"schema is for stream {schema.name!r}, not {stream!r}")
        return schema
    if streams is None:
        from replication.streams import all_streams

        streams = all_streams()
    if stream not in streams:
        raise SnapshotError(
            f"unknown stream {stream!r} (streams: {', '.join(sorted(streams))}); "
            "declare it under streams: in the config"
        )
    return streams[stream]


def read_bounds(
    url: str | DatabaseUrl,
    schema: StreamSchema,
    *,
    as_of: int | None = None,
    after: int | None = None,
    base_dir: str | None = None,
) -> SnapshotBounds:
    """Read the stream's applied token and token range in one read transaction.

    ``as_of`` picks an upper bound at or below the applied token (the default
    is the applied token itself); a token above it is an error, because those
    rows are not in the worker's database yet. ``after`` makes the range
    incremental: ``after < token <= upper``.
    """
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    for name, value in (("as_of", as_of), ("after", after)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise SnapshotError(f"{name} must be a token (a whole number >= 0), got {value!r}")
    table = schema.replicated_table
    wanted = ("token", "instance_name", "ts", *schema.column_names)
    try:
        reader = open_snapshot_reader(parsed)
    except StorageError as e:
        raise SnapshotError(str(e)) from None
    where = reader.describe()

    def run(view: SnapshotView) -> SnapshotBounds:
        if not view.has_table("tickline_applied"):
            raise SnapshotError(f"{where} is not a worker's database (it has no tickline_applied table)")
        if not view.has_table(table):
            raise SnapshotError(
                f"{where} has no table {table}: the worker does not replicate stream "
                f"{schema.name!r} (add it to worker.replicate or run the worker with --replicate {schema.name})"
            )
        columns = view.table_columns(table)
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise SnapshotError(
                f"table {table} in {where} lacks column(s) {', '.join(missing)} of stream "
                f"{schema.name!r}: the stream's declaration differs from the worker's"
            )
        applied = view.applied_token(schema.name)
        upper = applied if as_of is None else as_of
        if upper > applied:
            raise SnapshotError(
                f"token {upper} is above the worker's applied token {applied} for stream {schema.name!r}: "
                "those rows are not in its database yet"
            )
        if after is not None and after > upper:
            raise SnapshotError(
                f"after token {after} is above the upper bound {upper} for stream {schema.name!r} "
                f"(the worker's applied token is {applied})"
            )
        low, high = view.token_bounds(table, after, upper)
        return SnapshotBounds(parsed, schema, upper, after, applied, low, high)

    try:
        return reader.read(run)
    except StorageError as e:
        raise SnapshotError(str(e)) from None
    finally:
        reader.close()


def _where(url: DatabaseUrl) -> str:
    return f"SQLite database {url.path}" if url.is_sqlite else f"PostgreSQL database {redact_url(url.text)}"


# -- JDBC -----------------------------------------------------------------------------------------


def custom_schema(schema: StreamSchema) -> str:
    """Spark's ``customSchema`` for a replicated table: ``token BIGINT, instance_name STRING, ...``."""
    parts = [f"{name} {kind}" for name, kind in META_COLUMNS]
    parts += [f"{c.name} {SPARK_TYPES[c.type]}" for c in schema.columns]
    return ", ".join(parts)


def spark_schema(schema: StreamSchema) -> Any:
    """The DataFrame's schema as a ``StructType`` (nullable as declared; JSON as strings)."""
    from pyspark.sql import types as T

    kinds = {"STRING": T.StringType(), "BIGINT": T.LongType(), "DOUBLE": T.DoubleType(), "BOOLEAN": T.BooleanType()}
    fields = [T.StructField(name, kinds[kind], False) for name, kind in META_COLUMNS]
    fields += [T.StructField(c.name, kinds[SPARK_TYPES[c.type]], c.nullable) for c in schema.columns]
    return T.StructType(fields)


def jdbc_options(url: str | DatabaseUrl, base_dir: str | None = None) -> dict[str, str]:
    """JDBC ``url``, ``driver`` and connection properties for a tickline database URL.

    ``postgresql://user:password@host:port/db?sslmode=...`` becomes
    ``jdbc:postgresql://host:port/db`` with ``user`` and ``password``
    properties (``sslmode``, ``connect_timeout`` and ``application_name`` are
    carried over); ``sqlite:///path.db`` becomes ``jdbc:sqlite:/abs/path.db``.
    """
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    if parsed.is_sqlite:
        return {"url": f"jdbc:sqlite:{parsed.path}", "driver": SQLITE_DRIVER, "busy_timeout": "30000"}
    parts = urlsplit(parsed.dsn or "")
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    database = unquote(parts.path.lstrip("/"))
    options = {"url": f"jdbc:postgresql://{host}{port}/{database}", "driver": POSTGRESQL_DRIVER}
    if parts.username:
        options["user"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    carried = {
        "sslmode": "sslmode",
        "connect_timeout": "connectTimeout",
        "application_name": "ApplicationName",
        "user": "user",
        "password": "password",
    }
    for key, value in parse_qsl(parts.query):
        if key in ("dbname", "host", "port"):
            raise SnapshotError(
                f"PostgreSQL URL parameter {key!r} is not supported for Spark: put it in the URL itself"
            )
        if key in carried:
            options[carried[key]] = value
    return options


def _range_query(bounds: SnapshotBounds) -> str:
    return bounds.schema.replicated_range_sql(bounds.after, bounds.token)


def jdbc_read_options(bounds: SnapshotBounds, num_partitions: int, fetchsize: int) -> dict[str, str]:
    """Every option :func:`load` passes to Spark's JDBC source for these bounds."""
    options = jdbc_options(bounds.url)
    options.update(
        dbtable=_range_query(bounds),
        customSchema=custom_schema(bounds.schema),
        fetchsize=str(fetchsize),
    )
    if num_partitions > 1 and not bounds.is_empty and bounds.max_token != bounds.min_token:
        # The bounds only set the strides (Spark does not filter by them); the
        # range itself is in the query. upperBound + 1: the last token gets a
        # stride of its own share, not a partition of its own.
        options.update(
            partitionColumn="token",
            lowerBound=str(bounds.min_token),
            upperBound=str(int(bounds.max_token) + 1),  # type: ignore[arg-type]
            numPartitions=str(num_partitions),
        )
    return options


# -- step 2: the DataFrame ------------------------------------------------------------------------


@attr.s(slots=True, frozen=True, auto_attribs=True)
class Snapshot:
    """A DataFrame of one stream's rows in ``(after, token]``; unpacks as ``df, token``."""

    dataframe: DataFrame
    bounds: SnapshotBounds
    partitions: int  # the DataFrame's partitions (token ranges)

    @property
    def token(self) -> int:
        return self.bounds.token

    @property
    def after(self) -> int | None:
        return self.bounds.after

    @property
    def stream(self) -> str:
        return self.bounds.stream

    def __iter__(self) -> Iterator[Any]:
        yield self.dataframe
        yield self.token


def load(
    spark: SparkSession,
    bounds: SnapshotBounds,
    num_partitions: int | None = None,
    settings: SparkSettings | None = None,
) -> Snapshot:
    """Read the rows the bounds describe through Spark's JDBC source (lazily: Spark reads on an action)."""
    settings = settings or SparkSettings()
    partitions = settings.num_partitions if num_partitions is None else num_partitions
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise SnapshotError(f"num_partitions must be a whole number >= 1, got {partitions!r}")
    options = jdbc_read_options(bounds, partitions, settings.fetchsize)
    try:
        df = spark.read.format("jdbc").options(**options).load()
    except Exception as e:  # py4j's errors carry the Java exception's text
        raise _explain(e, bounds, settings) from None
    return Snapshot(df, bounds, _spark_partitions(options))


def _spark_partitions(options: Mapping[str, str]) -> int:
    """How many partitions Spark's JDBC source makes of these options (as ``JDBCRelation`` does),
    without the cost of ``df.rdd.getNumPartitions()``."""
    if "partitionColumn" not in options:
        return 1
    wanted = int(options["numPartitions"])
    span = int(options["upperBound"]) - int(options["lowerBound"])
    return wanted if span >= wanted else max(span, 1)


def _explain(error: Exception, bounds: SnapshotBounds, settings: SparkSettings) -> Exception:
    text = str(error)
    if "ClassNotFoundException" in text or "No suitable driver" in text:
        jar = settings.sqlite_jar if bounds.url.is_sqlite else settings.postgresql_jar
        return SnapshotError(
            f"the JDBC driver is not on Spark's classpath: build the session with workers.snapshot.spark_session() "
            f"or add {jar} to spark.jars (Debian: libxerial-sqlite-jdbc-java, libpostgresql-jdbc-java)"
        )
    first = next((line.strip() for line in text.splitlines() if "Exception" in line), text.strip()[:300])
    return SnapshotError(
        redact_url(f"Spark could not read {bounds.schema.replicated_table} from {_where(bounds.url)}: {first}")
    )


def snapshot(
    spark: SparkSession,
    url: str | DatabaseUrl,
    stream: str,
    schema: StreamSchema | None = None,
    *,
    as_of: int | None = None,
    num_partitions: int | None = None,
    settings: SparkSettings | None = None,
    streams: Mapping[str, StreamSchema] | None = None,
    base_dir: str | None = None,
) -> Snapshot:
    """The stream's rows with ``token <= T``, T the worker's applied token (or ``as_of``).

    ``schema`` defaults to the stream's entry in ``streams`` (for instance
    ``Config.streams``), else the built-in stream of that name.
    ``df, token = snapshot(spark, url, "events")`` unpacks the result.
    """
    bounds = read_bounds(url, resolve_schema(stream, schema, streams), as_of=as_of, base_dir=base_dir)
    return load(spark, bounds, num_partitions, settings)


def incremental(
    spark: SparkSession,
    url: str | DatabaseUrl,
    stream: str,
    after: int,
    schema: StreamSchema | None = None,
    *,
    upto: int | None = None,
    num_partitions: int | None = None,
    settings: SparkSettings | None = None,
    streams: Mapping[str, StreamSchema] | None = None,
    base_dir: str | None = None,
) -> Snapshot:
    """The rows with ``after < token <= T``, T the applied token (or ``upto``).

    Pass the previous read's token as ``after``: consecutive reads
    ``(0, T1]``, ``(T1, T2]``, ... together hold every row exactly once.
    """
    if after is None:
        raise SnapshotError("after is required for an incremental read (use snapshot() for everything)")
    bounds = read_bounds(url, resolve_schema(stream, schema, streams), as_of=upto, after=after, base_dir=base_dir)
    return load(spark, bounds, num_partitions, settings)


# -- JSON columns ---------------------------------------------------------------------------------


def parse_json(df: DataFrame, column: str, json_schema: Any, alias: str | None = None) -> DataFrame:
    """Replace the JSON text of ``column`` by its parsed value (``from_json`` with ``json_schema``).

    ``json_schema`` is a ``DataType`` or a DDL string such as ``"array<string>"``
    or ``"struct<a: bigint, b: string>"``; text that does not fit becomes null.
    With ``alias`` the parsed value goes into a new column and the text stays.
    For one field, ``get_json_object(col, "$.a")`` needs no schema.
    """
    from pyspark.sql import functions as F

    return df.withColumn(alias or column, F.from_json(F.col(column), json_schema))


# -- a local SparkSession -------------------------------------------------------------------------

_QUIET_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
"""


def _quiet_log_config() -> str:
    path = os.path.join(tempfile.gettempdir(), f"tickline-spark-log4j2-{os.geteuid()}.properties")
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == _QUIET_LOG4J2:
                return path
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix="tickline-log4j2-", suffix=".properties")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(_QUIET_LOG4J2)
    os.replace(tmp, path)
    return path


def spark_session(
    master: str = "local[2]",
    app_name: str = "tickline",
    settings: SparkSettings | None = None,
    conf: Mapping[str, str] | None = None,
    quiet: bool = False,
) -> SparkSession:
    """A local SparkSession bound to 127.0.0.1 with the system's JDBC jars (``spark.jars``).

    Nothing is downloaded: the jars are Debian's (``scripts/setup.sh`` installs
    them). ``quiet`` keeps the JVM's log to errors only. If a session is already
    running in this process, Spark returns that one and its jars stay as they were.
    """
    require_spark()
    settings = settings or SparkSettings()
    jars = [settings.postgresql_jar, settings.sqlite_jar]
    absent = [jar for jar in jars if not os.path.isfile(jar)]
    if len(absent) == len(jars):
        raise SnapshotError(
            f"no JDBC driver jar found ({', '.join(absent)}): run scripts/setup.sh "
            "(Debian packages libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java)"
        )
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.jars", ",".join(jar for jar in jars if jar not in absent))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
    )
    if quiet:
        builder = builder.config(
            "spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{_quiet_log_config()}"
        )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR" if quiet else "WARN")
    return spark


def output_name(stream: str, after: int | None, token: int) -> str:
    """The directory name of a written snapshot: ``<stream>_<after>_<token>`` (rows in ``(after, token]``)."""
    return f"{stream}_{after or 0}_{token}"
