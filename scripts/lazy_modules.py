"""Modules a start imports only because a dependency names them: loaded when first used.

``twisted.python.compat`` (imported by nearly every Twisted module) does
``from http import cookiejar as cookielib`` for a deprecated alias of its own;
``http.cookiejar`` imports ``urllib.request``, ``http.client`` and ``email``:
about 12 ms of every ``tickline worker`` start, for modules a worker never
uses. Inside :func:`lazy_modules` such a module is created without running
its code (``importlib.util.LazyLoader``): binding it to a name costs nothing,
and the first attribute taken from it runs it, as a normal import would have.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from typing import Any

# Imported by a dependency of a worker's start, used by none of its code paths (about 13 ms in
# all: http.cookiejar 12, by twisted.python.compat; asyncio.staggered 0.7, by
# asyncio.base_events; pty with tty 0.5, by twisted.internet.process). Each is bound to a name
# with plain ``import`` and used only inside functions: ``from m import x`` would run it.
# Not random (a worker's reconnect delays) nor pickle: user handlers use them, maybe from
# several threads at once, and Python 3.11's LazyLoader runs a module on its first use without
# a lock (another thread then sees it half made: AttributeError).
UNUSED_BY_A_WORKER = ("http.cookiejar", "asyncio.staggered", "pty")


class _LazyFinder:
    """A meta-path finder that gives the named modules a lazy loader (others: not found here)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: Any = None) -> ModuleSpec | None:
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not a plain module file here: imported the usual way
        spec.loader = importlib.util.LazyLoader(spec.loader)
        return spec


@contextmanager
def lazy_modules(names: Sequence[str] = UNUSED_BY_A_WORKER) -> Iterator[None]:
    """While inside, the first import of one of ``names`` makes a module that runs its code when first used.

    A module already imported stays as it is. Modules made lazy here stay
    lazy after the block, until used.
    """
    finder = _LazyFinder(names)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
