"""A PostgreSQL database through psycopg2: one connection per thread, migrations.

Writes run in a READ COMMITTED transaction, reads in REPEATABLE READ so that
several statements see one snapshot. Migrations take an advisory lock, so
processes starting together apply each migration once.
"""

from __future__ import annotations

import contextlib
import select
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from storage.migrate import apply_migrations
from storage.store import CommitUnknown, DatabaseUnavailable, error_line
from storage.urls import redact_url

MIGRATION_LOCK = 0x7469636B  # "tick"


def session_settings(server_version: int, settings: dict[str, str] | None = None) -> dict[str, str]:
    """What every tickline connection SETs for its session: ``settings``, then these defaults.

    - ``extra_float_digits = 3``: a double's text is then exact (the shortest
      text that reads back the same double, from PostgreSQL 12 on). With the
      server's or a role's setting at 0 or below, ``float8`` text is rounded to
      15 digits or fewer: rows read back, and lines built by the server
      (``storage.pg_lines``), would carry other numbers than the ones written.
    - ``plan_cache_mode = force_generic_plan`` (PostgreSQL 12 on): prepared
      statements (see ``prepared``) keep one generic plan. With the default,
      PostgreSQL plans range reads such as the master's lines anew on every
      call (a custom plan looked cheaper), which cost more than running them.
      Ad-hoc statements are not affected.
    """
    values = dict(settings or {})
    values.setdefault("extra_float_digits", "3")
    if server_version >= 120000:
        values.setdefault("plan_cache_mode", "force_generic_plan")
    return values


def quietly_close(conn: Any) -> None:
    """Close a connection that may be broken already (its error would say nothing new)."""
    try:
        conn.close()
    except psycopg2.Error:
        pass


def rollback_explicit(conn: Any) -> None:
    """End an explicit transaction on an autocommit connection after an error (psycopg2's ``rollback``
    would not); the connection is closed if even that fails."""
    try:
        if not conn.closed and conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            with conn.cursor() as cur:
                cur.execute("ROLLBACK")
    except psycopg2.Error:
        quietly_close(conn)


@contextlib.contextmanager
def committed(cursor: Any) -> Iterator[None]:
    """The body's explicit transaction (begun by its first statement) on an autocommit connection:
    ``COMMIT`` after it, :func:`rollback_explicit` if anything in it (or the commit) fails."""
    try:
        yield
        cursor.execute("COMMIT")
    except BaseException:
        rollback_explicit(cursor.connection)
        raise


class Cursor:
    """A psycopg2 cursor with SQLite's ``execute`` returning the cursor."""

    __slots__ = ("cursor",)

    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor

    def execute(self, sql: str, params: Any = ()) -> Any:
        self.cursor.execute(sql, params)
        return self.cursor

    def executemany(self, sql: str, params: Any) -> Any:
        rows = list(params)
        if rows:
            psycopg2.extras.execute_batch(self.cursor, sql, rows, page_size=1000)
        return self.cursor

    def execute_values(self, sql: str, rows: Sequence[Any], page_size: int = 5000, template: str | None = None) -> Any:
        psycopg2.extras.execute_values(self.cursor, sql, rows, template=template, page_size=page_size)
        return self.cursor

    @property
    def rowcount(self) -> int:
        return self.cursor.rowcount


def sql_literals(values: Sequence[str | int | None]) -> str:
    """``values`` as SQL literals separated by ``, ``: the text psycopg2 would send for them.

    For a connection with ``standard_conforming_strings`` on (the worker's
    apply connection sets it: ``PgWorkerStore.open_async_apply``; a
    single-row append checks it: :func:`execute_literals`), where a
    string literal is its text between single quotes with each quote
    doubled and a backslash is an ordinary character. Raises ``ValueError``
    for a NUL in a string (no literal holds one) or a value of any other
    type (a ``bool`` included): the caller then sends the row another way.
    """
    out = []
    for v in values:
        if type(v) is str:
            if "\x00" in v:
                raise ValueError("a string literal cannot hold NUL")
            out.append("'" + v.replace("'", "''") + "'")
        elif type(v) is int:
            out.append(str(v) if v >= 0 else f" {v}")  # as psycopg2: a space keeps "-" from making "--"
        elif v is None:
            out.append("NULL")
        else:
            raise ValueError(f"no literal for a {type(v).__name__}")
    return ", ".join(out)


def execute_literals(cursor: Any, execute: str, params: Sequence[Any]) -> str | None:
    """``execute`` (an ``EXECUTE name (%s, ...)`` from :func:`prepared`) with ``params`` written in as literals.

    :func:`sql_literals` costs about a third of psycopg2's adaptation (7 µs
    against 23 for a single-row append's 21 values). None, and the caller
    passes the parameters to psycopg2, when a value is not a ``str``, ``int``
    or None (a ``float``, a ``bool``, ...), a string holds NUL, or the
    connection does not have ``standard_conforming_strings`` on (where a
    backslash would need escaping).
    """
    if cursor.connection.get_parameter_status("standard_conforming_strings") != "on":
        return None
    try:
        return f"{execute[: execute.index(' (')]} ({sql_literals(params)})"
    except ValueError:
        return None


# Per connection: statement text -> its EXECUTE (a prepared statement lives as long as its connection).
_PREPARED: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def prepared(cursor: Any, sql: str) -> str:
    """``sql`` (with ``%s`` parameters) prepared once on the cursor's connection; its ``EXECUTE`` text.

    Statements run often (the master's wake-up, small appends, applies) are
    parsed and planned once per connection instead of on every call: for the
    short statements of a wake-up the plan costs more than the execution.
    Parameters are typed by their use in ``sql`` (cast where that is ambiguous).
    """
    conn = cursor.connection
    known = _PREPARED.get(conn)
    if known is None:
        known = _PREPARED[conn] = {}
    execute = known.get(sql)
    if execute is None:
        name = f"tickline_{len(known)}"
        parts = sql.split("%s")
        numbered = "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]
        cursor.execute(f"PREPARE {name} AS {numbered}")
        execute = known[sql] = f"EXECUTE {name}" + (
            f" ({', '.join(['%s'] * (len(parts) - 1))})" if len(parts) > 1 else ""
        )
    return execute


def closed_while_idle(conn: Any) -> bool:
    """Whether an idle connection can no longer carry a statement: closed, or its server spoke unasked.

    A session that listens to nothing gets no message while idle but its
    server's last ones: the notice that it was terminated (by an
    administrator, a restart, a crash) and the end of the stream. Found before
    a statement is sent, a new connection takes the statement: sent on this
    one, its loss would read as a ``COMMIT`` whose answer was lost
    (:class:`CommitUnknown`, "may have committed") though the server never saw
    it. A connection readable for another reason (a notice) is replaced all
    the same: nothing was sent on it, nothing is lost. One ``poll`` (about
    1 µs). A server that went silent without closing is only found by the
    statement itself.
    """
    if conn.closed:
        return True
    # poll, not select: select refuses descriptors from 1024 on (a process with many sockets).
    watch = select.poll()
    watch.register(conn.fileno(), select.POLLIN)
    return bool(watch.poll(0))


def lost_error(dsn: str, conn: Any, e: BaseException, commit_sent: bool = False) -> DatabaseUnavailable:
    """The one-line error for ``e`` on ``conn`` to the server at ``dsn`` (password redacted; call it
    before closing ``conn``, or use :func:`lost_connection`): :class:`CommitUnknown` when
    a ``COMMIT`` (or a statement that commits on its own) was sent and no answer came (the
    connection closed, or an error without a SQLSTATE: the server went away); else
    :class:`DatabaseUnavailable`. An error the server reported (a lock or statement timeout,
    a full disk) ended the statement: nothing of it committed, and a worker retries it with
    its backoff, not at once."""
    message = redact_url(f"PostgreSQL at {dsn}: {error_line(e)}")
    gone = bool(conn.closed) or getattr(e, "pgcode", None) is None
    return CommitUnknown(message) if commit_sent and gone else DatabaseUnavailable(message)


def lost_connection(dsn: str, conn: Any, e: BaseException, commit_sent: bool = False) -> DatabaseUnavailable:
    """:func:`lost_error` for a connection that failed, which is then closed (the caller forgets it)."""
    lost = lost_error(dsn, conn, e, commit_sent)
    quietly_close(conn)
    return lost


class PgDatabase:
    dialect = "postgresql"
    placeholder = "%s"

    def __init__(self, dsn: str, connect_timeout: int = 5, settings: dict[str, str] | None = None) -> None:
        self.dsn = dsn
        self._settings = dict(settings or {})  # SET for every connection (e.g. synchronous_commit)
        self._connect_timeout = connect_timeout
        self._local = threading.local()
        self._all: list[Any] = []
        self._all_lock = threading.Lock()
        self._spare: list[Any] = []  # idle connections a thread handed over (hand_over), under _all_lock

    def connect(self, autocommit: bool = False) -> Any:
        """A new connection (the caller owns it)."""
        try:
            conn = psycopg2.connect(self.dsn, connect_timeout=self._connect_timeout, application_name="tickline")
        except psycopg2.Error as e:
            raise DatabaseUnavailable(
                redact_url(f"cannot connect to PostgreSQL at {self.dsn}: {error_line(e)}")
            ) from None
        settings = session_settings(conn.server_version, self._settings)
        if settings:
            conn.autocommit = True
            with conn.cursor() as cur:
                for name, value in settings.items():
                    cur.execute("SELECT set_config(%s, %s, false)", (name, value))
        conn.autocommit = autocommit
        with self._all_lock:
            # Those closed are let go: a process that reconnects again and again keeps only its open ones.
            self._all = [c for c in self._all if not c.closed]
            self._all.append(conn)
        return conn

    def held(self, local: threading.local, name: str, autocommit: bool = False) -> Any:
        """The connection kept as ``local.<name>`` (one per thread); if it was closed, or found closed
        while idle (:func:`closed_while_idle`: a statement sent on it would be lost unanswered), one
        another thread handed over (:meth:`hand_over`) or else a new one."""
        conn = getattr(local, name, None)
        if conn is None or closed_while_idle(conn):
            if conn is not None:
                quietly_close(conn)
            conn = self._take_spare(autocommit) or self.connect(autocommit=autocommit)
            setattr(local, name, conn)
        return conn

    def hand_over(self) -> None:
        """This thread is done with its connection: kept open, idle, for the next thread that needs one.

        A worker's set-up thread opens and migrates the store while the start
        imports Twisted, then ends (scripts.worker_start); without this its
        connection stayed open unused while the database thread's first apply
        opened another, after the first rows had arrived (3-9 ms: the
        connection, then a round trip per session setting; docs/benchmarks.md,
        wstart3). A connection inside a transaction is closed instead.
        """
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is None or conn.closed:
            return
        if conn.info.transaction_status != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            quietly_close(conn)
            return
        conn.isolation_level = None  # as a new connection's: the server's default (reads set theirs)
        with self._all_lock:
            self._spare.append(conn)

    def _take_spare(self, autocommit: bool) -> Any:
        """A connection handed over by another thread (:meth:`hand_over`) and still usable, or None."""
        while True:
            with self._all_lock:
                if not self._spare:
                    return None
                conn = self._spare.pop()
            if closed_while_idle(conn):
                quietly_close(conn)
                continue
            conn.autocommit = autocommit
            return conn

    def connection(self) -> Any:
        """This thread's connection (see :meth:`held`)."""
        return self.held(self._local, "conn")

    def close(self) -> None:
        with self._all_lock:
            conns, self._all, self._spare = self._all, [], []
        for conn in conns:
            quietly_close(conn)
        self._local = threading.local()

    def _run(self, fn: Callable[[Cursor], Any], isolation: int, writes: bool = False) -> Any:
        conn = self.connection()
        committing = False
        try:
            conn.set_session(isolation_level=isolation)
            with conn.cursor() as cur:
                result = fn(Cursor(cur))
            committing = True
            conn.commit()
            return result
        except psycopg2.OperationalError as e:
            # Lost once a write's COMMIT was sent: the transaction may have committed (a worker's
            # apply must then be settled by applying it again, not retried as if it had not).
            self._local.conn = None
            raise lost_connection(self.dsn, conn, e, writes and committing) from None
        except BaseException:
            if not conn.closed:
                conn.rollback()
            raise

    def query(self, sql: str, params: Any = (), prepare: bool = False, writes: bool = False) -> list[Any]:
        """One statement's rows on this thread's autocommit connection: its own transaction, one round trip.

        The same snapshot semantics as :meth:`read` of a single statement,
        without ``BEGIN`` and ``COMMIT`` round trips. With ``prepare``, the
        statement is prepared once per connection (see :func:`prepared`).
        ``writes``: the statement writes, so a connection lost once it was
        sent raises :class:`CommitUnknown` (it commits on its own; see
        :func:`lost_error`).
        """
        conn = self.autocommit_connection()
        try:
            with conn.cursor() as cur:
                cur.execute(prepared(cur, sql) if prepare else sql, params)
                rows: list[Any] = cur.fetchall()
                return rows
        except psycopg2.OperationalError as e:
            raise self.lost_autocommit(conn, e, writes) from None

    def autocommit_connection(self) -> Any:
        """This thread's autocommit connection (:meth:`query`'s; see :meth:`held`)."""
        return self.held(self._local, "auto", autocommit=True)

    def lost_autocommit(self, conn: Any, e: BaseException, commit_sent: bool = False) -> DatabaseUnavailable:
        """Forget this thread's autocommit connection after ``e`` (the server went away); the error to
        raise (:class:`CommitUnknown` if a statement that commits was sent: :func:`lost_error`)."""
        self._local.auto = None
        return lost_connection(self.dsn, conn, e, commit_sent)

    def write(self, fn: Callable[[Cursor], Any]) -> Any:
        return self._run(fn, psycopg2.extensions.ISOLATION_LEVEL_READ_COMMITTED, writes=True)

    def read(self, fn: Callable[[Cursor], Any]) -> Any:
        return self._run(fn, psycopg2.extensions.ISOLATION_LEVEL_REPEATABLE_READ)

    def migrate(self) -> list[int]:
        def run(cur: Cursor) -> list[int]:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))

            def execute(sql: str, params: tuple) -> list:
                cur.execute(sql, params)
                return cur.cursor.fetchall() if cur.cursor.description else []

            return apply_migrations(execute, "%s")

        return self.write(run)
