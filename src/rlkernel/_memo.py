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
        if len(cache) >= MAX_ENTRIES:
            cache.clear()
        found = cache[key] = make()
    return found
