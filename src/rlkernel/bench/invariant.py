"""Benchmark suite ``invariant``: what batch invariance costs, kernel by kernel and for a whole model.

Workloads (bf16 on the GPU; ``shape`` and ``tokens`` columns say the size):

    gemm            y = x·Wᵀ, x [M, K], W [N, K]: 8192×4096×4096 and Qwen3-8B's layer shapes
                    (q/o_proj 4096×4096, k/v_proj 1024×4096, gate/up_proj 12288×4096, down_proj
                    4096×12288, lm_head 151936×4096) at M = 8192 (prefill) and M = 1, 8, 64
                    (decode)
    gemm_eager      the decode rows (M <= 64) again as isolated eager calls: GPU time plus the
                    host time until the kernel starts (what one eager ``linear`` call costs)
    rmsnorm         HF Qwen3RMSNorm over [M, 4096], M = 8192 and 32768, against its bandwidth ceiling
    attn_prefill    causal GQA, 32/8 heads, head_dim 128: B=4 × T=2048 and B=1 × T=8192
    attn_decode     one query per sequence against a KV cache of 2048 / 8192, B = 1, 8, 32, 64
    model_prefill   the anchor model (4 × Qwen3 layers, hidden 1024, 16/8 heads, vocab 151936): one
                    prefill forward of 8 × 512 tokens, no grad
    model_decode    the same model: one decode step at batch 32 against a 512-entry KV cache
    model_train     the same model: forward + backward over 4 × 512 tokens

Implementations:

    rlkernel     rlkernel.invariant: ``linear``, ``rms_norm``, ``attention``; for the model workloads
                 the HF model after ``patch_hf_model`` (a second copy with the same weights)
    torch        the standard path: ``F.linear`` (cuBLAS), the HF RMSNorm code, SDPA
                 (``scaled_dot_product_attention`` on K/V whose heads were repeated to Hq before the
                 timed call, so PyTorch's FlashAttention-2 backend applies on an H100), the unpatched
                 HF model with SDPA
    flash_attn   ``flash_attn_func`` / ``flash_attn_with_kvcache`` where flash-attn is importable

Timing: the kernel workloads (gemm, rmsnorm, attn_*) are GPU time (``Workload.queue_ahead``: the
host has issued each call before the GPU reaches it, so rows compare kernels and their ceilings,
not Python launch paths); gemm_eager and the model workloads are eager calls timed as a caller sees
them (for a decode step: mostly host time). ``scripts/profile_host_overhead.py`` breaks the host
time of each op down.

Bytes and flops (for the roofline columns; E = 2 bytes per bf16 element):

    gemm          flops 2·M·N·K; bytes (M·K + N·K + M·N)·E
    rmsnorm       bytes (2·M·H + H)·E: read x and the weight, write y (memory-bound: the ceiling row)
    attn_prefill  flops 2·B·Hq·T²·D (causal: half of the 4·B·Hq·T²·D of QKᵀ and PV)
    attn_decode   bytes 2·B·Tk·Hkv·D·E: read the cache's K and V once
    model_*       none reported (time ratios only)

Caveats:
    * ``--smoke`` runs tiny shapes on the CPU (the invariant reference path, per-row GEMVs): it checks
      the pipeline, never performance.
    * The model workloads compare the patched model with HF's SDPA model; the ratio is the cost of
      invariance end to end at these shapes, including HF's Python overhead, which dominates a decode
      step of a 4-layer model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlkernel.bench.harness import (
    BenchError,
    CallResult,
    Options,
    Prepared,
    Skip,
    Suite,
    Workload,
    optional_import,
    select,
)

IMPLS = ("rlkernel", "torch", "flash_attn")
KINDS = (
    "gemm", "gemm_eager", "rmsnorm", "attn_prefill", "attn_decode",
    "model_prefill", "model_decode", "model_train",
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
GEMM_M = (8192, 1, 8, 64)
GEMM_M_QUICK = (8192, 1, 64)
RMS_M, RMS_H = (8192, 32768), 4096
HQ, HKV, D = 32, 8, 128
PREFILL = ((4, 2048), (1, 8192))  # (B, T)
DECODE = ((1, 2048), (8, 2048), (32, 2048), (64, 2048), (32, 8192))  # (B, Tk)
MODEL_PREFILL, MODEL_DECODE, MODEL_TRAIN = (8, 512), (32, 512), (4, 512)  # (B, T)

SMOKE_GEMM = ((48, 32, "smoke"),)
SMOKE_M = (1, 8)
SMOKE_RMS = ((16,), 64)
SMOKE_HEADS = (4, 2, 16)
SMOKE_PREFILL, SMOKE_DECODE = ((2, 16),), ((2, 16),)
SMOKE_MODEL = (2, 8)


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
    )


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _randn(shape, device, gen, dtype, scale=1.0) -> torch.Tensor:
    return torch.randn(shape, device=device, generator=gen, dtype=torch.float32).mul_(scale).to(dtype)


def _fwd(fn: Callable[[], torch.Tensor]) -> CallResult:
    with torch.no_grad():
        return CallResult((fn(),))


# --------------------------------------------------------------------------------------------------
# Kernels: GEMM, RMSNorm, attention
# --------------------------------------------------------------------------------------------------


def _gemm_setup(m: int, n: int, k: int):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        from rlkernel.invariant.matmul import linear

        gen = torch.Generator(device=device).manual_seed(SEED)
        dt = _dtype(device)
        xs = [_randn((m, k), device, gen, dt) for _ in range(copies)]
        ws = [_randn((n, k), device, gen, dt, scale=k**-0.5) for _ in range(copies)]
        calls: dict[str, Any] = {
            "rlkernel": lambda i: _fwd(lambda: linear(xs[i], ws[i])),
            "torch": lambda i: _fwd(lambda: F.linear(xs[i], ws[i])),
        }
        return Prepared({k_: v for k_, v in calls.items() if k_ in impls}, {"torch": "F.linear (cuBLAS)"})

    return setup


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm.forward, written out (the unpatched model's code)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_setup(m: int, h: int):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        from rlkernel.invariant.rmsnorm import rms_norm

        gen = torch.Generator(device=device).manual_seed(SEED)
        dt = _dtype(device)
        xs = [_randn((m, h), device, gen, dt) for _ in range(copies)]
        w = (1.0 + 0.1 * torch.randn(h, device=device, generator=gen)).to(dt)
        calls: dict[str, Any] = {
            "rlkernel": lambda i: _fwd(lambda: rms_norm(xs[i], w, eps=1e-6)),
            "torch": lambda i: _fwd(lambda: hf_rms_norm(xs[i], w, 1e-6)),
        }
        return Prepared(
            {k: v for k, v in calls.items() if k in impls}, {"torch": "HF Qwen3RMSNorm code, eager"}
        )

    return setup


def _flash(device: torch.device) -> tuple[Any, str]:
    if device.type != "cuda":
        return None, "flash-attn needs a CUDA device"
    return optional_import("flash_attn")


def _attn_setup(b: int, tq: int, tk: int, heads: tuple[int, int, int]):
    hq, hkv, d = heads

    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        from rlkernel.invariant.attention import attention

        gen = torch.Generator(device=device).manual_seed(SEED)
        dt = _dtype(device)
        qs = [_randn((b, tq, hq, d), device, gen, dt) for _ in range(copies)]
        ks = [_randn((b, tk, hkv, d), device, gen, dt) for _ in range(copies)]
        vs = [_randn((b, tk, hkv, d), device, gen, dt) for _ in range(copies)]
        # SDPA gets its own [B, H, T, D] contiguous copies (the layout HF hands it) with the KV heads
        # already repeated to Hq outside the timed call: the FlashAttention backend then always
        # applies (enable_gqa does not reach it on every torch version), the strictest baseline.
        qt = [x.transpose(1, 2).contiguous() for x in qs]
        kt, vt = (
            [x.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous() for x in xs]
            for xs in (ks, vs)
        )
        causal = tq == tk  # decode: one query attends to the whole cache (no mask needed)

        def sdpa(i: int) -> CallResult:
            with torch.no_grad():
                o = F.scaled_dot_product_attention(qt[i], kt[i], vt[i], is_causal=causal)
            return CallResult((o.transpose(1, 2),))

        calls: dict[str, Any] = {
            "rlkernel": lambda i: _fwd(lambda: attention(qs[i], ks[i], vs[i])),
            "torch": sdpa,
        }
        notes = {"torch": "F.scaled_dot_product_attention, [B, H, T, D] inputs, KV heads pre-repeated"}
        if "flash_attn" in impls:
            fa, why = _flash(device)
            if fa is None:
                calls["flash_attn"] = Skip(why)
            else:
                calls["flash_attn"] = lambda i: _fwd(
                    lambda: fa.flash_attn_func(qs[i], ks[i], vs[i], causal=causal)
                )
                notes["flash_attn"] = f"flash_attn_func, flash-attn {getattr(fa, '__version__', '?')}"
        return Prepared({k: v for k, v in calls.items() if k in impls}, notes)

    return setup


# --------------------------------------------------------------------------------------------------
# The whole model: patched vs unpatched
# --------------------------------------------------------------------------------------------------


def _models(config: str, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unpatched, patched): two copies of one random-weight model."""
    from rlkernel.invariant.consistency import build_model
    from rlkernel.invariant.patch import patch_hf_model

    base = build_model(config, device=device, dtype=_dtype(device), seed=SEED)
    return base, patch_hf_model(copy.deepcopy(base))


def _model_setup(kind: str, config: str, b: int, t: int):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        base, patched = _models(config, device)
        models = {"torch": base, "rlkernel": patched}
        vocab = base.config.vocab_size
        gen = torch.Generator(device=device).manual_seed(SEED)
        ids = torch.randint(1, vocab, (b, t), device=device, generator=gen)
        # One next token / one upstream gradient, shared by both models (the cross-check compares them).
        tok = torch.randint(1, vocab, (b, 1), device=device, generator=gen)
        grad = (
            torch.randn((b, t, vocab), device=device, generator=gen).to(_dtype(device))
            if kind == "model_train"
            else None
        )
        calls: dict[str, Any] = {}
        for impl, model in models.items():
            if impl not in impls:
                continue
            if kind == "model_prefill":
                calls[impl] = _prefill_call(model, ids)
            elif kind == "model_decode":
                calls[impl] = _decode_call(model, ids, tok)
            else:
                calls[impl] = _train_call(model, ids, grad)
        notes = {"torch": "HF model, SDPA", "rlkernel": "HF model after rlkernel.invariant.patch_hf_model"}
        if "flash_attn" in impls:
            calls["flash_attn"] = Skip("model workloads compare patched vs unpatched only")
        return Prepared(calls, notes)

    return setup


def _prefill_call(model, ids):
    def call(i: int) -> CallResult:
        with torch.no_grad():
            return CallResult((model(input_ids=ids, use_cache=False).logits[:, -1],))

    return call


def _decode_call(model, ids, tok):
    """One decode step against a cache primed with ``ids``; the cache is cropped back after each call."""
    from transformers import DynamicCache

    b, t = ids.shape
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    pos = torch.full((b, 1), t, device=ids.device, dtype=torch.long)

    def call(i: int) -> CallResult:
        with torch.no_grad():
            out = model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
        cache.crop(-1)  # drop this step's entry: every call decodes against the same t entries
        if cache.get_seq_length() != t:
            raise RuntimeError(f"DynamicCache.crop(-1) left {cache.get_seq_length()} entries, expected {t}")
        return CallResult((out,))

    return call


def _train_call(model, ids, grad):
    params = [p for p in model.parameters() if p.requires_grad]

    def call(i: int) -> CallResult:
        logits = model(input_ids=ids, use_cache=False).logits
        grads = torch.autograd.grad(logits, params, grad)
        return CallResult((logits.detach()[:, -1],), (grads[-1],))  # the LM head's gradient

    return call


# --------------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------------


def _workload(
    name, pass_, shape, tokens, setup, impls, *, flops=None, bytes_moved=None, input_bytes=0,
    queue_ahead=False,
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
    )


def build(opts: Options) -> list[Workload]:
    """The workloads selected by ``opts``."""
    kinds = select(opts.workloads, KINDS, "workload", "invariant")
    impls = select(opts.impls, IMPLS, "implementation", "invariant")
    if opts.n_tokens or opts.vocab:
        raise BenchError("suite 'invariant' has fixed shapes: --n/--v do not apply (use --workload)")
    sz = sizes_for(opts)
    two = tuple(i for i in ("rlkernel", "torch") if i in impls)
    out: list[Workload] = []
    for kind in ("gemm", "gemm_eager"):
        if kind not in kinds or not two:
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
                        two,
                        flops=2 * m * n * k,
                        bytes_moved=(m * k + n * k + m * n) * E,
                        input_bytes=(m * k + n * k) * E,
                        queue_ahead=kind == "gemm",
                    )
                )
    if "rmsnorm" in kinds and two:
        for m in sz.rms_m:
            out.append(
                _workload(
                    "rmsnorm",
                    "fwd",
                    f"H={sz.rms_h}",
                    m,
                    _rms_setup(m, sz.rms_h),
                    two,
                    bytes_moved=(2 * m * sz.rms_h + sz.rms_h) * E,
                    input_bytes=m * sz.rms_h * E,
                    queue_ahead=True,
                )
            )
    hq, hkv, d = sz.heads
    attn_impls = tuple(i for i in IMPLS if i in impls)
    if "attn_prefill" in kinds and attn_impls:
        for b, t in sz.prefill:
            out.append(
                _workload(
                    "attn_prefill",
                    "fwd",
                    f"B={b} T={t} H={hq}/{hkv} D={d}",
                    b * t,
                    _attn_setup(b, t, t, sz.heads),
                    attn_impls,
                    flops=2 * b * hq * t * t * d,
                    input_bytes=b * t * (hq + 2 * hkv) * d * E,
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
                    _attn_setup(b, 1, tk, sz.heads),
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
                    _model_setup(kind, sz.model_config, b, t),
                    two,
                    input_bytes=1 << 40,
                )
            )
    return out


SUITE = Suite(
    name="invariant",
    description="batch-invariant GEMM, RMSNorm, attention and a patched HF model vs cuBLAS/SDPA/unpatched",
    impls=IMPLS,
    kinds=KINDS,
    param_columns=("shape", "tokens"),
    baseline="torch",
    build=build,
    bytes_doc=(
        "gemm: flops 2MNK, bytes (MK+NK+MN)*2; rmsnorm: bytes (2MH+H)*2; attn_prefill: flops 2*B*Hq*T^2*D "
        "(causal); attn_decode: bytes 2*B*Tk*Hkv*D*2 (read K and V once); model_*: time only"
    ),
)
