"""``rlkernel bench``: benchmark suites, the harness that runs them, and the report generators.

Suites register in :data:`SUITES`; each one is a :class:`~rlkernel.bench.harness.Suite` that builds
its workloads from the command line's :class:`~rlkernel.bench.harness.Options`. The harness runs every
implementation of a workload in one process (interleaved, medians), measures the hardware ceilings in
the same run, and writes ``<suite>.csv``, ``<suite>.json`` and ``<suite>.png``. See DESIGN.md,
"Performance method", and the module docstrings of :mod:`~rlkernel.bench.harness` and each suite for
what is timed and how bytes are counted.

Importing this package touches no device.
"""

from __future__ import annotations

from rlkernel.bench import logits
from rlkernel.bench.harness import BenchError, Suite

# name -> suite. Later suites ("linear": LM head + loss from hidden states; "invariant": the
# batch-invariant forward chain) add one module each and one entry here.
SUITES: dict[str, Suite] = {logits.SUITE.name: logits.SUITE}


def get_suite(name: str) -> Suite:
    """The registered suite ``name``; BenchError listing the valid names otherwise."""
    try:
        return SUITES[name]
    except KeyError:
        raise BenchError(f"unknown suite {name!r}; available suites: {', '.join(sorted(SUITES))}") from None


__all__ = ["SUITES", "BenchError", "Suite", "get_suite"]
