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
seconds is dropped by :meth:`safe_positions` (its row deleted); its late
commit then fails the epoch check and is retried with new tokens, so its rows
are still delivered, in token order. Epochs come from one sequence, so a
registration never takes an epoch that was live before, and the rows of
writers that left or died can be deleted: the table holds the live writers
(``WRITER_EPOCHS``).

Every commit, and every report that raises a writer's position, sends ``NOTIFY
tickline, '<stream>'``, which the master listens to instead of polling.
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
from typing import TYPE_CHECKING, Any

import orjson
import psycopg2
import psycopg2.extensions

from storage import time_index
from storage.contracts import CommittedRows, JsonRow, Row, StoredRow
from storage.limits import (
    DEFAULT_MAX_LINE_BYTES,
    RowChecker,
    batch_step_rows,
    check_rows,
    max_row_json_bytes,
    rdata_overhead,
)
from storage.pg_columns_out import read_lines
from storage.pg_copy import _COPY_FORMATS, NULL_COPY, _copy_text, chunk_formatter, data_needs_escapes, formatter
from storage.pg_db import (
    Cursor,
    PgDatabase,
    execute_literals,
    lost_connection,
    prepared,
    quietly_close,
    rollback_explicit,
)
from storage.pg_lines import LineRange, row_json_sql
from storage.pg_row_literals import row_literals
from storage.schema import COLUMN_TYPES, INT64_MAX, RowError, StreamSchema, check_instance_name
from storage.store import FIRST_VALUE, DatabaseUnavailable, StreamCatalog

if TYPE_CHECKING:
    from storage.pg_wake import PgWake

logger = logging.getLogger(__name__)
CHANNEL = "tickline"
NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"
COPY_ROWS = 100  # appends of at least this many rows go by COPY
MAX_TOKEN = INT64_MAX
ORACLE_SEQUENCE = "tickline_tso_seq"
ORACLE_FUNCTION = "tickline_allocate_v6"
ORACLE_LOCK = 0x74736F  # "tso": held by the allocation function for microseconds, never across a commit

# The timestamp oracle and token allocation on PostgreSQL, in one function
# called inside the writer's own transaction (no commit of its own).
#
# * ``tickline_tso.last_ts`` stays a floor (the oracle hands out only above
#   it): ``allocate_timestamps`` records its high-water mark there with a
#   durable commit, and an operator (or a bulk load) can move it up. The
#   function does not read it (v5 did, a query per call): a trigger on
#   ``tickline_tso`` (``FLOOR_TRIGGER``) lifts the sequence to every new
#   floor before that floor commits, so the sequence is always at or above
#   it (see ``_FLOOR_SQL``).
# * The oracle's state is a sequence: ``setval`` and ``nextval`` are atomic
#   and immediately visible to every session, are never rolled back and need
#   no commit. PostgreSQL persists a sequence by logging it ahead of the
#   values handed out (a window of 32 values for ``nextval``, the new end for
#   ``setval``) and that record is flushed by the writer's own commit: after a
#   restart, even of the server, the oracle resumes above every timestamp a
#   committed row carries. The physical part follows the caller's clock
#   (``now_ms``) when it is ahead; when the clock stands still or steps back
#   the logical part counts on.
# * A session advisory lock, taken and released inside the call (never held
#   across a commit), makes the timestamps and the tokens of one allocation
#   one step: whichever writer allocates first gets both the lower timestamps
#   and the lower tokens, so ``ts`` increases with the token in every stream.
# * An error between lock and unlock (none is expected: a sequence at its
#   maximum, a cancelled statement) would leave the session holding the lock:
#   the store then releases it (``pg_advisory_unlock_all``) before it uses
#   the connection again (see ``_release_oracle_lock``); a closed connection
#   releases it by itself. No exception block: it would cost a subtransaction
#   per call.
# * Every step is an assignment or a condition PL/pgSQL evaluates as a simple expression
#   (no executor of its own: no PERFORM, and the sequence's last value by
#   pg_sequence_last_value rather than a query). v4 ran five queries per call (PERFORMs
#   included): v5 took 23-34 us less backend CPU per single-row append (5-8%; two
#   interleaved runs, backend schedstat); v6 drops v5's last query, the floor's.
# * Tokens first, then timestamps: a reader of the oracle's mark without the
#   lock (``time_index.oracle_last``) that sees the new timestamps also finds
#   the new tokens allocated (the safe-time proof in docs/time.md needs it).
# * ``n_tokens`` consecutive tokens of the stream's sequence (``setval`` moves
#   it once for the whole range); 0 takes timestamps only.
_LOCK_STEP = f"""
    IF pg_advisory_lock({ORACLE_LOCK}) IS NULL THEN
        RETURN;
    END IF;"""
_TOKENS_STEP = """
    IF n_tokens > 0 THEN
        first_token := nextval(seq);
        IF n_tokens > 1 THEN
            last := setval(seq, first_token + n_tokens - 1, true);
        END IF;
    END IF;"""
_TIMESTAMPS_STEP = f"""
    last := pg_sequence_last_value('{ORACLE_SEQUENCE}'::regclass);
    called := last IS NOT NULL;
    IF NOT called THEN
        SELECT last_value - 1 INTO last FROM {ORACLE_SEQUENCE};
    END IF;
    first_ts := GREATEST(last + 1, now_ms << 18);
    IF n_ts = 1 AND first_ts = last + 1 AND called THEN
        first_ts := nextval('{ORACLE_SEQUENCE}'::regclass);
    ELSE
        last := setval('{ORACLE_SEQUENCE}'::regclass, first_ts + n_ts - 1, true);
    END IF;
    called := pg_advisory_unlock({ORACLE_LOCK});
"""


def _allocation_function_sql(name: str, tokens_parameter: str, tokens_step: str) -> str:
    """An allocation function: the oracle's lock, the tokens (``tokens_step``), the timestamps, the unlock."""
    return f"""
CREATE FUNCTION {name}(seq regclass, n_ts integer, {tokens_parameter}, now_ms bigint,
    OUT first_token bigint, OUT first_ts bigint) LANGUAGE plpgsql AS $fn$
DECLARE
    last bigint;
    called boolean;
BEGIN
{_LOCK_STEP + tokens_step + _TIMESTAMPS_STEP}
END
$fn$
"""


_ORACLE_SQL = _allocation_function_sql(ORACLE_FUNCTION, "n_tokens integer", _TOKENS_STEP)

# A write transaction's later batch append (``WriteTransaction``): timestamps for its rows
# and the token they share. That is the transaction's batch token if it is still the last
# token of the stream's sequence; if another token of the stream was allocated since (the
# transaction's own rows outside the batch, another writer's), a new token, so that ``ts``
# still increases with the token (its rows' timestamps come after that other token's). Decided
# under the oracle's lock, as every allocation: no allocation can come between the test and
# the timestamps.
BATCH_FUNCTION = "tickline_allocate_batch_v1"
_BATCH_TOKEN_STEP = """
    first_token := pg_sequence_last_value(seq);
    IF first_token IS DISTINCT FROM batch_token THEN
        first_token := nextval(seq);
    END IF;"""
_BATCH_SQL = _allocation_function_sql(BATCH_FUNCTION, "batch_token bigint", _BATCH_TOKEN_STEP)

# The floor (``tickline_tso.last_ts``) kept at or below the oracle's sequence, so the
# allocation need not read it: whatever raises the floor (``allocate_timestamps``, an
# operator's or a bulk load's UPDATE) lifts the sequence in the same transaction, before
# it commits, under the oracle's lock (an allocation's ``setval`` in between would
# otherwise put the sequence back below the new floor). The check before the lock needs
# none: the sequence only ever moves up (every ``setval`` of the oracle is above its last
# value), so once at or above the new floor it stays there; ``allocate_timestamps``
# writes a floor the sequence has reached already and never takes the lock here.
# ``setval`` is not transactional: if the floor's transaction rolls back, the sequence
# stays lifted, which only skips timestamps. Its WAL record comes before the floor's
# commit record, so the commit's flush makes it durable with the floor. The lock is a
# session lock, released on the way out even on an error (an exception block: this
# runs only when the floor moves above the sequence, not per append).
FLOOR_FUNCTION = "tickline_tso_floor_v1"
FLOOR_TRIGGER = "tickline_tso_floor"
_FLOOR_SQL = f"""
CREATE OR REPLACE FUNCTION {FLOOR_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF NEW.last_ts > COALESCE(pg_sequence_last_value('{ORACLE_SEQUENCE}'::regclass), -1) THEN
        PERFORM pg_advisory_lock({ORACLE_LOCK});
        BEGIN
            PERFORM setval('{ORACLE_SEQUENCE}'::regclass, GREATEST(NEW.last_ts,
                COALESCE(pg_sequence_last_value('{ORACLE_SEQUENCE}'::regclass), 0)), true);
        EXCEPTION WHEN OTHERS THEN
            PERFORM pg_advisory_unlock({ORACLE_LOCK});
            RAISE;
        END;
        PERFORM pg_advisory_unlock({ORACLE_LOCK});
    END IF;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER {FLOOR_TRIGGER} AFTER INSERT OR UPDATE OF last_ts ON tickline_tso
    FOR EACH ROW EXECUTE FUNCTION {FLOOR_FUNCTION}();
ALTER TABLE tickline_tso ENABLE ALWAYS TRIGGER {FLOOR_TRIGGER}
"""


# A large append's allocation when the writer can tell what it will be (``WriteTransaction._append_copy_proposed``):
# the tokens and timestamps it proposes are taken if they are exactly the next tokens of the
# stream's sequence and timestamps the oracle may hand out now (at least ``max(last + 1, now_ms
# << 18)``, above the floor, at most ``max(last + 1, (now_ms << 18) + PROPOSAL_LEAD)``: the current
# millisecond with its counter lifted by at most PROPOSAL_LEAD); else nothing is taken and the
# call raises PROPOSAL_CODE. Under the oracle's lock, as ``ORACLE_FUNCTION``, tokens first.
# The rows' COPY can then travel with it (and with BEGIN) in one round trip. v2 does not read the
# floor (v1 did, a query per call): as for ORACLE_FUNCTION, the floor's trigger keeps the sequence
# at or above it, so ``last + 1`` is above the floor already. v1 stays for processes of earlier
# versions (which also read the floor themselves).
PROPOSAL_FUNCTION = "tickline_allocate_as_v2"  # written as ORACLE_FUNCTION is: simple expressions
PROPOSAL_CODE = "TK002"
PROPOSAL_LEAD = 1 << 17
_PROPOSAL_SQL = f"""
CREATE FUNCTION {PROPOSAL_FUNCTION}(seq regclass, n_ts integer, n_tokens integer, now_ms bigint,
    want_token bigint, want_ts bigint) RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    last bigint;
BEGIN
    IF pg_advisory_lock({ORACLE_LOCK}) IS NULL THEN
        RETURN;
    END IF;
    IF n_tokens > 0 AND pg_sequence_last_value(seq) IS DISTINCT FROM want_token - 1 THEN
        IF pg_advisory_unlock({ORACLE_LOCK}) IS NOT NULL THEN  -- always: unlocked, then raise
            RAISE EXCEPTION 'the proposed tokens are not the next ones' USING ERRCODE = '{PROPOSAL_CODE}';
        END IF;
    END IF;
    last := pg_sequence_last_value('{ORACLE_SEQUENCE}'::regclass);
    IF last IS NULL THEN
        SELECT last_value - 1 INTO last FROM {ORACLE_SEQUENCE};
    END IF;
    IF want_ts < GREATEST(last + 1, now_ms << 18)
            OR want_ts > GREATEST(last + 1, (now_ms << 18) + {PROPOSAL_LEAD}) THEN
        IF pg_advisory_unlock({ORACLE_LOCK}) IS NOT NULL THEN  -- always: unlocked, then raise
            RAISE EXCEPTION 'the proposed timestamps are not the oracle''s' USING ERRCODE = '{PROPOSAL_CODE}';
        END IF;
    END IF;
    IF n_tokens > 0 THEN
        last := setval(seq, want_token + n_tokens - 1, true);
    END IF;
    last := setval('{ORACLE_SEQUENCE}'::regclass, want_ts + n_ts - 1, true);
    IF pg_advisory_unlock({ORACLE_LOCK}) THEN
        RETURN;
    END IF;
END
$fn$
"""


# Writers' epochs: every registration takes a new one from this sequence, so no (stream, writer,
# epoch) is ever live twice, and a writer's row can be deleted when it leaves or is declared dead
# (a late statement of that epoch finds no row: fenced, as it finds a dead one). Before this
# sequence a new row's epoch was 1 and fencing moved it by one, so such a row, deleted, could be
# registered again with an epoch a stalled transaction still carries: rows of epochs below
# EPOCH_BASE (made by earlier versions) are only marked dead, as they were.
WRITER_EPOCHS = "tickline_writer_epochs"
EPOCH_BASE = 1 << 40


def _create_writer_epochs(cur: Cursor) -> None:
    # Under the oracle's lock, as the oracle's own objects: IF NOT EXISTS alone does not keep two
    # processes opening a new database at once from both creating it (a unique violation).
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (ORACLE_LOCK,))
    cur.execute(f"CREATE SEQUENCE IF NOT EXISTS {WRITER_EPOCHS} MINVALUE {EPOCH_BASE} START {EPOCH_BASE}")


# time_index.oracle_last on PostgreSQL: the sequence holds what appends took, the table what the master took.
_ORACLE_LAST_SQL = f"SELECT GREATEST(t.last_ts, s.last_value) FROM tickline_tso t, {ORACLE_SEQUENCE} s WHERE t.id = 1"
FENCED_CODE = "TK001"
FENCED_FUNCTION = "tickline_fenced_v1"
_FENCED_SQL = f"""
CREATE FUNCTION {FENCED_FUNCTION}() RETURNS boolean LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'this writer was declared dead (fenced off)' USING ERRCODE = '{FENCED_CODE}';
END
$fn$
"""

# A single-row (or small, not batch) append's allocation, position and claim in one call
# (``_Statements._build_claiming``): the allocation as ``ORACLE_FUNCTION``'s, then, the
# oracle's lock released, the writer's position (the fenced error, TK001, if this epoch is
# no longer live: the statement fails and nothing commits; the row lock it takes orders the
# append against a concurrent fencing, as the statement's own UPDATE did) and the claim: the
# safe position the append's NOTIFY carries (docs/time.md, "the commit's own claim"), its
# writer's new position, or less where another live writer of the stream has committed less.
# The claim's query is a subquery of the UPDATE's RETURNING: a statement of this VOLATILE
# function in READ COMMITTED takes a snapshot of its own when it starts, after the
# allocation's steps, so every writer that allocated a lower token had registered
# (committed) before that snapshot. In another isolation level the snapshot would be the
# transaction's: no claim (NULL). One PL/pgSQL call instead of the allocation's call, an
# UPDATE, the claim's call (``tickline_claim_v1``, which earlier versions still create and
# use) and the fenced check as parts of the statement (fewer plan nodes to start per append).
APPEND_FUNCTION = "tickline_append_v2"
# The server's clock in milliseconds as double precision: the same heartbeat as NOW_MS (to the
# millisecond; double precision holds today's epoch to well under a microsecond) without
# numeric arithmetic, about 5 us less of the append's backend CPU with a durable commit (paired
# rounds, 16 of 300 appends). Only here: the function runs on every append.
_NOW_MS_FLOAT = "(date_part('epoch', clock_timestamp()) * 1000)::bigint"
# v2 is v1 (which processes of earlier versions still create and use) with the allocation's steps
# for a claiming statement: it always takes tokens (n_tokens >= 1, no test for none), and tells a
# sequence never called apart from the rest with one test; and _NOW_MS_FLOAT. Every step that runs
# per append is a PL/pgSQL simple expression less or cheaper; the order of the steps (the lock,
# tokens, then timestamps, the unlock, the UPDATE and its claim) is ORACLE_FUNCTION's and v1's.
_APPEND_SQL = f"""
CREATE FUNCTION {APPEND_FUNCTION}(seq regclass, n_ts integer, n_tokens integer, now_ms bigint,
    s text, writer text, ep bigint, cap bigint,
    OUT first_token bigint, OUT first_ts bigint, OUT claim bigint) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    last bigint;
    own bigint;
    unlocked boolean;
BEGIN
    IF pg_advisory_lock({ORACLE_LOCK}) IS NULL THEN
        RETURN;
    END IF;
    first_token := nextval(seq);
    IF n_tokens > 1 THEN
        last := setval(seq, first_token + n_tokens - 1, true);
    END IF;
    last := pg_sequence_last_value('{ORACLE_SEQUENCE}'::regclass);
    IF last IS NULL THEN  -- never called (a new sequence): its value is the next one
        SELECT last_value - 1 INTO last FROM {ORACLE_SEQUENCE};
        first_ts := GREATEST(last + 1, now_ms << 18);
        last := setval('{ORACLE_SEQUENCE}'::regclass, first_ts + n_ts - 1, true);
    ELSE
        first_ts := GREATEST(last + 1, now_ms << 18);
        IF n_ts = 1 AND first_ts = last + 1 THEN
            first_ts := nextval('{ORACLE_SEQUENCE}'::regclass);
        ELSE
            last := setval('{ORACLE_SEQUENCE}'::regclass, first_ts + n_ts - 1, true);
        END IF;
    END IF;
    unlocked := pg_advisory_unlock({ORACLE_LOCK});
    UPDATE tickline_writers SET position = GREATEST(position, LEAST(first_token + n_tokens - 1, cap)),
        heartbeat_ms = {_NOW_MS_FLOAT} WHERE stream = s AND instance_name = writer AND epoch = ep AND alive
        RETURNING position, CASE WHEN current_setting('transaction_isolation') = 'read committed' THEN
            LEAST(position, (SELECT MIN(w.position) FROM tickline_writers w
                WHERE w.alive AND w.stream = s AND w.instance_name <> writer)) END
        INTO own, claim;
    IF own IS NULL THEN
        RAISE EXCEPTION 'this writer was declared dead (fenced off)' USING ERRCODE = '{FENCED_CODE}';
    END IF;
END
$fn$
"""
# A notification that carries its rows: this first word, then tab-separated stream,
# claim (-1: none) and instance; then one line per row: token, ts, JSON array.
ROWS_PAYLOAD = "tickline-rows/1"
MAX_PAYLOAD_BYTES = 7900  # PostgreSQL refuses a NOTIFY payload of 8000 bytes or more


def _release_oracle_lock(conn: Any) -> None:
    """After an error: the session may hold the oracle's lock (an error inside the function); release it."""
    try:
        if conn.closed:
            return
        if conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            conn.rollback()
        with conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock_all()")
        if not conn.autocommit:
            conn.commit()
    except psycopg2.Error:
        quietly_close(conn)  # closing the session releases its locks


def _create_oracle(cur: Cursor) -> None:
    """Create the oracle's sequence (from ``tickline_tso``'s mark), its floor's trigger and functions, once."""
    floor_missing = cur.execute("SELECT 1 FROM pg_trigger WHERE tgname = %s", (FLOOR_TRIGGER,)).fetchone() is None
    if floor_missing:
        # Before the oracle's lock, as every writer of tickline_tso takes them (allocate_timestamps
        # holds the table, then its call takes the lock): no deadlock. Held to the commit, it keeps
        # every floor's UPDATE out until the trigger is there.
        cur.execute("LOCK TABLE tickline_tso IN SHARE ROW EXCLUSIVE MODE")
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (ORACLE_LOCK,))
    if cur.execute("SELECT to_regclass(%s)", (ORACLE_SEQUENCE,)).fetchone()[0] is None:
        (mark,) = cur.execute("SELECT last_ts FROM tickline_tso WHERE id = 1").fetchone()
        cur.execute(f"CREATE SEQUENCE {ORACLE_SEQUENCE} MINVALUE 0 START 0")
        cur.execute("SELECT setval(%s, %s, true)", (ORACLE_SEQUENCE, int(mark)))
    if floor_missing and cur.execute("SELECT 1 FROM pg_trigger WHERE tgname = %s", (FLOOR_TRIGGER,)).fetchone() is None:
        cur.execute(_FLOOR_SQL)
        # The floor as it stands (committed before the table's lock): the sequence at or above it
        # from now on (an earlier version's allocations read the floor themselves).
        cur.execute(
            f"SELECT setval(%s, GREATEST(t.last_ts, s.last_value), true) FROM tickline_tso t, {ORACLE_SEQUENCE} s "
            "WHERE t.id = 1",
            (ORACLE_SEQUENCE,),
        )
    if cur.execute("SELECT 1 FROM pg_proc WHERE proname = %s", (ORACLE_FUNCTION,)).fetchone() is None:
        cur.execute(_ORACLE_SQL)
    if cur.execute("SELECT 1 FROM pg_proc WHERE proname = %s", (BATCH_FUNCTION,)).fetchone() is None:
        cur.execute(_BATCH_SQL)
    if cur.execute("SELECT 1 FROM pg_proc WHERE proname = %s", (PROPOSAL_FUNCTION,)).fetchone() is None:
        cur.execute(_PROPOSAL_SQL)
    if cur.execute("SELECT 1 FROM pg_proc WHERE proname = %s", (FENCED_FUNCTION,)).fetchone() is None:
        cur.execute(_FENCED_SQL)
    if cur.execute("SELECT 1 FROM pg_proc WHERE proname = %s", (APPEND_FUNCTION,)).fetchone() is None:
        cur.execute(_APPEND_SQL)


def _upgrade_stream_tables(cur: Cursor) -> None:
    """Bring stream tables made by earlier versions to today's shape (``StreamSchema.upgrade_table_sql``)."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtext('tickline:upgrade streams'))")
    for name, columns in cur.execute("SELECT name, columns FROM tickline_streams").fetchall():
        for statement in StreamSchema.from_columns_json(name, columns).upgrade_table_sql("postgresql"):
            cur.execute(statement)


class Fenced(Exception):
    """This writer was declared dead: its transaction may not commit."""


class _WriterState:
    __slots__ = ("epoch", "inflight", "next_token", "next_ts", "propose", "writer_id")

    def __init__(self, writer_id: str, epoch: int) -> None:
        self.writer_id = writer_id  # "<instance>/<host>:<pid>:<nonce>": one per process
        self.epoch = epoch
        self.inflight: dict[int, int] = {}  # transaction id -> its lowest token
        # What this writer's next allocation will be if no other process allocates meanwhile
        # (its last allocation's ends + 1; 0: not known yet), and whether to propose it
        # (WriteTransaction._append_copy_proposed): not after a proposal that missed, until an
        # allocation shows the next one would have been right.
        self.next_token = 0
        self.next_ts = 0
        self.propose = True


def _seq(schema: StreamSchema) -> str:
    return f"{schema.table}_token_seq"


class PgStreamStore:
    """Implements :class:`storage.contracts.StreamStore`; holds its :class:`PgDatabase`."""

    max_line_bytes: int | None = DEFAULT_MAX_LINE_BYTES  # refuse rows whose RDATA line could be longer
    # Two backends read two chunks at once (their columns, or lines the server builds: storage.pg_columns_out).
    parallel_reads = 2

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
        self._row_plans: dict[tuple[str, str], _RowPlan] = {}  # per stream and writer (_append_row)
        self._next_txn = 0
        self._reporter: threading.Thread | None = None
        self._stop_reporting = threading.Event()
        self._side = threading.local()
        # Per thread, the autocommit connection of write transactions (``writing``): BEGIN goes
        # with the transaction's first statement and COMMIT with its last, no round trip of their own.
        self._writes = threading.local()
        self._process_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # autocommit connections for the oracle and reports

    def migrate(self) -> list[int]:
        """Create or upgrade the tables; returns the migration versions applied.

        Also creates the timestamp oracle's sequence and allocation function
        (PostgreSQL only, so not in the shared migration files).
        """
        applied = self.database.migrate()
        self.database.write(_create_oracle)
        self.database.write(_create_writer_epochs)
        self.database.write(_upgrade_stream_tables)
        return applied

    def catalog(self) -> dict[str, StreamSchema]:
        return self._catalog.catalog()

    # -- time (storage.time_index) ------------------------------------------------------

    def first_token_at(self, stream: str, since_ts: int) -> time_index.TokenAt:
        return time_index.first_token_at(self, stream, since_ts)

    def last_ts_upto(self, stream: str, token: int) -> int | None:
        return time_index.last_ts_upto(self, stream, token)

    def safe_point(self, expire_writers: bool = True, allocate: bool = True) -> tuple[dict[str, int], dict[str, int]]:
        """As :func:`storage.time_index.safe_point`, in two round trips on a wake-up.

        Without the dead-writer sweep, after the oracle's time ``t``, one
        prepared statement reads per stream the safe position, the allocated
        head, whether a live writer exists and the last timestamp at or below
        the position: the positions and the live writers from one snapshot (so
        the writers are read no later than the positions), the heads
        (sequences) after it, as the proof in docs/time.md needs.
        """
        known = self._catalog.known()
        if expire_writers or not known:
            return time_index.safe_point(self, expire_writers, allocate)
        if allocate:
            t = time_index.oracle_time(self)
        else:  # time_index.oracle_last, prepared
            t = int(self.database.query(_ORACLE_LAST_SQL, prepare=True)[0][0])
        # Per stream also the timestamp of the last row at or below the safe
        # position (time_index.last_ts_upto), read in the same statement (and
        # snapshot: every row up to the position has committed in it).
        parts = [
            "SELECT name, position, head, live, "
            f"(SELECT ts FROM {schema.table} WHERE token <= p.position ORDER BY token DESC LIMIT 1) FROM "
            "(SELECT %s::text AS name, COALESCE((SELECT MIN(position) FROM tickline_writers "
            f"WHERE alive AND stream = %s), (SELECT MAX(token) FROM {schema.table}), 0) AS position, "
            f"(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {_seq(schema)}) AS head, "
            "EXISTS (SELECT 1 FROM tickline_writers WHERE alive AND stream = %s) AS live) AS p"
            for schema in known
        ]
        params = [value for schema in known for value in (schema.name, schema.name, schema.name)]
        times: dict[str, int] = {}
        positions: dict[str, int] = {}
        for name, position, head, live, last_ts in self.database.query(" UNION ALL ".join(parts), params, prepare=True):
            positions[name] = int(position)
            found = time_index.stream_safe_time(t, int(head) <= position or not live, last_ts)
            if found is not None:
                times[name] = found
        return times, positions

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
    def _side_cursor(self, commits: bool = False) -> Iterator[Any]:
        """A cursor on this thread's autocommit connection; a lost server is DatabaseUnavailable
        (``commits``: the statements commit, so :class:`CommitUnknown` once the connection was made)."""
        conn = self._side_connection()
        try:
            with conn.cursor() as cur:
                yield cur
        except psycopg2.Error as e:
            self._side_failed(conn, e, commits)
            raise

    def _side_failed(self, conn: Any, error: psycopg2.Error, commits: bool = False) -> None:
        """After ``error`` on this thread's side connection: a lost connection is dropped and raised as
        :class:`DatabaseUnavailable` (:class:`CommitUnknown` where a statement that commits may have
        been sent: ``commits``); otherwise the session may hold the oracle's lock, which is released
        (the caller raises ``error`` again)."""
        if isinstance(error, psycopg2.OperationalError):
            self._side.conn = None
            raise lost_connection(self.database.dsn, conn, error, commits) from None
        _release_oracle_lock(conn)

    def _side_connection(self) -> Any:
        """This thread's autocommit connection (``PgDatabase.held``: a new one if the server closed it)."""
        return self.database.held(self._side, "conn", autocommit=True)

    def _head_sql(self, schema: StreamSchema) -> str:
        return f"SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {_seq(schema)}"

    # -- the timestamp oracle ----------------------------------------------------------

    def allocate_timestamps(self, count: int = 1) -> list[int]:
        """``count`` timestamps, strictly increasing across every process.

        The same allocation as an append's (``tickline_allocate``), and the
        high-water mark is also recorded in ``tickline_tso`` in the same
        statement: that write gives the statement a durable commit, so a
        timestamp handed out here (the master's safe time) is never handed out
        again, even after a crash of the database server. Appends do not pay
        this commit: their own commit makes their timestamps durable.
        """
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._side_cursor() as cur:
            cur.execute(
                f"WITH a AS (SELECT first_ts FROM {ORACLE_FUNCTION}(NULL, %s, 0, %s)) "
                "UPDATE tickline_tso SET last_ts = GREATEST(last_ts, a.first_ts + %s - 1) FROM a WHERE id = 1 "
                "RETURNING a.first_ts",
                (count, self._now_ms(), count),
            )
            (first,) = cur.fetchone()
        return list(range(first, first + count))

    def _now_ms(self) -> int:
        return max(int(self._clock() * 1000), 0)

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
                    f"VALUES (%s, %s, nextval('{WRITER_EPOCHS}'), ({self._head_sql(schema)}), {NOW_MS}, TRUE) "
                    "ON CONFLICT (stream, instance_name) DO UPDATE SET epoch = excluded.epoch, "
                    "position = excluded.position, heartbeat_ms = excluded.heartbeat_ms, alive = TRUE "
                    "RETURNING epoch",
                    (schema.name, writer_id),
                )
                (epoch,) = cur.fetchone()
                # A database that autovacuum has not analyzed yet (a new one: about its first
                # minute) has no size for tickline_writers, and the planner assumes ten pages:
                # the claim's query (APPEND_FUNCTION) became a bitmap scan, about 8 us more per
                # append than on a table it knows is one page. Done once, here, where the
                # writer's row is in. (Skipped with a warning where the user does not own it.)
                cur.execute("SELECT reltuples < 0 FROM pg_class WHERE oid = 'tickline_writers'::regclass")
                if cur.fetchone()[0]:
                    cur.execute("ANALYZE tickline_writers")
            state = self._writers[key] = _WriterState(writer_id, epoch)
        self._ensure_reporter()
        return state

    def append(self, stream: str, rows: Iterable[Row], instance_name: str, batch: bool = False) -> list[int]:
        """Append rows in one transaction; returns the token of each row.

        A writer that was declared dead meanwhile registers again and retries
        with new tokens, so its rows still arrive, in token order.
        """
        rows = list(rows)
        single = len(rows) == 1 and not batch
        for _attempt in range(5):
            try:
                if single:  # the usual case, straight to it: every call less counts (_append_row)
                    return self._append_row(self._catalog.schema(stream), rows[0], instance_name)
                if len(rows) < COPY_ROWS:
                    return self._append_one_statement(stream, rows, instance_name, batch)
                with self.writing(stream, instance_name) as txn:
                    return txn.append(rows, batch, alone=True)
            except Fenced:
                logger.warning(
                    "writer %s of %s was declared dead; registering again and retrying with new tokens",
                    instance_name,
                    stream,
                )
        raise Fenced(f"writer {instance_name} of {stream} was fenced off 5 times in a row")

    def _append_one_statement(self, stream: str, rows: list[Row], instance_name: str, batch: bool) -> list[int]:
        """A small append as one statement in autocommit: a transaction of its own, one round trip.

        The statement allocates, inserts, moves the writer's position and
        notifies; it fails as a whole (nothing committed) if the writer was
        fenced off.
        """
        schema = self.schema(stream)
        if len(rows) == 1 and not batch:
            return self._append_row(schema, rows[0], instance_name)
        check_instance_name(instance_name)
        state = self._register(schema, instance_name)
        with self._lock:
            self._next_txn += 1
            txn_id = self._next_txn
        try:
            with self._side_cursor(commits=True) as raw:  # the append's statement commits on its own
                txn = WriteTransaction(self, schema, instance_name, state, txn_id, Cursor(raw))
                tokens = txn.append(rows, batch)
            return tokens
        except Fenced:
            with self._lock:
                if self._writers.get((stream, instance_name)) is state:
                    del self._writers[(stream, instance_name)]
            raise
        finally:
            with self._lock:
                state.inflight.pop(txn_id, None)

    def _append_row(self, schema: StreamSchema, row: Row, instance_name: str) -> list[int]:
        """One row not in a batch: what ``_append_one_statement`` does through a WriteTransaction, inline.

        The same statement (``_Statements.claiming``), the same steps under the
        lock, the same errors and bookkeeping; without the transaction object,
        the generic row check and the per-call lookups of the statement. Why: the
        writer's CPU is on a single-row append's serial path, and right after its
        wait for the server the writer's code runs with cold caches, at about
        3.5 times its cost in a hot loop (13 against 46 µs, measured with the
        server's answer faked): every call and object less counts that much.
        """
        key = (schema.name, instance_name)
        plan = self._row_plans.get(key)
        if plan is None or plan.schema is not schema:
            check_instance_name(instance_name)
            if len(self._row_plans) >= 256:  # bounded: writers of a long-lived process come and go
                self._row_plans.clear()
            plan = self._row_plans[key] = _RowPlan(schema)
        # Registered already, as a rule: found without the lock (one dict read; _register takes it).
        state = self._writers.get(key)
        if state is None:
            state = self._register(schema, instance_name)
        conn = self._side_connection()
        # A row of exactly typed values: checked and written as literals in one pass (E'...', read
        # the same whatever the session's standard_conforming_strings); anything else the careful
        # way, which names the fault.
        literals = plan.literals
        text = None if literals is None else literals(row, self.max_line_bytes)
        if text is None:
            values = plan.checker.one(row, self.max_line_bytes)
            doubles = plan.doubles
            if doubles:  # as in WriteTransaction._append_small: a double as its shortest exact text
                values = tuple(repr(v) if k in doubles and v is not None else v for k, v in enumerate(values))
        now_ms = max(int(self._clock() * 1000), 0)  # self._now_ms(), inline
        lock = self._lock
        inflight = state.inflight
        try:
            # One tuple, read and replaced whole: threads with connections of their own share the plan.
            # The cursor is kept with it (one per connection, not one made and closed per append).
            prepared_on, cursor, writer_id, execute, head = plan.prepared
            if prepared_on is not conn or writer_id != state.writer_id:
                cursor = conn.cursor()
                execute = plan.statements.claiming(1, state.writer_id, instance_name, cursor)
                head = execute[: execute.index(" (") + 2]
                plan.prepared = (conn, cursor, state.writer_id, execute, head)
            # The cap and the allocation under the lock, as in _append_small. The statement has
            # committed (autocommit) when its answer comes, still under the lock: no other thread
            # of this writer can see it in flight, so it is not registered as such.
            with lock:
                cap = min(inflight.values()) - 1 if inflight else MAX_TOKEN  # this one is not in yet
                if text is not None:
                    statement = f"{head}{now_ms}, {state.epoch}, {cap}, {text})"
                    params = None
                else:
                    params = [now_ms, state.epoch, cap, *values]
                    literal = execute_literals(cursor, execute, params)
                    statement, params = (execute, params) if literal is None else (literal, None)
                try:
                    cursor.execute(statement, params)
                except psycopg2.Error as e:
                    if e.pgcode == FENCED_CODE:
                        raise Fenced(instance_name) from None
                    raise
                first_token, first_ts = cursor.fetchone()
                _remember(state, first_token, 1, first_ts, 1, now_ms)
            return [first_token]
        except Fenced:
            with lock:
                if self._writers.get(key) is state:
                    del self._writers[key]
            raise
        except psycopg2.Error as e:
            self._side_failed(conn, e, commits=True)  # the statement commits on its own
            raise

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
        conn = self.database.held(self._writes, "conn", autocommit=True)
        txn: WriteTransaction | None = None
        try:
            with conn.cursor() as raw:
                txn = WriteTransaction(self, schema, instance_name, state, txn_id, Cursor(raw), explicit=True)
                yield txn
                txn.commit()
        except psycopg2.OperationalError as e:
            # Lost once a COMMIT was sent: the rows may be in (a caller that writes them again
            # would repeat them), which the error must not hide.
            self._writes.conn = None
            raise lost_connection(self.database.dsn, conn, e, txn is not None and txn.commit_sent) from None
        except Fenced:
            rollback_explicit(conn)
            with self._lock:
                if self._writers.get((stream, instance_name)) is state:
                    del self._writers[(stream, instance_name)]
            raise
        except BaseException:
            if not conn.closed:
                rollback_explicit(conn)
                _release_oracle_lock(conn)
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
            fresh_ms = int(self.report_interval * 100)  # a tenth of the interval (_REPORT_SQL)
            with self._side_cursor() as cur:
                cur.execute(
                    _REPORT_SQL,
                    {"s": stream, "i": state.writer_id, "e": state.epoch, "p": position, "f": fresh_ms, "c": CHANNEL},
                )
                alive, _notified = cur.fetchone()
            if not alive:
                with self._lock:
                    if self._writers.get((stream, instance)) is state and not state.inflight:
                        del self._writers[(stream, instance)]  # register again on next write

    def retire_writers(self) -> None:
        """Leave cleanly: this process's writers stop holding their streams back."""
        self._stop_reporting.set()
        with self._lock:
            writers = list(self._writers.items())
            self._writers.clear()
        for (stream, _instance), state in writers:
            try:
                with self._side_cursor() as cur:
                    # Its epoch came from WRITER_EPOCHS: the row can go (a late statement of it is fenced).
                    cur.execute(
                        "DELETE FROM tickline_writers WHERE stream = %s AND instance_name = %s AND epoch = %s",
                        (stream, state.writer_id, state.epoch),
                    )
                    cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, stream))
            except DatabaseUnavailable as e:
                # Best effort: the master drops a silent writer after writer_timeout, as after a
                # crash; an error here must not hide the caller's own (a write that may have committed).
                logger.warning("writer %s of stream %s not retired: %s", state.writer_id, stream, e)

    def close(self) -> None:
        self.retire_writers()
        self.database.close()

    # -- reading ---------------------------------------------------------------------------

    def safe_positions(self, expire_writers: bool = True) -> dict[str, int]:
        """Per stream, the token up to which every row has committed.

        With ``expire_writers``, first drops writers silent for longer than
        ``writer_timeout``: their rows deleted (epochs from ``WRITER_EPOCHS``)
        or, rows of earlier versions, marked dead.
        """
        timeout_ms = int(self.writer_timeout * 1000)
        known = self._catalog.known()
        if not expire_writers and known:
            return self._safe_positions_now(known)

        def run(cur: Cursor) -> dict[str, int]:
            dead = []
            if expire_writers:
                # Rows with epochs from WRITER_EPOCHS are deleted (those that left but are still
                # there, marked dead by an earlier version's master, too); older ones marked dead.
                gone = cur.execute(
                    f"DELETE FROM tickline_writers WHERE epoch >= {EPOCH_BASE} "
                    f"AND (NOT alive OR heartbeat_ms < {NOW_MS} - %s) RETURNING stream, instance_name, alive",
                    (timeout_ms,),
                ).fetchall()
                dead = [(stream, instance) for stream, instance, alive in gone if alive]
                dead += cur.execute(
                    "UPDATE tickline_writers SET alive = FALSE, epoch = epoch + 1 "
                    f"WHERE alive AND heartbeat_ms < {NOW_MS} - %s AND epoch < {EPOCH_BASE} "
                    "RETURNING stream, instance_name",
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
            f"SELECT %s::text, COALESCE((SELECT MIN(position) FROM tickline_writers WHERE alive AND stream = %s), "
            f"(SELECT MAX(token) FROM {schema.table}), 0)"
            for schema in schemas
        ]
        params = [value for schema in schemas for value in (schema.name, schema.name)]
        with self._side_cursor() as cur:
            cur.execute(prepared(cur, " UNION ALL ".join(parts)), params)
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

    def read_lines_json(
        self, stream: str, after: int, upto: int, limit: int, prefix: str, with_ts: bool
    ) -> tuple[bytes, int, int] | None:
        """Whole ``RDATA`` lines for rows in ``(after, upto]``, built by PostgreSQL: ``(lines, last token, rows)``.

        About ``limit`` rows, never part of a token: the range ends at the
        token of the ``limit``-th row, all of whose rows are included (rows
        sharing a token are sent as ``batch`` lines, then the last with the
        token). No Python object per row or value: the server builds each
        line (JSON columns as stored, integral doubles with ``.0`` as the
        Python encoder writes them; other doubles may print their exponent
        differently, ``1e+300``, and read the same) and sends them by ``COPY``
        (``storage.pg_lines``), or sends the columns and the lines are built
        here from whole ``COPY`` buffers (``storage.pg_columns_out``). None
        (the caller builds the lines) if a line came out over ``max_line_bytes``.
        """
        schema = self.schema(stream)
        with self._side_cursor() as cur:
            return read_lines(cur, LineRange(schema, after, upto, limit, prefix, with_ts), self.max_line_bytes)

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

    def change_watch(self) -> None:
        """None: PostgreSQL wakes the master by :meth:`notifier` (``LISTEN/NOTIFY``)."""
        return None

    def open_wake(self) -> PgWake:
        """Blocking: the master's one-round-trip wake-up on a non-blocking connection (``storage.pg_wake``)."""
        from storage.pg_wake import open_wake

        return open_wake(self)


# A large append's allocation, and a write transaction's last statement (prepared once per connection).
BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED; "
_ALLOCATE_SQL = (
    f"SELECT first_token, first_ts FROM {ORACLE_FUNCTION}(%s::regclass, %s::integer, %s::integer, %s::bigint)"
)
_ALLOCATE_BATCH_SQL = (
    f"SELECT first_token, first_ts FROM {BATCH_FUNCTION}(%s::regclass, %s::integer, %s::bigint, %s::bigint)"
)
_PROPOSE_SQL = f"SELECT {PROPOSAL_FUNCTION}(%s::regclass, %s::integer, %s::integer, %s::bigint, %s::bigint, %s::bigint)"
# The writer's position and its NOTIFY, or the fenced error if this epoch is no longer live.
_FINISH_SQL = (
    "WITH u AS (UPDATE tickline_writers SET position = GREATEST(position, %s::bigint), "
    f"heartbeat_ms = {NOW_MS} WHERE stream = %s::text AND instance_name = %s::text AND epoch = %s::bigint AND alive "
    f"RETURNING 1) SELECT pg_notify(%s::text, %s::text) WHERE (SELECT count(*) FROM u) = 1 OR {FENCED_FUNCTION}()"
)


class WriteTransaction:
    """Rows appended by one writer in one open transaction (see ``PgStreamStore.writing``).

    A small append is one statement: the oracle's allocation (tokens and
    timestamps), the ``INSERT`` and the writer's position with its ``NOTIFY``
    (committed by the transaction's single commit). A large one allocates,
    then sends the rows by ``COPY``; its position moves with the commit (:meth:`commit`).
    With ``batch``, the transaction's batch appends share one token as long
    as no other token of the stream is allocated between them. A batch append
    that comes after such a token (the transaction's own rows outside the
    batch, another writer's) starts a new batch token, so that ``ts`` keeps
    increasing with the token in the stream (docs/time.md).
    """

    def __init__(
        self,
        store: PgStreamStore,
        schema: StreamSchema,
        instance: str,
        state: _WriterState,
        txn_id: int,
        cur: Cursor,
        explicit: bool = False,
    ) -> None:
        # explicit: cur's connection is in autocommit and this transaction sends its own BEGIN (with
        # its first statement) and COMMIT (with its last, in :meth:`commit`).
        self._begin = BEGIN if explicit else ""
        self._begun = False
        self._committed = False  # by the statement of an append alone in its transaction
        self.commit_sent = False  # a statement with the COMMIT went out (a lost connection: outcome unknown)
        self._alone = False
        self._store = store
        self._schema = schema
        self._instance = instance
        self._state = state
        self._id = txn_id
        self._cur = cur
        self._last_token = 0
        self._position_sent = 0  # the last token whose position update is already in the transaction
        self._batch_token: int | None = None
        self._batch_rows = 0  # rows of this transaction's batch token so far
        self._statements = _statements(schema)

    def append(self, rows: Iterable[Row], batch: bool = False, alone: bool = False) -> list[int]:
        """Append rows in this transaction; their tokens.

        ``alone``: the transaction's only append (``PgStreamStore.append``): a
        large one may then commit in the same round trip as its ``BEGIN`` and
        ``COPY`` (see :meth:`_append_copy_proposed`); the caller's
        :meth:`commit` has nothing left to do then.
        """
        self._alone = alone and not self._begun
        rows = rows if isinstance(rows, list) else list(rows)
        count = len(rows)
        if not count:
            return []
        previous_batch = self._batch_token
        batch_rows = self._batch_rows
        if batch:
            # The batch steps of one transaction share its token while nothing else of the stream is
            # allocated (see _allocated). This transaction's own rows since the batch's last step mean
            # a new token for certain; another writer's are not known before the call: the bound is
            # then checked as if the token were continued.
            batch_rows = batch_step_rows(self._schema.name, batch_rows, count, self._last_token == previous_batch)
        limit = self._store.max_line_bytes
        if count >= COPY_ROWS:
            first_token, _ = self._append_copy(rows, count, batch, limit)
        else:
            first_token, _ = self._append_small(check_rows(self._schema, rows, limit), batch)
        if batch:
            # Counted once the step is in (a refused one adds nothing); a new batch token
            # (_allocated) counts its own rows from now on.
            self._batch_rows = count if first_token != previous_batch else batch_rows
        tokens = [first_token] * count if batch else list(range(first_token, first_token + count))
        self._last_token = tokens[-1]
        return tokens

    def _token_count(self, count: int, batch: bool) -> int:
        if batch:
            return 0 if self._batch_token is not None else 1
        return count

    def _allocated(self, first_token: int | None, batch: bool, token_count: int) -> tuple[int, int]:
        """Remember what was allocated (under the store's lock): the rows' first token, the tokens taken.

        A later batch append (``token_count`` 0) took a token of its own if
        another token of the stream was allocated since the batch's
        (``BATCH_FUNCTION``): that is the transaction's batch token from now on.
        """
        assert first_token is not None
        if batch and self._batch_token is not None:
            if first_token == self._batch_token:
                return first_token, 0
            token_count = 1
        self._state.inflight.setdefault(self._id, first_token)
        if batch:
            self._batch_token = first_token
        return first_token, token_count

    def _cap(self) -> int:
        """The highest position this writer may claim: below its other transactions in flight."""
        others = [t for other, t in self._state.inflight.items() if other != self._id]
        return min(others) - 1 if others else MAX_TOKEN

    def _append_small(self, values: list[tuple[Any, ...]], batch: bool) -> tuple[int, int]:
        store, state, schema = self._store, self._state, self._schema
        count = len(values)
        token_count = self._token_count(count, batch)
        # Not a batch: the statement of APPEND_FUNCTION, with what stays the same for the writer
        # (its names, the stream, the row count) written into it (_Statements._build_claiming).
        claims = not (batch or token_count == 0)
        now_ms = store._now_ms()
        params: list[Any]
        if claims:
            sql = self._statements.claiming(count, state.writer_id, self._instance, self._cur.cursor)
            params = [now_ms, state.epoch, MAX_TOKEN]  # the cap is set under the lock
        else:
            sql = self._statements.batch(count, token_count == 0, self._cur.cursor)
            # A later batch append: the batch token in place of the token count (BATCH_FUNCTION).
            params = [_seq(schema), count, self._batch_token if token_count == 0 else token_count, now_ms]
            params.append(self._instance)
        doubles = self._statements.doubles
        for i, row in enumerate(values, 1):
            if not claims:
                params.append(i)
            if doubles:
                # A double as its shortest exact text, which the server reads with float8's input:
                # as a number psycopg2 writes -0.0, which an EXECUTE argument reads as a numeric
                # (no negative zero) and stored 0.
                row = tuple(repr(v) if k in doubles and v is not None else v for k, v in enumerate(row))
            params.extend(row)
        # Allocation and registration as in flight happen under the lock, so
        # a concurrent report never claims a token still in flight.
        with store._lock:
            cap = self._cap()
            if claims:
                params[2] = cap
            else:
                params += [cap, schema.name, state.writer_id, state.epoch, CHANNEL, schema.name]
            # A prepared statement's parameters as literals where they can be (execute_literals):
            # the same text psycopg2 would send, for a third of its CPU.
            text = execute_literals(self._cur.cursor, sql, params) if count <= PREPARED_ROWS else None
            try:
                # (first token, first ts) and, but for a one-row claiming statement, the NOTIFY's void
                if text is not None:
                    first_token, first_ts = self._cur.execute(self._first(text), None).fetchone()[:2]
                else:
                    first_token, first_ts = self._cur.execute(self._first(sql), params).fetchone()[:2]
            except psycopg2.Error as e:
                if e.pgcode == FENCED_CODE:
                    raise Fenced(self._instance) from None
                raise
            first, token_count = self._allocated(first_token, batch, token_count)
            _remember(self._state, first_token, token_count, first_ts, count, now_ms)
        self._position_sent = first if batch else first + count - 1
        return first, first_ts

    def _append_copy(self, rows: list[Row], count: int, batch: bool, limit: int | None) -> tuple[int, int]:
        """Allocate, then check and send the rows by ``COPY``; a bad row raises before anything is sent.

        The transaction then rolls back: the tokens and timestamps allocated
        are skipped, as for any rolled-back write.
        """
        store, schema = self._store, self._schema
        token_count = self._token_count(count, batch)
        if not self._begun and self._begin:
            took = self._append_copy_proposed(rows, count, batch, token_count, limit)
            if took is not None:
                return took
        now_ms = store._now_ms()
        # A later batch append: the batch token in place of the token count (BATCH_FUNCTION).
        sql, third = (_ALLOCATE_BATCH_SQL, self._batch_token) if token_count == 0 else (_ALLOCATE_SQL, token_count)
        with store._lock:
            first_token, first_ts = self._cur.execute(
                self._first(prepared(self._cur.cursor, sql)), (_seq(schema), count, third, now_ms)
            ).fetchone()
            first, token_count = self._allocated(first_token, batch, token_count)
            _remember(self._state, first_token, token_count, first_ts, count, now_ms)
        self._copy(_CopySource(self._statements, rows, self._instance, first, 0 if batch else 1, first_ts, limit))
        return first, first_ts

    def _copy(self, source: _CopySource, sql: str | None = None) -> None:
        try:
            self._cur.cursor.copy_expert(sql or self._statements.copy, source, size=1 << 20)
        except psycopg2.Error:
            if source.error is not None:  # psycopg2 ended the COPY with our error as its text
                raise source.error from None
            raise

    def _append_copy_proposed(
        self, rows: list[Row], count: int, batch: bool, token_count: int, limit: int | None
    ) -> tuple[int, int] | None:
        """The transaction's first ``COPY``, its allocation proposed in the same round trip (None: not done).

        The writer proposes what its next allocation will be if no other
        process allocated since its last one (``PROPOSAL_FUNCTION``), and
        sends ``BEGIN``, that call and the ``COPY`` as one query: the rows'
        tokens and timestamps are in the ``COPY`` data, so the call must take
        exactly those or nothing. If it takes nothing (another writer of the
        stream, or the master, allocated meanwhile), the ``COPY`` never
        starts, the transaction is rolled back, and the caller allocates as
        usual (a round trip more than without a proposal, no gap).
        """
        store, state, schema = self._store, self._state, self._schema
        now_ms = store._now_ms()
        with store._lock:
            if not state.propose or not state.next_token or (batch and token_count == 0):
                return None
            want_token = state.next_token
            want_ts = max(state.next_ts, (now_ms << 18) + PROPOSAL_LEAD)
            # In flight from before the call: a report never claims a token this call may take.
            self._state.inflight[self._id] = want_token
            # If the call takes the proposal, every allocation of this writer below it is in
            # flight already (registered with its allocation, under this lock): the cap holds.
            cap = self._cap()
        cursor = self._cur.cursor
        proposal = (_seq(schema), count, token_count, now_ms, want_token, want_ts)
        call = cursor.mogrify(prepared(cursor, _PROPOSE_SQL), proposal).decode()
        sql = f"{self._begin}{call}; {self._statements.copy}"
        last = want_token if batch else want_token + count - 1
        if self._alone:
            # The position and the COMMIT after the rows, in the same query: the whole append
            # in one round trip (the fenced error, as in commit(), stops it before the COMMIT).
            finish = (min(last, cap), schema.name, state.writer_id, state.epoch, CHANNEL, schema.name)
            sql += f"; {cursor.mogrify(prepared(cursor, _FINISH_SQL), finish).decode()}; COMMIT"
        source = _CopySource(self._statements, rows, self._instance, want_token, 0 if batch else 1, want_ts, limit)
        self._begun = True
        self.commit_sent = self._alone
        try:
            self._copy(source, sql)
            self._committed = self._alone
        except RowError:
            # The COPY had started: the call took the proposal. Those tokens and timestamps are
            # skipped with the rollback; the next proposal starts after them.
            with store._lock:
                _remember(self._state, want_token, token_count, want_ts, count)
            raise
        except psycopg2.Error as e:
            if e.pgcode == FENCED_CODE:
                raise Fenced(self._instance) from None
            if e.pgcode != PROPOSAL_CODE:
                raise
            self._cur.execute("ROLLBACK")
            self._begun = False
            self.commit_sent = False  # the proposal was refused before its COMMIT: nothing committed
            with store._lock:
                state.propose = False
                self._state.inflight.pop(self._id, None)
            return None
        with store._lock:
            if batch:
                self._batch_token = want_token
            _remember(self._state, want_token, token_count, want_ts, count)
        return want_token, want_ts

    def _first(self, sql: str) -> str:
        """``sql``, led by ``BEGIN`` if it is the transaction's first statement (explicit transactions)."""
        if self._begun:
            return sql
        self._begun = True
        return self._begin + sql

    def commit(self) -> None:
        """The writer's position moved and the transaction committed, in one round trip.

        Refuses (:class:`Fenced`, nothing committed) if the writer was
        declared dead meanwhile: the position's update then finds no live row
        of this epoch and the statement raises before the ``COMMIT``.
        """
        if not self._begun or self._committed:
            return
        self.commit_sent = True
        if not self._last_token or self._last_token <= self._position_sent:
            self._cur.execute("COMMIT")
            return
        store = self._store
        with store._lock:
            cap = self._cap()
        position = min(self._last_token, cap)
        try:
            self._cur.execute(
                prepared(self._cur.cursor, _FINISH_SQL) + "; COMMIT",
                (position, self._schema.name, self._state.writer_id, self._state.epoch, CHANNEL, self._schema.name),
            )
        except psycopg2.Error as e:
            if e.pgcode == FENCED_CODE:
                raise Fenced(self._instance) from None
            raise


class _Statements:
    """A stream's append statements, built once per stream and row count."""

    def __init__(self, schema: StreamSchema) -> None:
        self.schema = schema
        # ``seq`` is each row's timestamp (unique and increasing with the oracle, so it
        # orders a token's rows as inserted): given, not drawn from its sequence row by row.
        names = ", ".join(("seq", "token", "instance_name", "ts", *schema.column_names))
        self.copy = f"COPY {schema.table} ({names}) FROM STDIN"
        self._batch: dict[tuple[int, bool], str] = {}
        self._claiming: dict[tuple[int, str, str], str] = {}
        self._formats = [_COPY_FORMATS[c.type] for c in schema.columns]
        self.doubles = frozenset(schema.double_columns)
        self._chunk = chunk_formatter(schema)
        # JSON bytes a row can have beyond 6x its COPY text: brackets, per value quotes and a
        # separator, "null" for "\\N", "false" for "f", a double printed at its longest.
        self._fixed_json_bytes = 2 + sum(
            3 + 4 + (5 if c.type == "boolean" else 0) + (24 if c.type == "double" else 0) for c in schema.columns
        )

    def batch(self, count: int, shared: bool, cursor: Any) -> str:
        """A batch append's statement for ``count`` rows; for few rows a prepared one (``EXECUTE``, no parse or plan)."""
        key = (count, shared)
        sql = self._batch.get(key)
        if sql is None:
            sql = self._batch[key] = self._build_batch(count, shared)
        if count > PREPARED_ROWS:
            return sql
        return prepared(cursor, sql)

    def claiming(self, count: int, writer_id: str, instance: str, cursor: Any) -> str:
        """A writer's statement for ``count`` rows not in a batch (see :meth:`_build_claiming`)."""
        key = (count, writer_id, instance)
        sql = self._claiming.get(key)
        if sql is None:
            if len(self._claiming) >= 256:  # bounded: writers of a long-lived process come and go
                self._claiming.clear()
            sql = self._claiming[key] = self._build_claiming(count, writer_id, instance)
        if count > PREPARED_ROWS:
            return sql
        return prepared(cursor, sql)

    def _build_claiming(self, count: int, writer_id: str, instance: str) -> str:
        """One statement: allocation, position and claim (APPEND_FUNCTION), the rows' INSERT, the NOTIFY.

        What is the same on every call of a writer (the stream's sequence, names and
        channel, the writer's names, the row count, each row's index) is written in as
        literals: its parameters are the clock, the epoch, the cap and the values (fewer
        for the server to read and coerce per append; the sequence's name is resolved
        when the statement is planned, not per call).
        """
        schema = self.schema
        casts = self._casts()
        rows = ", ".join(f"({i}, {casts})" for i in range(1, count + 1))
        aliases = ", ".join(f"v.{name}" for name in schema.column_names)
        names = ", ".join(("seq", "token", "instance_name", "ts", *schema.column_names))
        stream, name = _literal(schema.name), _literal(instance)
        # The notification carries the rows and the claim, so the master can send them without
        # reading them back (CommittedRows); the stream's name alone when that would not fit in
        # a NOTIFY. The row's JSON is the master's reads' own SQL (row_json_sql: one call for
        # an all-text row, not one per value). Constant parts of the payload are one literal.
        row_json = row_json_sql(schema, False, schema.table)
        head = _literal(f"{ROWS_PAYLOAD}\t{schema.name}\t")
        claim = "COALESCE(a.claim, -1)::text"
        tab_name, tab_name_newline = _literal("\t" + instance), _literal("\t" + instance + "\n")
        line = "ins.token::text || E'\\t' || ins.ts::text || E'\\t' || ins.j"
        allocate = (
            f"WITH a AS (SELECT first_token, first_ts, claim FROM {APPEND_FUNCTION}({_literal(_seq(schema))}::regclass, "
            f"{count}, {count}, %s::bigint, {stream}, {_literal(writer_id)}, %s::bigint, %s::bigint)), "
            f"ins AS (INSERT INTO {schema.table} ({names}) "
            + (
                # One row: its values in the select list (no VALUES scan, no join to start per append).
                f"SELECT a.first_ts, a.first_token, {name}, a.first_ts, {casts} FROM a "
                if count == 1
                else f"SELECT a.first_ts + v._i - 1, a.first_token + v._i - 1, {name}, a.first_ts + v._i - 1, "
                f"{aliases} FROM a, (VALUES {rows}) AS v(_i, {', '.join(schema.column_names)}) "
            )
            + f"RETURNING token, ts, {row_json} AS j) "
        )
        if count == 1:
            # One row: the payload made in the select list of a join of the two one-row CTEs (no
            # aggregate, no sort, no subplan to start per append); it is never NULL.
            # Two columns, the NOTIFY in the (one-row) filter: psycopg2 decodes each column's name
            # through a Python-level codec, and a void column is one more to fetch (pg_notify
            # returns void, which is never NULL).
            return allocate + (
                "SELECT pl.first_token, pl.first_ts "
                f"FROM (SELECT a.first_token, a.first_ts, {head} || {claim} || {tab_name_newline} || {line} AS p "
                f"FROM a, ins) AS pl WHERE pg_notify({_literal(CHANNEL)}, "
                f"CASE WHEN octet_length(pl.p) <= {MAX_PAYLOAD_BYTES} THEN pl.p ELSE {stream} END) IS NOT NULL"
            )
        payload = (
            f"COALESCE((SELECT CASE WHEN octet_length(p) <= {MAX_PAYLOAD_BYTES} THEN p END FROM "
            f"(SELECT {head} || {claim} || {tab_name} || string_agg(E'\\n' || {line}, '' ORDER BY ins.token) AS p "
            f"FROM ins, a GROUP BY a.claim) AS pl), {stream})"
        )
        return allocate + f"SELECT a.first_token, a.first_ts, pg_notify({_literal(CHANNEL)}, {payload}) FROM a"

    def _casts(self) -> str:
        # (%s)::type: the value as a literal in parentheses, so that -9223372036854775808 is one
        # bigint, not the negation of one too large. A double without them: psycopg2 writes -0.0,
        # which in parentheses is the numeric 0 (no sign); -0.0::float8 negates the double 0.0.
        return ", ".join(
            f"%s::{COLUMN_TYPES[c.type][1]}" if c.type == "double" else f"(%s)::{COLUMN_TYPES[c.type][1]}"
            for c in self.schema.columns
        )

    def _build_batch(self, count: int, shared: bool) -> str:
        """A batch's statement (its rows share a token; its notification names the stream only).

        ``shared``: a later batch append of the transaction: its third parameter is the
        transaction's batch token, which ``BATCH_FUNCTION`` continues or replaces (the token
        the rows get is the call's ``first_token`` either way); else it is the number of
        tokens to allocate (1).
        """
        schema = self.schema
        rows = ", ".join([f"(%s::int, {self._casts()})"] * count)
        aliases = ", ".join(f"v.{name}" for name in schema.column_names)
        function, third = (BATCH_FUNCTION, "%s::bigint") if shared else (ORACLE_FUNCTION, "%s")
        names = ", ".join(("seq", "token", "instance_name", "ts", *schema.column_names))
        return (
            f"WITH a AS (SELECT first_token, first_ts FROM {function}(%s::regclass, %s, {third}, %s)), "
            f"ins AS (INSERT INTO {schema.table} ({names}) "
            f"SELECT a.first_ts + v._i - 1, a.first_token, %s, a.first_ts + v._i - 1, {aliases} "
            f"FROM a, (VALUES {rows}) AS v(_i, {', '.join(schema.column_names)})), "
            f"u AS (UPDATE tickline_writers SET position = GREATEST(position, LEAST(a.first_token, %s)), "
            f"heartbeat_ms = {NOW_MS} FROM a "
            f"WHERE stream = %s AND instance_name = %s AND epoch = %s AND alive RETURNING position) "
            f"SELECT a.first_token, a.first_ts, pg_notify(%s, %s) FROM a "
            f"WHERE (SELECT count(*) FROM u) = 1 OR {FENCED_FUNCTION}()"
        )

    def copy_lines(
        self, rows: list[Row], instance: str, first_token: int, step: int, first_ts: int, max_line_bytes: int | None
    ) -> bytes:
        """The rows checked, as the ``COPY`` data (RowError names the first bad row).

        The quick way (:func:`storage.pg_copy.chunk_formatter`: one generated
        loop, one check of the whole text for anything that would need an
        escape, a bound of every line's JSON) serves rows of exactly typed
        values; anything else, any doubt, and the rows are made the careful
        way (:meth:`columns_text`, which names the row that is wrong).
        """
        name = _copy_text(instance)
        lines, nulls = (None, 0) if self._chunk is None else self._chunk(rows, first_ts, first_token, step, name)
        if lines is not None and lines:
            room = None if max_line_bytes is None else max_row_json_bytes(self.schema.name, max_line_bytes)
            text = "\n".join(lines)
            # The whole piece's length bounds its longest line: usually enough, without a pass per line.
            if (
                room is None
                or 6 * len(text) + self._fixed_json_bytes <= room
                or 6 * max(map(len, lines)) + self._fixed_json_bytes <= room
            ):
                try:
                    data = (text + "\n").encode()
                except UnicodeEncodeError:  # a lone surrogate: named by the careful way
                    data = None
                # Checked on the encoded bytes, which are sent anyway: one pass instead of three.
                if data is not None and not data_needs_escapes(
                    data, len(lines) * (4 + len(self.schema.columns)), nulls + len(lines) * name.count("\\")
                ):
                    return data
        columns = self.columns_text(rows, max_line_bytes)
        return self.copy_text(columns, instance, first_token, step, first_ts).encode()

    def columns_text(self, rows: list[Row], max_line_bytes: int | None) -> list[str]:
        """Check every row and give its columns as COPY text (RowError names a bad row; nothing is sent).

        The generated formatter checks the values; the line limit
        (``storage.limits``) is checked exactly only where a cheap bound does
        not already show the row fits: every character of the COPY text as
        six bytes of JSON (``\\uXXXX``) plus the most any column's JSON can
        add. Streams with JSON columns (jsonb may print a number much longer)
        and rows the formatter does not take are checked exactly.
        """
        fast = None if self.schema.json_columns else formatter(self.schema)
        formats = self._formats
        room = None if max_line_bytes is None else max_row_json_bytes(self.schema.name, max_line_bytes)
        fixed = self._fixed_json_bytes
        out = []
        for index, row in enumerate(rows):
            text = None if fast is None else fast(row)
            if text is None or (room is not None and 6 * len(text) + fixed > room):
                try:
                    (values,) = check_rows(self.schema, [row], max_line_bytes)
                except RowError as e:
                    raise RowError(e.reason, index=index) from None
                text = "\t".join([NULL_COPY if v is None else f(v) for f, v in zip(formats, values, strict=False)])
            out.append(text)
        return out

    def copy_text(self, columns: list[str], instance: str, first_token: int, step: int, first_ts: int) -> str:
        """The rows as COPY text: seq (the row's timestamp), token, instance, ts, then the columns."""
        name = _copy_text(instance)
        if step:
            lines = [
                f"{first_ts + i}\t{first_token + i}\t{name}\t{first_ts + i}\t{text}" for i, text in enumerate(columns)
            ]
        else:
            lines = [f"{first_ts + i}\t{first_token}\t{name}\t{first_ts + i}\t{text}" for i, text in enumerate(columns)]
        lines.append("")
        return "\n".join(lines)


# Rows made into COPY text per read: PostgreSQL parses a piece while the next is made. 64 rather
# than 128: per 1000-row append, allocation and COPY 2.50-2.56 ms against 2.58-2.78 (alternating
# runs in the benchmark's loop), for 0.03 us of Python per row more.
COPY_PIECE_ROWS = 64


class _CopySource:
    """The ``COPY`` data of one append, made a piece at a time as psycopg2 reads it.

    PostgreSQL takes in each piece as it arrives, so the rows are checked and
    formatted here while the server parses and stores the previous ones (two
    processes at work, not one after the other). A bad row raises from
    :meth:`read`: psycopg2 then ends the ``COPY`` with an error, PostgreSQL
    discards it, and the transaction rolls back (nothing of it is stored).
    """

    __slots__ = ("_at", "_first_token", "_first_ts", "_instance", "_limit", "_rows", "_statements", "_step", "error")

    def __init__(
        self,
        statements: _Statements,
        rows: list[Row],
        instance: str,
        first_token: int,
        step: int,
        first_ts: int,
        limit: int | None,
    ) -> None:
        self._statements, self._rows, self._instance = statements, rows, instance
        self._first_token, self._step, self._first_ts, self._limit = first_token, step, first_ts, limit
        self._at = 0
        self.error: Exception | None = None  # what read raised (psycopg2 reports it as a failed COPY)

    def read(self, size: int = -1) -> bytes:
        at = self._at
        rows = self._rows
        if at >= len(rows):
            return b""
        end = len(rows) if len(rows) - at < 2 * COPY_PIECE_ROWS else at + COPY_PIECE_ROWS
        self._at = end
        token = self._first_token + at * self._step
        try:
            return self._statements.copy_lines(
                rows[at:end], self._instance, token, self._step, self._first_ts + at, self._limit
            )
        except RowError as e:
            self.error = RowError(e.reason, None if e.index is None else e.index + at)
            raise self.error from None
        except Exception as e:
            self.error = e
            raise


def _literal(text: str) -> str:
    """A string constant read the same whatever ``standard_conforming_strings`` is (``E'...'``).

    A ``%`` (an instance name may hold one) is written as ``chr(37)``: the statement's text
    goes through psycopg2's and :func:`storage.pg_db.prepared`'s ``%s`` placeholders.
    """
    if "\x00" in text:
        raise ValueError("a string literal cannot hold NUL")
    parts = ["E'" + part.replace("\\", "\\\\").replace("'", "''") + "'" for part in text.split("%")]
    return parts[0] if len(parts) == 1 else "(" + " || chr(37) || ".join(parts) + ")"


def _statements(schema: StreamSchema) -> _Statements:
    found = _STATEMENTS.get(schema)
    if found is None:
        found = _STATEMENTS[schema] = _Statements(schema)
    return found


_STATEMENTS: dict[StreamSchema, _Statements] = {}


def _remember(
    state: _WriterState, first_token: int | None, token_count: int, first_ts: int, count: int, now_ms: int | None = None
) -> None:
    """After an allocation (under the store's lock): what the writer's next one will be if it is alone.

    ``now_ms``: the clock an allocation that was not proposed was made
    with: if a proposal would have been taken (the same first token, and
    a first timestamp at or above the one the oracle gave), propose again.
    """
    if token_count:
        assert first_token is not None
        if (
            not state.propose
            and now_ms is not None
            and first_token == state.next_token
            and max(state.next_ts, (now_ms << 18) + PROPOSAL_LEAD) >= first_ts
        ):
            state.propose = True
        state.next_token = first_token + token_count
    state.next_ts = first_ts + count


class _RowPlan:
    """What a writer's single-row appends to one stream look up once (PgStreamStore._append_row)."""

    __slots__ = ("checker", "doubles", "literals", "prepared", "schema", "statements")

    def __init__(self, schema: StreamSchema) -> None:
        self.schema = schema
        self.checker = RowChecker(schema)
        self.literals = row_literals(schema, rdata_overhead(schema.name))
        self.statements = _statements(schema)
        self.doubles = self.statements.doubles
        # (connection, a cursor on it, writer id, the statement's EXECUTE text prepared on that
        # connection, that text up to its parameters: "EXECUTE tickline_N (").
        self.prepared: tuple[Any, Any, str, str, str] = (None, None, "", "", "")


PREPARED_ROWS = 8  # appends of up to this many rows use prepared statements


# A writer's report (``report_positions``), one statement: the row is written only when the report
# raises the position or the heartbeat is older than a tenth of the report interval (so it is at
# most about 1.1 intervals old, as when every report wrote it); a report that raised the position
# notifies in the same statement (another writer's rows may wait for it). Each append's statement
# sets the position and the heartbeat and notifies with its commit, so the reports of a writer that
# appends more often than that write nothing: no commit (no WAL flush) on the writers' database,
# no lock on the row its next append updates. ``w`` reads the row as it was before the ``UPDATE``.
_REPORT_SQL = (
    "WITH w AS (SELECT position AS stored, heartbeat_ms AS beat FROM tickline_writers "
    "WHERE stream = %(s)s AND instance_name = %(i)s AND epoch = %(e)s AND alive), "
    "moved AS (UPDATE tickline_writers t SET position = GREATEST(t.position, %(p)s), "
    f"heartbeat_ms = {NOW_MS} FROM w WHERE t.stream = %(s)s AND t.instance_name = %(i)s "
    f"AND t.epoch = %(e)s AND t.alive AND (w.stored < %(p)s OR w.beat < {NOW_MS} - %(f)s) "
    "RETURNING t.position > w.stored AS raised) "
    "SELECT EXISTS (SELECT 1 FROM w), "
    "(SELECT pg_notify(%(c)s, %(s)s) FROM moved WHERE moved.raised) IS NOT NULL"
)


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
        plain, committed = self.drain_committed()
        return plain | {rows.stream for rows in committed}

    def drain_committed(self) -> tuple[set[str], list[CommittedRows]]:
        """The streams named by notifications without rows, and the rows the others carried (never blocks)."""
        self._conn.poll()
        plain: set[str] = set()
        committed: list[CommittedRows] = []
        for n in self._conn.notifies:
            payload = n.payload
            if payload.startswith(ROWS_PAYLOAD + "\t"):
                rows = _committed_rows(payload)
                if rows is not None:
                    committed.append(rows)
                    continue
                payload = payload.split("\t", 2)[1]
            plain.add(payload)
        self._conn.notifies.clear()
        return plain, committed

    def close(self) -> None:
        self._conn.close()


def _committed_rows(payload: str) -> CommittedRows | None:
    """A rows notification (``_Statements._build_claiming``) parsed; None if it is not one."""
    head, *lines = payload.split("\n")
    parts = head.split("\t")
    if len(parts) != 4 or not lines:
        return None
    try:
        claim = int(parts[2])
        rows = []
        for line in lines:
            token, ts, values = line.split("\t", 2)
            rows.append((int(token), int(ts), values.encode()))
    except ValueError:
        return None
    return CommittedRows(parts[1], parts[3], None if claim < 0 else claim, rows)


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
