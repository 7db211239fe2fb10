"""The attention workloads of the ``invariant`` suite: ours (``rlkernel.invariant.attention``, and
its split-size variants) against SDPA on HF's layout with the KV heads pre-repeated, and
flash-attn's ``flash_attn_func`` where installed (forward only)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlkernel.bench._invariant_calls import fwd_only as _fwd
from rlkernel.bench._invariant_calls import grad_call as _grad_call
from rlkernel.bench._invariant_calls import randn as _randn
from rlkernel.bench.suite import CallResult, Prepared, Skip, bench_dtype, optional_import

# opt-in variants: the split size S of the two-level softmax (1 << 30: one split, the one-level loop)
ATTN_SPLITS = {"rlkernel_split1024": 1024, "rlkernel_onesplit": 1 << 30}


def _flash(device: torch.device) -> tuple[Any, str]:
    if device.type != "cuda":
        return None, "flash-attn needs a CUDA device"
    return optional_import("flash_attn")


def attn_setup(seed: int, b: int, tq: int, tk: int, heads: tuple[int, int, int], backward: bool = False):
    """The setup of one attention workload: B = ``b``, ``tq`` queries against ``tk`` keys (causal when
    equal), heads (Hq, Hkv, D); forward + backward (dq compared) with ``backward``."""
    hq, hkv, d = heads

    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        from rlkernel.invariant.attention import attention

        gen = torch.Generator(device=device).manual_seed(seed)
        dt = bench_dtype(device)
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
        if backward:  # dq is cross-checked (SDPA's dk/dv are those of the repeated heads)
            gos = [_randn((b, tq, hq, d), device, gen, dt) for _ in range(copies)]
            ours = [tuple(x.requires_grad_() for x in qkv) for qkv in zip(qs, ks, vs, strict=True)]
            theirs = [tuple(x.requires_grad_() for x in qkv) for qkv in zip(qt, kt, vt, strict=True)]

            def sdpa_fwd(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

            def sdpa_grads(i: int) -> CallResult:
                out = _grad_call(sdpa_fwd, theirs, gos, keep=1)(i)
                return CallResult(out.values, (out.grads[0].transpose(1, 2),))

            calls: dict[str, Any] = {
                "rlkernel": _grad_call(attention, ours, gos, keep=1),
                "torch": sdpa_grads,
            }
            for name, size in ATTN_SPLITS.items():
                calls[name] = _grad_call(attention, ours, gos, {"attention_split_keys": size}, keep=1)
            notes = {"torch": "F.scaled_dot_product_attention + autograd, KV heads pre-repeated"}
            notes |= {name: f"attention_split_keys={size}" for name, size in ATTN_SPLITS.items()}
            if "flash_attn" in impls:
                calls["flash_attn"] = Skip("forward only in this suite")
            return Prepared({k: v for k, v in calls.items() if k in impls}, notes)

        def sdpa(i: int) -> CallResult:
            with torch.no_grad():
                o = F.scaled_dot_product_attention(qt[i], kt[i], vt[i], is_causal=causal)
            return CallResult((o.transpose(1, 2),))

        def split_variant(size: int):
            def call(i: int) -> CallResult:
                import rlkernel as rk

                with rk.use_options(attention_split_keys=size):
                    return _fwd(lambda: attention(qs[i], ks[i], vs[i]))

            return call

        calls: dict[str, Any] = {
            "rlkernel": lambda i: _fwd(lambda: attention(qs[i], ks[i], vs[i])),
            "torch": sdpa,
        }
        calls |= {name: split_variant(size) for name, size in ATTN_SPLITS.items()}
        notes = {"torch": "F.scaled_dot_product_attention, [B, H, T, D] inputs, KV heads pre-repeated"}
        notes |= {name: f"attention_split_keys={size}" for name, size in ATTN_SPLITS.items()}
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
