"""What a benchmark suite hands to the harness: workloads, the calls' results, run options, and
the small helpers suites use to pick sizes and implementations (:mod:`rlkernel.bench.harness` runs
them; :mod:`rlkernel.bench.results` turns the measurements into rows and files)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlkernel.bench.timing import (  # noqa: F401 - re-exported: suites, tests and scripts use them here
    QUEUE_AHEAD_BYTES,
    gpu_time_ms,
    input_copies,
    quantile,
    synchronize,
    time_back_to_back,
    time_interleaved,
)


@functools.cache
def optional_import(name: str) -> tuple[Any, str]:
    """``(module, "")``, or ``(None, why)`` when ``name`` cannot be imported: an optional baseline
    (Liger-Kernel, flash-attn) that is not installed gives skipped rows, not an error. Cached."""
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip this baseline"
        return None, f"{name} not importable ({type(exc).__name__}: {exc})"


class BenchError(ValueError):
    """A user error in the bench command line (unknown suite, implementation, workload, size)."""


# --------------------------------------------------------------------------------------------------
# What a suite hands to the harness
# --------------------------------------------------------------------------------------------------


class CallResult(NamedTuple):
    """What one call of an implementation returns, for the cross-check (dropped when timing)."""

    values: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class Skip:
    """An implementation that cannot run for this workload, and why (recorded as a row)."""

    reason: str


Call = Callable[[int], CallResult]


@dataclass
class Prepared:
    """A workload's inputs, bound into one callable per implementation.

    ``calls[impl](i)`` runs the implementation once on input copy ``i % copies``.
    """

    calls: dict[str, Call | Skip]
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    """Everything a suite needs to choose and build its workloads."""

    device: torch.device
    smoke: bool = False
    quick: bool = False
    n_tokens: tuple[int, ...] | None = None
    vocab: tuple[int, ...] | None = None
    impls: tuple[str, ...] | None = None
    workloads: tuple[str, ...] | None = None
    compile_backend: str = "inductor"
    warmup: int = 1
    rounds: int = 5
    reps: int = 3
    # Back-to-back timing of the workloads that ask for it (``Workload.back_to_back``): ``loop_reps``
    # loops of ``loop_calls`` calls, one sync per loop; 0 calls turns it off.
    loop_calls: int = 20
    loop_reps: int = 3
    # The GPU counts of a suite that runs over several GPUs (``multigpu``; ``--gpus``); None: its default.
    gpus: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Workload:
    """One measured configuration of a suite.

    Attributes:
        name: the workload kind (``dapo_kl_fwd_bwd``); with ``params`` it identifies the row.
        pass_: ``fwd`` or ``fwd+bwd``.
        params: suite-specific columns (``n_tokens``, ``vocab`` ...), in column order.
        bytes_moved: bytes the math must move at least (None: not memory-bound, not reported).
        flops: floating-point operations the math needs (None: not reported).
        input_bytes: footprint of one set of inputs (decides L2 rotation).
        impls: the implementations to run, in display order.
        reference: what the others are cross-checked against: one of ``impls``, or the name of an
            untimed oracle that ``setup`` adds to ``Prepared.calls`` (called once; no row).
        setup: ``setup(device, impls, copies) -> Prepared``; allocates inputs.
        queue_ahead: time GPU work only: an L2-evicting 1 GiB write is queued before each call's
            start event, so the host has issued the call before the GPU reaches it (the launch
            latency and host time the call costs are hidden; for calls too small to time in
            isolation, e.g. a decode-shaped GEMM). Default False: an isolated call, what an eager
            caller pays.
        back_to_back: also time the implementations the way a training loop calls them:
            ``Options.loop_calls`` calls issued back to back, then one sync; the row's ``b2b_ms`` is
            the per-call wall time (host time hidden behind earlier calls' GPU work, or not).
        max_warmup, max_rounds, max_reps: caps on the run's ``Options.warmup`` / ``rounds`` /
            ``reps`` for this workload (None: the run's own). For calls that take seconds (a
            training step on 131,072 tokens), where the run's 1 + 1 + 15 calls per implementation
            would take minutes and a few samples already say what there is to say.
    """

    name: str
    pass_: str
    params: dict[str, Any]
    bytes_moved: int | None
    flops: int | None
    input_bytes: int
    impls: tuple[str, ...]
    reference: str | None
    setup: Callable[[torch.device, tuple[str, ...], int], Prepared]
    queue_ahead: bool = False
    back_to_back: bool = False
    max_warmup: int | None = None
    max_rounds: int | None = None
    max_reps: int | None = None

    def capped(self, opts: Options) -> tuple[int, int, int]:
        """``(warmup, rounds, reps)`` for this workload: the run's, capped by ``max_*``."""
        pairs = ((opts.warmup, self.max_warmup), (opts.rounds, self.max_rounds), (opts.reps, self.max_reps))
        warmup, rounds, reps = (value if cap is None else min(value, cap) for value, cap in pairs)
        return warmup, rounds, reps

    @property
    def label(self) -> str:
        return " ".join([self.name, *(f"{k}={v}" for k, v in self.params.items())])


@dataclass(frozen=True)
class Suite:
    """A registered benchmark suite (see ``rlkernel.bench.SUITES``)."""

    name: str
    description: str
    impls: tuple[str, ...]
    kinds: tuple[str, ...]
    param_columns: tuple[str, ...]
    baseline: str
    build: Callable[[Options], list[Workload]]
    bytes_doc: str = ""
    variants: tuple[str, ...] = ()  # opt-in implementations (rlkernel's switches): run when named
    # A suite that does not run in this process (``multigpu``: one torchrun per GPU count) runs
    # itself: ``runner(options) -> (rows, meta)`` instead of the harness's ``run_suite``.
    runner: Callable[[Options], tuple[list[dict], dict]] | None = None


@dataclass
class Measurement:
    """What the harness learned about one implementation of one workload."""

    impl: str
    status: str = "ok"
    samples: list[float] = field(default_factory=list)
    b2b_samples: list[float] = field(default_factory=list)  # per-call ms of each back-to-back loop
    b2b_calls: int | None = None
    host_samples: list[float] = field(default_factory=list)  # host ms of each isolated call
    first_call_s: float | None = None
    peak_bytes: float | None = None
    max_abs_diff: float | None = None
    grad_rel_diff: float | None = None
    note: str = ""


def select(requested: Sequence[str] | None, valid: tuple[str, ...], what: str, suite: str) -> tuple[str, ...]:
    """``requested`` validated against ``valid`` (BenchError naming the bad entry), in ``valid``'s
    order; None selects all."""
    if requested is None:
        return valid
    bad = [r for r in requested if r not in valid]
    if bad:
        raise BenchError(f"unknown {what} {bad[0]!r} for suite {suite!r}; choose from: {', '.join(valid)}")
    return tuple(r for r in valid if r in requested)


def select_impls(
    requested: Sequence[str] | None, valid: tuple[str, ...], variants: tuple[str, ...], suite: str
) -> tuple[str, ...]:
    """The implementations of a run: ``--impl`` validated against ``valid``; without it, all of
    ``valid`` except the opt-in ``variants`` (rlkernel with one switch changed: an ablation, run
    when named, kept out of the default run and its README table)."""
    if requested is None:
        return tuple(i for i in valid if i not in variants)
    return select(requested, valid, "implementation", suite)


def token_and_vocab_sizes(
    opts: Options, *, full: tuple[int, ...], quick: tuple[int, ...], smoke: tuple[int, ...],
    vocab_full: tuple[int, ...], vocab_smoke: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """The token counts and vocabulary sizes of a run: ``--n`` / ``--v`` if given, else the suite's
    defaults for ``--smoke`` / ``--quick`` / a full run. Raises BenchError on a size < 1."""
    ns = opts.n_tokens or (smoke if opts.smoke else quick if opts.quick else full)
    vs = opts.vocab or (vocab_smoke if opts.smoke else vocab_full)
    for x in (*ns, *vs):
        if x < 1:
            raise BenchError(f"sizes must be positive integers, got {x}")
    return ns, vs


def bench_dtype(device: torch.device) -> torch.dtype:
    """The dtype of a suite's tensors: bf16 on CUDA, fp32 on the CPU (``--smoke``: the reference
    paths, where bf16 would only be slower)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
