"""Named caches that ``caches`` stream rows invalidate.

A worker's code keeps its caches in a :class:`CacheRegistry`; each is an LRU
(:class:`LruCache`) with an optional size limit, or a function wrapped with
:meth:`CacheRegistry.cached`. A row ``[cache_name, keys, invalidation_ts]``
of the ``caches`` stream invalidates one entry (``keys`` is the JSON list of
the key's parts, e.g. a cached function's arguments) or, with ``keys`` null,
the whole cache. A *special name* (configured) stands for several caches.

Invalidations arrive on a database thread while the cached code usually runs
on the reactor thread, so every operation takes the cache's lock.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MISSING = object()


class LruCache:
    """A thread-safe LRU mapping with an optional maximum size."""

    def __init__(self, name: str, max_size: int | None = None) -> None:
        if max_size is not None and max_size < 1:
            raise ValueError(f"cache {name!r}: max_size must be at least 1")
        self.name = name
        self.max_size = max_size
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.invalidations = 0

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                self.misses += 1
                return default
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def set(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if self.max_size is not None:
                while len(self._data) > self.max_size:
                    self._data.popitem(last=False)

    def invalidate(self, key: Hashable) -> None:
        with self._lock:
            self._data.pop(key, None)
            self.invalidations += 1

    def invalidate_all(self) -> None:
        with self._lock:
            self._data.clear()
            self.invalidations += 1

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


def key_from_json(keys: Sequence[Any]) -> Hashable:
    """The cache key for a ``keys`` list: a tuple of its parts (lists become tuples)."""
    return tuple(key_from_json(k) if isinstance(k, list) else k for k in keys)


class CacheRegistry:
    def __init__(
        self,
        special_names: Mapping[str, Iterable[str]] | None = None,
        default_max_size: int | None = None,
    ) -> None:
        self._caches: dict[str, LruCache] = {}
        self._special = {name: tuple(caches) for name, caches in (special_names or {}).items()}
        self._default_max_size = default_max_size
        self._lock = threading.Lock()

    def cache(self, name: str, max_size: int | None = None) -> LruCache:
        """The cache of that name, created on first use."""
        with self._lock:
            found = self._caches.get(name)
            if found is None:
                if name in self._special:
                    raise ValueError(f"{name!r} is a special name; it cannot name a cache")
                found = self._caches[name] = LruCache(name, max_size or self._default_max_size)
            return found

    def cached(
        self, name: str | None = None, max_size: int | None = None
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: cache a function's results by its positional arguments.

        Invalidate one result with ``keys`` = the arguments as a JSON list.
        """

        def wrap(fn: Callable[..., T]) -> Callable[..., T]:
            cache = self.cache(name or fn.__name__, max_size)

            @functools.wraps(fn)
            def wrapper(*args: Hashable) -> T:
                key = tuple(args)
                value = cache.get(key, _MISSING)
                if value is _MISSING:
                    value = fn(*args)
                    cache.set(key, value)
                return value

            wrapper.cache = cache  # type: ignore[attr-defined]
            return wrapper

        return wrap

    def expand(self, name: str) -> tuple[str, ...]:
        """The caches a name stands for: itself, or a special name's caches."""
        return self._special.get(name, (name,))

    def invalidate(self, name: str, keys: Sequence[Any] | None) -> None:
        """Apply one ``caches`` row: one key, or the whole cache when ``keys`` is None."""
        for cache_name in self.expand(name):
            with self._lock:
                cache = self._caches.get(cache_name)
            if cache is None:
                continue  # nothing cached under that name in this process
            if keys is None:
                cache.invalidate_all()
            else:
                cache.invalidate(key_from_json(keys))
