"""Bounded caches with counters, and one registry that clears them all.

Every package keeps its memo tables (rule results, layout boxes, redistribute plans and
programs, the dispatcher's propagation cache...) in one of two forms defined here, so that
they share one eviction policy (least recently used), report the same counters and are all
emptied by one call (:func:`clear_all`, exported as ``dtensor.clear_caches``):

- :class:`LRUCache`, a dict-like table for callers that build keys themselves;
- :func:`memoize`, a decorator for pure functions of hashable arguments (``functools``'
  compiled LRU underneath, registered here).

Caches hold derived metadata only; clearing one never changes a result, only its cost.
Everything here is **Local**.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .errors import ConfigError

__all__ = ["LRUCache", "all_stats", "clear_all", "get_cache", "memoize"]

_MISSING = object()
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


class LRUCache:
    """A bounded map that evicts its least recently used entry, with counters.

    Parameters
    ----------
    name : str
        Unique name in the registry (``"rules.results"``); :func:`all_stats` reports under it.
    maxsize : int
        Most entries kept (at least 1).
    on_evict : callable, optional
        ``on_evict(key, value)`` for every entry dropped by eviction or :meth:`clear` (to
        release what a value holds, e.g. MPI datatypes).
    on_clear : callable, optional
        Called with no argument before the cache is cleared or trimmed (a front that keeps
        copies of the entries drops them).

    Attributes
    ----------
    data : OrderedDict
        The entries, least recently used first. Hot paths may read it directly
        (``data.get(key)``) and count with :attr:`hits`/:attr:`misses` themselves; a
        reader that skips ``data.move_to_end(key)`` on a hit leaves the order as it was,
        so such a table evicts its oldest entry.
    hits, misses, evictions : int
        Counters since creation or the last :meth:`clear`.
    """

    __slots__ = ("data", "evictions", "hits", "maxsize", "misses", "name", "on_clear", "on_evict")

    def __init__(
        self,
        name: str,
        maxsize: int,
        *,
        on_evict: Callable[[Hashable, Any], None] | None = None,
        on_clear: Callable[[], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ConfigError(f"LRUCache {name!r}: maxsize must be at least 1, got {maxsize}")
        self.name = name
        self.maxsize = int(maxsize)
        self.data: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = self.misses = self.evictions = 0
        self.on_evict = on_evict
        self.on_clear = on_clear
        _register(name, self)

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value of ``key`` (counted as a hit, and made most recent) or ``default``
        (counted as a miss)."""
        value = self.data.get(key, _MISSING)
        if value is _MISSING:
            self.misses += 1
            return default
        self.hits += 1
        self.data.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` under ``key`` as the most recent entry, evicting beyond maxsize."""
        data = self.data
        data[key] = value
        data.move_to_end(key)
        if len(data) > self.maxsize:
            self.trim()

    def trim(self) -> None:
        """Evict least recently used entries down to :attr:`maxsize`."""
        data = self.data
        if len(data) <= self.maxsize:
            return
        if self.on_clear is not None:
            self.on_clear()
        while len(data) > self.maxsize:
            key, value = data.popitem(last=False)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(key, value)

    def resize(self, maxsize: int) -> None:
        """Change the bound (evicting the oldest entries when it shrinks)."""
        if int(maxsize) < 1:
            raise ConfigError(f"LRUCache {self.name!r}: maxsize must be at least 1, got {maxsize}")
        self.maxsize = int(maxsize)
        self.trim()

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        if self.on_clear is not None:
            self.on_clear()
        data = self.data
        if self.on_evict is not None:
            while data:
                self.on_evict(*data.popitem(last=False))
        data.clear()
        self.hits = self.misses = self.evictions = 0

    def stats(self) -> dict[str, int]:
        """``hits``, ``misses``, ``evictions``, ``size`` and ``maxsize``."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "size": len(self.data),
            "maxsize": self.maxsize,
        }

    def __len__(self) -> int:
        return len(self.data)

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __repr__(self) -> str:
        return f"LRUCache({self.name!r}, size={len(self.data)}, maxsize={self.maxsize})"


class _Memo:
    """Registry adapter of a :func:`memoize`-d function (its ``functools`` LRU)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def clear(self) -> None:
        self.fn.cache_clear()

    def stats(self) -> dict[str, int]:
        info = self.fn.cache_info()
        return {
            "hits": info.hits,
            "misses": info.misses,
            "evictions": max(0, info.misses - info.currsize),
            "size": info.currsize,
            "maxsize": info.maxsize,
        }


def memoize(name: str, maxsize: int) -> Callable[[_Fn], _Fn]:
    """Decorator: an LRU memo of a pure function of hashable arguments, registered as
    ``name``. The function keeps ``cache_info()``/``cache_clear()``.

    ``evictions`` is derived (misses beyond the current size), exact unless the function
    raised on some calls.
    """

    def deco(fn: _Fn) -> _Fn:
        wrapped = functools.lru_cache(maxsize=maxsize)(fn)
        _register(name, _Memo(wrapped))
        return wrapped  # type: ignore[return-value]

    return deco


_REGISTRY: dict[str, Any] = {}


def _register(name: str, cache: Any) -> None:
    if name in _REGISTRY:
        raise ConfigError(f"cache name {name!r} is already registered")
    _REGISTRY[name] = cache


def get_cache(name: str) -> Any:
    """The registered cache ``name`` (an :class:`LRUCache` or a memo adapter)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"no cache named {name!r}; registered: {sorted(_REGISTRY)}") from None


def clear_all() -> None:
    """Empty every registered cache and reset its counters."""
    for cache in tuple(_REGISTRY.values()):
        cache.clear()


def all_stats() -> dict[str, dict[str, int]]:
    """``{name: stats}`` of every registered cache, sorted by name."""
    return {name: _REGISTRY[name].stats() for name in sorted(_REGISTRY)}
