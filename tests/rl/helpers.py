"""Random batches, packing, and the call/compare glue shared by the tests of ``rlkernel.rl``."""

from __future__ import annotations

import torch

import rlkernel as rk

from . import formulas

# float64 library vs float64 oracle (summation order differs) and float32 library vs the oracle.
TOLERANCES = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 2e-5)}

# One config per loss type, with bounds that random inputs cross on both sides (so the clipped and the
# unclipped branches both occur), plus the PPO extras.
LOSS_CONFIGS = {
    "ppo": dict(loss_type="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "ppo_delta": dict(loss_type="ppo", clip_low=0.2, clip_high=0.28, delta=1.5),
    "gspo": dict(loss_type="gspo", clip_low=0.1, clip_high=0.12),
    "gspo_token": dict(loss_type="gspo_token", clip_low=0.1, clip_high=0.12),
    "cispo": dict(loss_type="cispo", clip_low=None, clip_high=0.3),
    "cispo_low": dict(loss_type="cispo", clip_low=0.2, clip_high=0.3),
    "sapo": dict(loss_type="sapo", sapo_tau_pos=1.3, sapo_tau_neg=0.8),
    "gmpo": dict(loss_type="gmpo", clip_low=0.2, clip_high=0.3),
    "reinforce": dict(loss_type="reinforce"),
}
LOSS_TYPES = ("ppo", "gspo", "gspo_token", "cispo", "sapo", "gmpo", "reinforce")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
TENSOR_NAMES = ("logp", "old_logp", "ref_logp", "rollout_logp", "entropy")


def config(name: str, **overrides) -> rk.PolicyLossConfig:
    return rk.PolicyLossConfig(**{**LOSS_CONFIGS[name], **overrides})


def make_batch(batch=4, width=6, seed=0, *, per_token_adv=False, dtype=torch.float64, empty_row=True):
    """A padded batch: log-probs < 0, drifted old/ref/rollout log-probs, a random mask with row 1
    (when there is one) fully masked and row 0 with at least one active token."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    logp = -torch.rand(batch, width, generator=g, dtype=torch.float64) * 3 - 0.05
    mask = torch.rand(batch, width, generator=g) > 0.35
    mask[0, 0] = True
    if empty_row and batch > 1:
        mask[1] = False
    old_logp = logp + 0.35 * randn(batch, width)
    out = {
        "logp": logp,
        "old_logp": old_logp,
        "ref_logp": logp + 0.5 * randn(batch, width),
        "rollout_logp": old_logp + 0.3 * randn(batch, width),
        "entropy": torch.rand(batch, width, generator=g, dtype=torch.float64) * 2 + 0.1,
        "advantages": randn(batch, width) if per_token_adv else randn(batch),
        "mask": mask,
    }
    out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}
    return with_leaves(out)


def with_leaves(batch):
    """Fresh leaves requiring grad for the differentiable inputs (logp, entropy)."""
    out = dict(batch)
    for name in ("logp", "entropy"):
        out[name] = batch[name].detach().clone().requires_grad_(True)
    return out


def add_garbage(batch):
    """NaN/±inf at every masked position of every float input (per-token advantages included)."""
    out = dict(batch)
    off = batch["mask"] == 0
    for name, value in zip(
        TENSOR_NAMES, (float("nan"), float("inf"), float("nan"), -float("inf"), float("nan")), strict=True
    ):
        out[name] = batch[name].detach().masked_fill(off, value)
    if batch["advantages"].shape == off.shape:
        out["advantages"] = batch["advantages"].masked_fill(off, float("nan"))
    return with_leaves(out)


def pack(batch, lengths):
    """(packed batch, cu_seqlens, padded batch): row i's first lengths[i] positions, packed; the padded
    twin masks everything past each length and keeps NaN garbage there."""
    lengths = [int(n) for n in lengths]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    packed, padded = {}, dict(batch)
    for name, x in batch.items():
        if x.dim() == 1:
            packed[name] = x.detach().clone()
            continue
        packed[name] = torch.cat([x.detach()[i, :n] for i, n in enumerate(lengths)])
    beyond = torch.arange(batch["mask"].shape[1])[None, :] >= torch.tensor(lengths)[:, None]
    padded["mask"] = batch["mask"] & ~beyond
    for name in TENSOR_NAMES:
        padded[name] = batch[name].detach().masked_fill(beyond, float("nan"))
    return with_leaves(packed), cu, with_leaves(padded)


def run(cfg, batch, **kwargs) -> rk.PolicyLossOutput:
    return rk.policy_loss(
        batch["logp"],
        batch["old_logp"],
        batch["advantages"],
        batch["mask"],
        cfg,
        ref_logp=batch["ref_logp"],
        rollout_logp=batch["rollout_logp"],
        entropy=batch["entropy"],
        **kwargs,
    )


def oracle(cfg, batch, cu_seqlens=None, **kwargs) -> torch.Tensor:
    """The float64 formula on the same leaves (cast), so autograd gives its gradient too."""
    tensors = {
        "logp": batch["logp"].double(),
        "old": batch["old_logp"].double(),
        "adv": batch["advantages"].double(),
        "ref": batch["ref_logp"].double(),
        "rollout": batch["rollout_logp"].double(),
        "entropy": batch["entropy"].double(),
    }
    if cu_seqlens is None:
        seqs = formulas.sequences_from_padded(batch["mask"], **tensors)
        width = batch["mask"].shape[1]
    else:
        seqs = formulas.sequences_from_packed(cu_seqlens, batch["mask"], **tensors)
        cu = [int(c) for c in cu_seqlens]
        width = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)
    return formulas.policy_loss(cfg, seqs, width, **kwargs)


def grads(loss, batch):
    """Gradients of ``loss`` wrt (logp, entropy), zeros where a leaf is unused."""
    leaves = [batch["logp"], batch["entropy"]]
    got = torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves, strict=True)]


def assert_close(actual, expected, dtype=torch.float64):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)
