"""Bad input to ``rlkernel.integrations.verl``: the registered ``rk_<mode>`` losses refuse bad tensors,
settings and ``global_batch_info`` entries (``TypeError`` / ``ValueError`` naming verl's argument or
setting) before any arithmetic; the fused forward and its installer refuse what they cannot run.
Needs verl (fixture ``verl``): the module registers in verl's registry when imported."""

from __future__ import annotations

import pytest
import torch
import transformers

# Strings, not the functions: importing the integration imports verl (the walker of
# tests/test_public_api_bad_input.py imports it the way the fixture does).
COVERED = [
    "rlkernel.integrations.verl.forward:install_fused_forward",
    "rlkernel.integrations.verl.forward:forward_with_rlkernel_backend",
]

B, T = 3, 5


POLICY = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


def config(verl, info=None, dro_beta=0.1, **settings):
    base = dict(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05
    )
    policy = {k: settings.pop(k) for k in POLICY if k in settings}  # verl's PolicyLossConfig fields
    return verl.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        global_batch_info=dict(info or {}),
        policy_loss=verl.PolicyLossConfig(dro_beta=dro_beta, **policy),
        **{**base, **settings},
    )


def good():
    g = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(B, T, generator=g)
    return dict(
        old_log_prob=log_prob + 0.1 * torch.randn(B, T, generator=g),
        log_prob=log_prob,
        advantages=torch.randn(B, T, generator=g),
        response_mask=torch.rand(B, T, generator=g) > 0.3,
        loss_agg_mode="token-mean",
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(log_prob=[[0.0]]), TypeError, "log_prob"),
        (dict(log_prob=torch.zeros(B, T, dtype=torch.int64)), TypeError, "log_prob"),
        (dict(log_prob=torch.zeros(B * T)), ValueError, "log_prob"),
        (dict(old_log_prob=torch.zeros(B, T + 1)), ValueError, "old_log_prob"),
        (dict(advantages=torch.zeros(B)), ValueError, "advantages"),
        (dict(advantages=torch.zeros(B, T, dtype=torch.int32)), TypeError, "advantages"),
        (dict(response_mask=torch.full((B, T), 0.5)), ValueError, "response_mask"),
        (dict(response_mask=torch.ones(B, T - 1, dtype=torch.bool)), ValueError, "response_mask"),
        (dict(response_mask="all"), TypeError, "response_mask"),
        (dict(loss_agg_mode="mean"), ValueError, "loss_agg_mode"),
        (dict(rollout_is_weights=torch.ones(B, T - 1)), ValueError, "rollout_is_weights"),
        (dict(rollout_is_weights=torch.ones(B, T, dtype=torch.int64)), TypeError, "rollout_is_weights"),
        (dict(rollout_is_weights=[[1.0] * T] * B), TypeError, "rollout_is_weights"),
    ],
)
@pytest.mark.parametrize("mode", ["rk_vanilla", "rk_gspo", "rk_geo_mean", "rk_clip_cov", "rk_dppo_kl"])
def test_loss_refuses_bad_tensors(verl, mode, change, error, match):
    fn = verl.core_algos.get_policy_loss_fn(mode)
    with pytest.raises(error, match=match):
        fn(**{**good(), **change}, config=config(verl))


@pytest.mark.parametrize(
    "mode, settings, info, error, match",
    [
        ("rk_vanilla", dict(clip_ratio_c=1.0), None, ValueError, "clip_ratio_c"),
        ("rk_vanilla", dict(clip_ratio_low=-0.1), None, ValueError, "clip_ratio_low"),
        ("rk_vanilla", dict(clip_ratio_high="0.2"), None, TypeError, "clip_ratio_high"),
        ("rk_vanilla", dict(clip_ratio_high=[0.2]), None, TypeError, "clip_ratio_high"),
        ("rk_cispo", dict(clip_ratio_high=float("nan")), None, ValueError, "clip_ratio_high"),
        ("rk_sapo", dict(tau_pos=0.0), None, ValueError, "tau_pos"),
        ("rk_sapo", dict(tau_neg=None), None, TypeError, "tau_neg"),
        ("rk_vanilla", {}, dict(dp_size=0), ValueError, "dp_size"),
        ("rk_vanilla", {}, dict(dp_size="2"), TypeError, "dp_size"),
        ("rk_vanilla", {}, dict(batch_num_tokens=-1), ValueError, "batch_num_tokens"),
        ("rk_vanilla", {}, dict(batch_num_tokens=torch.ones(2)), ValueError, "batch_num_tokens"),
        ("rk_vanilla", {}, dict(global_batch_size=float("inf")), ValueError, "global_batch_size"),
        ("rk_vanilla", {}, dict(loss_scale_factor=2.5), TypeError, "loss_scale_factor"),
        ("rk_vanilla", {}, dict(loss_scale_factor=0), ValueError, "loss_scale_factor"),
        ("rk_vanilla", {}, dict(num_tokens=10), ValueError, "num_tokens"),
        ("rk_vanilla", {}, dict(dp_size=2), ValueError, "batch_num_tokens"),
        ("rk_dro", dict(dro_beta=None), None, TypeError, "dro_beta"),
        ("rk_dro", dict(dro_beta=0.0), None, ValueError, "dro_beta"),
        ("rk_dro", dict(dro_beta=-1.0), None, ValueError, "dro_beta"),
        ("rk_dppo_tv", dict(clip_ratio_c=0.0), None, ValueError, "clip_ratio_c"),
        ("rk_dppo_kl", dict(clip_ratio_low=-0.01), None, ValueError, "clip_ratio_low"),
        ("rk_clip_cov", dict(clip_cov_ratio=0.0), None, ValueError, "clip_cov_ratio"),
        ("rk_clip_cov", dict(clip_cov_ratio=1.5), None, ValueError, "clip_cov_ratio"),
        ("rk_clip_cov", dict(clip_cov_lb=2.0, clip_cov_ub=1.0), None, ValueError, "clip_cov_lb"),
        ("rk_kl_cov", dict(kl_cov_ratio=-0.1), None, ValueError, "kl_cov_ratio"),
        ("rk_kl_cov", dict(ppo_kl_coef=-1.0), None, ValueError, "ppo_kl_coef"),
        ("rk_kl_cov", dict(ppo_kl_coef="0.1"), None, TypeError, "ppo_kl_coef"),
    ],
)
def test_loss_refuses_bad_settings(verl, mode, settings, info, error, match):
    fn = verl.core_algos.get_policy_loss_fn(mode)
    with pytest.raises(error, match=match):
        fn(**good(), config=config(verl, info, **settings))


def test_loss_needs_a_config(verl):
    with pytest.raises(ValueError, match="config is required"):
        verl.core_algos.get_policy_loss_fn("rk_gpg")(**good())


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=29, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_install_refuses_what_it_cannot_patch(verl):
    install = verl.integration.install_fused_forward
    with pytest.raises(TypeError, match="model"):
        install("Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="lm_head"):
        install(tiny_llama().model)  # the decoder alone: no head
    vlm = tiny_llama()
    vlm.config.model_type = "qwen2_5_vl"
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        install(vlm)
    assert "forward" not in vars(vlm)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(return_dict=False), ValueError, "return_dict"),
        (dict(input_ids=None), ValueError, "input_ids, labels or shift_labels"),
        (dict(shift_labels=torch.full((1, 4), 29)), ValueError, "token_ids"),  # the next tokens
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=torch.ones(1)), TypeError, "temperature"),
    ],
)
def test_forward_refuses_bad_input(verl, kwargs, error, match):
    model = tiny_llama()
    base = dict(input_ids=torch.zeros(1, 4, dtype=torch.long), return_dict=True, temperature=1.0)
    with pytest.raises(error, match=match):
        verl.integration.forward_with_rlkernel_backend(model, **{**base, **kwargs})
