"""Token selection by covariance for ``clip_cov`` and ``kl_cov`` (Cui et al., "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", 2025), exactly as verl 0.9.1 selects.

Both losses look at the covariance of each active token's advantage and log-prob with the batch's
(the call's) means, over the active tokens of the whole ``[S, L]`` batch:

    cov_t = (A_t − mean_m A) · (logp_t − mean_m logp)            (logp detached)

* ``clip_cov``: the candidates are the active tokens with lb < cov_t < ub whose PPO branch is not
  already the clipped one; k = max(⌊ratio·Σm⌋, 1) of them, drawn uniformly at random without
  replacement, lose their gradient (their loss is multiplied by 0).
* ``kl_cov``: the k = max(⌊ratio·Σm⌋, 1) active tokens with the largest cov_t get the |lr| penalty.

The draws reproduce verl's: the candidates in row-major ``[S, L]`` order (the order of
``torch.nonzero``; for packed input, the order of the packed stream), then one
``torch.randperm(n_candidates)`` from torch's *default CPU generator* (whatever the device), the
first k of the permutation kept. With the same ``torch.manual_seed`` a verl call and an rlkernel
call select the same tokens. No draw happens when there is no candidate. The top-k of ``kl_cov``
runs on the CPU, on the active tokens in the same order, as verl's does (same ties).

Caveats:
    * Both read counts and selections on the host (``Σm``, ``nonzero``, the top-k on the CPU):
      a device sync per call, as in verl. Neither takes the fused token-level path.
    * verl's masked mean divides by Σm + 1e-8; in float32 that ε vanishes for Σm ≥ 1, so the means
      here are the plain masked means (float64 inputs could differ from verl's float64 selection only
      for a covariance within ~1e-16 relative of lb or ub).
    * NaN in an active token's advantage or log-prob makes that token's covariance NaN: it is never
      selected (comparisons with NaN are false; the top-k ranks NaN first in PyTorch, like verl).
"""

from __future__ import annotations

import torch

from rlkernel.rl.aggregate import masked, masked_mean


def covariance(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[S, L]``: (A − mean_m A)·(logp − mean_m logp) with detached ``logp``; 0 at masked positions."""
    logp = logp.detach()
    return masked((adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask)), mask)


def _count(mask: torch.Tensor, ratio: float) -> int:
    """k = max(⌊ratio · Σm⌋, 1), the number of tokens a selection may take (host sync)."""
    return max(int(ratio * int(mask.sum())), 1)


@torch.no_grad()
def clip_cov_selection(
    cov: torch.Tensor, candidates: torch.Tensor, mask: torch.Tensor, ratio: float, lb: float, ub: float
) -> torch.Tensor:
    """bool ``[S, L]``: the tokens whose gradient ``clip_cov`` cuts.

    Args:
        cov: ``[S, L]`` from :func:`covariance`.
        candidates: bool ``[S, L]``: active tokens that may be cut (not already PPO-clipped).
        mask: bool ``[S, L]`` active tokens (for the count k).
        ratio, lb, ub: ``cfg.clip_cov_ratio``, ``cfg.clip_cov_lb``, ``cfg.clip_cov_ub``.
    """
    pool = (candidates & (cov > lb) & (cov < ub)).reshape(-1).nonzero().squeeze(1)
    chosen = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if pool.numel() > 0:
        # verl: torch.randperm(len(idx)) on the default CPU generator, then the first k.
        perm = torch.randperm(pool.numel())[: _count(mask, ratio)]
        chosen[pool[perm.to(pool.device)]] = True
    return chosen.reshape(mask.shape)


@torch.no_grad()
def kl_cov_selection(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """bool ``[S, L]``: the ``kl_cov`` tokens, the k active ones with the largest covariance.

    Args:
        adv, logp: ``[S, L]`` float (``logp`` is read detached).
        mask: bool ``[S, L]`` active tokens.
        ratio: ``cfg.kl_cov_ratio``.
    """
    flat_mask = mask.reshape(-1)
    active = flat_mask.nonzero().squeeze(1)
    chosen = torch.zeros_like(flat_mask)
    if active.numel() > 0:
        # As verl: the active tokens' values on the CPU, plain means, torch.topk (same ties).
        a = adv.detach().reshape(-1)[active].cpu()
        lp = logp.detach().reshape(-1)[active].cpu()
        cov = (a - a.mean()) * (lp - lp.mean())
        top = torch.topk(cov, _count(mask, ratio), largest=True).indices
        chosen[active[top.to(active.device)]] = True
    return chosen.reshape(mask.shape)


@torch.no_grad()
def clip_cov_cut(
    adv: torch.Tensor,
    logp: torch.Tensor,
    mask: torch.Tensor,
    candidates: torch.Tensor,
    ratio: float,
    lb: float,
    ub: float,
    cp=None,
) -> torch.Tensor:
    """bool ``[S, L]``: ``clip_cov``'s cut (:func:`covariance` then :func:`clip_cov_selection`).

    With ``cp`` (context parallelism: the tensors are this rank's slice of every sequence) the
    selection is the unsplit batch's: every rank's values are gathered into the unsplit ``[S, L]``
    layout (``ContextParallel.to_global``: the same values in the same order, so the same means,
    candidates and draw), the draw of group rank 0 is broadcast (each rank draws too, advancing its
    generator as the unsplit call would), and each rank keeps its own positions.
    """
    if cp is None:
        cov = covariance(adv, logp, mask)
        return clip_cov_selection(cov, candidates, mask, ratio, lb, ub)
    adv_g, logp_g = cp.to_global(adv.detach()), cp.to_global(logp.detach())
    mask_g, candidates_g = cp.to_global(mask, False), cp.to_global(candidates, False)
    cut = clip_cov_selection(covariance(adv_g, logp_g, mask_g), candidates_g, mask_g, ratio, lb, ub)
    return cp.to_local(cp.broadcast(cut), False)


@torch.no_grad()
def kl_cov_chosen(
    adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, ratio: float, cp=None
) -> torch.Tensor:
    """bool ``[S, L]``: :func:`kl_cov_selection`; with ``cp`` over the unsplit batch (its values
    gathered as in :func:`clip_cov_cut`; the selection is deterministic, so every rank makes the
    same one), each rank keeping its own positions."""
    if cp is None:
        return kl_cov_selection(adv, logp, mask, ratio)
    gathered = kl_cov_selection(
        cp.to_global(adv.detach()), cp.to_global(logp.detach()), cp.to_global(mask, False), ratio
    )
    return cp.to_local(gathered, False)
