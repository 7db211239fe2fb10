"""rlkernel's drop-in for OpenRLHF's PolicyLoss, next to OpenRLHF's own, on one random batch (CPU, seconds).

    pip install --no-deps openrlhf==0.11.2      # the tested version (make setup-dev does this)
    PYTHONPATH=src python examples/openrlhf_policy_loss.py

In OpenRLHF the swap is one import, where ``ActorPPOTrainer`` builds its loss
(``openrlhf/trainer/ray/ppo_actor.py``):

    from rlkernel.integrations.openrlhf import PolicyLoss   # instead of openrlhf.models's

Without OpenRLHF installed the script prints rlkernel's side only.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import torch

from rlkernel.integrations.openrlhf import PolicyLoss


def openrlhf_policy_loss() -> type | None:
    """OpenRLHF's own PolicyLoss class, or None when OpenRLHF is not installed.

    ``openrlhf.models``' __init__ imports the actor and the model factory (transformers, peft,
    flash_attn, deepspeed), and ``openrlhf/models/utils.py`` imports deepspeed for a ZeRO-3 helper;
    the loss uses none of them. Load ``models/loss.py`` from the installed files behind an empty
    ``openrlhf.models`` package (and an empty ``deepspeed`` where it is not installed), so this runs
    on a CPU machine with the wheel alone.
    """
    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        return None
    if importlib.util.find_spec("deepspeed") is None:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    package = types.ModuleType("openrlhf.models")
    package.__path__ = [os.path.join(next(iter(spec.submodule_search_locations)), "models")]
    sys.modules["openrlhf.models"] = package
    return importlib.import_module("openrlhf.models.loss").PolicyLoss


def batch(seed: int = 0, B: int = 8, T: int = 32):
    """Ragged response masks, per-token advantages (GAE-like), policy drift and rollout mismatch."""
    g = torch.Generator().manual_seed(seed)
    log_probs = -3 * torch.rand(B, T, generator=g)
    old = log_probs + 0.3 * torch.randn(B, T, generator=g)
    rollout = old + 0.3 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return log_probs, old, advantages, mask, rollout


SETTINGS = {
    "PPO (defaults)": dict(),
    "DAPO-style: clip-higher, dual clip, TIS": dict(
        clip_eps_high=0.28, dual_clip=3.0, is_correction_level="token", is_correction_mode="clip"
    ),
    "GRPO-style per-sample mean, ICEPOP mask": dict(
        token_level_loss=False, is_correction_level="token", is_correction_threshold=(0.5, 2.0)
    ),
    "GSPO": dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4),
}


def main() -> None:
    reference = openrlhf_policy_loss()
    if reference is None:
        print("OpenRLHF is not installed: rlkernel's side only (pip install --no-deps openrlhf==0.11.2)")
    log_probs, old, advantages, mask, rollout = batch()
    # OpenRLHF's actor passes the step's global counts; one micro-batch of one rank here.
    step = dict(dp_size=1, batch_num_tokens=mask.sum().float(), global_batch_size=torch.tensor(8.0))
    for name, settings in SETTINGS.items():
        results = []
        for cls in (PolicyLoss, reference) if reference is not None else (PolicyLoss,):
            x = log_probs.clone().requires_grad_(True)
            loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = cls(**settings)(
                x, old, advantages, mask, rollout, **step
            )
            loss.backward()
            results.append((loss.detach(), x.grad, clip_ratio))
        (loss, grad, clip_ratio) = results[0]
        line = f"{name:42s} loss {loss.item():+.8f}  clip_ratio {clip_ratio.item():.4f}"
        if len(results) == 2:
            ref_loss, ref_grad, _ = results[1]
            line += (
                f"  | OpenRLHF {ref_loss.item():+.8f}  |Δloss| {(loss - ref_loss).abs().item():.1e}"
                f"  max|Δgrad| {(grad - ref_grad).abs().max().item():.1e}"
                f"  bitwise {torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)}"
            )
        print(line)


if __name__ == "__main__":
    main()
