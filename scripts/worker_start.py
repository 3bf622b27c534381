"""A worker's database opened while its start imports Twisted, on a thread of its own.

A ``tickline worker`` start spends about 0.1 s of CPU importing Twisted and
the worker's modules, none of which opening its database needs; opening it
(the connection, the session settings, the migrations' check) is a dozen
round trips to the server, mostly waiting. So the command line starts, as
soon as the configuration is read, a thread (:class:`SetupThread`) that opens
and migrates the store (``storage.worker_store.open_worker_store``) while the
main thread imports; ``Worker.prepare`` (tables, applied tokens) runs on it
too, the main thread waiting, so that it uses the connection the migrations
opened (a database keeps one connection per thread) instead of opening
another; then the thread ends. The worker's applies run on its database
thread as before.

Nothing here imports Twisted. What the worker does and in which order is
unchanged: a failure of the store's opening is raised where
``scripts.run_worker`` opened it before (after the handlers are loaded), so
errors and exit codes are those of a start without this thread. The
migrations may now have run in a start that then stops on a handler that
cannot be loaded or a bad ``--metrics-listen`` (they are idempotent; the
next start would run them); such a start closes the store on the thread and
ends it (:meth:`WorkerStart.abandon`).
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
    from storage.contracts import WorkerStore

T = TypeVar("T")

# The interpreter's switch interval in a worker (CPython's default: 5 ms). The database
# thread waits for its backend with the GIL released and needs it back at every answer
# (BEGIN, COPY, COMMIT), while the reactor thread holds it making the next group's COPY
# text and parsing rows: at 5 ms that handover stretched each 5,000-row COPY apply of a
# catch-up from about 6.7 to 9.3 ms (docs/benchmarks.md, cu3). It is set as soon as the
# set-up thread starts: while the main thread imports, each of the store's round trips
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


class _Outcome:
    """A call's result or exception, waited for by :meth:`SetupThread.call`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok = False
        self.value: Any = None

    def result(self) -> Any:
        self.event.wait()
        if not self.ok:
            raise self.value
        return self.value


_END = None


class SetupThread:
    """One thread running blocking calls in the order given, before Twisted is imported."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple, dict, _Outcome] | None] = queue.SimpleQueue()
        # A daemon: a start that fails before it is ended must not wait for it to exit.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not _END:
            fn, args, kwargs, outcome = call
            try:
                outcome.value = fn(*args, **kwargs)
                outcome.ok = True
            except BaseException as e:
                outcome.value = e
            outcome.event.set()
            del call, outcome  # nothing of a finished call is kept alive while the thread waits

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> _Outcome:
        """Run ``fn`` on the thread; the outcome's ``result()`` waits for it."""
        outcome = _Outcome()
        self._calls.put((fn, args, kwargs, outcome))
        return outcome

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the thread and wait: its result, or its exception raised here."""
        result: T = self.submit(fn, *args, **kwargs).result()
        return result

    def end(self) -> None:
        """The thread ends once the calls given before are done."""
        self._calls.put(_END)


@attr.s(slots=True, auto_attribs=True)
class WorkerStart:
    """What ``tickline worker`` began before its imports: a thread opening the worker's store."""

    config: WorkerConfig
    thread: SetupThread
    _store: _Outcome

    @classmethod
    def begin(cls, wc: WorkerConfig) -> WorkerStart:
        """Start the thread opening (and migrating) the worker's store."""
        from storage.worker_store import open_worker_store

        _import_store_modules(wc.database)
        sys.setswitchinterval(SWITCH_INTERVAL)
        thread = SetupThread(f"tickline-worker-{wc.name}-setup")
        store = thread.submit(open_worker_store, wc.database, synchronous_commit=wc.synchronous_commit)
        return cls(wc, thread, store)

    def store(self) -> WorkerStore:
        """The opened (migrated) store, once it is; raises what opening it raised (the thread then ends)."""
        try:
            store: WorkerStore = self._store.result()
        except BaseException:
            self.thread.end()
            raise
        return store

    def abandon(self) -> None:
        """A start that stops before :meth:`prepare`: the store, if it opened, closed on its thread
        (a database closes the calling thread's connection), then the thread ends."""

        def close() -> None:
            if self._store.ok:
                self._store.value.close()

        self.thread.submit(close)
        self.thread.end()

    def prepare(self, prepare: Callable[[], None]) -> None:
        """``prepare`` (the worker's blocking set-up) on the thread that opened the store, then the thread ends.

        Its connection, idle, is handed over to the worker's database thread (``hand_over_connection``):
        the first apply takes it instead of opening one after the first rows arrived."""
        store = self.store()

        def prepare_and_hand_over() -> None:
            prepare()
            store.hand_over_connection()

        try:
            self.thread.call(prepare_and_hand_over)
        finally:
            self.thread.end()


def _import_store_modules(url: str) -> None:
    """The store's modules imported here, before the thread starts, not by it.

    Two threads importing at once can see each other's modules half made where
    imports form a cycle; the thread then only waits for the server. Anything
    that fails here (psycopg2 not installed) is left for ``open_worker_store``
    to report, on the thread, raised by :meth:`WorkerStart.store` where it was
    raised before.
    """
    try:
        if parse_database_url(url).is_sqlite:
            import storage.sqlite_worker
        else:
            import storage.pg_worker  # noqa: F401
    except Exception:  # reported by open_worker_store, in its place
        pass
