"""Storage calls on a non-blocking connection, driven by the reactor (no thread hop).

:class:`AsyncQuery` watches the descriptor of a storage object that speaks
SQL without blocking (:class:`~storage.contracts.NonBlockingCall`: the
master's wake-up ``storage.pg_wake.PgWake``, a worker's small apply
``storage.pg_worker.PgAsyncApply``) while a call is in flight: it sends the
call, polls the connection whenever the reactor says it is readable or
writable, and fires a Deferred with the answer. Nothing here blocks: the
connection is non-blocking and only the storage object speaks SQL. Opening
the connection blocks, so the master and the worker do that on their
database threads.

A call may be run *lazily* (``run(..., lazy=True)``, the worker's apply): its
answer is not watched for once sent. The caller takes it when it wants it
(:meth:`AsyncQuery.settle`: the answer if it has come, else it is watched for
from then on), and a backstop timer settles a call nobody asked about within
one to two ``LAZY_ANSWER_SECONDS`` (one timer for many calls, not one each).
A worker applying one commit at a time thus wakes once per commit (for the
next rows, which settle the previous answer, long arrived) instead of twice
(the rows, then the answer). Nothing about the call changes:
it is sent at once, it commits or fails in its database as before; only when
this process reads its answer does.

A lost connection fails the call's Deferred with
:class:`~storage.store.DatabaseUnavailable` and marks the object
:attr:`~AsyncQuery.broken`: the caller then uses its database threads and
opens a new connection later.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from twisted.internet import defer
from twisted.internet.interfaces import IReadDescriptor, IWriteDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

from replication.reactor_types import Reactor
from storage.contracts import NonBlockingCall
from storage.store import DatabaseUnavailable

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A lazy call nobody settles is settled 1-2 times this long after it was sent (the backstop timer).
LAZY_ANSWER_SECONDS = 0.01


@implementer(IReadDescriptor, IWriteDescriptor)
class AsyncQuery(Generic[T]):
    """Runs calls of one non-blocking storage connection on the reactor, one at a time."""

    def __init__(self, reactor: Reactor, query: NonBlockingCall[T], name: str = "tickline-db-async") -> None:
        self._reactor = reactor
        self.query = query
        self._name = name
        # A descriptor of our own: psycopg2 closes its own when the server goes
        # away, and the reactor must still be able to unregister ours.
        self._fd = os.dup(query.fileno())
        self._call: defer.Deferred[T] | None = None
        self._reading = self._writing = False
        self.broken = False
        # The call in flight is lazy and not settled yet: its answer is not watched for.
        self._lazy = False
        self._calls = 0  # calls sent so far: which one the backstop timer was set for
        self._backstop: Any = None

    @property
    def busy(self) -> bool:
        return self._call is not None

    @property
    def usable(self) -> bool:
        return not self.broken and self._call is None

    def run(self, send: Callable[[], bool | None], lazy: bool = False) -> defer.Deferred[T] | None:
        """``send()`` sends a call (never blocks); the Deferred fires with its answer.

        None, nothing sent, when ``send`` returns False (the call does not
        suit this connection: the caller uses its threads). ``lazy``: the
        answer is taken when :meth:`settle` is called, or by the backstop
        timer (see the module doc).
        """
        assert self._call is None, "one call at a time"
        if self.broken:
            return defer.fail(DatabaseUnavailable("the connection is closed"))
        try:
            if send() is False:
                return None
        except DatabaseUnavailable as e:
            self._break()
            return defer.fail(e)
        d: defer.Deferred[T] = defer.Deferred()
        self._call = d
        self._calls += 1
        self._lazy = lazy
        self._poll()
        return d

    def settle(self) -> None:
        """The answer of a lazy call in flight is wanted now: taken if it has come, else watched for."""
        if self._lazy and self._call is not None:
            self._lazy = False
            self._poll()

    def _arm_backstop(self) -> None:
        if self._backstop is None:
            self._backstop = self._reactor.callLater(LAZY_ANSWER_SECONDS, self._backstop_fired, self._calls)

    def _backstop_fired(self, call: int) -> None:
        self._backstop = None
        if not self._lazy or self._call is None:
            return
        if call == self._calls:
            self.settle()
        else:  # a later call: its own time is not up yet
            self._backstop = self._reactor.callLater(LAZY_ANSWER_SECONDS, self._backstop_fired, self._calls)

    def _poll(self) -> None:
        try:
            state = self.query.poll()
        except DatabaseUnavailable as e:
            self._finish(Failure(e))
            self._break()
            return
        if state == "read":
            if self._lazy:
                self._watch(read=False, write=False)
                self._arm_backstop()
            else:
                self._watch(read=True, write=False)
        elif state == "write":
            self._watch(read=False, write=True)
        else:
            self._watch(read=False, write=False)
            try:
                result = self.query.result()
            except DatabaseUnavailable as e:
                self._finish(Failure(e))
                self._break()
                return
            except Exception as e:  # an answer the caller handles (a refused apply, a stale token)
                self._finish(Failure(e))
                return
            self._finish(result)

    def _finish(self, result: T | Failure) -> None:
        d, self._call = self._call, None
        self._lazy = False
        if d is not None:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)

    def _watch(self, read: bool, write: bool) -> None:
        if read != self._reading:
            (self._reactor.addReader if read else self._reactor.removeReader)(self)
            self._reading = read
        if write != self._writing:
            (self._reactor.addWriter if write else self._reactor.removeWriter)(self)
            self._writing = write

    def _break(self) -> None:
        if self.broken:
            return
        self.broken = True
        self._watch(read=False, write=False)
        if self._backstop is not None:
            if self._backstop.active():
                self._backstop.cancel()
            self._backstop = None
        self.query.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Stop: a call in flight fails, the connection closes."""
        self._finish(Failure(DatabaseUnavailable("the connection was closed")))
        self._break()

    # -- IReadDescriptor / IWriteDescriptor -------------------------------------------------

    def fileno(self) -> int:
        return self._fd

    def doRead(self) -> None:
        if self._call is not None:
            self._poll()

    def doWrite(self) -> None:
        if self._call is not None:
            self._poll()

    def connectionLost(self, reason: Any) -> None:
        # The reactor dropped the descriptor (an error on it): the call fails.
        self._reading = self._writing = False
        self._finish(Failure(DatabaseUnavailable(f"the connection was lost: {reason.getErrorMessage()}")))
        self._break()

    def logPrefix(self) -> str:
        return self._name
