"""``RLKernelGRPOTrainer._compute_loss`` against TRL 1.16's own ``GRPOTrainer._compute_loss``.

One trainer per setting; TRL's method and rlkernel's run on the same model and the same micro-batch
(``trl_helpers.make_batch``: ragged completions with a full and an empty row, advantages of both
signs, old log-probs off by ~0.3 so that ratios fall on both sides of every clip, reference and
vLLM log-probs), in float32. The loss and the gradient of every model parameter agree to 1e-6, and
so do the metrics both log. Each setting runs off-policy (old log-probs given) and on-policy (TRL's
default: no old log-probs, ratio exp(logp − sg[logp]): ``fused_policy_loss(old_logp=None)``), through
``fused_policy_loss`` or, with an entropy bonus, the linear primitive + ``policy_loss``; an
accumulation window of 2 micro-batches checks the normalizers.
"""

from __future__ import annotations

import pytest
import torch

from .trl_helpers import (
    dataset,
    grpo_args,
    importance_sampling_ratio,
    length_reward,
    load_model,
    loss_and_grads,
    make_batch,
    max_grad_diff,
    require_trl,
    save_tiny_model,
    tokenizer,
)

TOL = 1e-6
# Per-token KL against a reference 0.5 nats away (test_kl_far_from_the_reference_matches_trl: 25).
KL = dict(beta=0.05, use_bias_correction_kl=False)

SETTINGS = {
    "dapo (TRL default)": dict(),
    "dapo, clip-higher, delta": dict(epsilon=0.2, epsilon_high=0.28, delta=1.5),
    "grpo": dict(loss_type="grpo"),
    "grpo + KL": dict(loss_type="grpo", **KL),
    "bnpo": dict(loss_type="bnpo", epsilon=0.1),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=8),
    "luspo (token ratio)": dict(loss_type="luspo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    "GSPO (grpo, sequence ratio)": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05),
    "GSPO + KL": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05, **KL),
    "luspo (sequence ratio)": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.05),
    "dapo, sequence ratio": dict(importance_sampling_level="sequence", epsilon=0.05),
    "bnpo, sequence ratio": dict(loss_type="bnpo", importance_sampling_level="sequence", epsilon=0.05),
    "dr_grpo, sequence ratio": dict(loss_type="dr_grpo", importance_sampling_level="sequence", epsilon=0.05),
    "dapo + entropy bonus": dict(entropy_coef=0.1),
    "grpo + entropy bonus + KL": dict(loss_type="grpo", entropy_coef=-0.05, **KL),
    "sapo + adaptive entropy": dict(
        loss_type="sapo", use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=10.0
    ),
    # use_bias_correction_kl=True (TRL's default): the k3 term times the (differentiable) ratio.
    "grpo + bias-corrected KL (TRL default)": dict(loss_type="grpo", beta=0.05),
    "dapo + bias-corrected KL, delta": dict(epsilon_high=0.28, delta=1.5, beta=0.05),
    "GSPO + bias-corrected KL": dict(
        loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05, beta=0.05
    ),
    "cispo + bias-corrected KL": dict(loss_type="cispo", epsilon_high=1.2, beta=0.05),
    "sapo + bias-corrected KL": dict(loss_type="sapo", beta=0.05),
    "vespo (TRL defaults)": dict(loss_type="vespo"),
    "vespo + bias-corrected KL, own gamma": dict(
        loss_type="vespo", vespo_k_pos=0.5, vespo_lambda_pos=0.0, vespo_k_neg=4.0, vespo_lambda_neg=1.2,
        beta=0.05,
    ),  # fmt: skip
    "vespo, sequence level, plain KL": dict(loss_type="vespo", importance_sampling_level="sequence", **KL),
    "OPSM (grpo)": dict(loss_type="grpo", off_policy_mask_threshold=0.0),
    "OPSM (GSPO) + KL": dict(
        loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05, off_policy_mask_threshold=0.02,
        beta=0.05,
    ),  # fmt: skip
    "top-entropy quantile (dapo)": dict(top_entropy_quantile=0.3),
    "top-entropy quantile + entropy bonus (grpo)": dict(
        loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.1
    ),
    "top-entropy quantile + adaptive entropy (sapo)": dict(
        loss_type="sapo", top_entropy_quantile=0.6, use_adaptive_entropy=True, entropy_coef=0.02,
        entropy_target=10.0,
    ),  # fmt: skip
    "OPSM + top-entropy quantile (vespo)": dict(
        loss_type="vespo", off_policy_mask_threshold=0.0, top_entropy_quantile=0.5
    ),
}
# TRL's vLLM importance-sampling correction (use_vllm + vllm_importance_sampling_correction).
VLLM_SETTINGS = {
    "token_truncate": dict(
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.8
    ),
    "token_mask": dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.3),
    "sequence_truncate": dict(
        vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=1.5
    ),
    "sequence_mask (TRL default), lower bound <= 0": dict(
        vllm_importance_sampling_clip_min=0.0, vllm_importance_sampling_clip_max=2.0
    ),
    "sequence_mask, both bounds, grpo + KL": dict(
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0, loss_type="grpo", **KL
    ),
    "token_mask, GSPO": dict(
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.7,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=0.05,
    ),  # fmt: skip
    "token_truncate, cispo": dict(
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1.5,
        loss_type="cispo",
        epsilon_high=1.2,
    ),  # fmt: skip
    # vespo folds TRL's importance_sampling_ratio into its sequence weight (not into the loss).
    "token_truncate, vespo": dict(
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.8,
        loss_type="vespo",
    ),  # fmt: skip
    "token_mask, vespo": dict(
        vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.3, loss_type="vespo"
    ),
    "sequence_mask, vespo + bias-corrected KL": dict(
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0, loss_type="vespo",
        beta=0.05,
    ),  # fmt: skip
    # OPSM reads vLLM's log-probs (not the old ones) when it has them.
    "sequence_truncate, OPSM (grpo)": dict(
        vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=1.5,
        loss_type="grpo", off_policy_mask_threshold=0.0,
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_trl()
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")))


def build(model_dir, tmp_path, **overrides):
    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    trainer = RLKernelGRPOTrainer(
        model=load_model(model_dir), reward_funcs=length_reward, args=grpo_args(str(tmp_path), **overrides),
        train_dataset=dataset(), processing_class=tokenizer(),
    )  # fmt: skip
    trainer.model.train()
    # Trainer's loop sets this per window; a window of 2 micro-batches checks the normalizers.
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def pretend_vllm(trainer) -> None:
    """Mark the trainer's completions as vLLM's: vLLM cannot be installed on the CPU CI, so the
    trainer is built without it and its flags are set afterwards (the plan re-read from them)."""
    from rlkernel.integrations.trl import plan_from_trl

    trainer.args.use_vllm = trainer.use_vllm = True
    trainer.rlkernel_plan = plan_from_trl(trainer.args)


def compare(trainer, batch, *, metrics: bool = True, tol: float = TOL):
    """TRL's loss, gradients and metrics next to rlkernel's on ``batch`` (loss and gradients to ``tol``)."""
    from trl import GRPOTrainer

    mode = "train" if trainer.model.training else "eval"
    # The adaptive entropy controller's state, which each call advances: both start from it.
    state = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")
    before = {name: getattr(trainer, name) for name in state}
    trainer._metrics[mode].clear()
    ref_loss, ref_grads = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    ref_metrics = {k: v[-1] for k, v in trainer._metrics[mode].items()}
    ref_state = {name: getattr(trainer, name) for name in state}
    for name, value in before.items():
        setattr(trainer, name, value)
    trainer._metrics[mode].clear()
    loss, grads = loss_and_grads(type(trainer)._compute_loss, trainer, batch)
    ours = {k: v[-1] for k, v in trainer._metrics[mode].items()}
    for name in state[:2]:  # the coefficient moved alike, from the same measured entropy
        assert getattr(trainer, name) == pytest.approx(ref_state[name], abs=TOL), name
    assert torch.isfinite(ref_loss) and ref_loss != 0
    assert (loss - ref_loss).abs().item() <= tol, (loss.item(), ref_loss.item())
    assert max(g.abs().max().item() for g in ref_grads.values()) > 1e-4  # the gradient is not trivially 0
    assert max_grad_diff(grads, ref_grads) <= tol
    if metrics:
        # cispo_clip_ratio: rlkernel counts every clamped token, TRL only those with A > 0.
        shared = (ours.keys() & ref_metrics.keys()) - {"cispo_clip_ratio"}
        for key in shared:
            assert abs(ours[key] - ref_metrics[key]) <= TOL, (key, ours[key], ref_metrics[key])
    return ours, ref_metrics


@pytest.mark.parametrize("policy", ["off-policy", "on-policy"])
@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_loss_and_gradients_match_trl(model_dir, tmp_path, setting, policy):
    trainer = build(model_dir, tmp_path, **SETTINGS[setting])
    batch = make_batch(trainer, seed=len(setting))
    if policy == "on-policy":
        del batch["old_per_token_logps"]
    if trainer.use_adaptive_entropy:
        # As if the last optimizer step measured an entropy below the target: the coefficient applies.
        trainer._last_world_entropy = 1.0
    ours, ref = compare(trainer, batch)
    # The entropy metric: the composed route (entropy bonus, or OPSM reading the batch's vLLM
    # log-probs) computes the entropy, the fused path (on- and off-policy) does not.
    plan = trainer.rlkernel_plan
    assert ("entropy" in ours) == (plan.entropy_bonus or plan.config.off_policy_mask_threshold is not None)
    if trainer.rlkernel_plan.entropy_bonus:
        assert ours["entropy_coef"] == ref["entropy_coef"]


@pytest.mark.parametrize("setting", list(VLLM_SETTINGS), ids=list(VLLM_SETTINGS))
def test_vllm_importance_sampling_matches_trl(model_dir, tmp_path, setting):
    trainer = build(model_dir, tmp_path, **VLLM_SETTINGS[setting])
    pretend_vllm(trainer)
    assert trainer.rlkernel_plan.rollout_correction
    batch = make_batch(trainer, seed=11)
    batch["importance_sampling_ratio"] = ratio = importance_sampling_ratio(batch, trainer.args)
    # The window of each case rejects or truncates some weights and keeps others.
    changed = (ratio == 0) | (ratio == trainer.args.vllm_importance_sampling_clip_max)
    if trainer.args.vllm_importance_sampling_clip_min:
        changed |= ratio == trainer.args.vllm_importance_sampling_clip_min
    assert changed.any() and not changed.all()
    # vespo folds the vLLM ratio into φ(w) = e^λ·w^k·e^{−λw}, which amplifies float32 rounding of the
    # sequence log-ratio (TRL sums log(ρ) of the float32 ρ it clamped; rlkernel folds its own): a
    # few float32 ulps of the loss.
    compare(trainer, batch, tol=4 * TOL if trainer.args.loss_type == "vespo" else TOL)


# VESPO (issue 29). φ(w) = e^λ·w^k·e^{−λw} of the sequence *sum* of log-ratios amplifies the two LM
# heads' log-prob rounding (each ~5e-7 per token off float64): on 200 random off-policy batches the
# losses differed by at most 2.3e-6 (6 of them above 1e-6; gradients at most 1.1e-6), while with the
# same head under TRL's own _compute_loss they were bitwise equal (the algebra is TRL's, operation
# order included). docs/integrations/trl.md states the bound.
VESPO_SETTINGS = [s for s in SETTINGS if s.startswith("vespo")]
VESPO_TOL = 3e-6
SAME_HEAD_TOL = 2e-7  # a couple of float32 ulps of a loss of ~1 (measured: 0, and 9e-8 of gradients)
VESPO_SEEDS = (1, 179)  # batches where the heads' losses differ by 1.3e-6 and 2.3e-6


@pytest.mark.parametrize("setting", VESPO_SETTINGS)
def test_vespo_algebra_matches_trl_on_the_same_log_probs(model_dir, tmp_path, setting):
    """TRL's own ``_compute_loss`` with rlkernel's LM head (``use_rlkernel_lm_head``) reads the log-probs
    rlkernel's loss reads: the two VESPO losses then agree to float32 rounding, on the batches where
    the two heads make them differ by more than 1e-6."""
    from rlkernel.integrations.trl import use_rlkernel_lm_head

    trainer = build(model_dir, tmp_path, **SETTINGS[setting])
    use_rlkernel_lm_head(trainer)
    for seed in VESPO_SEEDS:
        compare(trainer, make_batch(trainer, seed=seed), tol=SAME_HEAD_TOL)


def test_vespo_with_trls_head_within_the_stated_bound(model_dir, tmp_path):
    trainer = build(model_dir, tmp_path, **SETTINGS["vespo (TRL defaults)"])
    for seed in VESPO_SEEDS:
        compare(trainer, make_batch(trainer, seed=seed), tol=VESPO_TOL)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_evaluation_normalizers_match_trl(model_dir, tmp_path, loss_type):
    """In evaluation TRL neither splits nor accumulates: no GA, and dapo's divisor is the batch's
    token count per process."""
    trainer = build(model_dir, tmp_path, loss_type=loss_type, entropy_coef=0.1)
    trainer.model.eval()
    batch = make_batch(trainer, seed=3)
    compare(trainer, batch)


@pytest.mark.parametrize("setting", ["dapo (TRL default)", "GSPO + KL", "grpo + entropy bonus + KL"])
def test_tool_masked_tokens_match_trl(model_dir, tmp_path, setting):
    """Tool-output tokens (``tool_mask`` 0 inside a completion) are left out of the loss, packed away."""
    trainer = build(model_dir, tmp_path, **SETTINGS[setting])
    compare(trainer, make_batch(trainer, seed=5, tool_mask=True))


@pytest.mark.parametrize("setting", ["dapo (TRL default)", "sapo"])
def test_per_token_advantages_match_trl(model_dir, tmp_path, setting):
    """A subclass may give advantages per token ([B, T]); TRL uses them as they are."""
    trainer = build(model_dir, tmp_path, **SETTINGS[setting])
    compare(trainer, make_batch(trainer, seed=6, token_advantages=True))


def test_per_token_advantages_with_a_sequence_ratio_raise(model_dir, tmp_path):
    trainer = build(model_dir, tmp_path, **SETTINGS["GSPO (grpo, sequence ratio)"])
    batch = make_batch(trainer, seed=6, token_advantages=True)
    with pytest.raises(ValueError, match="per-token advantages"):
        trainer._compute_loss(trainer.model, batch)


def test_as_many_tokens_as_sequences(model_dir, tmp_path):
    """4 sequences with 4 completion tokens in all: packed per-sequence advantages would be read per
    token (rlkernel's rule for an [N] tensor when N equals the sequence count); they are expanded."""
    trainer = build(model_dir, tmp_path, loss_type="grpo")
    batch = make_batch(trainer, seed=7)
    batch["completion_mask"] = torch.tensor(
        [[1, 1, 0, 0, 0, 0, 0], [0] * 7, [1, 0, 0, 0, 0, 0, 0], [1] + [0] * 6]
    )
    compare(trainer, batch)


def test_logit_scale_folds_into_the_temperature(model_dir, tmp_path):
    """A config's logit scale s (e.g. Cohere's ``logit_scale``) and the sampling temperature τ:
    TRL's head scores softmax(z·s/τ); rlkernel's temperature τ/s gives the same."""
    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    model = load_model(model_dir)
    model.config.logit_scale = 0.6  # read by TRL's head and by rlkernel's, from the config
    trainer = RLKernelGRPOTrainer(
        model=model, reward_funcs=length_reward, args=grpo_args(str(tmp_path), temperature=0.7),
        train_dataset=dataset(), processing_class=tokenizer(),
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    assert trainer._rlkernel_head.temperature == pytest.approx(0.7 / 0.6)
    compare(trainer, make_batch(trainer, seed=8))


@pytest.mark.parametrize(
    "setting, policy",
    [("dapo, clip-higher, delta", "off-policy"), ("grpo + KL", "off-policy"), ("cispo", "off-policy"),
     ("dapo, clip-higher, delta", "on-policy"), ("grpo + KL", "on-policy")],
)  # fmt: skip
def test_triton_fused_path_matches_trl(
    model_dir, tmp_path, smallest_linear_chunks, monkeypatch, setting, policy
):
    """The path a GPU takes: the Triton kernels (in the CPU interpreter, 16-row chunks) fuse the loss
    into the linear chunk engine (gradient computed in the forward pass). Agreement to float32
    rounding of each gradient's scale (the chunk engine sums in another order); on-policy too
    (old_logp=None: one pass)."""
    from trl import GRPOTrainer

    import rlkernel as rk
    from rlkernel.ops import _linear_function

    calls = []
    engine = _linear_function.fused_linear_token_loss
    # seam: a spy, to check that the fused chunk engine (not the composed path) computed the loss
    monkeypatch.setattr(
        _linear_function, "fused_linear_token_loss", lambda *a, **k: calls.append(1) or engine(*a, **k)
    )
    trainer = build(model_dir, tmp_path, **SETTINGS[setting])
    batch = make_batch(trainer, seed=9)
    if policy == "on-policy":  # one fused pass with old_logp=None
        del batch["old_per_token_logps"]
    ref_loss, ref_grads = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    with rk.use_backend("triton"):
        loss, grads = loss_and_grads(type(trainer)._compute_loss, trainer, batch)
    assert calls == [1]
    assert (loss - ref_loss).abs().item() <= TOL
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).abs().max().item() <= 2 * TOL * max(1.0, grad.abs().max().item()), name


@pytest.mark.parametrize("setting", ["grpo + KL", "grpo + bias-corrected KL (TRL default)"])
def test_kl_far_from_the_reference_matches_trl(model_dir, tmp_path, setting):
    """TRL's k3 has no clamps: with the reference 2.8–4 nats above the policy on most tokens
    (k3 = e^{ref−logp} − (ref − logp) − 1 up to ~50, beyond rlkernel's clamp of k3 at 10) and 25 below
    on the others (beyond the clamp of the exponent at ±20), the mapped ``k3_unclamped`` still gives
    TRL's loss and gradients; the clamped ``k3`` would not."""
    import dataclasses

    from trl import GRPOTrainer

    trainer = build(model_dir, tmp_path, **dict(SETTINGS[setting], beta=0.01))
    assert trainer.rlkernel_plan.config.kl_estimator == "k3_unclamped"
    batch = make_batch(trainer, seed=12)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, 7)[0].float()
    drift = 2.8 + 1.2 * torch.rand(logp.shape, generator=g)
    drift[:, ::3] = -25.0
    batch["ref_per_token_logps"] = logp + drift.to(logp.device)
    ours, ref = compare(trainer, batch, metrics=False)
    # The mean KL is ~25 here: float32 rounding of it is ~2e-6, so relative (the others as usual).
    assert ours["kl"] == pytest.approx(ref["kl"], rel=1e-6) and ref["kl"] > 10
    for key in (ours.keys() & ref.keys()) - {"kl"}:
        assert abs(ours[key] - ref[key]) <= TOL, (key, ours[key], ref[key])
    # Not vacuous: rlkernel's clamped k3 gives another loss on this batch.
    clamped = dataclasses.replace(trainer.rlkernel_plan.config, kl_estimator="k3")
    trainer.rlkernel_plan = dataclasses.replace(trainer.rlkernel_plan, config=clamped)
    ref_loss, _ = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    loss, _ = loss_and_grads(type(trainer)._compute_loss, trainer, batch)
    assert (loss - ref_loss).abs().item() > 1e-2


@pytest.mark.parametrize("setting", ["dapo (TRL default)", "GSPO + KL", "grpo + entropy bonus + KL"])
@pytest.mark.parametrize("policy", ["off-policy", "on-policy"])
def test_all_masked_micro_batch_gives_zero(model_dir, tmp_path, setting, policy):
    """A micro-batch whose completions are all masked (e.g. every one truncated, with
    ``mask_truncated_completions``): loss 0 and zero gradients, as TRL's."""
    from trl import GRPOTrainer

    trainer = build(model_dir, tmp_path, **SETTINGS[setting])
    batch = make_batch(trainer, seed=10)
    batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])
    if policy == "on-policy":
        del batch["old_per_token_logps"]
    for compute_loss in (GRPOTrainer._compute_loss, type(trainer)._compute_loss):
        loss, grads = loss_and_grads(compute_loss, trainer, batch)
        assert loss.item() == 0
        assert all((g == 0).all() for g in grads.values())


@pytest.mark.parametrize(
    "setting", ["OPSM (grpo)", "top-entropy quantile (dapo)", "vespo + bias-corrected KL, own gamma"]
)
def test_new_settings_change_the_loss(model_dir, tmp_path, setting):
    """The comparisons above could pass with a mask that drops nothing or a field that is ignored:
    TRL's and rlkernel's loss with the setting differ from both without it (off-policy batch)."""
    from trl import GRPOTrainer

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    overrides = SETTINGS[setting]
    trainer = build(model_dir, tmp_path, **overrides)
    batch = make_batch(trainer, seed=len(setting))
    plain = dict(overrides, off_policy_mask_threshold=None, top_entropy_quantile=1.0)
    if overrides.get("loss_type") == "vespo":
        plain = dict(loss_type="vespo", beta=0.05)  # TRL's gamma defaults
    baseline = build(model_dir, tmp_path, **plain)
    for compute_loss in (GRPOTrainer._compute_loss, RLKernelGRPOTrainer._compute_loss):
        loss, _ = loss_and_grads(compute_loss, trainer, batch)
        base, _ = loss_and_grads(compute_loss, baseline, batch)
        assert (loss - base).abs().item() > 1e-3, (loss.item(), base.item())

