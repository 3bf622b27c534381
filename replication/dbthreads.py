"""Blocking storage calls, run on a bounded thread pool off the reactor thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from twisted.internet import defer, threads
from twisted.python.threadpool import ThreadPool

T = TypeVar("T")


class DatabaseRunner(Protocol):
    """Runs blocking storage calls off the reactor thread (what the master and workers need)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> defer.Deferred[T]: ...


class DatabaseThreads:
    def __init__(self, reactor: Any, max_threads: int = 4, name: str = "tickline-db") -> None:
        self._reactor = reactor
        self._pool = ThreadPool(minthreads=1, maxthreads=max_threads, name=name)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._pool.start()
            self._started = True
            self._reactor.addSystemEventTrigger("during", "shutdown", self.stop)

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._pool.stop()

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> defer.Deferred[T]:
        return threads.deferToThreadPool(self._reactor, self._pool, fn, *args, **kwargs)
