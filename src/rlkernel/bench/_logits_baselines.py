"""The objectives of the ``logits`` benchmark suite and the implementations it times besides rlkernel's.

    objectives     ``TEMPERATURE`` and the loss presets (``LOSSES``: rlkernel's ``dapo`` with a k3 KL
                   term, ``gspo``), resolved to an rlkernel config and the equal :class:`LossSpec`
    torch          plain PyTorch: fp32 log-softmax + gather (:func:`torch_token_logprobs`) and the RL
                   algebra written out (:func:`plain_policy_loss`); ``torch.compile`` compiles the same
    liger          adapters that configure Liger-Kernel's ``GrpoLossFunction`` for the same objective
    trl            TRL's fused log-prob + entropy kernel, ``trl.kernels.selective_log_softmax_and_entropy``
                   (TRL 1.16; only ``trl.kernels`` is imported, which needs torch, triton, transformers
                   and packaging, none of TRL's trainer dependencies)

What is timed, on which inputs, and how bytes are counted is in :mod:`rlkernel.bench.logits`, which
binds these implementations to the workloads (and re-exports every name defined here).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.bench.suite import optional_import

# The settings of the objectives every implementation computes (see rlkernel.bench.logits).
TEMPERATURE = 0.9
KL_COEF = 1e-3


# --------------------------------------------------------------------------------------------------
# The plain-PyTorch baselines (also compiled by torch.compile)
# --------------------------------------------------------------------------------------------------


def torch_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, entropy: bool):
    """The code most RL trainers run: fp32 log-softmax of the whole ``[..., V]``, then a gather."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@dataclass(frozen=True)
class LossSpec:
    """The subset of ``PolicyLossConfig`` the plain baseline implements."""

    loss_type: str  # "ppo" (token-level ratio) | "gspo" (sequence-level ratio)
    clip_low: float
    clip_high: float
    kl_coef: float
    aggregation: str  # "token-mean" | "seq-mean-token-mean"
    dual_clip: float | None = None  # ppo only
    delta: float | None = None  # ppo only


def _surrogate(ratio, adv, spec: LossSpec):
    unclipped = ratio if spec.delta is None else ratio.clamp(max=spec.delta)
    loss = torch.maximum(-adv * unclipped, -adv * ratio.clamp(1.0 - spec.clip_low, 1.0 + spec.clip_high))
    if spec.dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -spec.dual_clip * adv), loss)
    return loss


def plain_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    ref_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """The RL algebra on ``[B, T]`` written plainly, the way verl writes it (its guards included).

    ``ppo``: r = exp(clamp(logp − old_logp, ±20)), ℓ = max(−A·min(r, δ), −A·clip(r, 1−clip_low,
    1+clip_high)), then ℓ = min(ℓ, −c·A) where A < 0 (dual clip c). ``gspo``: s_i = exp(min(masked
    mean of logp − old_logp, 10)), A_i = masked mean of A, the same clipped surrogate on s_i, broadcast
    to the sequence's tokens. KL: k3 with verl's clamps (−d to ±20, value to ±10). Aggregation
    ``token-mean`` or ``seq-mean-token-mean`` over active tokens / non-empty sequences.
    """
    m = mask.to(logp.dtype)
    if spec.loss_type == "ppo":
        ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
        per_tok = _surrogate(ratio, advantages, spec)
    elif spec.loss_type == "gspo":
        n = m.sum(-1).clamp(min=1.0)
        s = torch.exp((((logp - old_logp) * m).sum(-1) / n).clamp(max=10.0))
        a = (advantages * m).sum(-1) / n
        per_tok = _surrogate(s, a, spec).unsqueeze(-1).expand_as(logp)
    else:
        raise ValueError(f"plain_policy_loss implements loss_type 'ppo' and 'gspo', got {spec.loss_type!r}")
    if spec.kl_coef:
        neg = (ref_logp - logp).clamp(-20.0, 20.0)
        per_tok = per_tok + spec.kl_coef * (torch.expm1(neg) - neg).clamp(-10.0, 10.0)
    if spec.aggregation == "token-mean":
        return (per_tok * m).sum() / m.sum().clamp(min=1.0)
    if spec.aggregation == "seq-mean-token-mean":
        n = m.sum(-1)
        per_seq = (per_tok * m).sum(-1) / n.clamp(min=1.0)
        has = (n > 0).to(logp.dtype)
        return (per_seq * has).sum() / has.sum().clamp(min=1.0)
    raise ValueError(
        f"plain_policy_loss implements token-mean and seq-mean-token-mean, got {spec.aggregation!r}"
    )


def torch_policy_loss_from_logits(logits, token_ids, old_logp, ref_logp, advantages, mask, spec, temperature):
    logp = torch_token_logprobs(logits, token_ids, temperature, False)
    return plain_policy_loss(logp, old_logp, advantages, mask, spec, ref_logp)


# --------------------------------------------------------------------------------------------------
# Loss configurations: rlkernel's presets, mirrored by the plain baseline and Liger
# --------------------------------------------------------------------------------------------------

# preset name and the bench's overrides (DAPO gets a k3 KL term so that the KL path is timed too).
LOSSES: dict[str, tuple[str, dict[str, Any]]] = {
    "dapo": ("dapo", {"kl_coef": KL_COEF, "kl_estimator": "k3"}),
    "gspo": ("gspo", {}),
}


def loss_config(name: str) -> Any:
    """``rlkernel.PolicyLossConfig.preset(...)`` with the bench's overrides."""
    import rlkernel as rk

    preset, overrides = LOSSES[name]
    return rk.PolicyLossConfig.preset(preset, **overrides)


def spec_from_config(cfg: Any) -> LossSpec:
    """The ``LossSpec`` equal to ``cfg``; ValueError if ``cfg`` uses a feature the baseline lacks."""
    get = functools.partial(getattr, cfg)
    unsupported = {
        "rollout_correction": get("rollout_correction", None),
        "entropy_coef": get("entropy_coef", 0.0) or None,
    }
    used = [k for k, v in unsupported.items() if v is not None]
    if used:
        raise ValueError(f"the plain baseline does not implement {', '.join(used)}")
    kl_coef = float(get("kl_coef", 0.0) or 0.0)
    if kl_coef and get("kl_estimator", "k3") not in ("k3", "low_var_kl"):
        raise ValueError(f"the plain baseline implements the k3 KL only, got {get('kl_estimator')!r}")
    return LossSpec(
        loss_type=cfg.loss_type,
        clip_low=float(cfg.clip_low),
        clip_high=float(cfg.clip_high),
        kl_coef=kl_coef,
        aggregation=cfg.aggregation,
        dual_clip=get("dual_clip", None),
        delta=get("delta", None),
    )


def resolve_loss(name: str) -> tuple[Any, LossSpec]:
    """The rlkernel config and the equal ``LossSpec`` every other implementation runs.

    Raises ValueError when the preset uses a feature the plain baseline lacks: the workload then
    fails loudly (error rows) instead of comparing two different objectives.
    """
    cfg = loss_config(name)
    return cfg, spec_from_config(cfg)


# --------------------------------------------------------------------------------------------------
# Liger-Kernel
# --------------------------------------------------------------------------------------------------


def _liger_module() -> tuple[Any, str]:
    return optional_import("liger_kernel.ops.grpo_loss")


def _liger(device: torch.device) -> tuple[Any, str]:
    from rlkernel._dispatch import interpreter_enabled

    # On CPU, Liger's kernels run only in the Triton interpreter (slow; used to check the bench's
    # Liger configuration on machines without a GPU).
    if device.type != "cuda" and not interpreter_enabled():
        return None, "Liger's Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU)"
    return _liger_module()


def liger_grpo_args(fn_cls: Any, **kwargs: Any) -> list[Any]:
    """Positional arguments for ``GrpoLossFunction.apply`` (its forward takes no keywords).

    Bound by name against the installed version's ``forward`` signature, so a renamed or missing
    parameter fails loudly instead of shifting every later argument.
    """
    params = list(inspect.signature(fn_cls.forward).parameters.values())[1:]  # drop ctx
    names = {p.name for p in params}
    missing = sorted(set(kwargs) - names)
    if missing:
        raise ValueError(f"this liger-kernel's GrpoLossFunction has no parameter(s) {missing}")
    args = []
    for p in params:
        if p.name in kwargs:
            args.append(kwargs[p.name])
        elif p.default is inspect.Parameter.empty:
            raise ValueError(f"GrpoLossFunction parameter {p.name!r} has no default and no value")
        else:
            args.append(p.default)
    return args


LIGER_TENSOR_ARGS = ("logits", "old_logp", "ref_logp", "completion_ids", "advantages", "completion_mask")


def liger_loss_kwargs(spec: LossSpec) -> dict[str, Any]:
    """Liger's configuration of the same loss as ``spec`` (ValueError where it has none)."""
    if spec.loss_type == "ppo" and spec.aggregation == "token-mean":
        loss_type, level = "dapo", "token"  # Σ mℓ / Σ m: token-mean
    elif spec.loss_type == "gspo" and spec.aggregation == "seq-mean-token-mean":
        loss_type, level = "grpo", "sequence"  # mean over sequences of the token mean
    else:
        raise ValueError(f"no Liger equivalent for {spec}")
    kwargs = {
        "temperature": TEMPERATURE,
        "beta": spec.kl_coef,
        "eps_low": spec.clip_low,
        "eps_high": spec.clip_high,
        "inplace": False,
        "loss_type": loss_type,
        "reduce": True,
        "importance_sampling_level": level,
    }
    if spec.delta is not None:
        kwargs["delta"] = spec.delta
    return kwargs


# --------------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------------

TRL_MODULE = "trl.kernels"
TRL_FUNCTION = "selective_log_softmax_and_entropy"


def _trl(device: torch.device, module: str = TRL_MODULE) -> tuple[Any, str]:
    """``(selective_log_softmax_and_entropy, "")`` from TRL's ``trl.kernels``, or ``(None, why)``.

    ``fn(logits [..., V] (last dim contiguous, any leading strides), index [...], temperature=,
    row_mask=[...] | None) -> (logp, entropy)`` fp32; rows whose mask is 0 are skipped (0 out, 0
    gradient). ``trl.kernels`` exports it only when ``transformers.utils.is_triton_available()``.
    """
    from rlkernel._dispatch import interpreter_enabled

    if device.type != "cuda" and not interpreter_enabled():
        return None, "TRL's Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 on CPU)"
    mod, why = optional_import(module)
    if mod is None:
        return None, why
    fn = getattr(mod, TRL_FUNCTION, None)
    if fn is None:
        return None, f"{module} exports no {TRL_FUNCTION} (transformers reports no triton)"
    return fn, ""
