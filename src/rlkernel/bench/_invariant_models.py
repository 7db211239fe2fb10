"""The ``model_*`` workloads of the ``invariant`` suite: a tiny Qwen3-architecture model, patched
(:func:`rlkernel.invariant.patch_hf_model`) vs HF's own, at prefill, KV-cache decode and a training
step (the suite itself is :mod:`rlkernel.bench.invariant`)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from rlkernel.bench.suite import CallResult, Prepared, Skip, bench_dtype
from rlkernel.invariant.scoring import cache_arg


def models(config: str, device: torch.device, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unpatched, patched): two copies of one random-weight model that share its parameters.

    The patched copy has modules of its own (``patch_hf_model`` swaps their classes) but the same
    parameter tensors: no call writes them (gradients come from ``torch.autograd.grad``), and one
    resident set of weights (3.3 GB for the Qwen3-8B slice) leaves the long-context rows room."""
    from rlkernel.invariant.consistency import build_model
    from rlkernel.invariant.patch import patch_hf_model

    base = build_model(config, device=device, dtype=bench_dtype(device), seed=seed)
    shared = {id(p): p for p in base.parameters()}  # deepcopy's memo: these objects are not copied
    return base, patch_hf_model(copy.deepcopy(base, memo=shared))


def model_setup(kind: str, config: str, b: int, t: int, seed: int):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        base, patched = models(config, device, seed)
        pair = {"torch": base, "rlkernel": patched}
        vocab = base.config.vocab_size
        gen = torch.Generator(device=device).manual_seed(seed)
        ids = torch.randint(1, vocab, (b, t), device=device, generator=gen)
        # One next token / one upstream gradient, shared by both models (the cross-check compares them).
        tok = torch.randint(1, vocab, (b, 1), device=device, generator=gen)
        grad = (
            torch.randn((b, t, vocab), device=device, generator=gen).to(bench_dtype(device))
            if kind == "model_train"
            else None
        )
        calls: dict[str, Any] = {}
        for impl, model in pair.items():
            if impl not in impls:
                continue
            if kind == "model_prefill":
                calls[impl] = prefill_call(model, ids)
            elif kind == "model_decode":
                calls[impl] = decode_call(model, ids, tok)
            else:
                calls[impl] = _train_call(model, ids, grad)
        notes = {"torch": "HF model, SDPA", "rlkernel": "HF model after rlkernel.invariant.patch_hf_model"}
        if "flash_attn" in impls:
            calls["flash_attn"] = Skip("model workloads compare patched vs unpatched only")
        return Prepared(calls, notes)

    return setup


def prefill_call(model, ids, *, last_only: bool = False):
    """One forward over ``ids`` without a cache, no grad; ``last_only``: ``logits_to_keep=1``, only
    the last position's logits, as ``generate()`` runs a prefill (the whole [B, T, V] otherwise)."""
    keep = {"logits_to_keep": 1} if last_only else {}

    def call(i: int) -> CallResult:
        with torch.no_grad():
            return CallResult((model(input_ids=ids, use_cache=False, **keep).logits[:, -1],))

    return call


def decode_call(model, ids, tok):
    """One decode step against a cache primed with ``ids``; the cache is cropped back after each call."""
    from transformers import DynamicCache

    b, t = ids.shape
    cache = DynamicCache(config=model.config)
    with_cache = cache_arg(model, cache)
    with torch.no_grad():  # only the cache is needed: no [B, T, V] logits (10 GB at 32k tokens)
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **with_cache)
    pos = torch.full((b, 1), t, device=ids.device, dtype=torch.long)

    def call(i: int) -> CallResult:
        with torch.no_grad():
            out = model(input_ids=tok, position_ids=pos, use_cache=True, **with_cache).logits[:, -1]
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
