"""The issue-14 loss algebra against TRL 1.16's own ``GRPOTrainer._compute_loss``: ``vespo`` (with and
without the vLLM importance-sampling ratio it folds into its sequence weight), the ratio-weighted KL
(``use_bias_correction_kl``) at the token and the sequence importance-sampling level, and what
``importance_sampling_level="sequence"`` computes (the geometric-mean sequence ratio).

``_compute_loss`` runs unchanged on a bare trainer object (``object.__new__(GRPOTrainer)``) that has
only the attributes the loss reads, and whose ``_get_per_token_logps_and_entropies`` returns our
log-prob leaf instead of running a model; it runs in eval mode (``model.training = False``: no
gradient-accumulation scaling). Loss and gradient wrt the log-probs must agree to ≤ 1e-6 (float32).
The tests skip when TRL is not installed, except under ``CI``, where they fail.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import rlkernel as rk

TRL_VERSION = "1.16.0"
TOL = dict(atol=1e-6, rtol=1e-6)
B, T = 6, 9


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; CI must run the TRL comparison")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def grpo_trainer_cls():
    if importlib.util.find_spec("trl") is None:
        _unavailable(f"TRL is not installed (pip install trl=={TRL_VERSION})")
    version = importlib.metadata.version("trl")
    if version != TRL_VERSION:
        _unavailable(f"TRL {version} is installed; these tests compare with {TRL_VERSION}")
    from trl.trainer.grpo_trainer import GRPOTrainer

    return GRPOTrainer


def make_batch(seed: int):
    """float32 logp leaf, old, ref, sampling log-probs [B, T], per-sequence advantages [B], int mask
    (row 0 full, row 1 empty)."""
    g = torch.Generator().manual_seed(seed)
    logp = -2.5 * torch.rand(B, T, generator=g) - 0.02
    old = logp + 0.1 * torch.randn(B, T, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    sampling = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(1, T, (B,), generator=g)
    lengths[0], lengths[1] = T, 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return dict(logp=logp.requires_grad_(True), old=old, ref=ref, sampling=sampling, adv=adv, mask=mask)


def trl_is_ratio(batch, mode: str, clip_max: float) -> torch.Tensor:
    """TRL's ``importance_sampling_ratio`` input, as ``_generate_and_score_completions`` builds it
    from the sampler's log-probs: token modes ``[B, T]``, sequence modes ``[B, 1]``."""
    diff = (batch["old"] - batch["sampling"]) * batch["mask"]
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(max=clip_max)
    return ratio.masked_fill(ratio > clip_max, 0.0)


def trl_loss(cls, batch, *, loss_type, level="token", beta=0.0, bias_kl=False, is_ratio=None, **args):
    """TRL's ``_compute_loss`` on a bare trainer: (loss, the trainer's logged metrics)."""
    trainer = object.__new__(cls)
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = level
    trainer.beta = beta
    trainer.epsilon_low, trainer.epsilon_high = args.pop("epsilon_low", 0.2), args.pop("epsilon_high", 0.28)
    trainer.top_entropy_quantile = 1.0
    trainer.off_policy_mask_threshold = None
    trainer.use_vllm = is_ratio is not None
    trainer.vllm_importance_sampling_correction = is_ratio is not None
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = False
    trainer.current_gradient_accumulation_steps = 1
    trainer.model = SimpleNamespace(training=False)
    trainer.accelerator = SimpleNamespace(
        num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t, sync_gradients=True
    )
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.args = SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, **args)
    entropies = torch.ones(B, T)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (batch["logp"], entropies, None)
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": batch["mask"],
        "advantages": batch["adv"],
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        "num_items_in_batch": batch["mask"].sum().float(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return trainer._compute_loss(None, inputs), trainer._metrics["eval"]


def ours(cfg, batch, **kwargs):
    return rk.policy_loss(
        batch["logp"],
        batch["old"],
        batch["adv"],
        batch["mask"],
        cfg,
        ref_logp=batch["ref"],
        rollout_logp=batch["sampling"],
        **kwargs,
    )


def assert_same(trl_value, our_value, batch):
    (g_trl,) = torch.autograd.grad(trl_value, batch["logp"])
    (g_ours,) = torch.autograd.grad(our_value, batch["logp"])
    torch.testing.assert_close(our_value, trl_value, **TOL)
    torch.testing.assert_close(g_ours, g_trl, **TOL)


VESPO_ARGS = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


@pytest.mark.parametrize("params", [VESPO_ARGS, dict(vespo_k_pos=0.5, vespo_lambda_pos=0.0, vespo_k_neg=4.0,
                                                      vespo_lambda_neg=1.2)])  # fmt: skip
def test_vespo(grpo_trainer_cls, params):
    batch = make_batch(seed=1)
    loss, metrics = trl_loss(grpo_trainer_cls, batch, loss_type="vespo", **params)
    # TRL's vespo normalizer is num_items_in_batch: token-mean over the step's tokens.
    cfg = rk.PolicyLossConfig(loss_type="vespo", aggregation="token-mean", **params)
    out = ours(cfg, batch, global_tokens=batch["mask"].sum())
    assert_same(loss, out.loss, batch)
    # φ from TRL's own get_gamma_weights, [B, 1]: our metric is its mean over the active tokens.
    # (TRL logs vespo/phi_seq_mean, the mean over all B rows, an empty row's φ = 1 included.)
    lr = (batch["logp"] - batch["old"]).detach()
    gamma = {name.removeprefix("vespo_"): value for name, value in params.items()}  # k_pos=…, lambda_pos=…
    phi = grpo_trainer_cls.get_gamma_weights(batch["adv"][:, None], lr, batch["mask"], None, **gamma)
    n = batch["mask"].sum(-1, keepdim=True)
    token_mean = (phi * n).sum() / n.sum()
    assert out.metrics["vespo_phi_mean"].item() == pytest.approx(token_mean.item(), abs=1e-6)
    assert metrics["vespo/phi_seq_mean"][0] == pytest.approx(phi.mean().item(), abs=1e-6)
    assert (phi - 1.0).abs().max() > 1e-2  # the weight is not trivially 1 (the test can fail)


@pytest.mark.parametrize(
    ("trl_mode", "ours_mode"),
    [
        ("token_truncate", "token_tis"),
        ("token_mask", "token_mis"),
        ("sequence_truncate", "seq_tis"),
        ("sequence_mask", "seq_mis"),
    ],
)
def test_vespo_folds_the_vllm_importance_ratio_into_its_sequence_weight(
    grpo_trainer_cls, trl_mode, ours_mode
):
    batch = make_batch(seed=2)
    clip_max = 1.3 if trl_mode.startswith("token") else 2.0
    ratio = trl_is_ratio(batch, trl_mode, clip_max)
    loss, _ = trl_loss(grpo_trainer_cls, batch, loss_type="vespo", is_ratio=ratio, **VESPO_ARGS)
    cfg = rk.PolicyLossConfig(
        loss_type="vespo", rollout_correction=ours_mode, rollout_clip_max=clip_max, **VESPO_ARGS
    )
    out = ours(cfg, batch, global_tokens=batch["mask"].sum())
    assert_same(loss, out.loss, batch)
    plain = ours(
        rk.PolicyLossConfig(loss_type="vespo", **VESPO_ARGS), batch, global_tokens=batch["mask"].sum()
    )
    assert not torch.allclose(plain.loss, out.loss)  # the ratio matters (the test can fail)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl(grpo_trainer_cls, level):
    """TRL ``loss_type="grpo"``, ``beta > 0``, ``use_bias_correction_kl=True``: KL · coef_1 (token
    ratio, or the sequence ratio at the sequence level), not detached."""
    batch = make_batch(seed=3)
    loss, _ = trl_loss(grpo_trainer_cls, batch, loss_type="grpo", level=level, beta=0.2, bias_kl=True)
    cfg = rk.PolicyLossConfig(
        loss_type="ppo" if level == "token" else "gspo",
        clip_low=0.2,
        clip_high=0.28,
        aggregation="seq-mean-token-mean",
        kl_coef=0.2,
        kl_estimator="k3_unclamped",
        kl_ratio_weighted=True,
    )
    # TRL's grpo mean runs over all B rows, the empty one included: global_seqs = B.
    out = ours(cfg, batch, global_seqs=B)
    assert_same(loss, out.loss, batch)
    unweighted, _ = trl_loss(grpo_trainer_cls, batch, loss_type="grpo", level=level, beta=0.2)
    plain = ours(rk.PolicyLossConfig(**{**vars(cfg), "kl_ratio_weighted": False}), batch, global_seqs=B)
    assert_same(unweighted, plain.loss, batch)
    assert not torch.allclose(plain.loss, out.loss)


def test_sequence_level_importance_sampling_is_the_geometric_mean(grpo_trainer_cls):
    """Item 4's probe of TRL: ``importance_sampling_level="sequence"`` uses exp(Σ m·lr / n)."""
    batch = make_batch(seed=4)
    loss, _ = trl_loss(grpo_trainer_cls, batch, loss_type="grpo", level="sequence")
    geo = rk.PolicyLossConfig(
        loss_type="gspo",
        clip_low=0.2,
        clip_high=0.28,
        aggregation="seq-mean-token-mean",
        seq_ratio="geo_mean",
    )
    assert_same(loss, ours(geo, batch, global_seqs=B).loss, batch)
    product = rk.PolicyLossConfig(**{**vars(geo), "seq_ratio": "product"})
    assert not torch.allclose(ours(product, batch, global_seqs=B).loss, loss.detach(), atol=1e-4)
