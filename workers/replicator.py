"""Built-in handlers: the table replicator and the cache invalidator."""

from __future__ import annotations

from storage.schema import StreamSchema
from workers.caches import CacheRegistry
from workers.handlers import ApplyContext, Handler, ReplicatedRow


class TableReplicator:
    """Copy rows into ``replicated_<stream>``: the columns plus token, instance_name, ts.

    The worker store writes them (many rows per statement on PostgreSQL). A
    stream whose only handler is this one may give the store its rows as
    received instead (``WorkerStore.apply_replicated``): the same effect.

    Each row is checked against the stream's columns first, so a worker whose
    declaration differs from the master's stops (and says why) instead of
    storing wrong data.
    """

    def __init__(self, schema: StreamSchema) -> None:
        self.schema = schema

    def __call__(self, ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
        check = self.schema.check_row
        ctx.transaction.replicate(self.schema, [(r.token, r.instance_name, r.ts, *check(r.values)) for r in rows])


def table_replicator(schema: StreamSchema) -> Handler:
    """The :class:`TableReplicator` of ``schema``."""
    return TableReplicator(schema)


def cache_invalidator(registry: CacheRegistry) -> Handler:
    """Apply ``caches`` rows ``[cache_name, keys or null, invalidation_ts]`` to the registry."""

    def invalidate(ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
        for row in rows:
            cache_name, keys = row.values[0], row.values[1]
            if keys is not None and not isinstance(keys, list):
                keys = [keys]
            registry.invalidate(cache_name, keys)

    return invalidate
