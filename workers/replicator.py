"""Built-in handlers: the table replicator and the cache invalidator."""

from __future__ import annotations

from storage.schema import StreamSchema
from workers.caches import CacheRegistry
from workers.handlers import ApplyContext, Handler, ReplicatedRow


def table_replicator(schema: StreamSchema) -> Handler:
    """Copy rows into ``replicated_<stream>``: the columns plus token, instance_name, ts.

    The worker store writes them (many rows per statement on PostgreSQL).

    Each row is checked against the stream's columns first, so a worker whose
    declaration differs from the master's stops (and says why) instead of
    storing wrong data.
    """
    check = schema.check_row

    def replicate(ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
        ctx.transaction.replicate(schema, [(r.token, r.instance_name, r.ts, *check(r.values)) for r in rows])

    replicate.__name__ = f"replicate_{schema.name}"
    # Marks the replicator: a stream with no other handler may give the store
    # its rows as received (WorkerStore.apply_replicated), the same effect.
    replicate.replicates = schema  # type: ignore[attr-defined]
    return replicate


def cache_invalidator(registry: CacheRegistry) -> Handler:
    """Apply ``caches`` rows ``[cache_name, keys or null, invalidation_ts]`` to the registry."""

    def invalidate(ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
        for row in rows:
            cache_name, keys = row.values[0], row.values[1]
            if keys is not None and not isinstance(keys, list):
                keys = [keys]
            registry.invalidate(cache_name, keys)

    return invalidate
