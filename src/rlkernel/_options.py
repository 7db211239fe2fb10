"""The scoped options of rlkernel: one frozen :class:`Options` read from a context variable.

Every switch that picks which code runs (and may change which bits come out) lives here, not in
module globals: a public op reads :func:`current_options` once per call and passes the values it
needs down as arguments. Change them for a block of code with :func:`use_options`::

    with rk.use_options(matmul_table="single", linear_chunk_bytes=256 << 20):
        out = rk.fused_policy_loss(cfg, hidden=h, weight=w, ...)

The scope is a :class:`contextvars.ContextVar`: it nests, is restored on exit (also on an
exception), and is per thread and per asyncio task, so two threads can run with different options.
Nothing here is process-wide. Inside ``torch.compile``d code the options are read from a per-thread
mirror of the same scopes instead (Dynamo cannot trace ``ContextVar.get``, torch 2.13, but it
guards on the mirror: code compiled under one set of options is recompiled when they change). The
two agree except when asyncio tasks of one thread interleave different ``use_options`` blocks
around compiled code; keep such blocks within one task step there.

The defaults are the settings measured best on the H100 (``docs/api/options.md`` lists each option
with its default, what it costs and where it was measured).

This module is below every layer (``kernels`` may import it): it imports only the standard library
and torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Iterator
from typing import Literal

import torch

MatmulTable = Literal["tuned", "single"]
InvariantBackward = Literal["kernel", "torch"]
LogitsDtype = Literal["fp32", "input"]
DweightAccum = Literal["fp32", "weight"]
LinearHeadGemm = Literal["auto", "triton", "cublas"]
TpGemm = Literal["auto", "half", "fp32"]
TpElementwise = Literal["auto", "torch"]
AttentionSplitDecode = Literal["auto", "always", "never"]


@dataclasses.dataclass(frozen=True)
class MatmulThresholds:
    """Where the tuned GEMM table switches cells (speed only: every configuration of a dtype's table
    gives the same bits, so these never change a result).

    Attributes:
        narrow_n: weights with N <= this are "narrow" (GQA k/v projections).
        vocab_n: weights with N >= this are "vocab" (LM heads); the rest are "wide".
        min_tiles: a pointer configuration of a cell is used when its grid has at least this many
            tiles (else the cell's next one).
        min_tiles_tma: the same for the persistent TMA kernel (it needs several tiles per SM).
    """

    narrow_n: int = 2048
    vocab_n: int = 32768
    min_tiles: int = 128
    min_tiles_tma: int = 512


_CHOICES = {
    "matmul_table": ("tuned", "single"),
    "invariant_backward": ("kernel", "torch"),
    "linear_logits_dtype": ("fp32", "input"),
    "linear_dweight_accum": ("fp32", "weight"),
    "linear_head_gemm": ("auto", "triton", "cublas"),
    "tp_gemm": ("auto", "half", "fp32"),
    "tp_elementwise": ("auto", "torch"),
    "attention_split_decode": ("auto", "always", "never"),
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Every rlkernel switch, with the measured-best defaults (``docs/api/options.md``).

    Attributes:
        matmul_table: the batch-invariant GEMM's launch configurations. ``"tuned"``: per call from
            the measured table by (dtype, M bucket, weight class, grid size), all configurations of
            a dtype in one bitwise class (GPU models not verified run ``"single"``); ``"single"``:
            one configuration per dtype, invariant by construction, 1.1-4x slower off its shape.
        matmul_thresholds: the tuned table's cell boundaries (:class:`MatmulThresholds`).
        invariant_backward: the two backward GEMMs of ``rlkernel.invariant.linear`` on the Triton
            backend: ``"kernel"`` (the invariant kernel: no split-K, no atomics) or ``"torch"``
            (cuBLAS: deterministic on one GPU, faster on shapes the kernel tiles poorly).
        token_level_fusion: ``fused_policy_loss`` runs token-level losses (ppo, cispo, sapo,
            reinforce with any KL/entropy/rollout correction) as the fused per-token kernels;
            False: the composed path (log-prob primitive, then ``policy_loss``).
        grad_in_forward_max_vocab: from logits, V up to this takes the two-pass path (the gradient
            written during the forward); 0 turns it off (the three-pass path).
        linear_logits_dtype: the linear path's logits chunk: ``"fp32"`` (GEMM output in fp32) or
            ``"input"`` (in the input dtype, as the model's own LM head gives; ~5 % faster).
        linear_dweight_accum: the linear path's dweight accumulator: ``"fp32"`` or ``"weight"``
            (the weight's dtype; ~1 % faster, bf16 rounding per group).
        linear_head_gemm: the linear path's logits GEMMs: ``"auto"`` (the Triton LM-head GEMM whose
            epilogue computes the log-softmax statistics, and recomputes the logits gradient in the
            primitive's backward, where it runs: CUDA sm90+, 16-bit inputs, no bias, fp32 logits,
            not invariant; cuBLAS chunks elsewhere), ``"triton"`` (that kernel wherever it can
            run, the CPU interpreter included: tests), ``"cublas"`` (cuBLAS chunks and the
            log-softmax kernels over stored logits).
        linear_chunk_bytes: the linear path's budget for one fp32 logits chunk (rows × V × 4).
        linear_grad_bytes: the linear path's budget for one gradient group's fp32 ∂z.
        tp_gemm: the vocab-parallel path's local GEMMs for bf16/fp16: ``"auto"`` (half-precision
            operands with fp32 output on CUDA, fp32 elsewhere), ``"half"``, ``"fp32"``.
        tp_elementwise: the vocab-parallel chunk math with half-operand GEMMs: ``"auto"`` (the
            Triton log-prob kernels where they run) or ``"torch"``.
        fast_launch: Triton launches go through rlkernel's cached launcher (less host time per
            launch); False: Triton's own launch every time (for profiling the difference).
        attention_split_keys: the split size S (keys) of ``rlkernel.invariant.attention``'s
            two-level softmax: a row with more than S keys merges S-key splits of its keys in
            order. Part of the formula (rows with more than S keys change bits with it; rollout and
            trainer must agree on it). None: the default of (head_dim, dtype) (2048); otherwise
            a multiple of the backend's key block, at most 2^30 (2^30: one split, the one-level
            formula).
        attention_split_decode: when that attention runs a call as split-decode (the splits of a
            row on separate programs, then a combine kernel): ``"auto"`` (rows spanning two splits
            or more and a one-pass grid smaller than the GPU's SM count), ``"always"``,
            ``"never"``. Speed only: the same bits either way.
    """

    matmul_table: MatmulTable = "tuned"
    matmul_thresholds: MatmulThresholds = MatmulThresholds()
    invariant_backward: InvariantBackward = "kernel"
    token_level_fusion: bool = True
    grad_in_forward_max_vocab: int = 262144
    linear_logits_dtype: LogitsDtype = "fp32"
    linear_dweight_accum: DweightAccum = "fp32"
    linear_head_gemm: LinearHeadGemm = "auto"
    linear_chunk_bytes: int = 1280 << 20
    linear_grad_bytes: int = 1280 << 20
    tp_gemm: TpGemm = "auto"
    tp_elementwise: TpElementwise = "auto"
    fast_launch: bool = True
    attention_split_keys: int | None = None
    attention_split_decode: AttentionSplitDecode = "auto"

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"option {name} must be one of {allowed}, got {value!r}")
        for name in ("token_level_fusion", "fast_launch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"option {name} must be a bool, got {getattr(self, name)!r}")
        lows = (("grad_in_forward_max_vocab", 0), ("linear_chunk_bytes", 1), ("linear_grad_bytes", 1))
        for name, low in lows:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"option {name} must be an int >= {low}, got {value!r}")
        split = self.attention_split_keys
        bad_split = isinstance(split, bool) or not isinstance(split, int) or not 1 <= split <= 1 << 30
        if split is not None and bad_split:
            raise ValueError(
                f"option attention_split_keys must be None or an int in [1, 2**30], got {split!r}"
            )
        th = self.matmul_thresholds
        if not isinstance(th, MatmulThresholds):
            raise ValueError(f"option matmul_thresholds must be a MatmulThresholds, got {th!r}")
        for field in dataclasses.fields(th):
            value = getattr(th, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"matmul_thresholds.{field.name} must be an int >= 1, got {value!r}")


DEFAULTS = Options()
_current: contextvars.ContextVar[Options] = contextvars.ContextVar("rlkernel_options", default=DEFAULTS)


class _Scope:
    """One open :func:`use_options` block: its changes, and the options in force while it is the
    innermost open block (recomputed if an enclosing block exits first)."""

    __slots__ = ("changes", "options")

    def __init__(self, changes: dict[str, object], options: Options) -> None:
        self.changes, self.options = changes, options


# The open scopes of this context, in entry order (innermost last); _current holds the last one's
# options (or DEFAULTS), so that current_options() stays one ContextVar read.
_open: contextvars.ContextVar[tuple[_Scope, ...]] = contextvars.ContextVar("rlkernel_open_scopes", default=())
_traced = threading.local()  # .stack: this thread's scopes' options, for torch.compile (above)


def current_options() -> Options:
    """The options in force here (the innermost :func:`use_options`, else the defaults)."""
    if torch.compiler.is_compiling():
        stack = getattr(_traced, "stack", None)
        return stack[-1] if stack else DEFAULTS
    return _current.get()


def _close(scope: _Scope) -> None:
    """End ``scope``: the options in force become those of the scopes still open, applied in entry
    order over the defaults. For nested blocks that is the value before the block (as
    ``ContextVar.reset``). Blocks that end out of order (two generators each holding a block across
    a ``yield``) must not leave the ended block's options in force, nor drop a block still open:
    the scopes opened after ``scope`` are recomputed without its changes."""
    scopes = _open.get()
    if scope not in scopes:  # ended in another context (thread, task) than it began in
        raise RuntimeError(
            "a use_options block ended in another thread or asyncio task than the one it began in; "
            "its options cannot be restored there"
        )
    at = scopes.index(scope)
    rest = scopes[:at] + scopes[at + 1 :]
    options = rest[at - 1].options if at > 0 else DEFAULTS
    for later in rest[at:]:  # only when blocks end out of order
        options = later.options = dataclasses.replace(options, **later.changes)
    _open.set(rest)
    _current.set(rest[-1].options if rest else DEFAULTS)
    stack = getattr(_traced, "stack", None)
    if stack is not None:  # in place: compiled code guards on this list
        stack[:] = [s.options for s in rest]


@contextlib.contextmanager
def use_options(**changes: object) -> Iterator[Options]:
    """Run the enclosed code with the named options changed (the others as they are here).

    Blocks nest. Blocks that end out of order (two generators each holding a block across a
    ``yield``, one closed before the other) are handled: after any block ends, the options in force
    are the defaults with the changes of the blocks still open applied in the order they began; so
    a block still open keeps its own changes and loses those of a block that enclosed it and ended.

    Args:
        **changes: fields of :class:`Options`, e.g. ``matmul_table="single"``.

    Yields:
        The :class:`Options` in force inside the block (as it began).

    Raises:
        ValueError: an unknown option name or a value outside its allowed set.
        RuntimeError: on exit, the block ended in another thread or asyncio task than it began in.
    """
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Options)})
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(Options))
        raise ValueError(f"unknown option(s) {unknown}; the options are: {known}")
    options = dataclasses.replace(_current.get(), **changes)
    scope = _Scope(changes, options)
    _open.set((*_open.get(), scope))
    _current.set(options)
    stack = getattr(_traced, "stack", None)
    if stack is None:
        stack = _traced.stack = []
    stack.append(options)
    try:
        yield options
    finally:
        _close(scope)
