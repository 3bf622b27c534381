"""Stream definitions: the built-in streams, and streams declared in the config."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from storage.schema import Column, SchemaError, StreamSchema

EVENTS = StreamSchema(
    "events",
    (
        Column("event_id", "text"),
        Column("room_id", "text"),
        Column("type", "text"),
        Column("state_key", "text", nullable=True),
        Column("redacts", "text", nullable=True),
    ),
)

CACHES = StreamSchema(
    "caches",
    (
        Column("cache_name", "text"),
        Column("keys", "json", nullable=True),
        Column("invalidation_ts", "bigint"),
    ),
)

BUILTIN_STREAMS: tuple[StreamSchema, ...] = (EVENTS, CACHES)


def cache_invalidation_row(cache_name: str, keys: Sequence[Any] | None, now_ms: int) -> list[Any]:
    """A ``caches`` row: invalidate one key (its parts as a list) or, with None, the whole cache."""
    if not isinstance(cache_name, str) or not cache_name:
        raise SchemaError(f"cache name must be a non-empty string, got {cache_name!r}")
    if keys is not None and not isinstance(keys, (list, tuple)):
        raise SchemaError(f"cache keys must be a list of the key's parts or None, got {keys!r}")
    return [cache_name, None if keys is None else list(keys), now_ms]


def schema_from_config(name: str, declaration: Mapping[str, Any]) -> StreamSchema:
    """A stream from its config entry: ``{columns: [{name, type, nullable}]}``."""
    if not isinstance(declaration, Mapping):
        raise SchemaError(f"stream {name!r}: expected a mapping with 'columns'")
    unknown = sorted(set(declaration) - {"columns"})
    if unknown:
        raise SchemaError(f"stream {name!r}: unknown key {unknown[0]!r}")
    columns = declaration.get("columns")
    if not isinstance(columns, list) or not columns:
        raise SchemaError(f"stream {name!r}: 'columns' must be a non-empty list")
    built = []
    for i, column in enumerate(columns):
        if not isinstance(column, Mapping):
            raise SchemaError(f"stream {name!r}: column {i} must be a mapping with name and type")
        extra = sorted(set(column) - {"name", "type", "nullable"})
        if extra:
            raise SchemaError(f"stream {name!r}: column {i} has unknown key {extra[0]!r}")
        if "name" not in column or "type" not in column:
            raise SchemaError(f"stream {name!r}: column {i} needs 'name' and 'type'")
        built.append(Column(column["name"], column["type"], column.get("nullable", False)))
    return StreamSchema(name, tuple(built))


def all_streams(declared: Iterable[StreamSchema] = ()) -> dict[str, StreamSchema]:
    """The built-ins plus declared streams; a declared stream may not redefine a built-in."""
    streams = {s.name: s for s in BUILTIN_STREAMS}
    for schema in declared:
        if schema.name in streams:
            raise SchemaError(f"stream {schema.name!r} is built in and cannot be redeclared")
        streams[schema.name] = schema
    return streams
