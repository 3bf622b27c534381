"""The configuration file: read once, here, into attrs objects for the layers below.

Every key's default is the default of the attrs field it fills
(``MasterConfig``, ``ProtocolConfig``); ``sample_config.yaml`` documents them.
Unknown keys, wrong types and bad addresses or URLs stop start-up with one
message naming the key.
"""

from __future__ import annotations

import logging
import math
import os
import reprlib
import typing
from collections.abc import Mapping
from typing import Any, Optional

import attr

from replication.logsafe import SafeFormatter
from replication.settings import LimitsConfig, MasterConfig, ProtocolConfig, TLSConfig
from replication.streams import all_streams, schema_from_config
from replication.timeline_settings import TimelineSettings
from scripts.when import BadInstant, parse_when
from storage.schema import NAME_WORD, SchemaError, StreamSchema
from storage.urls import BadDatabaseUrl, parse_database_url
from workers.settings import ApplySettings, SparkSettings, TimelineWorkerSettings, WorkerConfig

DEFAULT_DATABASE = "sqlite:///tickline.db"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_CONFIG_BYTES = 1024 * 1024


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


@attr.s(slots=True, frozen=True, auto_attribs=True)
class CacheSettings:
    """The worker's cache registry; these defaults are the configuration's defaults."""

    max_size: int | None = None  # entries per cache; None: unbounded
    special: dict[str, tuple[str, ...]] = attr.Factory(dict)  # name -> the caches it stands for


@attr.s(slots=True, frozen=True, auto_attribs=True)
class Config:
    master: MasterConfig = MasterConfig()
    protocol: ProtocolConfig = ProtocolConfig()
    database: str = DEFAULT_DATABASE
    log_level: str = "INFO"
    streams: dict[str, StreamSchema] = attr.Factory(all_streams)
    source: str | None = None
    worker: WorkerConfig = WorkerConfig()
    caches: CacheSettings = CacheSettings()
    metrics_listen: tuple[str, int] | None = None  # the master's /metrics; None: off
    worker_metrics_listen: tuple[str, int] | None = None  # a worker's /metrics; None: off
    spark: SparkSettings = SparkSettings()  # tickline snapshot and workers.snapshot
    limits: LimitsConfig = LimitsConfig()  # the master's limits (keys under master:)
    tls: TLSConfig = TLSConfig()  # the tls: section
    timeline: TimelineSettings = TimelineSettings()  # the master's timeline topics


def parse_address(value: Any, key: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into (host, port)."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{key}: expected HOST:PORT, got {_shown(value)}")
    host, _, port_text = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ConfigError(f"{key}: missing host in {_shown(value)}")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{key}: port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} is out of range 0-65535")
    return host, port


# The range of every number in the configuration, inclusive. Durations are in
# seconds. A value outside it (or not finite: .inf, .nan) stops start-up with
# a message naming the key and the range. Numbers not listed here take
# SECONDS or COUNT. docs/operations.md has the same table.
NUMBER_RANGES: dict[str, tuple[float, float]] = {
    "master.poll_interval": (0.001, 60.0),
    "master.change_check_interval": (0.001, 60.0),
    "master.writer_timeout": (0.1, 3600.0),
    "master.fanout_rows": (1, 1_000_000),
    "master.db_threads": (1, 64),
    "protocol.ping_interval": (0.01, 3600.0),
    "protocol.ping_timeout": (0.05, 86400.0),
    "protocol.max_line_bytes": (512, 16 * 1024 * 1024),
    "protocol.max_pause": (0.1, 86400.0),
    "protocol.close_grace": (0.01, 3600.0),
    "protocol.catchup_rows": (1, 1_000_000),
    "worker.reconnect_initial": (0.01, 3600.0),
    "worker.reconnect_max": (0.01, 86400.0),
    "worker.replicate_retry": (0.01, 86400.0),
    "worker.max_pending_rows": (1, 10_000_000),
    "worker.apply_rows": (1, 1_000_000),
    "worker.apply_connections": (1, 2),
    "worker.apply_linger": (0.001, 1.0),
    "worker.apply_linger_rows": (1, 1_000_000),
    "worker.retry_initial": (0.01, 3600.0),
    "worker.retry_max": (0.01, 86400.0),
    "caches.max_size": (1, 1_000_000_000),
    "spark.num_partitions": (1, 1024),
    "spark.fetchsize": (1, 10_000_000),
    "master.auth_timeout": (0.1, 86400.0),
    "master.idle_timeout": (0.1, 86400.0),
    "master.line_timeout": (0.1, 86400.0),
    "master.max_queued_bytes": (4096, 1024**3),
    "master.max_name_bytes": (16, 65536),
}
SECONDS = (0.001, 31_536_000.0)  # any other duration: 1 ms to a year
COUNT = (1, 2**31 - 1)  # any other whole number
SECRET_KEYS = frozenset({"secret"})  # never echoed in a message


def _range(key: str, kind: type) -> tuple[float, float]:
    return NUMBER_RANGES.get(key, SECONDS if kind is float else COUNT)


def _check_number(value: Any, kind: type, key: str) -> Any:
    what = "a positive number" if kind is float else "a positive whole number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
        raise ConfigError(f"{key}: expected {what}, got {_shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{key}: expected {what}, got {_shown(value)}")
    low, high = _range(key, kind)
    if not low <= value <= high:
        unit = " seconds" if kind is float else ""
        raise ConfigError(f"{key}: {_shown(value)} is out of range ({_number(low)} to {_number(high)}{unit})")
    return float(value) if kind is float else value


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shown(value: Any) -> str:
    """A value for a message, bounded (a hostile file may hold a huge one)."""
    return reprlib.repr(value)


def _check_type(value: Any, kind: Any, key: str) -> Any:
    if kind in ("float", float):
        return _check_number(value, float, key)
    if kind in ("int", int):
        return _check_number(value, int, key)
    if kind in ("str", str):
        if isinstance(value, str) and NAME_WORD.fullmatch(value):
            return value
        if key in SECRET_KEYS:  # a secret is never echoed, not even a wrong one
            raise ConfigError(f"{key}: expected one word of printable ASCII, 1 to 200 characters (value not shown)")
        raise ConfigError(f"{key}: expected one word of printable ASCII, got {_shown(value)}")
    if kind in ("bool", bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_shown(value)}")
    if kind in ("Optional[int]", "int | None", Optional[int]):  # noqa: UP045 (a runtime type to compare)
        return None if value is None else _check_type(value, int, key)
    if kind in ("Optional[float]", "float | None", Optional[float]):  # noqa: UP045 (a runtime type to compare)
        return None if value is None else _check_type(value, float, key)
    if kind in ("Optional[str]", "str | None", Optional[str]):  # noqa: UP045 (a runtime type to compare)
        return None if value is None else _check_type(value, str, key)
    raise AssertionError(f"no type check for {kind!r}")


def _checked(cls: type, section: Mapping[str, Any], prefix: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """Values for an attrs class from a mapping, checking each key's name and type."""
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in section.items():
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}: unknown key (known: {', '.join(sorted(allowed))})")
        values[key] = _check_type(value, hints[key], f"{prefix}{key}")
    return values


TOP_KEYS = (
    "server_name",
    "instance_name",
    "database",
    "listen",
    "secret",
    "metrics_listen",
    "master",
    "protocol",
    "streams",
    "logging",
    "worker",
    "caches",
    "spark",
    "tls",
    "timeline",
)


def load_config(path: str | None = None) -> Config:
    """Read and check a configuration file; no file means every default."""
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"config file {path} is not valid UTF-8 (line {line}, byte {e.start + 1})") from None
    import yaml  # only with a file: about 25 ms of a start without one

    try:
        raw = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
        raise ConfigError(f"config file {path} is not valid YAML: {e.problem or e.context}{where}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply") from None
    return config_from_mapping(raw or {}, source=path)


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {_shown(value)}")
    return value


def config_from_mapping(raw: Any, source: str | None = None) -> Config:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a mapping of keys, got {type(raw).__name__}")
    for key in raw:
        if key not in TOP_KEYS:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(TOP_KEYS)})")

    # server_name, instance_name and secret sit at the top, the rest under master:
    top_keys = ("server_name", "instance_name", "secret")
    section_keys = tuple(
        f.name for f in attr.fields(MasterConfig) if f.name not in (*top_keys, "listen_host", "listen_port")
    )
    master_section, limits = _limits_config(_section(raw, "master"))
    master_values = _checked(MasterConfig, master_section, "master.", section_keys)
    master_values.update(_checked(MasterConfig, {k: raw[k] for k in top_keys if k in raw}, "", top_keys))
    if "listen" in raw:
        master_values["listen_host"], master_values["listen_port"] = parse_address(raw["listen"], "listen")
    master = MasterConfig(**master_values)

    protocol_keys = tuple(f.name for f in attr.fields(ProtocolConfig))
    protocol = ProtocolConfig(**_checked(ProtocolConfig, _section(raw, "protocol"), "protocol.", protocol_keys))
    if protocol.ping_interval >= protocol.ping_timeout:
        raise ConfigError(
            f"protocol.ping_interval ({protocol.ping_interval:g} s) must be below "
            f"protocol.ping_timeout ({protocol.ping_timeout:g} s), or every peer times out"
        )

    database = raw.get("database", DEFAULT_DATABASE)
    try:
        parse_database_url(database)
    except BadDatabaseUrl as e:
        raise ConfigError(f"database: {e}") from None

    logging_section = _section(raw, "logging")
    for key in logging_section:
        if key != "level":
            raise ConfigError(f"logging.{key}: unknown key (known: level)")
    level = str(logging_section.get("level", "INFO")).upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"logging.level: expected one of {', '.join(LOG_LEVELS)}, got {level!r}")

    streams_section = _section(raw, "streams")
    try:
        declared = [schema_from_config(str(name), decl) for name, decl in streams_section.items()]
        streams = all_streams(declared)
    except SchemaError as e:
        raise ConfigError(f"streams: {e}") from None

    worker_section = dict(_section(raw, "worker"))
    worker_metrics = parse_metrics_address(worker_section.pop("metrics_listen", None), "worker.metrics_listen")
    worker = _worker_config(worker_section, streams, master)
    caches = _cache_settings(_section(raw, "caches"))
    metrics = parse_metrics_address(raw.get("metrics_listen"), "metrics_listen")
    spark_keys = tuple(f.name for f in attr.fields(SparkSettings))
    spark = SparkSettings(**_checked(SparkSettings, _section(raw, "spark"), "spark.", spark_keys))
    tls = _tls_config(_section(raw, "tls"))
    timeline = timeline_settings(_section(raw, "timeline"))
    return Config(
        master,
        protocol,
        database,
        level,
        streams,
        source,
        worker,
        caches,
        metrics,
        worker_metrics,
        spark=spark,
        limits=limits,
        tls=tls,
        timeline=timeline,
    )


def timeline_settings(section: Mapping[str, Any]) -> TimelineSettings:
    """The ``timeline:`` section: ``topics`` (a list of names; ``jobs`` always exists) and tuning."""
    keys = tuple(f.name for f in attr.fields(TimelineSettings))
    plain = {k: v for k, v in section.items() if k != "topics"}
    values = _checked(TimelineSettings, plain, "timeline.", keys)
    if "topics" in section:
        topics = _string_list(section["topics"], "timeline.topics")
        for topic in topics:
            if not NAME_WORD.fullmatch(topic):
                raise ConfigError(f"timeline.topics: {topic!r} is not one word of printable ASCII")
        values["topics"] = topics
    return TimelineSettings(**values)


# -- limits and TLS (issue 10: bounded resources, TLS) ------------------------------------


def _limits_config(master_section: Mapping[str, Any]) -> tuple[dict[str, Any], LimitsConfig]:
    """Split the ``master:`` section: the limit keys (``LimitsConfig``) and the rest."""
    limit_keys = tuple(f.name for f in attr.fields(LimitsConfig))
    rest = {k: v for k, v in master_section.items() if k not in limit_keys}
    values = _checked(LimitsConfig, {k: v for k, v in master_section.items() if k in limit_keys}, "master.", limit_keys)
    return rest, LimitsConfig(**values)


TLS_KEYS = tuple(f.name for f in attr.fields(TLSConfig))
_TLS_FILES = ("cert", "key", "client_ca", "ca", "client_cert", "client_key")


def _tls_config(section: Mapping[str, Any]) -> TLSConfig:
    """The ``tls:`` section: file paths (checked to be readable) and a host name."""
    values: dict[str, str | None] = {}
    for key, value in section.items():
        if key not in TLS_KEYS:
            raise ConfigError(f"tls.{key}: unknown key (known: {', '.join(TLS_KEYS)})")
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"tls.{key}: expected a file path, got {value!r}")
        if key in _TLS_FILES:
            try:
                with open(value, "rb"):
                    pass
            except OSError as e:
                raise ConfigError(f"tls.{key}: cannot read {value}: {e.strerror}") from None
        values[key] = value
    for a, b in (("cert", "key"), ("client_cert", "client_key")):
        if (a in values) != (b in values):
            raise ConfigError(f"tls.{a} and tls.{b} must be given together")
    if "client_ca" in values and "cert" not in values:
        raise ConfigError("tls.client_ca needs tls.cert and tls.key (client certificates are asked for over TLS)")
    tls = TLSConfig(**values)
    if values:
        from replication.tls import TLSFileError, check_files  # pyOpenSSL only when TLS is configured

        try:
            check_files(tls)
        except TLSFileError as e:
            raise ConfigError(str(e)) from None
    return tls


def parse_metrics_address(value: Any, key: str) -> tuple[str, int] | None:
    """``HOST:PORT``, or ``PORT`` alone on 127.0.0.1; None (the default) turns /metrics off."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and value.isdigit():
        value = f"127.0.0.1:{value}"
    return parse_address(value, key)


def _string_list(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key}: expected a list of names, got {_shown(value)}")
    return tuple(value)


def _worker_config(
    section: Mapping[str, Any], streams: Mapping[str, StreamSchema], master: MasterConfig
) -> WorkerConfig:
    special = ("master", "replicate", "handlers", "database", "ordered", "start_at", "timeline")
    apply_keys = tuple(f.name for f in attr.fields(ApplySettings))
    plain_keys = tuple(
        f.name
        for f in attr.fields(WorkerConfig)
        if f.name not in (*special, "master_host", "master_port", "apply", "start_at_ms")
    )
    plain = {k: v for k, v in section.items() if k not in special and k not in apply_keys}
    values = _checked(WorkerConfig, plain, "worker.", plain_keys)
    apply_values = _checked(ApplySettings, {k: v for k, v in section.items() if k in apply_keys}, "worker.", apply_keys)
    values["apply"] = ApplySettings(**apply_values)
    if "master" in section:
        values["master_host"], values["master_port"] = parse_address(section["master"], "worker.master")
    else:
        # Without worker.master, a worker follows the master of the same file.
        host = master.listen_host
        values["master_host"] = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        values["master_port"] = master.listen_port
    if "database" in section:
        try:
            parse_database_url(section["database"])
        except BadDatabaseUrl as e:
            raise ConfigError(f"worker.database: {e}") from None
        values["database"] = section["database"]
    if "replicate" in section:
        values["replicate"] = _string_list(section["replicate"], "worker.replicate")
        for stream in values["replicate"]:
            if stream not in streams:
                raise ConfigError(f"worker.replicate: unknown stream {stream!r}")
    handlers = section.get("handlers") or {}
    if not isinstance(handlers, Mapping):
        raise ConfigError("worker.handlers: expected a mapping of stream to a list of handler paths")
    pairs = []
    for stream, paths in handlers.items():
        if stream not in streams:
            raise ConfigError(f"worker.handlers.{stream}: unknown stream {stream!r}")
        pairs += [(stream, path) for path in _string_list(paths, f"worker.handlers.{stream}")]
    values["handlers"] = tuple(pairs)
    if section.get("ordered") is not None:
        values["ordered"] = _check_type(section["ordered"], bool, "worker.ordered")
    if section.get("start_at") is not None:
        try:
            values["start_at_ms"] = parse_when(section["start_at"])
        except BadInstant as e:
            raise ConfigError(f"worker.start_at: {e}") from None
    if "timeline" in section:
        values["timeline"] = worker_timeline(section["timeline"])
    worker = WorkerConfig(**values)
    for low, high in (("reconnect_initial", "reconnect_max"), ("retry_initial", "retry_max")):
        settings = worker.apply if low.startswith("retry") else worker
        if getattr(settings, low) > getattr(settings, high):
            raise ConfigError(
                f"worker.{low} ({getattr(settings, low):g} s) must not be above worker.{high} ({getattr(settings, high):g} s)"
            )
    if worker.apply.apply_linger_rows > worker.apply.apply_rows:
        # Then no group would ever be held or wait (both need at least apply_linger_rows, below apply_rows).
        raise ConfigError(
            f"worker.apply_linger_rows ({worker.apply.apply_linger_rows}) must not be above "
            f"worker.apply_rows ({worker.apply.apply_rows})"
        )
    return worker


def worker_timeline(value: Any) -> tuple[TimelineWorkerSettings, ...]:
    """``worker.timeline``: one mapping (or a list of them) of topic, handler, credit, lease, backoff."""
    entries = value if isinstance(value, list) else [value]
    keys = tuple(f.name for f in attr.fields(TimelineWorkerSettings))
    found = []
    for i, entry in enumerate(entries):
        prefix = "worker.timeline." if not isinstance(value, list) else f"worker.timeline[{i}]."
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{prefix[:-1]}: expected a mapping with topic and handler, got {entry!r}")
        if "handler" not in entry:
            raise ConfigError(f"{prefix}handler: missing (a dotted path, package.module:function)")
        handler = entry["handler"]
        if not isinstance(handler, str) or not handler.strip():
            raise ConfigError(f"{prefix}handler: expected a dotted path, got {handler!r}")
        values = _checked(TimelineWorkerSettings, {k: v for k, v in entry.items() if k != "handler"}, prefix, keys)
        found.append(TimelineWorkerSettings(handler=handler, **values))
    topics = [(s.topic, s.consumer) for s in found]
    if len(set(topics)) != len(topics):
        raise ConfigError("worker.timeline: a topic is consumed twice with the same consumer id")
    return tuple(found)


def _cache_settings(section: Mapping[str, Any]) -> CacheSettings:
    for key in section:
        if key not in ("max_size", "special"):
            raise ConfigError(f"caches.{key}: unknown key (known: max_size, special)")
    max_size = _check_type(section.get("max_size"), "int | None", "caches.max_size")
    special = section.get("special") or {}
    if not isinstance(special, Mapping):
        raise ConfigError("caches.special: expected a mapping of name to a list of cache names")
    expanded = {str(k): _string_list(v, f"caches.special.{k}") for k, v in special.items()}
    return CacheSettings(max_size, expanded)


def setup_logging(level: str) -> None:
    """One line per event on stderr; journald adds the time."""
    handler = logging.StreamHandler()
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    handler.setFormatter(SafeFormatter(fmt))  # peer text escaped even where a call forgot it
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level))
