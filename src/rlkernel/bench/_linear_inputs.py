"""The inputs of the ``linear`` benchmark suite: workload kinds, their ``[B, T]`` layouts, the rows a
workload scores, and the input tensors (see :mod:`rlkernel.bench.linear` for the implementations).

Every input set is ``[B, T]`` sequences of T = 1024 response tokens (16 with ``--smoke``), N = B·T:

    ragged   the users' call pattern, the headline: the hidden states are the view
             ``base[:, P-1:-1]`` of the model's last hidden states ``base`` ``[B, P+T, H]`` (P = 128
             prompt positions; ``base`` requires grad, so every gradient is the base's), response
             lengths uniform in ``[T/4, T]`` (:func:`rlkernel.bench._logits_inputs.ragged_lengths`:
             one fixed CPU draw, the same for every input copy, device and run), the mask 0 beyond
             each length: padding at the end of each sequence.
    dense    the second view: a contiguous hidden leaf ``[N, H]`` (viewed ``[B, T, H]``); no padding
             for the log-prob kinds, ~10 % right padding for the losses (lengths uniform in
             ``[0.8·T, T]``, also one fixed CPU draw).

How each implementation is told about padding: rlkernel's ids are ``ignore_index`` (-100) beyond
each length (``ids_ignore``; its losses also take ``mask``), TRL's head and Liger get the mask,
plain torch projects every row and masks its outputs. Log-prob kinds: upstream gradients of logp
and entropy ``randn``, 0 beyond each length. Loss kinds: old/ref log-probs = the true log-probs
(of bf16 logits) + 0.1·randn, per-sequence advantages ``randn``.

Values: hidden ``randn`` bf16, weight ``randn·2/√H`` (logits of std ≈ 2), uniform token ids.

The scored rows A (the active tokens; N for the dense log-prob kinds) set the workload's FLOPs:
``n_gemms·2·A·H·V``, since the LM head has nothing to compute for a padded row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.bench._logits_baselines import TEMPERATURE, torch_token_logprobs
from rlkernel.bench._logits_inputs import (
    IGNORE_INDEX,
    LENGTH_SEED,
    LOGP_NOISE,
    Geometry,
    _randn,
    geometry,
    ragged_lengths,
)

__all__ = ["IGNORE_INDEX", "Geometry", "geometry"]


@dataclass(frozen=True)
class Kind:
    """A workload kind: the primitive (log-probs + entropy) or the DAPO-KL loss; ``frozen_weight``:
    no weight gradient; ``ragged``: the users' layout (else the dense second view)."""

    loss: bool
    frozen_weight: bool = False
    ragged: bool = False

    @property
    def n_gemms(self) -> int:
        """The LM-head GEMMs the work needs at least: the primitive's 4 (logits; their recomputation
        in backward, when autograd hands over the upstream gradients; dhidden; dweight), the fused
        loss's 3 (the gradient formed while the logits are live), 2 with a frozen weight."""
        if not self.loss:
            return 4
        return 2 if self.frozen_weight else 3


# The headline (ragged) kinds first: the run, its CSV and the README table lead with them.
KINDS: dict[str, Kind] = {
    "ragged_logprobs_entropy_fwd_bwd": Kind(loss=False, ragged=True),
    "ragged_dapo_kl_fwd_bwd": Kind(loss=True, ragged=True),
    "ragged_dapo_kl_frozen_fwd_bwd": Kind(loss=True, frozen_weight=True, ragged=True),
    "lmhead_logprobs_entropy_fwd_bwd": Kind(loss=False),
    "lmhead_dapo_kl_fwd_bwd": Kind(loss=True),
    "lmhead_dapo_kl_frozen_fwd_bwd": Kind(loss=True, frozen_weight=True),
}


def lengths(kind: Kind, geo: Geometry) -> torch.Tensor:
    """``[B]`` int64 response lengths on the CPU, the same for every input copy (see the module
    docstring): ragged U[ceil(T/4), T]; dense losses U[ceil(0.8·T), T]; dense log-probs T."""
    if kind.ragged:
        return ragged_lengths(geo.b, geo.t)
    if not kind.loss:
        return torch.full((geo.b,), geo.t, dtype=torch.int64)
    gen = torch.Generator().manual_seed(LENGTH_SEED + 1)
    return torch.randint(math.ceil(0.8 * geo.t), geo.t + 1, (geo.b,), generator=gen)


def scored_rows(kind: Kind, geo: Geometry) -> int:
    """A: the rows the LM head must project (Σ lengths)."""
    return int(lengths(kind, geo).sum())


def hidden(inp: dict[str, Any]) -> torch.Tensor:
    """The hidden states ``[B, T, H]`` as the caller passes them: ragged, the window of the base
    (a view, taken inside the timed call as a trainer takes it every step); dense, the leaf."""
    b, t, p = inp["b"], inp["t"], inp["p"]
    base = inp["base"]
    return base[:, p - 1 : -1] if inp["ragged"] else base.view(b, t, base.shape[-1])


def make_inputs(kind: Kind, geo: Geometry, h: int, v: int, device: torch.device, *, seed: int) -> dict:
    """One input set: ``base`` (ragged ``[B, P+T, H]``, dense ``[N, H]``; the caller makes it require
    grad), ``weight`` ``[V, H]``, ``ids``/``ids_ignore``/``mask`` ``[B, T]``, and per kind
    ``grad_out`` (log-probs) or ``old_logp``/``ref_logp``/``advantages`` ``[B, T]`` and
    ``adv_seq`` ``[B]`` (losses)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t, p = geo.b, geo.t, geo.p
    shape = (b, p + t, h) if kind.ragged else (b * t, h)
    base = _randn(shape, device, gen, torch.bfloat16)
    w = _randn((v, h), device, gen, torch.bfloat16, scale=2.0 / math.sqrt(h))
    ids = torch.randint(0, v, (b, t), device=device, generator=gen)
    mask = torch.arange(t, device=device)[None, :] < lengths(kind, geo).to(device)[:, None]
    inp: dict[str, Any] = {
        "base": base, "weight": w, "ids": ids, "mask": mask, "b": b, "t": t, "p": p, "ragged": kind.ragged,
        "ids_ignore": ids.masked_fill(~mask, IGNORE_INDEX),
    }  # fmt: skip
    if not kind.loss:
        inp["grad_out"] = tuple(_randn((b, t), device, gen) * mask for _ in range(2))
        return inp
    true = _true_logp(hidden(inp), w, ids)
    inp["old_logp"] = true + _randn((b, t), device, gen, scale=LOGP_NOISE)
    inp["ref_logp"] = true + _randn((b, t), device, gen, scale=LOGP_NOISE)
    inp["adv_seq"] = _randn((b,), device, gen)
    inp["advantages"] = inp["adv_seq"][:, None].expand(b, t).contiguous()
    return inp


@torch.no_grad()
def _true_logp(hid: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs of ``ids`` ``[B, T]`` under the bf16 logits ``hid @ w.T``, 1024 rows at a time."""
    flat_h, flat_ids = hid.reshape(-1, hid.shape[-1]), ids.reshape(-1)
    out = torch.empty(flat_ids.shape, device=ids.device, dtype=torch.float32)
    for s in range(0, flat_ids.numel(), 1024):
        z = flat_h[s : s + 1024] @ w.t()
        out[s : s + 1024] = torch_token_logprobs(z, flat_ids[s : s + 1024], TEMPERATURE, False)
    return out.view(ids.shape)
