"""``rlkernel bench``: benchmark suites, the harness that runs them, and the report generators.

Suites register in :data:`SUITES`; each one is a :class:`~rlkernel.bench.suite.Suite` that builds
its workloads from the command line's :class:`~rlkernel.bench.harness.Options`. The harness runs every
implementation of a workload in one process (interleaved, medians), measures the hardware ceilings in
the same run, and writes ``<suite>.csv``, ``<suite>.json`` and ``<suite>.png``. See DESIGN.md,
"Performance method", and the module docstrings of :mod:`~rlkernel.bench.harness` and each suite for
what is timed and how bytes are counted.

Importing this package touches no device.
"""

from __future__ import annotations

import importlib

from rlkernel.bench.suite import BenchError, Suite

# One module per suite, each defining ``SUITE``: logits (log-probs and losses from logits), linear
# (LM head + loss from hidden states), invariant (the batch-invariant forward chain), multigpu (the
# LM head over several GPUs: one torchrun run per GPU count).
_SUITE_MODULES = ("logits", "linear", "invariant", "multigpu")


def _load_suites() -> dict[str, Suite]:
    suites = {}
    for name in _SUITE_MODULES:
        module = importlib.import_module(f"rlkernel.bench.{name}")
        suites[module.SUITE.name] = module.SUITE
    return suites


# name -> suite.
SUITES: dict[str, Suite] = _load_suites()


def get_suite(name: str) -> Suite:
    """The registered suite ``name``; BenchError listing the valid names otherwise."""
    try:
        return SUITES[name]
    except KeyError:
        raise BenchError(f"unknown suite {name!r}; available suites: {', '.join(sorted(SUITES))}") from None


__all__ = ["SUITES", "BenchError", "Suite", "get_suite"]
