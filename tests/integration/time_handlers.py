"""A handler that records what it is given, in the worker's database (same transaction as the token)."""

from __future__ import annotations

import time

from workers.handlers import ApplyContext, ReplicatedRow


def record(ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
    p = ctx.placeholder
    ctx.execute(
        "CREATE TABLE IF NOT EXISTS seen (n INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT, token BIGINT, "
        "ts BIGINT, body TEXT, applied_ms BIGINT)"
    )
    now_ms = int(time.time() * 1000)
    ctx.executemany(
        f"INSERT INTO seen (stream, token, ts, body, applied_ms) VALUES ({p}, {p}, {p}, {p}, {p})",
        [(r.stream, r.token, r.ts, str(r.values[0]), now_ms) for r in rows],
    )


def record_unless_paused(ctx: ApplyContext, rows: list[ReplicatedRow]) -> None:
    """Like :func:`record`, but fails (and is retried) while $TICKLINE_TEST_PAUSE names a file that exists."""
    import os

    pause = os.environ.get("TICKLINE_TEST_PAUSE")
    if pause and os.path.exists(pause):
        raise RuntimeError("paused by the test")
    record(ctx, rows)
