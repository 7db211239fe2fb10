"""One memo for the pure functions a call asks again every step (the route, the loss's scalars, the
kernels' branch and scalar tuples): a module dict per function, bounded, and never written inside
``torch.compile`` tracing (Dynamo replays a global dict's writes after the graph and cannot rebuild
the frozen dataclasses they hold). Below every layer: imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

_T = TypeVar("_T")
MAX_ENTRIES = 1024  # a training loop asks a handful of distinct questions; past this, start over


def memoized(cache: dict, key: Hashable, make: Callable[[], _T]) -> _T:
    """``cache[key]``, made by ``make()`` on first use (computed without the cache while tracing)."""
    if torch.compiler.is_compiling():
        return make()
    found = cache.get(key)
    if found is None:
        found = store(cache, key, make())
    return found


def store(cache: dict, key: Hashable, value: _T, bound: int = MAX_ENTRIES) -> _T:
    """``cache[key] = value``, the cache started over first when it holds ``bound`` entries;
    returns ``value``."""
    if len(cache) >= bound:
        cache.clear()
    cache[key] = value
    return value
