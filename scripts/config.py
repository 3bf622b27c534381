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
from typing import Any, Mapping, Optional

import attr
import yaml

from replication.master import MasterConfig
from replication.protocol import ProtocolConfig
from replication.streams import all_streams, schema_from_config
from storage.schema import SchemaError, StreamSchema
from storage.urls import BadDatabaseUrl, parse_database_url

DEFAULT_DATABASE = "sqlite:///tickline.db"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


@attr.s(slots=True, frozen=True, auto_attribs=True)
class Config:
    master: MasterConfig = MasterConfig()
    protocol: ProtocolConfig = ProtocolConfig()
    database: str = DEFAULT_DATABASE
    log_level: str = "INFO"
    streams: dict[str, StreamSchema] = attr.Factory(all_streams)
    source: Optional[str] = None


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
        if isinstance(value, str) and value and not any(c.isspace() for c in value):
            return value
        raise ConfigError(f"{key}: expected one word of text, got {value!r}")
    if kind in ("Optional[str]", Optional[str]):
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


TOP_KEYS = ("server_name", "instance_name", "database", "listen", "secret", "master", "protocol", "streams", "logging")


def load_config(path: Optional[str] = None) -> Config:
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


def config_from_mapping(raw: Any, source: Optional[str] = None) -> Config:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a mapping of keys, got {type(raw).__name__}")
    for key in raw:
        if key not in TOP_KEYS:
            raise ConfigError(f"{key}: unknown key (known: {', '.join(TOP_KEYS)})")

    # server_name, instance_name and secret sit at the top, the rest under master:
    top_keys = ("server_name", "instance_name", "secret")
    section_keys = tuple(
        f.name for f in attr.fields(MasterConfig) if f.name not in top_keys + ("listen_host", "listen_port")
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

    return Config(master, protocol, database, level, streams, source)


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
