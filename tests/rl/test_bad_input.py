"""Bad input to every public function of rlkernel.rl: a TypeError/ValueError that names the argument."""

import pytest
import torch

import rlkernel as rk

# The public functions (and classes) whose bad-input cases live in this module.
COVERED = [
    rk.policy_loss,
    rk.fused_policy_loss,
    rk.group_advantages,
    rk.kl_penalty,
    rk.PolicyLossConfig,
    rk.PolicyLossConfig.preset,
    rk.global_normalizers,
    rk.token_logprobs,  # only its number check (HUGE_NUMBER_CASES)
]

B, T, V = 3, 4, 7
META = torch.device("meta")  # a second device on a CPU-only machine


def _f(*shape, device="cpu"):
    return torch.randn(*shape, device=device)


def _loss_args(**changes):
    args = dict(
        logp=_f(B, T), old_logp=_f(B, T), advantages=_f(B), mask=torch.ones(B, T), cfg=rk.PolicyLossConfig()
    )
    args.update(changes)
    return args


def _call_loss(**changes):
    args = _loss_args(**changes)
    positional = [args.pop(k) for k in ("logp", "old_logp", "advantages", "mask", "cfg")]
    return rk.policy_loss(*positional, **args)


POLICY_LOSS_CASES = [
    (dict(logp=[[0.0]]), TypeError, "logp must be a torch.Tensor"),
    (dict(logp=torch.zeros(B, T, dtype=torch.long)), TypeError, "logp must be a floating-point"),
    (dict(logp=_f(B, T, 2)), ValueError, r"logp must be \[B, T\]"),
    (dict(logp=_f(B)), ValueError, "cu_seqlens is required"),
    (dict(old_logp=_f(B, T + 1)), ValueError, "old_logp must have shape"),
    (dict(old_logp=_f(B, T, device=META)), ValueError, "old_logp must be on cpu"),
    (dict(old_logp=torch.zeros(B, T, dtype=torch.int32)), TypeError, "old_logp"),
    (dict(advantages=_f(B + 1)), ValueError, "advantages must have shape"),
    (dict(advantages=_f(T, B)), ValueError, "advantages must have shape"),
    (dict(advantages=_f(B, device=META)), ValueError, "advantages must be on cpu"),
    (dict(advantages=torch.ones(B, dtype=torch.long)), TypeError, "advantages"),
    (dict(mask=torch.ones(B, T + 1)), ValueError, "mask must have shape"),
    (dict(mask=torch.ones(B, T, device=META)), ValueError, "mask must be on cpu"),
    (dict(mask=[[1] * T] * B), TypeError, "mask must be a torch.Tensor"),
    (dict(mask=torch.ones(B, T, dtype=torch.complex64)), TypeError, "mask must be a bool, integer or float"),
    (dict(cfg="ppo"), TypeError, "cfg must be a PolicyLossConfig"),
    (dict(ref_logp=_f(B, T - 1)), ValueError, "ref_logp must have shape"),
    (dict(rollout_logp=_f(B, T, device=META)), ValueError, "rollout_logp must be on cpu"),
    (dict(entropy=torch.ones(B, T, dtype=torch.long)), TypeError, "entropy"),
    (dict(cfg=rk.PolicyLossConfig(kl_coef=0.1)), ValueError, "ref_logp is required when cfg.kl_coef > 0"),
    (
        dict(cfg=rk.PolicyLossConfig(entropy_coef=-0.1)),
        ValueError,
        "entropy is required when cfg.entropy_coef",
    ),
    (dict(cfg=rk.PolicyLossConfig(rollout_correction="seq_tis")), ValueError, "rollout_logp is required"),
    (dict(global_tokens=-1), ValueError, "global_tokens must be a finite number >= 0"),
    (dict(global_tokens=float("inf")), ValueError, "global_tokens"),
    # Beyond float32 (issue 29): 1e39 divided the loss by inf (a silent 0), 1e-45 by a denormal.
    (dict(global_tokens=1e39), ValueError, "global_tokens must be at most 3.40282e.38"),
    (dict(global_tokens=1e-45), ValueError, "global_tokens must be at least 1.17549e-38"),
    (dict(global_seqs=1e39), ValueError, "global_seqs must be at most 3.40282e.38"),
    (dict(global_tokens="8"), TypeError, "global_tokens must be a number"),
    (dict(global_tokens=True), TypeError, "global_tokens"),
    (dict(global_tokens=torch.tensor([8.0])), ValueError, "global_tokens must be a 0-dim tensor"),
    (dict(global_tokens=torch.tensor(True)), TypeError, "global_tokens must be an integer or floating-point"),
    (dict(global_seqs=torch.tensor(3.0, device=META)), ValueError, "global_seqs must be on cpu"),
    (dict(global_seqs=-2), ValueError, "global_seqs"),
    (dict(cu_seqlens=torch.tensor([0, 4, 8, 12])), ValueError, "cu_seqlens is only for packed"),
]


@pytest.mark.parametrize("changes, error, match", POLICY_LOSS_CASES)
def test_policy_loss(changes, error, match):
    with pytest.raises(error, match=match):
        _call_loss(**changes)


PACKED_CU_CASES = [
    (torch.tensor([1, 4, 6]), ValueError, "cu_seqlens must start at 0"),
    (torch.tensor([0, 4, 2, 6]), ValueError, "cu_seqlens must be non-decreasing"),
    (torch.tensor([0, 4, 5]), ValueError, "cu_seqlens must end at the packed length 6"),
    (torch.tensor([0.0, 3.0, 6.0]), TypeError, "cu_seqlens must be an integer tensor"),
    (torch.tensor([[0, 6]]), ValueError, "cu_seqlens must be 1-D"),
    ([0, 3, 6], TypeError, "cu_seqlens must be a torch.Tensor"),
    # issue 29: NotImplementedError from the host read of a meta tensor
    (torch.tensor([0, 3, 6], device=META), ValueError, "cu_seqlens is on the meta device"),
]


@pytest.mark.parametrize("cu, error, match", PACKED_CU_CASES)
def test_policy_loss_bad_cu_seqlens(cu, error, match):
    with pytest.raises(error, match=match):
        rk.policy_loss(_f(6), _f(6), _f(2), torch.ones(6), rk.PolicyLossConfig(), cu_seqlens=cu)


def test_fused_policy_loss_cu_seqlens_on_meta():
    ids, cu = torch.zeros(6, dtype=torch.long), torch.tensor([0, 3, 6], device=META)
    with pytest.raises(ValueError, match="cu_seqlens is on the meta device"):
        rk.fused_policy_loss(rk.PolicyLossConfig(), logits=_f(6, 5), token_ids=ids, old_logp=_f(6),
                             advantages=_f(2), mask=torch.ones(6), cu_seqlens=cu)  # fmt: skip


def test_packed_advantages_shape_names_sequences():
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\)"):
        rk.policy_loss(
            _f(6), _f(6), _f(3), torch.ones(6), rk.PolicyLossConfig(), cu_seqlens=torch.tensor([0, 2, 6])
        )


KL_CASES = [
    (dict(logp=1.0), TypeError, "logp must be a torch.Tensor"),
    (dict(logp=torch.zeros(3, dtype=torch.long)), TypeError, "logp"),
    (dict(ref_logp=_f(4)), ValueError, "ref_logp must have shape"),
    (dict(ref_logp=_f(3, device=META)), ValueError, "ref_logp must be on cpu"),
    (dict(ref_logp=torch.zeros(3, dtype=torch.long)), TypeError, "ref_logp"),
    (dict(estimator="k4"), ValueError, "estimator must be one of"),
    (dict(estimator="k2+"), ValueError, "estimator must be one of"),
    (dict(estimator=None), ValueError, "estimator"),
]


@pytest.mark.parametrize("changes, error, match", KL_CASES)
def test_kl_penalty(changes, error, match):
    args = {"logp": _f(3), "ref_logp": _f(3), "estimator": "k3", **changes}
    with pytest.raises(error, match=match):
        rk.kl_penalty(**args)


ADV_CASES = [
    (dict(rewards=_f(2, 3)), ValueError, r"rewards must be 1-D"),
    (dict(rewards=torch.ones(6, dtype=torch.long)), TypeError, "rewards must be a floating-point"),
    (dict(rewards=[1.0] * 6), TypeError, "rewards must be a torch.Tensor"),
    (dict(group_size=None), ValueError, "exactly one of group_size .* got neither"),
    (dict(group_ids=torch.zeros(6, dtype=torch.long)), ValueError, "exactly one of group_size .* got both"),
    (dict(group_size=4), ValueError, "group_size=4 must divide the batch size 6"),
    (dict(group_size=0), ValueError, "group_size must be > 0"),
    (dict(group_size=2.0), TypeError, "group_size must be an int"),
    (dict(group_size=None, group_ids=torch.zeros(6)), TypeError, "group_ids must be an integer tensor"),
    (
        dict(group_size=None, group_ids=torch.zeros(5, dtype=torch.long)),
        ValueError,
        "group_ids must have shape",
    ),
    (
        dict(group_size=None, group_ids=torch.zeros(6, dtype=torch.long, device=META)),
        ValueError,
        "group_ids must be on cpu",
    ),
    (dict(estimator="ppo"), ValueError, "estimator must be one of"),
    (dict(eps=-1e-6), ValueError, "eps must be a finite number >= 0"),
    (
        dict(token_counts=torch.ones(6)),
        ValueError,
        "token_counts is only used by estimator='reinforce_pp_baseline'",
    ),
    (
        dict(estimator="reinforce_pp_baseline", token_counts=torch.ones(5)),
        ValueError,
        "token_counts must have shape",
    ),
    (
        dict(estimator="reinforce_pp_baseline", token_counts=torch.ones(6, dtype=torch.bool)),
        TypeError,
        "token_counts must be an integer or float",
    ),
    # token_counts are whitening weights: negative ones gave advantages of ±500, complex ones were
    # silently truncated to their real part, NaN/inf ones gave NaN everywhere.
    *[
        (
            dict(estimator="reinforce_pp_baseline", token_counts=counts),
            ValueError,
            r"token_counts must be finite and >= 0 .*first: " + first,
        )
        for counts, first in [
            (torch.tensor([3, 5, -2, 4, 4, 1]), "-2"),
            (torch.tensor([3.0, 5.0, 2.0, 4.0, -0.5, 1.0]), "-0.5"),
            (torch.tensor([3.0, float("nan"), 2.0, 4.0, 4.0, 1.0]), "nan"),
            (torch.tensor([3.0, 5.0, 2.0, float("inf"), 4.0, 1.0]), "inf"),
            (torch.tensor([3.0, 5.0, 2.0, 4.0, 4.0, -float("inf")]), "-inf"),
        ]
    ],
    *[
        (
            dict(estimator="reinforce_pp_baseline", token_counts=torch.randint(1, 9, (6,)).to(dtype)),
            TypeError,
            "token_counts must be an integer or float tensor",
        )
        for dtype in (torch.complex64, torch.complex128)
    ],
]


@pytest.mark.parametrize("changes, error, match", ADV_CASES)
def test_group_advantages(changes, error, match):
    args = {"rewards": _f(6), "group_size": 3, **changes}
    rewards = args.pop("rewards")
    group_size = args.pop("group_size")
    with pytest.raises(error, match=match):
        rk.group_advantages(rewards, group_size, **args)


FP32_MAX = torch.finfo(torch.float32).max
# Numbers that pass a "finite number in range" check in float64 but do not survive the float32 loss
# math and kernels (or do not even fit a float): each must be rejected at construction, by name.
CONFIG_CASES = [
    (dict(norm_length=10**30), ValueError, r"norm_length must be <= 2147483647, got an int of 31 digits"),
    (dict(norm_length=2**31), ValueError, r"norm_length must be <= 2147483647"),
    (dict(norm_length=2**63), ValueError, r"norm_length must be <= 2147483647"),
    (dict(clip_high=10**400), ValueError, r"clip_high must be a finite number, got an int of 401 digits"),
    (dict(clip_low=10**39), ValueError, r"clip_low must be at most 3\.40282e\+38"),
    (dict(clip_high=1e39), ValueError, r"clip_high must be at most"),
    (dict(dual_clip=3.5e38), ValueError, r"dual_clip must be at most"),
    (dict(delta=10**40), ValueError, r"delta must be at most"),
    (dict(delta=10**400), ValueError, r"delta must be a finite number"),
    (dict(kl_coef=2 * FP32_MAX), ValueError, r"kl_coef must be at most"),
    (dict(kl_coef=10**309), ValueError, r"kl_coef must be a finite number"),
    (dict(entropy_coef=-1e300), ValueError, r"entropy_coef must be at most"),
    (dict(entropy_coef=-(10**500)), ValueError, r"entropy_coef must be a finite number"),
    (dict(rollout_clip_max=1e300), ValueError, r"rollout_clip_max must be at most"),
    (dict(rollout_clip_min=1e-300), ValueError, r"rollout_clip_min must be at least 1\.17549e-38"),
    (dict(rollout_clip_min=10**400, rollout_clip_max=None), ValueError, r"rollout_clip_min must be a finite"),
    (dict(loss_type="sapo", sapo_tau_pos=1e-40), ValueError, r"sapo_tau_pos must be at least"),
    (dict(loss_type="sapo", sapo_tau_neg=1e39), ValueError, r"sapo_tau_neg must be at most"),
    (dict(loss_type="sapo", sapo_tau_neg=10**400), ValueError, r"sapo_tau_neg must be a finite number"),
]


@pytest.mark.parametrize("kwargs, error, match", CONFIG_CASES)
def test_config_numbers_out_of_float32(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.PolicyLossConfig(**kwargs)
    preset = "sapo" if kwargs.get("loss_type") == "sapo" else "dapo"
    overrides = {k: v for k, v in kwargs.items() if k != "loss_type"}
    with pytest.raises(error, match=match):
        rk.PolicyLossConfig.preset(preset, **overrides)


def test_config_norm_length_bound_is_usable():
    # The largest accepted norm_length runs on every path; one more is rejected (not an OverflowError
    # in the loss, as 10**30 used to give).
    cfg = rk.PolicyLossConfig(aggregation="seq-mean-token-sum-norm", norm_length=2**31 - 1)
    loss = _call_loss(cfg=cfg).loss
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="norm_length"):
        rk.PolicyLossConfig(aggregation="seq-mean-token-sum-norm", norm_length=2**31)


# Ints too large for a float, where the other public functions take a number.
HUGE_NUMBER_CASES = [
    (lambda: _call_loss(global_tokens=10**400), "global_tokens must be a finite number"),
    (lambda: _call_loss(global_seqs=-(10**400)), "global_seqs must be a finite number"),
    (lambda: rk.group_advantages(_f(6), 3, eps=10**400), "eps must be a finite number"),
    (
        lambda: rk.fused_policy_loss(
            rk.PolicyLossConfig(), logits=_f(B, T, V), temperature=10**400, **_fused_kwargs()
        ),
        "temperature must be a finite number",
    ),
    (
        lambda: rk.token_logprobs(_f(B, T, V), torch.zeros(B, T, dtype=torch.long), temperature=10**400),
        "temperature",
    ),
]


@pytest.mark.parametrize("call, match", HUGE_NUMBER_CASES)
def test_ints_too_large_for_a_float_are_a_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="dpo"), "loss_type must be one of"),
        (dict(aggregation="sum"), "aggregation must be one of"),
        (dict(kl_estimator="full"), "kl_estimator must be one of"),
    ],
)
def test_config_unknown_names(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rk.PolicyLossConfig(**kwargs)
    with pytest.raises(ValueError, match="preset name must be one of"):
        rk.PolicyLossConfig.preset("grpo++")


def _fused_kwargs(**changes):
    kwargs = dict(
        token_ids=torch.randint(0, V, (B, T)),
        old_logp=_f(B, T),
        advantages=_f(B),
        mask=torch.ones(B, T),
    )
    kwargs.update(changes)
    return kwargs


FUSED_CASES = [
    (dict(), ValueError, "exactly one of logits or hidden .* got neither"),
    (dict(logits=_f(B, T, V), hidden=_f(B, T, 5)), ValueError, "exactly one of logits or hidden .* got both"),
    (dict(hidden=_f(B, T, 5)), ValueError, "weight .* is required with hidden"),
    (dict(logits=_f(B, T, V), weight=_f(V, 5)), ValueError, "weight only apply with hidden"),
    (dict(logits=_f(B, T, V), tp_group=object()), ValueError, "tp_group only apply with hidden"),
    (dict(logits=_f(B, T, V), token_ids=_f(B, T)), TypeError, "token_ids must be an integer tensor"),
    (dict(logits=_f(B, T, V), mask=torch.ones(B, T + 1)), ValueError, "mask must have shape"),
    (dict(logits=_f(B, T, V), mask=torch.ones(B, T, device=META)), ValueError, "mask must be on cpu"),
    (dict(logits=_f(B, T + 1, V)), ValueError, "token_ids must have shape"),
    (dict(logits=_f(B, T, V, device=META)), ValueError, "token_ids must be on meta"),
    (dict(logits=_f(B, T, V), temperature=0.0), ValueError, "temperature"),
    (dict(logits=_f(B, T, V), temperature=1e-40), ValueError, "temperature must be at least 1.17549e-38"),
    (dict(hidden=_f(B, T, 5), weight=_f(V, 5), temperature=1e-40), ValueError, "temperature must be at"),
    (dict(logits=_f(B, T, V), global_tokens=1e-45), ValueError, "global_tokens must be at least"),
    (dict(logits=_f(B, T, V), old_logp=_f(B, T - 1)), ValueError, "old_logp must have shape"),
    (dict(hidden=_f(B, T, 5), weight=_f(V, 6)), ValueError, r"weight must be \[V, H\]"),
]


# Flags must be bools: inplace_backward="False" is truthy and would overwrite the logits.
FLAG_CASES = [
    (dict(logits=_f(B, T, V), inplace_backward="False"), TypeError, "inplace_backward must be a bool"),
    (dict(logits=_f(B, T, V), inplace_backward=1), TypeError, "inplace_backward must be a bool"),
    (dict(logits=_f(B, T, V), validate=None), TypeError, "validate must be a bool"),
    (dict(hidden=_f(B, T, 5), weight=_f(V, 5), validate="yes"), TypeError, "validate must be a bool"),
]


@pytest.mark.parametrize("changes, error, match", FUSED_CASES + FLAG_CASES)
def test_fused_policy_loss(changes, error, match):
    with pytest.raises(error, match=match):
        rk.fused_policy_loss(rk.PolicyLossConfig(), **_fused_kwargs(**changes))


def test_fused_cfg_type():
    with pytest.raises(TypeError, match="cfg must be a PolicyLossConfig"):
        rk.fused_policy_loss({"loss_type": "ppo"}, logits=_f(B, T, V), **_fused_kwargs())


GLOBAL_NORMALIZERS_CASES = [
    (dict(count_empty="no"), TypeError, "count_empty must be a bool"),
    (dict(count_empty=None), TypeError, "count_empty must be a bool"),
    (dict(count_empty=0), TypeError, "count_empty must be a bool"),
]


@pytest.mark.parametrize("changes, error, match", GLOBAL_NORMALIZERS_CASES)
def test_global_normalizers(changes, error, match):
    mask = torch.rand(B, T) > 0.5
    with pytest.raises(error, match=match):
        rk.global_normalizers(mask, **changes)
