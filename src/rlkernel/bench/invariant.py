"""Benchmark suite ``invariant``: what batch invariance costs, kernel by kernel and for a whole model.

Workloads (bf16 on the GPU; ``shape`` and ``tokens`` columns say the size):

    gemm            y = x·Wᵀ, x [M, K], W [N, K]: 8192×4096×4096 and Qwen3-8B's layer shapes
                    (q/o_proj 4096×4096, k/v_proj 1024×4096, gate/up_proj 12288×4096, down_proj
                    4096×12288, lm_head 151936×4096) at M = 8192 (prefill), M = 1, 8, 64
                    (decode) and M = 256, 2048 (the table's mid cells)
    gemm_eager      the decode rows (M <= 64) again as isolated eager calls: GPU time plus the
                    host time until the kernel starts (what one eager ``linear`` call costs)
    gemm_fwd_bwd    training: y = x·Wᵀ and both gradients (dx, dW) at M = 8192 for q/o_proj,
                    gate/up_proj and lm_head
    rmsnorm         HF Qwen3RMSNorm over [M, 4096], M = 8192 and 32768, against its bandwidth ceiling
    rmsnorm_fwd_bwd the same, forward + backward (dx, dweight)
    attn_prefill    causal GQA, 32/8 heads, head_dim 128: B=4 × T=2048, B=1 × T=8192, B=4 × T=8192
                    and B=1 × T=32768 (issue 25's shapes; --quick: the first)
    attn_prefill_fwd_bwd  the same, forward + backward (dq, dk, dv)
    attn_decode     one query per sequence against a KV cache: 2048 at B = 1, 8, 32, 64; 8192 and
                    32768 at B = 1 and 32 (the long-cache decode of issue 25: B = 1 runs split-decode)
    model_prefill   the anchor model (4 × Qwen3 layers, hidden 1024, 16/8 heads, vocab 151936): one
                    prefill forward of 8 × 512 tokens, no grad
    model_decode    the same model: one decode step at batch 32 against a 512-entry KV cache
    model_train     the same model: forward + backward over 4 × 512 tokens
    model_long_prefill  a Qwen3-8B-shaped 2-layer slice at B = 1: one prefill of T = 8192 and 32768
                    tokens as generate() runs it (logits_to_keep=1), no grad (the model_long_*
                    rows are not in a --quick run)
    model_long_decode   the same slice: one decode step at B = 1 against a KV cache of 8192 / 32768
    model_long_train    the same slice: one training step without the optimizer (forward,
                    ``fused_policy_loss(hidden=...)``, backward to every parameter) on T = 8192,
                    32768 and 131072 tokens as one sequence, and on 131072 tokens of ragged
                    sequences packed into one row (:mod:`rlkernel.bench._invariant_long` has the
                    inputs and how each model is told about the packing); the three at T = 8192
                    and 32768 for the anchor model as well (D = 64: the attention's other tiles)

Implementations:

    rlkernel     rlkernel.invariant: ``linear``, ``rms_norm``, ``attention``; for the model workloads
                 the HF model after ``patch_hf_model`` (a second copy sharing the same weights); on
                 ``model_long_train``, ``fused_policy_loss(..., invariant=True)``
    torch        the standard path: ``F.linear`` (cuBLAS), the HF RMSNorm code, SDPA
                 (``scaled_dot_product_attention`` on K/V whose heads were repeated to Hq before the
                 timed call, so PyTorch's FlashAttention-2 backend applies on an H100), the unpatched
                 HF model with SDPA (on ``model_long_train``, ``fused_policy_loss``'s defaults)
    flash_attn   ``flash_attn_func`` / ``flash_attn_with_kvcache`` where flash-attn is importable

Opt-in variants (``--impl``; not in the default run or the README table):

    rlkernel_single     (gemm, gemm_eager) ``rk.use_options(matmul_table="single")``: one
                        configuration per dtype for every M, the conservative table
    rlkernel_cublas_bwd (gemm_fwd_bwd) ``rk.use_options(invariant_backward="torch")``: the two
                        backward GEMMs on cuBLAS instead of the invariant kernel
    rlkernel_split1024  (attn_*) ``rk.use_options(attention_split_keys=1024)``: half the default
                        split size (more decode programs, twice the prefill merges; other bits)
    rlkernel_onesplit   (attn_*) ``rk.use_options(attention_split_keys=2**30)``: one split, the
                        one-level formula and its one-pass decode (what the splits cost and gain)

Timing: the kernel workloads (gemm, rmsnorm, attn_*) are GPU time (``Workload.queue_ahead``: the
host has issued each call before the GPU reaches it, so rows compare kernels and their ceilings,
not Python launch paths); gemm_eager and the model workloads are eager calls timed as a caller sees
them (for a decode step: mostly host time). ``scripts/profile_invariant.py`` breaks the host
time of each op down. The training steps that take seconds cap their calls per implementation
(``Workload.max_*``): 1 + 1 + 1 + 6 at 32k tokens, 1 + 1 + 3 at 128k (first call, warm-up, memory
call, timed); the ``samples`` column says how many were timed.

Bytes and flops (for the roofline columns; E = 2 bytes per bf16 element):

    gemm          flops 2·M·N·K; bytes (M·K + N·K + M·N)·E
    gemm_fwd_bwd  flops 3 · 2·M·N·K (the forward, dx and dW GEMMs)
    rmsnorm       bytes (2·M·H + H)·E: read x and the weight, write y (memory-bound: the ceiling row)
    rmsnorm_fwd_bwd  bytes (5·M·H + 2·H)·E: the forward, then read x and dy, write dx (+ the weight
                  and its gradient)
    attn_prefill  flops 2·B·Hq·T²·D (causal: half of the 4·B·Hq·T²·D of QKᵀ and PV)
    attn_prefill_fwd_bwd  flops 3.5 × the forward's: the backward's 5 GEMMs (QKᵀ recomputed, dV, dP,
                  dQ, dK) against the forward's 2
    attn_decode   bytes 2·B·Tk·Hkv·D·E: read the cache's K and V once
    model_*       none reported (time ratios only)

Caveats:
    * ``--smoke`` runs tiny shapes on the CPU (the invariant reference path, per-row GEMVs): it checks
      the pipeline, never performance.
    * The model workloads compare the patched model with HF's SDPA model; the ratio is the cost of
      invariance end to end at these shapes, including HF's Python overhead, which dominates a decode
      step of a 4-layer model.
    * ``peak_extra_gb`` of a model row is above the resident weights (one copy, shared by both
      models; the notes give their size): the memory a step needs beyond the model itself.
    * The packed 128k row of the unpatched model goes through HF's own packed path, an N × N mask
      with SDPA (no FlashAttention kernel takes a mask): it may run out of memory on an 80 GB GPU,
      which its row then says (``oom``) rather than ending the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlkernel.bench._invariant_attention import ATTN_SPLITS, attn_setup
from rlkernel.bench._invariant_calls import fwd_only as _fwd
from rlkernel.bench._invariant_calls import grad_call as _grad_call
from rlkernel.bench._invariant_calls import randn as _randn
from rlkernel.bench._invariant_long import LONG_KINDS, long_setup, packed_lengths
from rlkernel.bench._invariant_models import model_setup
from rlkernel.bench.suite import (
    BenchError,
    CallResult,
    Options,
    Prepared,
    Suite,
    Workload,
    bench_dtype,
    select,
    select_impls,
)

VARIANTS = ("rlkernel_single", "rlkernel_cublas_bwd", "rlkernel_split1024", "rlkernel_onesplit")
# attn_* variants: the option attention_split_keys they set
IMPLS = ("rlkernel", "torch", "flash_attn", *VARIANTS)
KINDS = (
    "gemm", "gemm_eager", "gemm_fwd_bwd", "rmsnorm", "rmsnorm_fwd_bwd", "attn_prefill",
    "attn_prefill_fwd_bwd", "attn_decode", "model_prefill", "model_decode", "model_train",
    *LONG_KINDS,
)  # fmt: skip
SEED = 1234
E = 2  # bytes per bf16 element

# (N, K, name): Qwen3-8B's per-layer linears and its LM head.
GEMM_SHAPES = (
    (4096, 4096, "q/o_proj"),
    (1024, 4096, "k/v_proj"),
    (12288, 4096, "gate/up_proj"),
    (4096, 12288, "down_proj"),
    (151936, 4096, "lm_head"),
)
GEMM_M = (8192, 1, 8, 64, 256, 2048)
GEMM_M_QUICK = (8192, 1, 64)
GEMM_FWD_BWD_M = 8192
RMS_M, RMS_H = (8192, 32768), 4096
HQ, HKV, D = 32, 8, 128
PREFILL = ((4, 2048), (1, 8192), (4, 8192), (1, 32768))  # (B, T); --quick takes the first
# (B, Tk); --quick takes every other one
DECODE = ((1, 2048), (8, 2048), (32, 2048), (64, 2048), (32, 8192), (1, 8192), (1, 32768), (32, 32768))
MODEL_PREFILL, MODEL_DECODE, MODEL_TRAIN = (8, 512), (32, 512), (4, 512)  # (B, T)
# model_long_*: the Qwen3-8B slice at B = 1; T for prefill, decode (the cache) and training, and the
# 128k training step (one sequence and packed). Timing caps (warmup, rounds, reps) for the training
# steps that take seconds: the longest T gets 1 + 1 + 1 + 6 calls per implementation (first call,
# warm-up, memory, timed), the 128k step 1 + 1 + 3.
LONG_CONFIG, LONG_T, LONG_STEP_T = "qwen3-8b-slice", (8192, 32768), 131072
LONG_OTHER_CONFIGS = ("anchor",)  # prefill, decode and training at each T of LONG_T too (no 128k step)
LONG_TRAIN_CAPS, STEP_CAPS, NO_CAPS = (1, 3, 2), (0, 3, 1), (None, None, None)

SMOKE_GEMM = ((48, 32, "smoke"),)
SMOKE_M = (1, 8)
SMOKE_RMS = ((16,), 64)
SMOKE_HEADS = (4, 2, 16)
SMOKE_PREFILL, SMOKE_DECODE = ((2, 16),), ((2, 16),)
SMOKE_MODEL = (2, 8)
SMOKE_LONG_T, SMOKE_LONG_STEP_T, SMOKE_LONG_OTHER = (16, 32), 64, ("tiny-llama",)


@dataclass(frozen=True)
class Sizes:
    gemm_shapes: tuple[tuple[int, int, str], ...]
    gemm_m: tuple[int, ...]
    rms_m: tuple[int, ...]
    rms_h: int
    heads: tuple[int, int, int]
    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    model_config: str
    model_prefill: tuple[int, int]
    model_decode: tuple[int, int]
    model_train: tuple[int, int]
    gemm_fwd_bwd_m: int
    long_config: str
    long_t: tuple[int, ...]
    long_step_t: int
    long_other_configs: tuple[str, ...]  # the model_long_* rows at each T of long_t, no long_step_t


def sizes_for(opts: Options) -> Sizes:
    if opts.smoke:
        b, t = SMOKE_MODEL
        return Sizes(
            SMOKE_GEMM,
            SMOKE_M,
            *SMOKE_RMS,
            SMOKE_HEADS,
            SMOKE_PREFILL,
            SMOKE_DECODE,
            "tiny",
            (b, t),
            (b, t),
            (b, t),
            SMOKE_M[-1],
            "tiny",
            SMOKE_LONG_T,
            SMOKE_LONG_STEP_T,
            SMOKE_LONG_OTHER,
        )
    return Sizes(
        GEMM_SHAPES,
        GEMM_M_QUICK if opts.quick else GEMM_M,
        RMS_M,
        RMS_H,
        (HQ, HKV, D),
        PREFILL[:1] if opts.quick else PREFILL,
        DECODE[::2] if opts.quick else DECODE,
        "anchor",
        MODEL_PREFILL,
        MODEL_DECODE,
        MODEL_TRAIN,
        GEMM_FWD_BWD_M,
        LONG_CONFIG,
        LONG_T,
        LONG_STEP_T,
        LONG_OTHER_CONFIGS,
    )


# --------------------------------------------------------------------------------------------------
# Kernels: GEMM, RMSNorm, attention
# --------------------------------------------------------------------------------------------------


def _gemm_setup(m: int, n: int, k: int):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        import rlkernel as rk
        from rlkernel.invariant.matmul import linear

        gen = torch.Generator(device=device).manual_seed(SEED)
        dt = bench_dtype(device)
        xs = [_randn((m, k), device, gen, dt) for _ in range(copies)]
        ws = [_randn((n, k), device, gen, dt, scale=k**-0.5) for _ in range(copies)]

        def single(i: int) -> CallResult:
            with rk.use_options(matmul_table="single"):
                return _fwd(lambda: linear(xs[i], ws[i]))

        calls: dict[str, Any] = {
            "rlkernel": lambda i: _fwd(lambda: linear(xs[i], ws[i])),
            "torch": lambda i: _fwd(lambda: F.linear(xs[i], ws[i])),
            "rlkernel_single": single,
        }
        notes = {"torch": "F.linear (cuBLAS)", "rlkernel_single": 'matmul_table="single"'}
        return Prepared({k_: v for k_, v in calls.items() if k_ in impls}, notes)

    return setup


def _gemm_fwd_bwd_setup(m: int, n: int, k: int):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        from rlkernel.invariant.matmul import linear

        gen = torch.Generator(device=device).manual_seed(SEED)
        dt = bench_dtype(device)
        xs = [_randn((m, k), device, gen, dt).requires_grad_() for _ in range(copies)]
        ws = [_randn((n, k), device, gen, dt, scale=k**-0.5).requires_grad_() for _ in range(copies)]
        leaves = list(zip(xs, ws, strict=True))
        gys = [_randn((m, n), device, gen, dt) for _ in range(copies)]
        calls: dict[str, Any] = {
            "rlkernel": _grad_call(linear, leaves, gys),
            "torch": _grad_call(F.linear, leaves, gys),
            "rlkernel_cublas_bwd": _grad_call(linear, leaves, gys, {"invariant_backward": "torch"}),
        }
        notes = {"torch": "F.linear + autograd (cuBLAS)", "rlkernel_cublas_bwd": 'invariant_backward="torch"'}
        return Prepared({k_: v for k_, v in calls.items() if k_ in impls}, notes)

    return setup


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm.forward, written out (the unpatched model's code)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_setup(m: int, h: int, backward: bool = False):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        from rlkernel.invariant.rmsnorm import rms_norm

        gen = torch.Generator(device=device).manual_seed(SEED)
        dt = bench_dtype(device)
        xs = [_randn((m, h), device, gen, dt) for _ in range(copies)]
        w = (1.0 + 0.1 * torch.randn(h, device=device, generator=gen)).to(dt)
        if backward:
            w.requires_grad_()
            leaves = [(x.requires_grad_(), w) for x in xs]
            gys = [_randn((m, h), device, gen, dt) for _ in range(copies)]
            calls: dict[str, Any] = {
                "rlkernel": _grad_call(lambda x, w_: rms_norm(x, w_, eps=1e-6), leaves, gys),
                "torch": _grad_call(lambda x, w_: hf_rms_norm(x, w_, 1e-6), leaves, gys),
            }
        else:
            calls = {
                "rlkernel": lambda i: _fwd(lambda: rms_norm(xs[i], w, eps=1e-6)),
                "torch": lambda i: _fwd(lambda: hf_rms_norm(xs[i], w, 1e-6)),
            }
        note = "HF Qwen3RMSNorm code, eager" + (" + autograd" if backward else "")
        return Prepared({k: v for k, v in calls.items() if k in impls}, {"torch": note})

    return setup


# --------------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------------


def _workload(
    name, pass_, shape, tokens, setup, impls, *, flops=None, bytes_moved=None, input_bytes=0,
    queue_ahead=False, caps=(None, None, None),
):  # fmt: skip
    return Workload(
        name=name,
        pass_=pass_,
        params={"shape": shape, "tokens": tokens},
        bytes_moved=bytes_moved,
        flops=flops,
        input_bytes=input_bytes,
        impls=impls,
        reference="torch" if "torch" in impls else None,
        setup=setup,
        queue_ahead=queue_ahead,
        max_warmup=caps[0],
        max_rounds=caps[1],
        max_reps=caps[2],
    )


def build(opts: Options) -> list[Workload]:
    """The workloads selected by ``opts``."""
    kinds = select(opts.workloads, KINDS, "workload", "invariant")
    impls = select_impls(opts.impls, IMPLS, VARIANTS, "invariant")
    if opts.n_tokens or opts.vocab:
        raise BenchError("suite 'invariant' has fixed shapes: --n/--v do not apply (use --workload)")
    if opts.quick:  # the long-context rows take minutes: a full run's alone
        named = [k for k in LONG_KINDS if opts.workloads is not None and k in opts.workloads]
        if named:
            raise BenchError(f"{named[0]} has no --quick sizes (its rows take minutes): run without --quick")
        kinds = tuple(k for k in kinds if k not in LONG_KINDS)
    sz = sizes_for(opts)

    def chosen(*applicable: str) -> tuple[str, ...]:
        return tuple(i for i in applicable if i in impls)

    two = chosen("rlkernel", "torch")
    out: list[Workload] = []
    for kind in ("gemm", "gemm_eager"):
        gemm_impls = chosen("rlkernel", "torch", "rlkernel_single")
        if kind not in kinds or not gemm_impls:
            continue
        for m in sz.gemm_m if kind == "gemm" else [m for m in sz.gemm_m if m <= 64]:
            for n, k, label in sz.gemm_shapes:
                out.append(
                    _workload(
                        kind,
                        "fwd",
                        f"N={n} K={k} {label}",
                        m,
                        _gemm_setup(m, n, k),
                        gemm_impls,
                        flops=2 * m * n * k,
                        bytes_moved=(m * k + n * k + m * n) * E,
                        input_bytes=(m * k + n * k) * E,
                        queue_ahead=kind == "gemm",
                    )
                )
    fwd_bwd_impls = chosen("rlkernel", "torch", "rlkernel_cublas_bwd")
    if "gemm_fwd_bwd" in kinds and fwd_bwd_impls:
        m = sz.gemm_fwd_bwd_m
        for n, k, label in sz.gemm_shapes[::2]:
            out.append(
                _workload(
                    "gemm_fwd_bwd",
                    "fwd+bwd",
                    f"N={n} K={k} {label}",
                    m,
                    _gemm_fwd_bwd_setup(m, n, k),
                    fwd_bwd_impls,
                    flops=3 * 2 * m * n * k,
                    input_bytes=(2 * m * k + n * k + m * n) * E,
                    queue_ahead=True,
                )
            )
    for kind, backward in (("rmsnorm", False), ("rmsnorm_fwd_bwd", True)):
        if kind not in kinds or not two:
            continue
        reads = 5 if backward else 2  # fwd: read x, write y; bwd: read x and dy, write dx
        for m in sz.rms_m:
            out.append(
                _workload(
                    kind,
                    "fwd+bwd" if backward else "fwd",
                    f"H={sz.rms_h}",
                    m,
                    _rms_setup(m, sz.rms_h, backward),
                    two,
                    bytes_moved=(reads * m * sz.rms_h + (2 if backward else 1) * sz.rms_h) * E,
                    input_bytes=(2 if backward else 1) * m * sz.rms_h * E,
                    queue_ahead=True,
                )
            )
    hq, hkv, d = sz.heads
    attn_impls = chosen("rlkernel", "torch", "flash_attn", *ATTN_SPLITS)
    for kind, backward in (("attn_prefill", False), ("attn_prefill_fwd_bwd", True)):
        if kind not in kinds or not attn_impls:
            continue
        for b, t in sz.prefill:
            out.append(
                _workload(
                    kind,
                    "fwd+bwd" if backward else "fwd",
                    f"B={b} T={t} H={hq}/{hkv} D={d}",
                    b * t,
                    attn_setup(SEED, b, t, t, sz.heads, backward),
                    attn_impls,
                    flops=(7 if backward else 2) * b * hq * t * t * d,
                    input_bytes=b * t * ((2 if backward else 1) * hq + 2 * hkv) * d * E,
                    queue_ahead=True,
                )
            )
    if "attn_decode" in kinds and attn_impls:
        for b, tk in sz.decode:
            out.append(
                _workload(
                    "attn_decode",
                    "fwd",
                    f"B={b} Tk={tk} H={hq}/{hkv} D={d}",
                    b,
                    attn_setup(SEED, b, 1, tk, sz.heads),
                    attn_impls,
                    bytes_moved=2 * b * tk * hkv * d * E,
                    input_bytes=b * (hq + 2 * tk * hkv) * d * E,
                    queue_ahead=True,
                )
            )
    model_kinds = (
        ("model_prefill", "fwd", sz.model_prefill),
        ("model_decode", "fwd", sz.model_decode),
        ("model_train", "fwd+bwd", sz.model_train),
    )
    for kind, pass_, (b, t) in model_kinds:
        if kind in kinds and two:
            tokens = b if kind == "model_decode" else b * t
            shape = f"{sz.model_config} B={b} " + (f"cache={t}" if kind == "model_decode" else f"T={t}")
            out.append(
                _workload(
                    kind,
                    pass_,
                    shape,
                    tokens,
                    model_setup(kind, sz.model_config, b, t, SEED),
                    two,
                    input_bytes=1 << 40,
                )
            )
    out += _long_workloads(kinds, sz, two)
    return out


def _long_workloads(kinds: tuple[str, ...], sz: Sizes, impls: tuple[str, ...]) -> list[Workload]:
    """The ``model_long_*`` rows (:mod:`rlkernel.bench._invariant_long`): prefill and decode at each
    T of ``sz.long_t``; training at each T, then ``sz.long_step_t`` tokens as one sequence and packed
    (``sz.long_config`` only); the same rows but the step's for each of ``sz.long_other_configs``."""
    if not impls:
        return []
    out = []
    for config in (sz.long_config, *sz.long_other_configs):
        for kind in LONG_KINDS:
            if kind not in kinds:
                continue
            layouts = [[t] for t in sz.long_t]
            if kind == "model_long_train" and config == sz.long_config:
                n = sz.long_step_t
                layouts += [[n], packed_lengths(n, SEED)]
            for lengths in layouts:
                out.append(_long_workload(kind, config, lengths, sz, impls))
    return out


def _long_workload(kind: str, config: str, lengths: list[int], sz: Sizes, impls: tuple[str, ...]) -> Workload:
    t = sum(lengths)
    if kind == "model_long_decode":
        shape, tokens = f"{config} B=1 cache={t}", 1
    elif len(lengths) > 1:
        shape, tokens = f"{config} packed S={len(lengths)} T={t}", t
    else:
        shape, tokens = f"{config} B=1 T={t}", t
    caps = NO_CAPS
    if kind == "model_long_train" and t == sz.long_step_t:
        caps = STEP_CAPS
    elif kind == "model_long_train" and t == max(sz.long_t):
        caps = LONG_TRAIN_CAPS
    return _workload(
        kind,
        "fwd+bwd" if kind == "model_long_train" else "fwd",
        shape,
        tokens,
        long_setup(kind, config, lengths, SEED),
        impls,
        input_bytes=1 << 40,
        caps=caps,
    )


SUITE = Suite(
    name="invariant",
    description="batch-invariant GEMM, RMSNorm, attention and a patched HF model vs cuBLAS/SDPA/unpatched",
    impls=IMPLS,
    kinds=KINDS,
    param_columns=("shape", "tokens"),
    baseline="torch",
    build=build,
    variants=VARIANTS,
    bytes_doc=(
        "gemm: flops 2MNK, bytes (MK+NK+MN)*2; gemm_fwd_bwd: flops 3*2MNK; rmsnorm: bytes (2MH+H)*2, "
        "fwd+bwd (5MH+2H)*2; attn_prefill: flops 2*B*Hq*T^2*D (causal), fwd+bwd 3.5x that; "
        "attn_decode: bytes 2*B*Tk*Hkv*D*2 (read K and V once); model_*: time only"
    ),
)
