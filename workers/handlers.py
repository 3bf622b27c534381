"""Handlers: what a worker does with the rows of a stream.

A handler is a callable ``handler(ctx, rows)``. ``rows`` are the
:class:`ReplicatedRow` s of one or more whole tokens, in token order; ``ctx``
is the :class:`ApplyContext` of the database transaction that also moves the
stream's applied token. Database effects made through ``ctx.execute`` /
``ctx.executemany`` therefore commit exactly once with the token. A handler
that raises rolls the whole transaction back: the token does not advance and
the rows are retried with backoff (logged with the failing token's rows),
never skipped.

Handlers run on the worker's database thread, one transaction at a time, in
the order they were registered.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attr

from storage.contracts import ApplyTransaction
from storage.schema import StreamSchema
from storage.tso import physical_ms


@attr.s(slots=True, frozen=True, auto_attribs=True)
class ReplicatedRow:
    stream: str
    token: int
    instance_name: str
    ts: int | None
    values: tuple[Any, ...]  # the stream's columns in declared order (JSON columns parsed)

    @property
    def ts_ms(self) -> int | None:
        """The physical time of ``ts``: Unix milliseconds (``ts`` is the raw 64-bit value)."""
        return None if self.ts is None else physical_ms(self.ts)

    def as_dict(self, schema: StreamSchema) -> dict[str, Any]:
        return dict(zip(schema.column_names, self.values, strict=False))


@attr.s(slots=True, auto_attribs=True)
class ApplyContext:
    """One apply transaction on the worker's database, for one stream's rows.

    ``connection`` is the transaction's DB-API-like connection and
    ``placeholder`` its parameter marker (``?`` on SQLite, ``%s`` on
    PostgreSQL), for a handler's own SQL; ``transaction`` is the worker
    store's side of it (``transaction.replicate`` copies rows into
    ``replicated_<stream>``).
    """

    transaction: ApplyTransaction
    stream: str
    schema: StreamSchema
    worker_name: str

    @property
    def connection(self) -> Any:
        return self.transaction.connection

    @property
    def placeholder(self) -> str:
        return self.transaction.placeholder

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.connection.execute(sql, params)

    def executemany(self, sql: str, params: Iterable[Sequence[Any]]) -> Any:
        return self.connection.executemany(sql, params)


Handler = Callable[[ApplyContext, list[ReplicatedRow]], None]


class HandlerError(ValueError):
    """A handler that cannot be loaded; the message names it."""


class HandlerRegistry:
    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {}

    def register(self, stream: str, handler: Handler) -> None:
        """Run ``handler`` for the stream's rows, after those registered before it."""
        if not callable(handler):
            raise HandlerError(f"handler for stream {stream!r} is not callable: {handler!r}")
        self._handlers.setdefault(stream, []).append(handler)

    def handler(self, stream: str) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`register`."""

        def wrap(fn: Handler) -> Handler:
            self.register(stream, fn)
            return fn

        return wrap

    def streams(self) -> list[str]:
        return sorted(self._handlers)

    def for_stream(self, stream: str) -> list[Handler]:
        return list(self._handlers.get(stream, ()))


def load_handler(path: str) -> Callable[..., Any]:
    """A handler from ``package.module:name`` or ``package.module.name``.

    Any callable: a stream's rows handler (:data:`Handler`) or a timeline's job
    handler; what it is called with is the caller's contract."""
    module_name, sep, attr_name = path.partition(":")
    if not sep:
        module_name, _, attr_name = path.rpartition(".")
    if not module_name or not attr_name:
        raise HandlerError(f"handler {path!r}: expected package.module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise HandlerError(f"handler {path!r}: cannot import {module_name}: {e}") from None
    try:
        found = getattr(module, attr_name)
    except AttributeError:
        raise HandlerError(f"handler {path!r}: {module_name} has no {attr_name!r}") from None
    if not callable(found):
        raise HandlerError(f"handler {path!r} is not callable")
    return found
