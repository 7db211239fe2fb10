"""The long-context model workloads of the ``invariant`` suite (issue 25): a Qwen3-8B-shaped 2-layer
slice (``qwen3-8b-slice``; ``tiny`` with ``--smoke``) at B = 1, patched
(:func:`rlkernel.invariant.patch_hf_model`) vs HF's own model with SDPA, in one process, the two
copies sharing one set of weights (:func:`rlkernel.bench._invariant_models.models`).

    model_long_prefill  one prefill forward of T tokens as ``generate()`` runs it: ``logits_to_keep=1``
                        (a rollout engine samples from the last position's logits only), no grad
    model_long_decode   one decode step at B = 1 against a KV cache of T entries
    model_long_train    one training step without the optimizer: the base model's forward to the last
                        hidden states, ``rlkernel.fused_policy_loss(PolicyLossConfig.preset("dapo"),
                        hidden=..., weight=lm_head.weight, ...)`` on-policy (``old_logp=None``), and the
                        backward to every parameter (``torch.autograd.grad``, the embedding's dense
                        gradient included). The patched model's loss runs with ``invariant=True`` (and
                        its LM head's logits dtype), the unpatched model's with the defaults: what a
                        trainer of each would call. ``T`` rows: one sequence; ``packed`` rows: ragged
                        sequences packed into one row of T tokens.

Training inputs (:func:`train_inputs`): uniform random token ids; each sequence's first quarter is
its prompt (mask 0) and its last token has no next token (mask 0); the target of every other token
is the next token; one advantage per sequence (``randn``). Packed lengths (:func:`packed_lengths`):
a fixed CPU draw, uniform in [T/32, T/4], the last sequence taking what remains.

How each model is told about the packing (the same tokens, positions restarting at 0 per sequence):

* patched: ``position_ids``, plus ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (the flash-attention
  packing kwargs of transformers' ``DataCollatorWithFlattening``, which
  ``rlkernel.invariant.hf_attention`` reads at batch 1: the varlen kernel) and
  ``attention_mask={"full_attention": None}``, a prepared mask mapping, so that transformers does
  not build the [1, 1, N, N] mask that the adapter would not read (N² bytes: 17.2 GB at
  N = 131,072; from ``position_ids`` alone the adapter reads the packing from that mask).
* unpatched: HF's own SDPA path for packed rows: ``position_ids`` alone. transformers builds the
  block-diagonal [1, 1, N, N] boolean mask, and SDPA with a mask runs without its FlashAttention
  kernel (torch turns a boolean mask into an additive one of the query's dtype, 2·N² bytes). At
  131,072 tokens that may not fit an 80 GB GPU: the row then says ``oom``, and its notes say why.

Memory: ``peak_extra_gb`` is above the resident weights (both models share them; the notes give
their size) and the inputs, and includes every parameter's gradient. No gradient checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.bench._invariant_models import decode_call, models, prefill_call
from rlkernel.bench.suite import CallResult, Prepared, Skip

LONG_KINDS = ("model_long_prefill", "model_long_decode", "model_long_train")
PROMPT_SHARE = 4  # the first 1/4 of each sequence is prompt (mask 0)


def packed_lengths(n: int, seed: int) -> list[int]:
    """Ragged sequence lengths that sum to ``n``: a fixed CPU draw, uniform in [n/32, n/4], the last
    one taking what remains (never less than n/32, so it may exceed n/4)."""
    lo, hi = max(1, n // 32), max(1, n // 4)
    gen = torch.Generator().manual_seed(seed)
    out, rest = [], n
    while rest > 0:
        x = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        if rest - x < lo:
            x = rest
        out.append(x)
        rest -= x
    return out


@dataclass(frozen=True)
class TrainInputs:
    """One training batch of N tokens in one row. ``ids`` ``[1, N]``; the loss inputs are ``[1, N]``
    (one sequence) or packed ``[N]`` with ``cu_seqlens`` ``[S + 1]`` int32 and ``advantages``
    ``[S, 1]``; ``position_ids`` ``[1, N]`` restarting per sequence (packed only)."""

    ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    cu_seqlens: torch.Tensor | None
    position_ids: torch.Tensor | None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def train_inputs(lengths: list[int], vocab: int, device: torch.device, seed: int) -> TrainInputs:
    """The batch of :class:`TrainInputs` for sequences of ``lengths`` (one entry: not packed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = sum(lengths)
    ids = torch.randint(1, vocab, (1, n), device=device, generator=gen)
    lens = torch.tensor(lengths, device=device)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
    pos = torch.arange(n, device=device) - starts[seq]  # position within its sequence
    mask = (pos >= lens[seq] // PROMPT_SHARE) & (pos < lens[seq] - 1)
    targets = torch.zeros(n, dtype=torch.long, device=device)  # any id where the mask is 0
    targets[:-1] = ids[0, 1:]
    targets = targets.masked_fill(~mask, 0)
    adv = torch.randn((len(lengths),), device=device, generator=gen)
    if len(lengths) == 1:
        return TrainInputs(ids, targets[None], mask[None], adv, None, None)
    cu = torch.cat([starts, lens[-1:] + starts[-1:]]).to(torch.int32)
    return TrainInputs(ids, targets, mask, adv[:, None], cu, pos[None])


def forward_kwargs(model: torch.nn.Module, inp: TrainInputs, patched: bool) -> dict[str, Any]:
    """How the batch's packing reaches each model (see the module docstring)."""
    if not inp.packed:
        return {}
    if not patched:
        return {"position_ids": inp.position_ids}
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return {
        "position_ids": inp.position_ids,
        "cu_seq_lens_q": inp.cu_seqlens,
        "cu_seq_lens_k": inp.cu_seqlens,
        "attention_mask": dict.fromkeys(layer_types),  # prepared: no N×N mask is built
    }


def train_call(model: torch.nn.Module, inp: TrainInputs, *, patched: bool):
    """Forward, ``fused_policy_loss`` from the hidden states, backward to every parameter. The result
    holds the loss and the last position's hidden state, and the gradient of the first layer's input
    RMSNorm weight (the end of the backward: every op of the model is on its path)."""
    import rlkernel as rk
    from rlkernel.invariant.patch import patched_lm_head_dtype

    cfg = rk.PolicyLossConfig.preset("dapo")
    params = [p for p in model.parameters() if p.requires_grad]
    probe = model.model.layers[0].input_layernorm.weight
    k = next(j for j, p in enumerate(params) if p is probe)
    fwd = forward_kwargs(model, inp, patched)
    loss_kw = {"invariant": True, "logits_dtype": patched_lm_head_dtype(model)} if patched else {}
    head = model.lm_head

    def call(i: int) -> CallResult:
        hidden = model.model(input_ids=inp.ids, use_cache=False, **fwd).last_hidden_state
        out = rk.fused_policy_loss(
            cfg,
            hidden=hidden[0] if inp.packed else hidden,
            weight=head.weight,
            token_ids=inp.targets,
            old_logp=None,
            advantages=inp.advantages,
            mask=inp.mask,
            cu_seqlens=inp.cu_seqlens,
            **loss_kw,
        )
        grads = torch.autograd.grad(out.loss, params)
        # clone: a view would keep the whole [1, N, H] hidden state alive with the result
        return CallResult((out.loss.detach(), hidden.detach()[0, -1].clone()), (grads[k],))

    return call


def _weights_note(model: torch.nn.Module) -> str:
    gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    return f"weights {gb:.2f} GB resident (shared by both models), not in peak"


def long_setup(kind: str, config: str, lengths: list[int], seed: int):
    """``setup`` of one ``model_long_*`` workload: ``lengths`` is one T (one sequence; the cache for
    decode) or the packed lengths."""
    t = sum(lengths)

    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        base, patched = models(config, device, seed)
        vocab = base.config.vocab_size
        pair = {"torch": base, "rlkernel": patched}
        notes = {
            "torch": "HF model, SDPA",
            "rlkernel": "HF model after rlkernel.invariant.patch_hf_model",
        }
        calls: dict[str, Any] = {}
        if kind == "model_long_train":
            inp = train_inputs(lengths, vocab, device, seed)
            for impl, model in pair.items():
                if impl in impls:
                    calls[impl] = train_call(model, inp, patched=impl == "rlkernel")
            notes["torch"] += "; fused_policy_loss(hidden=...), defaults"
            notes["rlkernel"] += "; fused_policy_loss(hidden=..., invariant=True)"
            if inp.packed:
                gb = t * t / 1e9
                notes["torch"] += (
                    f"; packed: position_ids only, so transformers builds a [1, 1, N, N] bool mask "
                    f"({gb:.3g} GB) and SDPA runs without FlashAttention"
                )
                notes["rlkernel"] += "; packed: position_ids + cu_seq_lens_q/k, prepared mask mapping (None)"
        else:
            gen = torch.Generator(device=device).manual_seed(seed)
            ids = torch.randint(1, vocab, (1, t), device=device, generator=gen)
            tok = torch.randint(1, vocab, (1, 1), device=device, generator=gen)
            for impl, model in pair.items():
                if impl in impls:
                    if kind == "model_long_prefill":
                        calls[impl] = prefill_call(model, ids, last_only=True)
                    else:
                        calls[impl] = decode_call(model, ids, tok)
            if kind == "model_long_prefill":
                notes = {k: v + "; logits_to_keep=1" for k, v in notes.items()}
        notes = {k: f"{v}; {_weights_note(base)}" for k, v in notes.items()}
        if "flash_attn" in impls:
            calls["flash_attn"] = Skip("model workloads compare patched vs unpatched only")
        return Prepared(calls, notes)

    return setup
