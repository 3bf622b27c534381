"""The timeline store on SQLite and PostgreSQL (one SQL text, two dialects).

Composition: the store holds a database object (``SqliteDatabase`` or
``PgDatabase``) and runs each operation as one transaction whose change is
ONE conditional statement (an ``UPDATE``/``INSERT`` whose ``WHERE`` is the
operation's condition and the caller's version). When the statement changes
nothing, a read of the row names the condition that failed; nothing changed.

Leasing due messages takes ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so two
masters (or two connections) racing for one message never both get it; on
SQLite every write holds the database's write lock.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from storage.timeline_contract import (
    AVAILABLE,
    LEASE_EXPIRED,
    LEASED,
    NOT_DUE,
    NOT_HOLDER,
    NOT_OWNER,
    PROCESSING,
    STALE_VERSION,
    STATUSES,
    UNKNOWN_MESSAGE,
    WAITING,
    Database,
    Leased,
    Outcome,
    PassResult,
    TimelineMessage,
    new_message_id,
)
from storage.urls import DatabaseUrl, parse_database_url

TABLE = "tickline_timeline"
# Operations apply() may batch into one transaction.
BATCHABLE = frozenset(
    {"schedule", "move", "cancel", "lease", "lease_due", "extend", "release", "delete", "next_due", "active_leases"}
)
_COLUMNS = "topic, id, ts, body, producer_group, consumer, bucket, version, created_ms"
_COLUMN_LIST = _COLUMNS.split(", ")


def _message_key(call: tuple[str, tuple[Any, ...]]) -> tuple[str, str]:
    """(topic, id) of a batched call (generated ids first); reads come after every change."""
    name, args = call
    if name in ("schedule", "move", "cancel"):
        return args[0], args[2] or ""
    if name in ("lease", "extend", "release", "delete"):
        return args[0], args[1]
    return "\uffff", ""


def _deal(due: list[Any], consumers: list[str], remaining: list[int]) -> list[int]:
    """Deal due rows (earliest first; row[3] is the last holder) over requests in turn.

    Returns the request index of each row. A row goes to the next request in
    turn with room whose consumer was not its last holder (an expired lease
    goes to someone else first), else to any with room. ``remaining`` is
    used up in place; the rows are never more than the room.
    """
    assigned = []
    n = len(consumers)
    turn = 0
    for row in due:
        last = row[3]
        pick = -1
        for k in range(n):
            j = (turn + k) % n
            if remaining[j] > 0 and consumers[j] != last:
                pick = j
                break
        if pick < 0:
            pick = next(j for j in range(n) if remaining[j] > 0)
        remaining[pick] -= 1
        assigned.append(pick)
        turn = pick + 1
    return assigned


def _pg_array(words: Sequence[str]) -> str:
    """A PostgreSQL text array literal (one parameter, parsed once by the server, not a node per element)."""
    return "{" + ",".join('"' + w.replace("\\", "\\\\").replace('"', '\\"') + '"' for w in words) + "}"


def _message(row: Any) -> TimelineMessage:
    topic, mid, ts, body, group, consumer, bucket, version, created = row
    return TimelineMessage(topic, mid, int(ts), body, group, consumer, int(bucket), int(version), int(created))


class SqlTimelineStore:
    """A timeline store over a database object (see the module's doc)."""

    def __init__(self, db: Database, buckets: int = 1, id_factory: Callable[[int], str] = new_message_id) -> None:
        if buckets < 1:
            raise ValueError("buckets must be at least 1")
        self.db = db
        self.buckets = buckets
        self._new_id = id_factory
        self._pg = db.dialect == "postgresql"
        self._batch = threading.local()

    # -- transactions ------------------------------------------------------------------
    # Each operation runs in its own transaction, or, inside apply(), in the
    # batch's one transaction (the cursor of the current thread's batch).

    def _write(self, fn: Callable[[Any], Any]) -> Any:
        cur = getattr(self._batch, "cur", None)
        return fn(cur) if cur is not None else self.db.write(fn)

    def _read(self, fn: Callable[[Any], Any]) -> Any:
        cur = getattr(self._batch, "cur", None)
        return fn(cur) if cur is not None else self.db.read(fn)

    def apply(self, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run several operations (method name, arguments) in ONE transaction; results in order.

        Each operation is still its own conditional statement and its own
        outcome (a refusal changes nothing and does not stop the others); the
        batch shares one commit, so nothing of it is acknowledged before all
        of it is durable. A database error rolls the whole batch back.
        """
        self._check_batchable(calls)

        def run(cur: Any) -> list[Any]:
            self._batch.cur = cur
            try:
                return self._apply_calls(cur, calls)
            finally:
                self._batch.cur = None

        result: list[Any] = self.db.write(run)
        return result

    def cycle(
        self,
        calls: Sequence[tuple[str, tuple[Any, ...]]],
        frees: Sequence[tuple[int, int] | None],
        passes: Sequence[tuple[str, Sequence[tuple[str, int, int]], int]],
    ) -> tuple[list[Any], list[PassResult]]:
        """The master's cycle, in ONE transaction: the changes, then a lease pass per topic.

        ``calls`` run as in :meth:`apply`. ``passes`` are (topic, requests,
        now) with requests (consumer, lease_ms, how many); ``frees[i]`` names
        the (pass, request) whose credit call ``i`` frees when it succeeds (a
        ``DELETE`` or ``RELEASE`` of a lease the consumer held): the pass asks
        that many more, so credit freed by a change is used again in the same
        commit. One durable commit for the whole cycle; nothing of it is
        acknowledged or sent before it.
        """
        self._check_batchable(calls)

        def run(cur: Any) -> tuple[list[Any], list[PassResult]]:
            self._batch.cur = cur
            try:
                results = self._apply_calls(cur, calls) if calls else []
                asks = [[n for _, _, n in requests] for _, requests, _ in passes]
                for result, free in zip(results, frees, strict=True):
                    if free is not None and isinstance(result, Outcome) and result.ok:
                        asks[free[0]][free[1]] += 1
                out = []
                for (topic, requests, now_ms), ask in zip(passes, asks, strict=True):
                    reqs = [(c, lease, n) for (c, lease, _), n in zip(requests, ask, strict=True)]
                    out.append(self._lease_round(cur, topic, reqs, now_ms, exact_next_due=False))
                return results, out
            finally:
                self._batch.cur = None

        result: tuple[list[Any], list[PassResult]] = self.db.write(run)
        return result

    @staticmethod
    def _check_batchable(calls: Sequence[tuple[str, tuple[Any, ...]]]) -> None:
        for name, _ in calls:
            if name not in BATCHABLE:
                raise ValueError(f"{name!r} cannot run in a batch")

    def _apply_calls(self, cur: Any, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        results: list[Any] = [None] * len(calls)
        done: set[int] = set()
        if self._pg:
            # Deletes that carry the leased row's tid: one statement per topic.
            groups: dict[str, list[int]] = {}
            for i, (name, args) in enumerate(calls):
                if name == "delete" and len(args) > 5 and args[5] is not None:
                    groups.setdefault(args[0], []).append(i)
            for topic, positions in groups.items():
                first: dict[str, int] = {}
                for i in positions:
                    first.setdefault(calls[i][1][1], i)
                unique = sorted(first.values())
                items = [(a[5], a[1], a[2], a[3], a[4]) for a in (calls[i][1] for i in unique)]
                for i, outcome in zip(unique, self._delete_by_tid(cur, topic, items), strict=True):
                    if outcome is not None:
                        results[i] = outcome
                        done.add(i)
        # The rest one by one, in message order (concurrent batches lock rows
        # in the same order; one message's changes keep their order).
        rest = sorted((i for i in range(len(calls)) if i not in done), key=lambda i: _message_key(calls[i]))
        for i in rest:
            name, args = calls[i]
            results[i] = getattr(self, name)(*args)
        return results

    def _sql(self, text: str) -> str:
        return text.replace("?", "%s") if self._pg else text

    def _one(self, cur: Any, sql: str, params: tuple[Any, ...]) -> Any:
        return cur.execute(self._sql(sql), params).fetchone()

    def _all(self, cur: Any, sql: str, params: tuple[Any, ...]) -> list[Any]:
        return list(cur.execute(self._sql(sql), params).fetchall())

    def close(self) -> None:
        self.db.close()

    def migrate(self) -> list[int]:
        return list(self.db.migrate())

    # -- producers -------------------------------------------------------------------

    def schedule(self, topic: str, group: str, message_id: str | None, at_ms: int, body: str, now_ms: int) -> Outcome:
        """A new message at ``at_ms``; the same id again returns the existing message unchanged.

        An id whose message was deleted (marked, not yet removed) is scheduled
        anew, with a higher version than the deleted one had.
        """
        mid = message_id if message_id is not None else self._new_id(now_ms)
        bucket = random.randrange(self.buckets) if self.buckets > 1 else 0

        def run(cur: Any) -> Outcome:
            row = self._one(
                cur,
                f"INSERT INTO {TABLE} ({_COLUMNS}, deleted_ms) VALUES (?, ?, ?, ?, ?, NULL, ?, 1, ?, NULL) "
                f"ON CONFLICT (topic, id) DO UPDATE SET ts = excluded.ts, body = excluded.body, "
                f"producer_group = excluded.producer_group, consumer = NULL, bucket = excluded.bucket, "
                f"version = {TABLE}.version + 1, created_ms = excluded.created_ms, deleted_ms = NULL "
                f"WHERE {TABLE}.deleted_ms IS NOT NULL "
                f"RETURNING {_COLUMNS}",
                (topic, mid, at_ms, body, group, bucket, now_ms),
            )
            if row is not None:
                return Outcome(True, _message(row), created=True)
            existing = self._get(cur, topic, mid)
            if existing is None:  # removed between the two statements: try again
                return Outcome.refused(UNKNOWN_MESSAGE)
            if existing.group != group:
                return Outcome.refused(NOT_OWNER)
            return Outcome(True, existing, created=False)

        for _ in range(3):
            outcome: Outcome = self._write(run)
            if outcome.ok or outcome.reason != UNKNOWN_MESSAGE or getattr(self._batch, "cur", None) is not None:
                return outcome
        return outcome

    def move(self, topic: str, group: str, message_id: str, at_ms: int, now_ms: int) -> Outcome:
        """The owner moves a message that has no active lease (an expired lease is dropped)."""
        return self._owner_change(
            topic,
            group,
            message_id,
            now_ms,
            f"UPDATE {TABLE} SET ts = ?, consumer = NULL, version = version + 1 "
            "WHERE topic = ? AND id = ? AND deleted_ms IS NULL AND producer_group = ? "
            "AND (consumer IS NULL OR ts <= ?) "
            f"RETURNING {_COLUMNS}",
            (at_ms, topic, message_id, group, now_ms),
        )

    def cancel(self, topic: str, group: str, message_id: str, now_ms: int) -> Outcome:
        """The owner deletes a message that has no active lease."""
        return self._owner_change(
            topic,
            group,
            message_id,
            now_ms,
            f"UPDATE {TABLE} SET deleted_ms = ?, version = version + 1 "
            "WHERE topic = ? AND id = ? AND deleted_ms IS NULL AND producer_group = ? "
            "AND (consumer IS NULL OR ts <= ?) "
            f"RETURNING {_COLUMNS}",
            (now_ms, topic, message_id, group, now_ms),
        )

    def _owner_change(
        self, topic: str, group: str, message_id: str, now_ms: int, sql: str, params: tuple[Any, ...]
    ) -> Outcome:
        def run(cur: Any) -> Outcome:
            row = self._one(cur, sql, params)
            if row is not None:
                return Outcome(True, _message(row))
            current = self._get(cur, topic, message_id)
            if current is None:
                return Outcome.refused(UNKNOWN_MESSAGE)
            if current.group != group:
                return Outcome.refused(NOT_OWNER)
            return Outcome.refused(LEASED)

        result: Outcome = self._write(run)
        return result

    # -- the master, for consumers ---------------------------------------------------

    def lease(self, topic: str, message_id: str, consumer: str, lease_ms: int, now_ms: int) -> Outcome:
        """Lease one available message to ``consumer`` until ``now + lease``."""

        def run(cur: Any) -> Outcome:
            row = self._one(
                cur,
                f"UPDATE {TABLE} SET consumer = ?, ts = ?, version = version + 1 "
                "WHERE topic = ? AND id = ? AND deleted_ms IS NULL AND ts <= ? "
                f"RETURNING {_COLUMNS}",
                (consumer, now_ms + lease_ms, topic, message_id, now_ms),
            )
            if row is not None:
                return Outcome(True, _message(row))
            current = self._get(cur, topic, message_id)
            if current is None:
                return Outcome.refused(UNKNOWN_MESSAGE)
            return Outcome.refused(LEASED if current.consumer is not None and current.ts > now_ms else NOT_DUE)

        result: Outcome = self._write(run)
        return result

    def lease_due(
        self, topic: str, consumer: str, lease_ms: int, limit: int, now_ms: int, others_only: bool = False
    ) -> list[Leased]:
        """Lease up to ``limit`` available messages (earliest first) to ``consumer``.

        One conditional ``UPDATE`` per bucket: a message is leased only while
        its timestamp is due, so an active lease is never taken twice. With
        ``others_only``, messages whose expired lease was this consumer's are
        left for others.
        """
        if limit <= 0:
            return []
        until = now_ms + lease_ms
        skip_own = " AND (consumer IS NULL OR consumer <> ?)" if others_only else ""
        own: tuple[Any, ...] = (consumer,) if others_only else ()

        def run(cur: Any) -> list[Leased]:
            leased: list[Leased] = []
            for bucket in self._bucket_order():
                want = limit - len(leased)
                if want <= 0:
                    break
                if self._pg:
                    rows = self._all(
                        cur,
                        # A materialized CTE: the LIMIT is applied once (a subquery in
                        # FROM may be rescanned, leasing more than asked). The rows are
                        # locked, so their ctid is stable: the update finds them by
                        # ctid whatever the planner's statistics say.
                        f"WITH d AS MATERIALIZED (SELECT ctid, id, ts FROM {TABLE} WHERE topic = ? AND bucket = ? "
                        f"AND deleted_ms IS NULL AND ts <= ?{skip_own} ORDER BY ts LIMIT ? FOR UPDATE SKIP LOCKED), "
                        f"u AS (UPDATE {TABLE} SET consumer = ?, ts = ?, version = version + 1 "
                        # No indexable condition beside the ctids: the plan is a TID scan.
                        "WHERE ctid = ANY(ARRAY(SELECT ctid FROM d)) AND deleted_ms IS NULL AND ts <= ? "
                        f"RETURNING {_COLUMNS}) "
                        "SELECT u.topic, u.id, u.ts, u.body, u.producer_group, u.consumer, u.bucket, u.version, "
                        "u.created_ms, d.ts FROM u JOIN d ON u.id = d.id",
                        (topic, bucket, now_ms, *own, want, consumer, until, now_ms),
                    )
                    found = [(_message(r[:9]), int(r[9])) for r in rows]
                else:
                    # The write lock is held: the due times read here are the
                    # ones the conditional UPDATE changes.
                    due = dict(
                        self._all(
                            cur,
                            f"SELECT id, ts FROM {TABLE} WHERE topic = ? AND bucket = ? AND deleted_ms IS NULL "
                            f"AND ts <= ?{skip_own} ORDER BY ts LIMIT ?",
                            (topic, bucket, now_ms, *own, want),
                        )
                    )
                    if not due:
                        continue
                    marks = ", ".join("?" * len(due))
                    rows = self._all(
                        cur,
                        f"UPDATE {TABLE} SET consumer = ?, ts = ?, version = version + 1 "
                        f"WHERE topic = ? AND id IN ({marks}) AND deleted_ms IS NULL AND ts <= ? "
                        f"RETURNING {_COLUMNS}",
                        (consumer, until, topic, *due, now_ms),
                    )
                    found = [(_message(r), int(due[r[1]])) for r in rows]
                found.sort(key=lambda pair: (pair[1], pair[0].id))
                leased.extend(Leased(m, d) for m, d in found)
            return leased

        result: list[Leased] = self._write(run)
        return result

    def lease_pass(
        self, topic: str, requests: Sequence[tuple[str, int, int]], now_ms: int
    ) -> tuple[list[list[Leased]], int | None]:
        """The master's pass, in ONE transaction: leases for several consumers, then the next due time.

        ``requests`` are (consumer, lease_ms, how many). See :meth:`_lease_round`.
        """

        def run(cur: Any) -> tuple[list[list[Leased]], int | None]:
            self._batch.cur = cur
            try:
                result = self._lease_round(cur, topic, requests, now_ms, exact_next_due=True)
                return result.leased, result.next_due
            finally:
                self._batch.cur = None

        out: tuple[list[list[Leased]], int | None] = self.db.write(run)
        return out

    def _lease_round(
        self, cur: Any, topic: str, requests: Sequence[tuple[str, int, int]], now_ms: int, exact_next_due: bool
    ) -> PassResult:
        """Lease the earliest due messages to several consumers at once, spread fairly.

        Up to the total asked, earliest first (on PostgreSQL ``FOR UPDATE
        SKIP LOCKED``: never a message another transaction holds), dealt out
        in turn over the requests; a message whose lease expired goes to
        another consumer than its last holder when one can take it (a lone
        consumer gets its own back). On PostgreSQL this is ONE statement
        (lock, deal, lease). The next due time is read only when fewer were
        found than asked (else more may be due: ``more``), or always with
        ``exact_next_due``.
        """
        leased: list[list[Leased]] = [[] for _ in requests]
        total = sum(n for _, _, n in requests)
        found_total = 0
        if total > 0:
            for bucket in self._bucket_order():
                want = total - found_total
                if want <= 0:
                    break
                remaining = [n - len(got) for (_, _, n), got in zip(requests, leased, strict=True)]
                if self._pg:
                    found_total += self._lease_pg(cur, topic, bucket, requests, remaining, now_ms, leased)
                    continue
                # SQLite: the write lock is held, the due rows read are the ones updated.
                due = self._all(
                    cur,
                    f"SELECT rowid, id, ts, consumer FROM {TABLE} "
                    "WHERE topic = ? AND bucket = ? AND deleted_ms IS NULL AND ts <= ? ORDER BY ts, id LIMIT ?",
                    (topic, bucket, now_ms, want),
                )
                if due:
                    found_total += len(due)
                    assigned = _deal(due, [c for c, _, _ in requests], remaining)
                    self._lease_rows(cur, topic, requests, due, assigned, now_ms, leased)
        more = total > 0 and found_total >= total
        next_due = self.next_due(topic) if exact_next_due or not more else now_ms
        return PassResult(leased, next_due, more)

    def _lease_pg(
        self,
        cur: Any,
        topic: str,
        bucket: int,
        requests: Sequence[tuple[str, int, int]],
        remaining: list[int],
        now_ms: int,
        leased: list[list[Leased]],
    ) -> int:
        """One statement: lock up to sum(remaining) due rows, deal them over the requests in turn, lease them.

        The k-th row (in due order) goes to the k-th slot of a round-robin
        over the requests with room. Rows that went back to their last holder
        while another request could take them are then moved (rare: expired
        leases). Returns how many rows were leased.
        """
        slots: list[int] = []
        left = list(remaining)
        while any(left):
            for j, n in enumerate(left):
                if n > 0:
                    slots.append(j)
                    left[j] = n - 1
        rows = self._all(
            cur,
            # A materialized CTE: the LIMIT is applied once (a subquery in FROM
            # may be rescanned, leasing more than asked). The rows are locked,
            # so their ctid is stable: the update is a TID scan whatever the
            # planner's statistics say.
            f"WITH d AS MATERIALIZED (SELECT ctid, id, ts, consumer FROM {TABLE} "
            "WHERE topic = ? AND bucket = ? AND deleted_ms IS NULL AND ts <= ? "
            "ORDER BY ts, id LIMIT ? FOR UPDATE SKIP LOCKED), "
            "n AS (SELECT ctid, ts, consumer, row_number() OVER (ORDER BY ts, id) AS k FROM d) "
            f"UPDATE {TABLE} t SET consumer = (?::text[])[n.k], ts = (?::bigint[])[n.k], version = t.version + 1 "
            f"FROM n WHERE t.ctid = n.ctid RETURNING {', '.join('t.' + c for c in _COLUMN_LIST)}, t.ctid, n.ts, n.consumer, n.k",
            (
                topic,
                bucket,
                now_ms,
                len(slots),
                _pg_array([requests[j][0] for j in slots]),
                "{" + ",".join(str(now_ms + requests[j][1]) for j in slots) + "}",
            ),
        )
        if not rows:
            return 0
        rows.sort(key=lambda r: r[12])
        got = [(r, slots[r[12] - 1]) for r in rows]
        used = [0] * len(requests)
        for _, j in got:
            used[j] += 1
        if any(r[11] is not None and r[11] == requests[j][0] for r, j in got):
            got = self._not_to_last_holder(cur, got, requests, remaining, used, now_ms)
        for r, j in got:
            leased[j].append(Leased(_message(r[:9]), int(r[10]), str(r[9])))
        return len(rows)

    def _not_to_last_holder(
        self,
        cur: Any,
        got: list[tuple[Any, int]],
        requests: Sequence[tuple[str, int, int]],
        remaining: list[int],
        used: list[int],
        now_ms: int,
    ) -> list[tuple[Any, int]]:
        """Move expired leases that went back to their last holder to another request that can take them."""
        out = list(got)
        for i, (r, j) in enumerate(out):
            last = r[11]
            if last is None or last != requests[j][0]:
                continue
            target = next(
                (k for k in range(len(requests)) if requests[k][0] != last and used[k] < remaining[k]),
                None,
            )
            if target is not None:
                used[j] -= 1
                used[target] += 1
                out[i] = (self._relet(cur, r, requests[target], now_ms), target)
                continue
            # Swap with a row dealt to another consumer that may take this one.
            for m, (r2, j2) in enumerate(out):
                if requests[j2][0] != last and r2[11] != requests[j][0]:
                    out[i] = (self._relet(cur, r, requests[j2], now_ms), j2)
                    out[m] = (self._relet(cur, r2, requests[j], now_ms), j)
                    break
        return out

    def _relet(self, cur: Any, row: Any, request: tuple[str, int, int], now_ms: int) -> Any:
        """Give a row leased in this transaction to another consumer (same change: same version)."""
        new = self._one(
            cur,
            f"UPDATE {TABLE} SET consumer = ?, ts = ? WHERE ctid = ?::tid RETURNING {_COLUMNS}, ctid",
            (request[0], now_ms + request[1], str(row[9])),
        )
        return (*new, row[10], row[11], row[12])

    def _lease_rows(
        self,
        cur: Any,
        topic: str,
        requests: Sequence[tuple[str, int, int]],
        due: list[Any],
        assigned: list[int],
        now_ms: int,
        leased: list[list[Leased]],
    ) -> None:
        """SQLite: lease each due row (read under the write lock) to its request's consumer."""
        due_of = {row[1]: int(row[2]) for row in due}
        req_of = {row[1]: j for row, j in zip(due, assigned, strict=True)}
        rows = []
        for row, j in zip(due, assigned, strict=True):
            consumer, lease_ms, _ = requests[j]
            got = self._one(
                cur,
                f"UPDATE {TABLE} SET consumer = ?, ts = ?, version = version + 1 "
                "WHERE topic = ? AND id = ? AND deleted_ms IS NULL AND ts <= ? "
                f"RETURNING {_COLUMNS}",
                (consumer, now_ms + lease_ms, topic, row[1], now_ms),
            )
            if got is not None:
                rows.append(got)
        for r in sorted(rows, key=lambda r: (due_of[r[1]], r[1])):
            leased[req_of[r[1]]].append(Leased(_message(r), due_of[r[1]]))

    def _bucket_order(self) -> list[int]:
        if self.buckets == 1:
            return [0]
        start = random.randrange(self.buckets)
        return [(start + i) % self.buckets for i in range(self.buckets)]

    # -- the lease holder --------------------------------------------------------------

    def extend(self, topic: str, message_id: str, consumer: str, version: int, lease_ms: int, now_ms: int) -> Outcome:
        """The holder, with its version, while the lease is active: the lease ends at now + lease."""
        return self._holder_change(
            topic,
            message_id,
            consumer,
            version,
            now_ms,
            f"UPDATE {TABLE} SET ts = ?, version = version + 1 "
            "WHERE topic = ? AND id = ? AND deleted_ms IS NULL AND consumer = ? AND version = ? AND ts > ? "
            f"RETURNING {_COLUMNS}",
            (now_ms + lease_ms,),
        )

    def release(self, topic: str, message_id: str, consumer: str, version: int, delay_ms: int, now_ms: int) -> Outcome:
        """The holder, with its version, while the lease is active: back on the timeline at now + delay."""
        return self._holder_change(
            topic,
            message_id,
            consumer,
            version,
            now_ms,
            f"UPDATE {TABLE} SET ts = ?, consumer = NULL, version = version + 1 "
            "WHERE topic = ? AND id = ? AND deleted_ms IS NULL AND consumer = ? AND version = ? AND ts > ? "
            f"RETURNING {_COLUMNS}",
            (now_ms + delay_ms,),
        )

    def delete(
        self, topic: str, message_id: str, consumer: str, version: int, now_ms: int, tid: str | None = None
    ) -> Outcome:
        """The holder, with its version, while the lease is active: the message is deleted (marked).

        ``tid`` (where the leased row was, from :class:`Leased`) is only a
        hint for batches (:meth:`apply`); alone, the message is found by id.
        """
        return self._holder_change(
            topic,
            message_id,
            consumer,
            version,
            now_ms,
            f"UPDATE {TABLE} SET deleted_ms = ?, version = version + 1 "
            "WHERE topic = ? AND id = ? AND deleted_ms IS NULL AND consumer = ? AND version = ? AND ts > ? "
            f"RETURNING {_COLUMNS}",
            (now_ms,),
        )

    def _delete_by_tid(self, cur: Any, topic: str, items: list[tuple[str, str, str, int, int]]) -> list[Outcome | None]:
        """Delete several distinct messages in ONE statement, found by their leased row's tid.

        ``items`` are (tid, id, consumer, version, now_ms). Each row is still checked
        on its own holder/version/lease condition. A message not deleted here
        (refused, or its row moved since: the tid is stale) gets None: the
        caller runs it through :meth:`delete` by primary key, which changes it
        or names the failed condition.
        """
        rows = self._all(
            cur,
            f"UPDATE {TABLE} t SET deleted_ms = v.now, version = t.version + 1 "
            "FROM unnest(?::tid[], ?::text[], ?::text[], ?::bigint[], ?::bigint[]) AS v(tid, id, consumer, version, now) "
            "WHERE t.ctid = v.tid AND t.topic = ? AND t.id = v.id AND t.deleted_ms IS NULL "
            "AND t.consumer = v.consumer AND t.version = v.version AND t.ts > v.now "
            f"RETURNING {', '.join('t.' + c for c in _COLUMN_LIST)}",
            (
                "{" + ",".join(f'"{item[0]}"' for item in items) + "}",
                _pg_array([item[1] for item in items]),
                _pg_array([item[2] for item in items]),
                "{" + ",".join(str(item[3]) for item in items) + "}",
                "{" + ",".join(str(item[4]) for item in items) + "}",
                topic,
            ),
        )
        deleted = {r[1]: _message(r) for r in rows}
        return [None if (m := deleted.get(item[1])) is None else Outcome(True, m) for item in items]

    def _holder_change(
        self,
        topic: str,
        message_id: str,
        consumer: str,
        version: int,
        now_ms: int,
        sql: str,
        values: tuple[Any, ...],
    ) -> Outcome:
        def run(cur: Any) -> Outcome:
            row = self._one(cur, sql, (*values, topic, message_id, consumer, version, now_ms))
            if row is not None:
                return Outcome(True, _message(row))
            current = self._get(cur, topic, message_id)
            if current is None:
                return Outcome.refused(UNKNOWN_MESSAGE)
            if current.consumer != consumer:
                return Outcome.refused(NOT_HOLDER)
            if current.version != version:
                return Outcome.refused(STALE_VERSION)
            return Outcome.refused(LEASE_EXPIRED)

        result: Outcome = self._write(run)
        return result

    # -- reads ---------------------------------------------------------------------------

    def _get(self, cur: Any, topic: str, message_id: str) -> TimelineMessage | None:
        row = self._one(
            cur,
            f"SELECT {_COLUMNS} FROM {TABLE} WHERE topic = ? AND id = ? AND deleted_ms IS NULL",
            (topic, message_id),
        )
        return None if row is None else _message(row)

    def get(self, topic: str, message_id: str) -> TimelineMessage | None:
        result: TimelineMessage | None = self._read(lambda cur: self._get(cur, topic, message_id))
        return result

    def active_leases(self, topic: str, consumer: str, now_ms: int, limit: int = 10_000) -> list[TimelineMessage]:
        """The consumer's active leases (for a consumer that comes back), earliest end first."""
        rows = self._read(
            lambda cur: self._all(
                cur,
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE topic = ? AND consumer = ? AND deleted_ms IS NULL "
                "AND ts > ? ORDER BY ts LIMIT ?",
                (topic, consumer, now_ms, limit),
            )
        )
        return [_message(r) for r in rows]

    def next_due(self, topic: str) -> int | None:
        """The earliest timestamp of the topic (already due, or the next to come), or None."""

        def run(cur: Any) -> int | None:
            best: int | None = None
            for bucket in range(self.buckets):
                row = self._one(
                    cur,
                    f"SELECT MIN(ts) FROM {TABLE} WHERE topic = ? AND bucket = ? AND deleted_ms IS NULL",
                    (topic, bucket),
                )
                if row is not None and row[0] is not None and (best is None or int(row[0]) < best):
                    best = int(row[0])
            return best

        result: int | None = self._read(run)
        return result

    def _range(self, start_ms: int | None, end_ms: int | None) -> tuple[str, tuple[Any, ...]]:
        sql, params = "", cast(tuple[Any, ...], ())
        if start_ms is not None:
            sql, params = sql + " AND ts >= ?", (*params, start_ms)
        if end_ms is not None:
            sql, params = sql + " AND ts < ?", (*params, end_ms)
        return sql, params

    def counts(self, topic: str, now_ms: int, start_ms: int | None = None, end_ms: int | None = None) -> dict[str, int]:
        """Messages by status, with timestamps in ``[start_ms, end_ms)`` when given."""
        where, params = self._range(start_ms, end_ms)
        rows = self._read(
            lambda cur: self._all(
                cur,
                f"SELECT CASE WHEN ts <= ? THEN '{AVAILABLE}' WHEN consumer IS NULL THEN '{WAITING}' "
                f"ELSE '{PROCESSING}' END AS status, COUNT(*) FROM {TABLE} "
                f"WHERE topic = ? AND deleted_ms IS NULL{where} GROUP BY 1",
                (now_ms, topic, *params),
            )
        )
        counts = dict.fromkeys(STATUSES, 0)
        counts.update({status: int(n) for status, n in rows})
        return counts

    def list_messages(
        self,
        topic: str,
        now_ms: int,
        status: str | None = None,
        start_ms: int | None = None,
        end_ms: int | None = None,
        limit: int = 1000,
    ) -> list[TimelineMessage]:
        """Messages in timeline order, optionally of one status and in ``[start_ms, end_ms)``."""
        where, params = self._range(start_ms, end_ms)
        if status == AVAILABLE:
            where, params = where + " AND ts <= ?", (*params, now_ms)
        elif status == WAITING:
            where, params = where + " AND ts > ? AND consumer IS NULL", (*params, now_ms)
        elif status == PROCESSING:
            where, params = where + " AND ts > ? AND consumer IS NOT NULL", (*params, now_ms)
        elif status is not None:
            raise ValueError(f"unknown status {status!r} (statuses: {', '.join(STATUSES)})")
        rows = self._read(
            lambda cur: self._all(
                cur,
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE topic = ? AND deleted_ms IS NULL{where} ORDER BY ts, id LIMIT ?",
                (topic, *params, limit),
            )
        )
        return [_message(r) for r in rows]

    def deleted_count(self) -> int:
        row = self._read(lambda cur: self._one(cur, f"SELECT COUNT(*) FROM {TABLE} WHERE deleted_ms IS NOT NULL", ()))
        return int(row[0])

    def remove_deleted(self, limit: int = 1000) -> int:
        """Remove up to ``limit`` deleted (marked) messages; returns how many."""

        def run(cur: Any) -> int:
            # By physical row id, so the plan never scans the whole table.
            where = (
                f"ctid = ANY(ARRAY(SELECT ctid FROM {TABLE} WHERE deleted_ms IS NOT NULL ORDER BY deleted_ms LIMIT ?))"
                if self._pg
                else f"rowid IN (SELECT rowid FROM {TABLE} WHERE deleted_ms IS NOT NULL ORDER BY deleted_ms LIMIT ?)"
            )
            rows = self._all(
                cur, f"DELETE FROM {TABLE} WHERE {where} AND deleted_ms IS NOT NULL RETURNING id", (limit,)
            )
            return len(rows)

        result: int = self._write(run)
        return result


def open_timeline_store(url: str | DatabaseUrl, base_dir: str | None = None, buckets: int = 1) -> SqlTimelineStore:
    """Open (and migrate) the timeline store behind a database URL."""
    parsed = url if isinstance(url, DatabaseUrl) else parse_database_url(url, base_dir)
    db: Database
    if parsed.is_sqlite:
        from storage.sqlite_db import SqliteDatabase

        assert parsed.path is not None
        db = SqliteDatabase(parsed.path)
    else:
        from storage.store import require_postgres

        require_postgres()
        from storage.pg_db import PgDatabase

        assert parsed.dsn is not None
        db = PgDatabase(parsed.dsn)
    store = SqlTimelineStore(db, buckets=buckets)
    store.migrate()
    return store
