"""The configuration file: read once, here, into attrs objects for the layers below.

Every key's default is the default of the attrs field it fills
(``MasterConfig``, ``ProtocolConfig``); ``sample_config.yaml`` documents them.
Unknown keys, wrong types and bad addresses or URLs stop start-up with one
message naming the key.
"""

from __future__ import annotations

import logging
import os
import typing
from collections.abc import Mapping
from typing import Any, Optional

import attr
import yaml

from replication.settings import MasterConfig, ProtocolConfig
from replication.streams import all_streams, schema_from_config
from scripts.when import BadInstant, parse_when
from storage.schema import NAME_WORD, SchemaError, StreamSchema
from storage.urls import BadDatabaseUrl, parse_database_url
from workers.settings import ApplySettings, WorkerConfig
from workers.snapshot import SparkSettings

DEFAULT_DATABASE = "sqlite:///tickline.db"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


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


def parse_address(value: Any, key: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into (host, port)."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{key}: expected HOST:PORT, got {value!r}")
    host, _, port_text = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ConfigError(f"{key}: missing host in {value!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{key}: port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} is out of range 0-65535")
    return host, port


def _check_type(value: Any, kind: Any, key: str) -> Any:
    if kind in ("float", float):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
        raise ConfigError(f"{key}: expected a positive number, got {value!r}")
    if kind in ("int", int):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        raise ConfigError(f"{key}: expected a positive whole number, got {value!r}")
    if kind in ("str", str):
        if isinstance(value, str) and NAME_WORD.fullmatch(value):
            return value
        raise ConfigError(f"{key}: expected one word of printable ASCII, got {value!r}")
    if kind in ("bool", bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind in ("Optional[int]", "int | None", Optional[int]):  # noqa: UP045 (a runtime type to compare)
        return None if value is None else _check_type(value, int, key)
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
)


def load_config(path: str | None = None) -> Config:
    """Read and check a configuration file; no file means every default."""
    if path is None:
        return Config()
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    return config_from_mapping(raw or {}, source=path)


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
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
    master_values = _checked(MasterConfig, _section(raw, "master"), "master.", section_keys)
    master_values.update(_checked(MasterConfig, {k: raw[k] for k in top_keys if k in raw}, "", top_keys))
    if "listen" in raw:
        master_values["listen_host"], master_values["listen_port"] = parse_address(raw["listen"], "listen")
    master = MasterConfig(**master_values)

    protocol_keys = tuple(f.name for f in attr.fields(ProtocolConfig))
    protocol = ProtocolConfig(**_checked(ProtocolConfig, _section(raw, "protocol"), "protocol.", protocol_keys))

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
    return Config(
        master, protocol, database, level, streams, source, worker, caches, metrics, worker_metrics, spark=spark
    )


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
        raise ConfigError(f"{key}: expected a list of names, got {value!r}")
    return tuple(value)


def _worker_config(
    section: Mapping[str, Any], streams: Mapping[str, StreamSchema], master: MasterConfig
) -> WorkerConfig:
    special = ("master", "replicate", "handlers", "database", "ordered", "start_at")
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
    return WorkerConfig(**values)


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
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level))
