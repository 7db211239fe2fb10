"""Bad input to ``rlkernel.integrations.trl``: a ``GRPOConfig`` setting rlkernel cannot reproduce raises
``ValueError`` naming it (in ``policy_config_from_trl`` / ``plan_from_trl`` and in
``RLKernelGRPOTrainer``'s constructor, before TRL builds anything), wrong types raise ``TypeError``,
another TRL release raises ``RuntimeError``; ``add_rlkernel_lm_head`` refuses outputs, models and
arguments it cannot serve. Needs TRL 1.16 (skips without it; fails under ``CI``)."""

from __future__ import annotations

import pytest
import torch

from .trl_helpers import (
    dataset,
    grpo_args,
    length_reward,
    load_model,
    require_trl,
    save_tiny_model,
    tokenizer,
)

# The callables' keys (module:qualname); strings, so that collecting this module imports no TRL.
COVERED = [
    "rlkernel.integrations.trl.trainer:RLKernelGRPOTrainer",
    "rlkernel.integrations.trl.config:policy_config_from_trl",
    "rlkernel.integrations.trl.config:plan_from_trl",
    "rlkernel.integrations.trl.head:add_rlkernel_lm_head",
    "rlkernel.integrations.trl.head:use_rlkernel_lm_head",
    "rlkernel.integrations.trl.sampler:SamplerLogprobs",
    "rlkernel.integrations.trl.sampler:sampling_metrics",
]


@pytest.fixture(scope="module")
def args_for(tmp_path_factory):
    require_trl()
    out = str(tmp_path_factory.mktemp("out"))
    return lambda **overrides: grpo_args(out, **overrides)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_trl()
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")))


# (GRPOConfig overrides, a pattern the error names)
UNSUPPORTED = [
    # no rlkernel equivalent
    (
        dict(loss_type="vespo", importance_sampling_level="sequence", beta=0.04),
        "vespo.*sequence.*use_bias_correction_kl",
    ),
    (dict(loss_type="cispo", importance_sampling_level="sequence"), "cispo.*sequence"),
    (dict(loss_type="sapo", importance_sampling_level="sequence"), "sapo.*sequence"),
    (dict(delta=1.5, importance_sampling_level="sequence"), "delta.*sequence"),
    (dict(delta=0.9), "delta"),
    (dict(loss_type="cispo", epsilon_high=0.5), "epsilon_high"),
    (dict(loss_type="dr_grpo", max_completion_length=None), "max_completion_length"),
    (dict(use_vllm=True, vllm_importance_sampling_clip_max=None), "vllm_importance_sampling_clip"),
    # values TRL would take and fail on later, or that are not numbers of the right range
    (dict(loss_type="ppo"), "loss_type"),
    (dict(importance_sampling_level="batch"), "importance_sampling_level"),
    (dict(beta=-0.1), "beta"),
    (dict(epsilon=-0.1), "epsilon"),
    (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg"),
    (dict(use_vllm=True, vllm_importance_sampling_mode="token"), "vllm_importance_sampling_mode"),
    (dict(top_entropy_quantile=float("nan")), "top_entropy_quantile"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
    (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold"),
    (dict(off_policy_mask_threshold=float("inf")), "off_policy_mask_threshold"),
    (dict(loss_type="vespo", vespo_k_pos=-1.0), "vespo_k_pos"),
    (dict(loss_type="vespo", vespo_lambda_neg=float("nan")), "vespo_lambda_neg"),
]


@pytest.mark.parametrize("overrides, match", UNSUPPORTED, ids=[str(u[0]) for u in UNSUPPORTED])
def test_unsupported_settings_raise_at_construction(args_for, tmp_path, overrides, match):
    from rlkernel.integrations.trl import RLKernelGRPOTrainer, plan_from_trl, policy_config_from_trl

    args = args_for(**overrides)
    for mapping in (policy_config_from_trl, plan_from_trl):
        with pytest.raises(ValueError, match=match):
            mapping(args)
    # Before TRL builds anything: the model path is never read.
    with pytest.raises(ValueError, match=match):
        RLKernelGRPOTrainer(model=str(tmp_path / "not-a-model"), reward_funcs=length_reward, args=args)


@pytest.mark.parametrize(
    "field, value",
    [("epsilon", "0.2"), ("beta", None), ("delta", "1.5"), ("top_entropy_quantile", True),
     ("off_policy_mask_threshold", "0.5")],
)  # fmt: skip
def test_wrong_types_raise(args_for, field, value):
    from rlkernel.integrations.trl import plan_from_trl, policy_config_from_trl

    args = args_for()
    setattr(args, field, value)
    for mapping in (policy_config_from_trl, plan_from_trl):
        with pytest.raises(TypeError, match=field):
            mapping(args)


def test_not_a_grpo_config_raises():
    from rlkernel.integrations.trl import policy_config_from_trl

    require_trl()
    with pytest.raises(TypeError, match="GRPOConfig.*loss_type"):
        policy_config_from_trl(object())


def test_unsupported_models_raise_at_construction(tmp_path_factory, args_for):
    """A softcapped LM head is known only once TRL has the model; still at construction."""
    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    model = load_model(save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3"))))
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="softcap"):
        RLKernelGRPOTrainer(
            model=model, reward_funcs=length_reward, args=args_for(), train_dataset=dataset(),
            processing_class=tokenizer(),
        )  # fmt: skip




@pytest.mark.parametrize("version", ["1.16.0", "1.16.2", "1.16.10", None])
def test_supported_versions(version):
    from rlkernel.integrations.trl.config import check_version

    check_version(version)


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "2.0.0", "1.160.0", "0.16.0"])
def test_other_versions_raise(version):
    from rlkernel.integrations.trl.config import check_version

    with pytest.raises(RuntimeError, match=r"TRL 1\.16\.x .*installed trl is " + version.replace(".", r"\.")):
        check_version(version)


def test_the_installed_version_is_checked_at_every_entry_point(args_for, monkeypatch):
    from rlkernel.integrations.trl import (
        RLKernelGRPOTrainer,
        add_rlkernel_lm_head,
        config,
        plan_from_trl,
        policy_config_from_trl,
    )

    args = args_for()
    monkeypatch.setattr(config, "installed_version", lambda: "1.17.0")  # seam: another installed TRL
    for call in (
        lambda: policy_config_from_trl(args),
        lambda: plan_from_trl(args),
        lambda: add_rlkernel_lm_head(torch.nn.Linear(2, 2)),
        lambda: RLKernelGRPOTrainer(model="unused", args=args),
    ):
        with pytest.raises(RuntimeError, match="1.17.0"):
            call()


@pytest.mark.parametrize(
    "head_args, error, match",
    [
        (dict(outputs=("log_probs", "is_top1")), ValueError, "is_top1"),
        (dict(outputs=("log_probs", "logits")), ValueError, "logits"),
        (dict(outputs="log_probs"), TypeError, "outputs"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(cast_lm_head_to_fp32=1), TypeError, "cast_lm_head_to_fp32"),
    ],
)
def test_bad_arguments_raise(model_dir, head_args, error, match):
    from rlkernel.integrations.trl import add_rlkernel_lm_head

    with pytest.raises(error, match=match):
        add_rlkernel_lm_head(load_model(model_dir), **head_args)


@pytest.mark.parametrize(
    "config_change, match",
    [
        (dict(final_logit_softcapping=30.0), "softcap"),
        (dict(output_router_logits=True), "router"),
        (dict(logit_scale=0.0), "logit scale"),
        (dict(logit_scale=-2.0), "logit scale"),
        # Granite divides by logits_scaling: 0 raised ZeroDivisionError (issue 29)
        (dict(logits_scaling=0), r"config.logits_scaling must be a finite number > 0, got 0"),
        (dict(logits_scaling=-1.5), "config.logits_scaling must be a finite number > 0"),
    ],
)
def test_unsupported_models_raise(model_dir, config_change, match):
    from rlkernel.integrations.trl import add_rlkernel_lm_head

    model = load_model(model_dir)
    for name, value in config_change.items():
        setattr(model.config, name, value)
    with pytest.raises(ValueError, match=match):
        add_rlkernel_lm_head(model)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        add_rlkernel_lm_head(torch.nn.Linear(2, 2))


def test_use_rlkernel_lm_head_needs_a_grpo_trainer(model_dir):
    from rlkernel.integrations.trl import use_rlkernel_lm_head

    with pytest.raises(TypeError, match="GRPOTrainer"):
        use_rlkernel_lm_head(load_model(model_dir))


def test_moe_load_balancing_loss_raises_at_construction(tmp_path, args_for):
    """A Mixture-of-Experts model whose config weights a router loss (Qwen3-MoE: 0.001)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    tok = tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=2,
        num_experts_per_tok=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    assert config.router_aux_loss_coef > 0
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        RLKernelGRPOTrainer(
            model=Qwen3MoeForCausalLM(config), reward_funcs=length_reward, args=args_for(),
            train_dataset=dataset(), processing_class=tok,
        )  # fmt: skip


def test_the_trainer_shows_trls_signature():
    import inspect

    require_trl()
    from trl import GRPOTrainer

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    ours, theirs = inspect.signature(RLKernelGRPOTrainer), inspect.signature(GRPOTrainer)
    # TRL's parameters, then the one keyword of its own (true on-policy, off by default).
    assert list(ours.parameters.values())[:-1] == list(theirs.parameters.values())
    extra = list(ours.parameters.values())[-1]
    keyword = inspect.Parameter.KEYWORD_ONLY
    assert (extra.name, extra.kind, extra.default) == ("true_on_policy", keyword, False)


def test_sampler_logprobs_bad_input():
    """``SamplerLogprobs`` takes a module and a positive temperature, and records once at a time."""
    from rlkernel.integrations.trl.sampler import SamplerLogprobs

    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        SamplerLogprobs("model", temperature=1.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be a number > 0"):
            SamplerLogprobs(torch.nn.Linear(2, 2), temperature=bad)
    recorder = SamplerLogprobs(torch.nn.Linear(2, 2), temperature=1.0)
    with recorder, pytest.raises(RuntimeError, match="already recording"):
        recorder.__enter__()


def test_sampling_metrics_bad_input():
    from rlkernel.integrations.trl.sampler import sampling_metrics

    a, b = torch.randn(2, 3), torch.randn(2, 3)
    with pytest.raises(ValueError, match="must have the same shape"):
        sampling_metrics(a, b[:, :2])
    with pytest.raises(ValueError, match="mask"):
        sampling_metrics(a, b, torch.ones(3, 2, dtype=torch.bool))
