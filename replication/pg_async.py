"""A storage query on a non-blocking connection, driven by the reactor (no thread hop).

:class:`AsyncWake` watches the descriptor of a :class:`~storage.contracts.WakeQuery`
(``storage.pg_wake`` on PostgreSQL) while a call is in flight: it sends the
call, polls the connection whenever the reactor says it is readable or
writable, and fires a Deferred with the answer. Nothing here blocks: the
connection is non-blocking and only the storage object speaks SQL. Opening
and preparing the connection blocks, so the master does that on its
database threads.

A lost connection fails the call's Deferred with
:class:`~storage.store.DatabaseUnavailable` and marks this object
:attr:`~AsyncWake.broken`: the master then reads on its database threads
(the same reads, nothing having moved) and opens a new connection later.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReadDescriptor, IWriteDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

from replication.reactor_types import Reactor
from storage.contracts import WakeQuery, WakeReads, WakeResult
from storage.store import DatabaseUnavailable

logger = logging.getLogger(__name__)


@implementer(IReadDescriptor, IWriteDescriptor)
class AsyncWake:
    """Runs the master's wake-up query on the reactor, one call at a time."""

    def __init__(self, reactor: Reactor, query: WakeQuery) -> None:
        self._reactor = reactor
        self.query = query
        # A descriptor of our own: psycopg2 closes its own when the server goes
        # away, and the reactor must still be able to unregister ours.
        self._fd = os.dup(query.fileno())
        self._call: defer.Deferred[WakeResult] | None = None
        self._reading = self._writing = False
        self.broken = False

    @property
    def busy(self) -> bool:
        return self._call is not None

    def run(self, read_mark: bool, reads: WakeReads, limit: int) -> defer.Deferred[WakeResult]:
        """Send the wake-up; the Deferred fires with its answer."""
        assert self._call is None, "one wake-up at a time"
        if self.broken:
            return defer.fail(DatabaseUnavailable("the wake-up connection is closed"))
        try:
            self.query.start(read_mark, reads, limit)
        except DatabaseUnavailable as e:
            self._break()
            return defer.fail(e)
        d: defer.Deferred[WakeResult] = defer.Deferred()
        self._call = d
        self._poll()
        return d

    def _poll(self) -> None:
        try:
            state = self.query.poll()
        except DatabaseUnavailable as e:
            self._finish(Failure(e))
            self._break()
            return
        if state == "read":
            self._watch(read=True, write=False)
        elif state == "write":
            self._watch(read=False, write=True)
        else:
            self._watch(read=False, write=False)
            try:
                result = self.query.result()
            except Exception as e:  # a decoding error: the call failed, the connection is suspect
                self._finish(Failure(e))
                self._break()
                return
            self._finish(result)

    def _finish(self, result: WakeResult | Failure) -> None:
        d, self._call = self._call, None
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
        self.query.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Stop: a call in flight fails, the connection closes."""
        self._finish(Failure(DatabaseUnavailable("the wake-up connection was closed")))
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
        self._finish(Failure(DatabaseUnavailable(f"the wake-up connection was lost: {reason.getErrorMessage()}")))
        self._break()

    def logPrefix(self) -> str:
        return "tickline-wake"
