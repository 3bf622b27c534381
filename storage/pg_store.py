"""Streams on PostgreSQL, with several concurrent writer processes.

Tokens come from one sequence per stream, so writers never wait for each
other, and transactions may commit out of token order. To keep readers from
skipping a token that is still in flight (writer A takes 10, B takes 11, B
commits first), every writer keeps a *position*: the highest token below which
all of its own allocations have committed. It is stored in
``tickline_writers`` with the commit that moves it, and reported at least
every ``report_interval`` seconds (an idle writer reports the stream's head,
so it never holds the stream back). The stream's *safe position* is the
minimum over the live writers; readers follow that, never the raw head.

A writer registers (``alive``, a new ``epoch``, position = the current head)
before it allocates. A writer that stops reporting for ``writer_timeout``
seconds is marked dead by :meth:`safe_positions` and its epoch moves on; its
late commit then fails the epoch check and is retried with new tokens, so its
rows are still delivered, in token order.

Every commit and every report sends ``NOTIFY tickline, '<stream>'``, which the
master listens to instead of polling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson
import psycopg2
import psycopg2.extensions

from storage import time_index
from storage.contracts import JsonRow, Row, StoredRow
from storage.limits import DEFAULT_MAX_LINE_BYTES, check_rows
from storage.pg_db import Cursor, PgDatabase
from storage.schema import StreamSchema, check_instance_name
from storage.store import FIRST_VALUE, DatabaseUnavailable, StreamCatalog
from storage.urls import redact_url

logger = logging.getLogger(__name__)
CHANNEL = "tickline"
NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"


class Fenced(Exception):
    """This writer was declared dead: its transaction may not commit."""


class _WriterState:
    __slots__ = ("epoch", "inflight", "reported", "writer_id")

    def __init__(self, writer_id: str, epoch: int) -> None:
        self.writer_id = writer_id  # "<instance>/<host>:<pid>:<nonce>": one per process
        self.epoch = epoch
        self.inflight: dict[int, int] = {}  # transaction id -> its lowest token
        self.reported = -1


def _seq(schema: StreamSchema) -> str:
    return f"{schema.table}_token_seq"


class PgStreamStore:
    """Implements :class:`storage.contracts.StreamStore`; holds its :class:`PgDatabase`."""

    max_line_bytes: int | None = DEFAULT_MAX_LINE_BYTES  # refuse rows whose RDATA line could be longer

    def __init__(
        self,
        dsn: str,
        clock: Callable[[], float] = time.time,
        report_interval: float = 0.2,
        writer_timeout: float = 5.0,
    ) -> None:
        self.database = PgDatabase(dsn)
        self._catalog = StreamCatalog(self.database)
        self._clock = clock
        self.report_interval = report_interval
        self.writer_timeout = writer_timeout
        self._lock = threading.Lock()
        self._json_encoders: dict[str, Callable[[StoredRow], bytes]] = {}
        self._writers: dict[tuple[str, str], _WriterState] = {}
        self._next_txn = 0
        self._reporter: threading.Thread | None = None
        self._stop_reporting = threading.Event()
        self._side = threading.local()
        self._process_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # autocommit connections for the oracle and reports

    def migrate(self) -> list[int]:
        """Create or upgrade the tables; returns the migration versions applied."""
        return self.database.migrate()

    def catalog(self) -> dict[str, StreamSchema]:
        return self._catalog.catalog()

    # -- time (storage.time_index) ------------------------------------------------------

    def first_token_at(self, stream: str, since_ts: int) -> time_index.TokenAt:
        return time_index.first_token_at(self, stream, since_ts)

    def safe_point(self, expire_writers: bool = True, allocate: bool = True) -> tuple[dict[str, int], dict[str, int]]:
        return time_index.safe_point(self, expire_writers, allocate)

    def schema(self, stream: str) -> StreamSchema:
        return self._catalog.schema(stream)

    # -- schema ------------------------------------------------------------------

    def register_stream(self, schema: StreamSchema) -> None:
        def run(cur: Cursor) -> None:
            cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"stream:{schema.name}",))
            if self._catalog.registered_already(cur, schema):
                return
            for statement in schema.create_table_sql(self.database.dialect):
                cur.execute(statement)
            cur.execute(f"CREATE SEQUENCE {_seq(schema)} MINVALUE 1 START 1")
            cur.execute(
                "INSERT INTO tickline_streams (name, columns) VALUES (%s, %s)",
                (schema.name, schema.columns_json()),
            )

        self.database.write(run)
        self._catalog.remember(schema)

    # -- side connections (autocommit) ----------------------------------------------

    @contextlib.contextmanager
    def _side_cursor(self) -> Iterator[Any]:
        """A cursor on this thread's autocommit connection; a lost server is DatabaseUnavailable."""
        conn = getattr(self._side, "conn", None)
        if conn is None or conn.closed:
            conn = self._side.conn = self.database.connect(autocommit=True)
        try:
            with conn.cursor() as cur:
                yield cur
        except psycopg2.OperationalError as e:
            try:
                conn.close()
            except psycopg2.Error:
                pass
            self._side.conn = None
            raise DatabaseUnavailable(redact_url(f"PostgreSQL at {self.database.dsn}: {_first_line(e)}")) from None

    def _head_sql(self, schema: StreamSchema) -> str:
        return f"SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {_seq(schema)}"

    # -- the timestamp oracle ----------------------------------------------------------

    def allocate_timestamps(self, count: int = 1) -> list[int]:
        """``count`` timestamps, strictly increasing across every process.

        One short autocommit statement on the oracle's row: the new high-water
        mark is persisted before any of the timestamps is used.
        """
        if count < 1:
            raise ValueError("count must be at least 1")
        from storage import tso

        floor = tso.compose(max(int(self._clock() * 1000), 0)) + count - 1
        with self._side_cursor() as cur:
            cur.execute(
                "UPDATE tickline_tso SET last_ts = GREATEST(last_ts + %s, %s) WHERE id = 1 RETURNING last_ts",
                (count, floor),
            )
            (last,) = cur.fetchone()
        return list(range(last - count + 1, last + 1))

    def allocate_rows(self, schema: StreamSchema, ts_count: int, token_count: int) -> tuple[int, list[int]]:
        """``ts_count`` timestamps and ``token_count`` tokens of the stream, in one statement.

        The statement holds the oracle's row lock from its ``UPDATE`` until it
        commits, and takes the tokens (``nextval``) for the rows the update
        returned, so inside that lock: whichever of two writers allocates
        first gets both the lower timestamps and the lower tokens. Hence a
        stream's ``ts`` increases with its token, on PostgreSQL as on SQLite
        (``storage.time_index`` relies on it), and a timestamp the master takes
        from the oracle is above every timestamp of a token already allocated.
        """
        from storage import tso

        floor = tso.compose(max(int(self._clock() * 1000), 0)) + ts_count - 1
        with self._side_cursor() as cur:
            cur.execute(
                "WITH oracle AS (UPDATE tickline_tso SET last_ts = GREATEST(last_ts + %s, %s) WHERE id = 1 "
                "RETURNING last_ts) SELECT oracle.last_ts, nextval(%s) FROM oracle, generate_series(1, %s)",
                (ts_count, floor, _seq(schema), token_count),
            )
            rows = cur.fetchall()
        last = rows[0][0]
        return last - ts_count + 1, sorted(r[1] for r in rows)

    # -- writers -------------------------------------------------------------------------

    def _register(self, schema: StreamSchema, instance: str) -> _WriterState:
        """Register as a live writer of the stream (before allocating anything)."""
        key = (schema.name, instance)
        # Positions are kept per process, not per instance name: two processes
        # that happen to share an instance name must not fence each other off.
        writer_id = f"{instance}/{self._process_id}"
        with self._lock:
            state = self._writers.get(key)
            if state is not None:
                return state
            with self._side_cursor() as cur:
                cur.execute(
                    "INSERT INTO tickline_writers (stream, instance_name, epoch, position, heartbeat_ms, alive) "
                    f"VALUES (%s, %s, 1, ({self._head_sql(schema)}), {NOW_MS}, TRUE) "
                    "ON CONFLICT (stream, instance_name) DO UPDATE SET epoch = tickline_writers.epoch + 1, "
                    "position = excluded.position, heartbeat_ms = excluded.heartbeat_ms, alive = TRUE "
                    "RETURNING epoch",
                    (schema.name, writer_id),
                )
                (epoch,) = cur.fetchone()
            state = self._writers[key] = _WriterState(writer_id, epoch)
        self._ensure_reporter()
        return state

    def append(self, stream: str, rows: Iterable[Row], instance_name: str, batch: bool = False) -> list[int]:
        """Append rows in one transaction; returns the token of each row.

        A writer that was declared dead meanwhile registers again and retries
        with new tokens, so its rows still arrive, in token order.
        """
        rows = list(rows)
        for _attempt in range(5):
            try:
                with self.writing(stream, instance_name) as txn:
                    return txn.append(rows, batch)
            except Fenced:
                logger.warning(
                    "writer %s of %s was declared dead; registering again and retrying with new tokens",
                    instance_name,
                    stream,
                )
        raise Fenced(f"writer {instance_name} of {stream} was fenced off 5 times in a row")

    @contextlib.contextmanager
    def writing(self, stream: str, instance_name: str) -> Iterator[WriteTransaction]:
        """One write transaction of a writer: ``append`` any number of times, commit on exit.

        While it is open its first token holds the stream's safe position back.
        Raises :class:`Fenced` at commit if the writer was declared dead meanwhile.
        """
        schema = self.schema(stream)
        check_instance_name(instance_name)
        state = self._register(schema, instance_name)
        with self._lock:
            self._next_txn += 1
            txn_id = self._next_txn
        conn = self.database.connection()
        try:
            conn.set_session(isolation_level=psycopg2.extensions.ISOLATION_LEVEL_READ_COMMITTED)
            with conn.cursor() as raw:
                txn = WriteTransaction(self, schema, instance_name, state, txn_id, Cursor(raw))
                yield txn
                txn.finish()
            conn.commit()
        except psycopg2.OperationalError as e:
            self.database.drop_broken(conn)
            raise DatabaseUnavailable(redact_url(f"PostgreSQL at {self.database.dsn}: {str(e).strip()}")) from None
        except Fenced:
            conn.rollback()
            with self._lock:
                if self._writers.get((stream, instance_name)) is state:
                    del self._writers[(stream, instance_name)]
            raise
        except BaseException:
            if not conn.closed:
                conn.rollback()
            raise
        finally:
            with self._lock:
                state.inflight.pop(txn_id, None)

    def _ensure_reporter(self) -> None:
        with self._lock:
            if self._reporter is not None:
                return
            self._reporter = threading.Thread(
                target=_report_loop,
                args=(weakref.ref(self), self._stop_reporting, self.report_interval),
                name="tickline-writer-reports",
                daemon=True,
            )
            self._reporter.start()

    def report_positions(self) -> None:
        """Tell the master how far each of this process's writers has committed."""
        with self._lock:
            writers = list(self._writers.items())
        for (stream, instance), state in writers:
            schema = self.schema(stream)
            with self._lock, self._side_cursor() as cur:
                if state.inflight:
                    position = min(state.inflight.values()) - 1
                else:
                    cur.execute(self._head_sql(schema))
                    (position,) = cur.fetchone()
            with self._side_cursor() as cur:
                cur.execute(
                    f"UPDATE tickline_writers SET position = GREATEST(position, %s), heartbeat_ms = {NOW_MS} "
                    "WHERE stream = %s AND instance_name = %s AND epoch = %s AND alive",
                    (position, stream, state.writer_id, state.epoch),
                )
                if cur.rowcount != 1:
                    with self._lock:
                        if self._writers.get((stream, instance)) is state and not state.inflight:
                            del self._writers[(stream, instance)]  # register again on next write
                    continue
                if position != state.reported:
                    state.reported = position
                    cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, stream))

    def retire_writers(self) -> None:
        """Leave cleanly: this process's writers stop holding their streams back."""
        self._stop_reporting.set()
        with self._lock:
            writers = list(self._writers.items())
            self._writers.clear()
        for (stream, _instance), state in writers:
            with self._side_cursor() as cur:
                cur.execute(
                    "UPDATE tickline_writers SET alive = FALSE WHERE stream = %s AND instance_name = %s AND epoch = %s",
                    (stream, state.writer_id, state.epoch),
                )
                cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, stream))

    def close(self) -> None:
        self.retire_writers()
        self.database.close()

    # -- reading ---------------------------------------------------------------------------

    def safe_positions(self, expire_writers: bool = True) -> dict[str, int]:
        """Per stream, the token up to which every row has committed.

        With ``expire_writers``, first marks writers silent for longer than
        ``writer_timeout`` as dead.
        """
        timeout_ms = int(self.writer_timeout * 1000)
        known = self._catalog.known()
        if not expire_writers and known:
            return self._safe_positions_now(known)

        def run(cur: Cursor) -> dict[str, int]:
            dead = []
            if expire_writers:
                dead = cur.execute(
                    "UPDATE tickline_writers SET alive = FALSE, epoch = epoch + 1 "
                    f"WHERE alive AND heartbeat_ms < {NOW_MS} - %s RETURNING stream, instance_name",
                    (timeout_ms,),
                ).fetchall()
            for stream, instance in dead:
                logger.warning(
                    "writer %s of stream %s stopped reporting: dropped from the safe position", instance, stream
                )
            alive = dict(
                cur.execute("SELECT stream, MIN(position) FROM tickline_writers WHERE alive GROUP BY stream").fetchall()
            )
            positions = {}
            for stream, columns in cur.execute("SELECT name, columns FROM tickline_streams").fetchall():
                if stream in alive:
                    positions[stream] = alive[stream]
                else:
                    # No live writer: every row that will ever commit below the
                    # head has committed (dead writers are fenced off).
                    table = StreamSchema.from_columns_json(stream, columns).table
                    top = cur.execute(f"SELECT MAX(token) FROM {table}").fetchone()[0]
                    positions[stream] = top or 0
            return positions

        return self.database.write(run)

    def _safe_positions_now(self, schemas: list[StreamSchema]) -> dict[str, int]:
        """The same answer in one autocommit statement (one snapshot), for wake-ups.

        Streams without a live writer fall back to their highest committed
        token; ``COALESCE`` evaluates that only where it is needed.
        """
        parts = [
            f"SELECT %s, COALESCE((SELECT MIN(position) FROM tickline_writers WHERE alive AND stream = %s), "
            f"(SELECT MAX(token) FROM {schema.table}), 0)"
            for schema in schemas
        ]
        params = [value for schema in schemas for value in (schema.name, schema.name)]
        with self._side_cursor() as cur:
            cur.execute(" UNION ALL ".join(parts), params)
            return {name: int(position) for name, position in cur.fetchall()}

    def heads(self) -> dict[str, int]:
        """The highest token allocated per stream (not necessarily committed)."""
        result = {}
        for stream, schema in self.catalog().items():
            result[stream] = self.database.read(lambda cur: cur.execute(self._head_sql(schema)).fetchone()[0])
        return result

    def read_rows(self, stream: str, after: int, upto: int, limit: int) -> list[StoredRow]:
        schema = self.schema(stream)
        selected = ", ".join(f"{c.name}::text" if c.type == "json" else c.name for c in schema.columns)
        columns = f"seq, token, instance_name, ts, {selected}"
        first = f"SELECT {columns} FROM {schema.table} WHERE token > %s AND token <= %s ORDER BY token, seq LIMIT %s"
        rest = f"SELECT {columns} FROM {schema.table} WHERE token = %s AND seq > %s ORDER BY seq"

        # No transaction needed: a token's rows commit together and never change,
        # so two statements cannot see a token half written.
        with self._side_cursor() as cur:
            cur.execute(first, (after, upto, limit))
            rows = cur.fetchall()
            if len(rows) == limit and rows:
                last = rows[-1]
                cur.execute(rest, (last[1], last[0]))
                rows.extend(cur.fetchall())
            return rows

    def read_rows_json(self, stream: str, after: int, upto: int, limit: int) -> list[JsonRow]:
        """Like :meth:`read_rows`, each row ``(seq, token, instance_name bytes, ts, JSON array bytes)``.

        The JSON is built here with orjson (JSON columns embedded as the text
        PostgreSQL gives, unparsed), once per row: the master's fan-out then
        sends it as it is, as on SQLite.
        """
        encode = self._json_encoders.get(stream)
        if encode is None:
            encode = self._json_encoders[stream] = _json_encoder(self.schema(stream))
        return [
            (row[0], row[1], row[2].encode(), row[3], encode(row)) for row in self.read_rows(stream, after, upto, limit)
        ]

    # -- change notification -----------------------------------------------------------------

    def notifier(self) -> PgNotifier:
        return PgNotifier(self.database)


class WriteTransaction:
    """Rows appended by one writer in one open transaction (see ``PgStreamStore.writing``)."""

    def __init__(
        self, store: PgStreamStore, schema: StreamSchema, instance: str, state: _WriterState, txn_id: int, cur: Cursor
    ) -> None:
        self._store = store
        self._schema = schema
        self._instance = instance
        self._state = state
        self._id = txn_id
        self._cur = cur
        self._last_token = 0
        names = ", ".join(("token", "instance_name", "ts", *schema.column_names))
        self._insert = f"INSERT INTO {schema.table} ({names}) VALUES %s"

    def append(self, rows: Iterable[Row], batch: bool = False) -> list[int]:
        values = check_rows(self._schema, rows, self._store.max_line_bytes)
        if not values:
            return []
        count = len(values)
        store = self._store
        # Allocation and registration as in flight happen under the lock, so
        # a concurrent report never claims a token still in flight. Tokens and
        # timestamps come from one statement (see allocate_rows).
        with store._lock:
            first_ts, allocated = store.allocate_rows(self._schema, count, 1 if batch else count)
            self._state.inflight.setdefault(self._id, allocated[0])
        tokens = [allocated[0]] * count if batch else allocated
        self._cur.execute_values(
            self._insert,
            [
                (token, self._instance, first_ts + i, *row)
                for i, (token, row) in enumerate(zip(tokens, values, strict=False))
            ],
        )
        self._last_token = tokens[-1]
        return tokens

    def finish(self) -> None:
        """Move the writer's position with the commit, or refuse if it was fenced off."""
        if not self._last_token:
            return
        store = self._store
        with store._lock:
            others = [t for other, t in self._state.inflight.items() if other != self._id]
        position = min([self._last_token] + [t - 1 for t in others])
        self._cur.execute(
            f"UPDATE tickline_writers SET position = GREATEST(position, %s), heartbeat_ms = {NOW_MS} "
            "WHERE stream = %s AND instance_name = %s AND epoch = %s AND alive",
            (position, self._schema.name, self._state.writer_id, self._state.epoch),
        )
        if self._cur.rowcount != 1:
            raise Fenced(self._instance)
        self._cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, self._schema.name))


def _report_loop(store_ref: weakref.ref[PgStreamStore], stop: threading.Event, interval: float) -> None:
    """The reporter thread; it holds the store weakly and ends with it."""
    while not stop.wait(interval):
        store = store_ref()
        if store is None:
            return
        try:
            store.report_positions()
        except Exception as e:  # keep reporting; the master times us out otherwise
            logger.warning("reporting writer positions failed: %s", e)
        del store


class PgNotifier:
    """``LISTEN tickline`` on a connection of its own: a file descriptor to watch."""

    def __init__(self, database: PgDatabase) -> None:
        self._conn = database.connect(autocommit=True)
        with self._conn.cursor() as cur:
            cur.execute(f"LISTEN {CHANNEL}")

    def fileno(self) -> int:
        return self._conn.fileno()

    def drain(self) -> set[str]:
        """The streams named by the notifications that arrived (never blocks)."""
        self._conn.poll()
        streams = {n.payload for n in self._conn.notifies}
        self._conn.notifies.clear()
        return streams

    def close(self) -> None:
        self._conn.close()


def _json_encoder(schema: StreamSchema) -> Callable[[StoredRow], bytes]:
    """A stored row's column values as one JSON array (JSON columns are JSON text already)."""
    json_columns = schema.json_columns
    end = FIRST_VALUE + len(schema.columns)
    dumps = orjson.dumps
    fragment = orjson.Fragment
    if not json_columns:
        return lambda row: dumps(row[FIRST_VALUE:end])

    def encode(row: StoredRow) -> bytes:
        values = list(row[FIRST_VALUE:end])
        for i in json_columns:
            if values[i] is not None:
                values[i] = fragment(values[i])
        return dumps(values)

    return encode


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
