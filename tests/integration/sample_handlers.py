"""Handlers loaded by dotted path from a worker's config in the integration tests."""

from __future__ import annotations

from workers.handlers import ApplyContext, ReplicatedRow


def count_rooms(ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
    """Keep a per-room count of events, in the same transaction as the token."""
    ctx.execute("CREATE TABLE IF NOT EXISTS room_counts (room_id TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    for row in rows:
        room = row.as_dict(ctx.schema)["room_id"]
        ctx.execute(
            "INSERT INTO room_counts (room_id, n) VALUES (?, 1) ON CONFLICT (room_id) DO UPDATE SET n = n + 1",
            (room,),
        )


def record_invalidations(ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
    ctx.execute("CREATE TABLE IF NOT EXISTS seen_invalidations (token INTEGER, cache_name TEXT, keys TEXT)")
    for row in rows:
        ctx.execute(
            "INSERT INTO seen_invalidations VALUES (?, ?, ?)",
            (row.token, row.values[0], None if row.values[1] is None else repr(row.values[1])),
        )
