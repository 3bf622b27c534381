"""A worker's database opened while its start imports Twisted, on the thread that then runs its applies.

A ``tickline worker`` start spends about 0.1 s of CPU importing Twisted and
the worker's modules, none of which opening its database needs; opening it
(the connection, the session settings, the migrations' check) is a dozen
round trips to the server, mostly waiting. So the command line starts, as
soon as the configuration is read, the one thread that will run the worker's
blocking database calls (:class:`DatabaseThread`), and it opens and migrates
the store (``storage.worker_store.open_worker_store``) while the main thread
imports. ``Worker.prepare`` (tables, applied tokens) then runs on it, the
main thread waiting, and it becomes the worker's database runner
(``replication.dbthreads.DatabaseRunner``): a database keeps one connection
per thread, so the first apply uses the connection the migrations opened
instead of opening one of its own.

Nothing here imports Twisted at import time. What the worker does and in
which order is unchanged: a failure of the store's opening is raised where
``scripts.run_worker`` opened it before (after the handlers are loaded), so
errors and exit codes are those of a start without this thread.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import attr

from scripts.config import Config, ConfigError, parse_address
from storage.schema import NAME_WORD
from storage.urls import parse_database_url
from workers.settings import WorkerConfig

if TYPE_CHECKING:
    from twisted.internet import defer

    from storage.contracts import WorkerStore

T = TypeVar("T")

# The interpreter's switch interval in a worker (CPython's default: 5 ms). The database
# thread waits for its backend with the GIL released and needs it back at every answer
# (BEGIN, COPY, COMMIT), while the reactor thread holds it making the next group's COPY
# text and parsing rows: at 5 ms that handover stretched each 5,000-row COPY apply of a
# catch-up from about 6.7 to 9.3 ms (docs/benchmarks.md, cu3). It is set as soon as the
# database thread starts: while the main thread imports, each of the store's round trips
# would otherwise wait up to 5 ms for the GIL.
SWITCH_INTERVAL = 0.0005


def worker_config(args: argparse.Namespace, config: Config) -> WorkerConfig:
    """The config's worker section with the command line's overrides."""
    wc = config.worker
    changes: dict = {}
    if args.name:
        if not NAME_WORD.fullmatch(args.name):
            raise ConfigError("--name must be one word of printable ASCII")
        changes["name"] = args.name
    if args.master:
        changes["master_host"], changes["master_port"] = parse_address(args.master, "--master")
    if args.database:
        parse_database_url(args.database)
        changes["database"] = args.database
    if args.server_name:
        changes["server_name"] = args.server_name
    if args.replicate:
        for stream in args.replicate:
            if stream not in config.streams:
                raise ConfigError(
                    f"--replicate: unknown stream {stream!r} (known: {', '.join(sorted(config.streams))})"
                )
        changes["replicate"] = tuple(dict.fromkeys(wc.replicate + tuple(args.replicate)))
    return attr.evolve(wc, **changes)


def thread_name(wc: WorkerConfig) -> str:
    return f"tickline-worker-{wc.name}-db"


class _Call:
    """One call for the thread; ``done`` is told the outcome on the thread."""

    __slots__ = ("args", "done", "fn", "kwargs")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, done: Callable[[bool, Any], None]) -> None:
        self.fn, self.args, self.kwargs, self.done = fn, args, kwargs, done


class _Outcome:
    """What a blocking :meth:`DatabaseThread.call` waits for."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok = False
        self.value: Any = None

    def __call__(self, ok: bool, value: Any) -> None:
        self.ok, self.value = ok, value
        self.event.set()

    def result(self) -> Any:
        self.event.wait()
        if not self.ok:
            raise self.value
        return self.value


_STOP = object()


class DatabaseThread:
    """One thread for blocking database calls, running before Twisted is imported.

    Before the reactor: :meth:`submit` and :meth:`call` (blocking). After
    :meth:`attach`: a ``DatabaseRunner`` as ``replication.dbthreads.DatabaseThreads``
    with one thread (calls run one at a time in the order given; their results
    come back on the reactor; :meth:`stop` lets the calls already given finish,
    then ends the thread).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._reactor: Any = None
        self._started = False
        # A daemon: a start that fails before the reactor runs must not wait for it to exit.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is _STOP:
                return
            try:
                result = call.fn(*call.args, **call.kwargs)
            except BaseException as e:
                call.done(False, e)
            else:
                call.done(True, result)
            del call  # nothing of a finished call is kept alive while the thread waits

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> _Outcome:
        """Run ``fn`` on the thread; the returned outcome's ``result()`` waits for it."""
        outcome = _Outcome()
        self._calls.put(_Call(fn, args, kwargs, outcome))
        return outcome

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the thread and wait: its result, or its exception raised here."""
        result: T = self.submit(fn, *args, **kwargs).result()
        return result

    # -- DatabaseRunner ------------------------------------------------------------

    def attach(self, reactor: Any) -> None:
        """The reactor that :meth:`run` answers on (and whose shutdown stops the thread)."""
        self._reactor = reactor

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._reactor.addSystemEventTrigger("during", "shutdown", self.stop)

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._calls.put(_STOP)
            if self._thread is not threading.current_thread():
                self._thread.join()

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> defer.Deferred[T]:
        """``fn`` on the thread; a Deferred fired on the reactor with its result or failure."""
        from twisted.internet import defer
        from twisted.python.failure import Failure

        d: defer.Deferred[T] = defer.Deferred()
        reactor = self._reactor

        def done(ok: bool, value: Any) -> None:
            # As twisted.internet.threads.deferToThreadPool: the failure is taken on the thread.
            if ok:
                reactor.callFromThread(d.callback, value)
            else:
                reactor.callFromThread(d.errback, Failure(value, type(value), value.__traceback__))

        self._calls.put(_Call(fn, args, kwargs, done))
        return d


@attr.s(slots=True, auto_attribs=True)
class WorkerStart:
    """What ``tickline worker`` began before its imports: the database thread opening the store."""

    config: WorkerConfig
    thread: DatabaseThread
    _store: _Outcome

    @classmethod
    def begin(cls, wc: WorkerConfig) -> WorkerStart:
        """Start the database thread opening (and migrating) the worker's store."""
        from storage.worker_store import open_worker_store

        _import_store_modules(wc.database)
        sys.setswitchinterval(SWITCH_INTERVAL)
        thread = DatabaseThread(thread_name(wc))
        store = thread.submit(open_worker_store, wc.database, synchronous_commit=wc.synchronous_commit)
        return cls(wc, thread, store)

    def store(self) -> WorkerStore:
        """The opened (migrated) store, once it is; raises what opening it raised."""
        store: WorkerStore = self._store.result()
        return store


def _import_store_modules(url: str) -> None:
    """The store's modules imported here, before the thread starts, not by it.

    Two threads importing at once can see each other's modules half made where
    imports form a cycle; the thread then only waits for the server. A module
    that is missing (psycopg2 not installed) is left for ``open_worker_store``
    to report, on the thread, raised by :meth:`WorkerStart.store`.
    """
    try:
        if parse_database_url(url).is_sqlite:
            import storage.sqlite_worker
        else:
            import storage.pg_worker  # noqa: F401
    except ImportError:
        pass
