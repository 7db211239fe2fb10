"""``fused_policy_loss``: the RL loss straight from logits, or from hidden states and the LM head.

    logp (, entropy) = token_logprobs(logits, ids)            or linear_token_logprobs(hidden, W, ids)
    out              = policy_loss(logp, old_logp, advantages, mask, cfg, entropy=entropy, ...)

It is a composition of the log-prob primitives (:mod:`rlkernel.ops.logprobs`) and the loss
algebra (:mod:`rlkernel.rl.loss`): the memory-lean part — never holding fp32 ``[N, V]`` copies, or the
logits at all on the hidden-state path — is the primitives' job.

Token-level fusion (logits path, Triton backend). When the objective's gradient is token-local
(``rlkernel.rl.token_loss.is_eligible``: loss types ppo, cispo, sapo, reinforce, with any
aggregation, KL estimator, entropy coefficient and rollout correction), the ``[B, T]`` algebra does
not run under autograd: a plan of per-token constants is built with a few torch ops, and the call is

    forward   log-prob kernel → token-loss kernel (loss partials, dL/dlogp, dL/dH) → sum of partials
    backward  one log-prob backward launch, scaled in-kernel by the upstream gradient

instead of ~100 small autograd launches (1.8–2.0 ms of host time per call at N = 8192 on an H100).
For V <= the option ``grad_in_forward_max_vocab`` (65,536 by default; 0 turns it off), when the
logits require grad and ``inplace_backward`` is off, the gradient is instead written during the
forward (2 passes over the logits) and the backward only rescales it. The option
``token_level_fusion=False`` sends every call to the composed path (for comparisons). Both options
are read once per call (``rlkernel.use_options``; measurements behind the defaults:
``docs/api/options.md``).
gspo, gspo_token and gmpo (sequence-coupled gradients), the hidden-state path, fp64 logits, the
reference backend and ``torch.compile`` tracing keep the composed path. Both give the same loss,
gradients (to fp32 rounding) and metrics.

Masked positions are sent to the primitive as ``ignore_index`` (their ids may be garbage such as -1 or
a pad id out of the vocabulary), so they cost no softmax gradient and need no valid id. Entropy is
computed only when ``cfg.entropy_coef != 0``.

Caveats:
    * The caller aligns logits with ids (``logits[:, :-1]`` predicts ``ids[:, 1:]``); strided views
      are fine.
    * ``tp_group`` (vocab-parallel LM head) is forwarded to ``linear_token_logprobs`` and works only
      on the hidden-state path.
    * The fused token-level path runs eagerly only; inside ``torch.compile`` the composed path is
      traced instead (the token-loss kernel is not registered as a custom op yet).
"""

from __future__ import annotations

import torch

from rlkernel import _dispatch
from rlkernel import _validate as check
from rlkernel._autocast import without_autocast
from rlkernel._options import Options, current_options
from rlkernel.ops.checks import check_common, check_linear_inputs
from rlkernel.ops.logprobs import (
    invariant_logits_dtype,
    linear_token_logprobs,
    linear_token_logprobs_checked,
    token_logprobs_checked,
)
from rlkernel.rl import token_loss
from rlkernel.rl.batch import LossBatch, validate_batch
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.loss import PolicyLossOutput, loss_from_batch

IGNORE_INDEX = token_loss.IGNORE_INDEX


def _token_level(cfg: PolicyLossConfig, x: object, opts: Options) -> bool:
    """Whether a call whose logits (or hidden states) are ``x`` takes a fused token-level path: the
    option ``token_level_fusion``, an eligible objective, eager mode, and the Triton backend for
    ``x`` (see the module docstring)."""
    if not opts.token_level_fusion or not isinstance(x, torch.Tensor) or not token_loss.is_eligible(cfg):
        return False
    if torch.compiler.is_compiling():
        return False
    has_kernel = x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return _dispatch.resolve_backend(x.device, has_kernel=has_kernel) == "triton"


def _token_level_linear(cfg: PolicyLossConfig, hidden: object, weight: object, opts: Options) -> bool:
    """Whether a hidden-state call takes the fused linear path (gradient computed while each
    chunk's logits are live: 3 GEMMs instead of 4; see rlkernel.ops._linear_function)."""
    if not isinstance(weight, torch.Tensor) or not isinstance(hidden, torch.Tensor):
        return False
    # A dtype mismatch takes the primitive path, which raises the clear error.
    return weight.dtype == hidden.dtype and _token_level(cfg, hidden, opts)


def _check_source(logits, hidden, weight, bias, tp_group) -> None:
    if (logits is None) == (hidden is None):
        raise ValueError(
            "pass exactly one of logits or hidden (with weight), got "
            f"{'both' if logits is not None else 'neither'}"
        )
    if logits is not None:
        extra = [n for n, v in (("weight", weight), ("bias", bias), ("tp_group", tp_group)) if v is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} only apply with hidden, not with logits")
    elif weight is None:
        raise ValueError("weight (the [V, H] LM head) is required with hidden")


@without_autocast
def fused_policy_loss(
    cfg: PolicyLossConfig,
    *,
    token_ids: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    tp_group: object | None = None,
    cu_seqlens: torch.Tensor | None = None,
    validate: bool = True,
    inplace_backward: bool = False,
    invariant: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> PolicyLossOutput:
    """The RL loss from logits or hidden states; same result as ``policy_loss(token_logprobs(...))``.

    Args:
        cfg: the objective (:class:`PolicyLossConfig`).
        token_ids: int ``[B, T]`` (or packed ``[N]``), the sampled tokens aligned with the logits;
            any value (e.g. -1, a pad id) at masked positions.
        old_logp, advantages, mask, ref_logp, rollout_logp, global_tokens, global_seqs, cu_seqlens:
            as in :func:`rlkernel.policy_loss`, over the shape of ``token_ids``.
        logits: ``[B, T, V]`` (or ``[N, V]``) float logits. Exactly one of ``logits`` and ``hidden``.
        hidden: ``[B, T, H]`` (or ``[N, H]``) last hidden states, with ``weight`` ``[V, H]`` and an
            optional ``bias`` ``[V]``.
        temperature: the sampling temperature (> 0) applied to the logits.
        tp_group: vocab-parallel process group (hidden path only; see ``linear_token_logprobs``).
        validate: check that active ids are in ``[0, V)`` (one host sync); ``False`` skips it.
        inplace_backward: logits path only: the backward writes dL/dlogits into the logits' own
            storage (see :func:`rlkernel.token_logprobs`), so the step needs no memory for the
            gradient; the logits must not be used after the backward.
        invariant, logits_dtype: hidden path only: the log-probs (and entropy) are bitwise those
            ``token_logprobs`` gives for the logits of the LM head of a model patched by
            ``rlkernel.invariant.patch_hf_model`` (with ``lm_head_dtype=logits_dtype``); see
            :func:`rlkernel.linear_token_logprobs`. Not with ``tp_group``.

    Returns:
        :class:`PolicyLossOutput`; the loss is differentiable in ``logits`` or ``hidden``/``weight``/
        ``bias``.

    Raises:
        TypeError: wrong dtypes or types (as the primitives and ``policy_loss`` do), ``validate``
            or ``inplace_backward`` not a bool.
        ValueError: both or neither of ``logits``/``hidden``, ``weight`` missing with ``hidden``,
            ``weight``/``bias``/``tp_group`` with ``logits``, shape/device mismatches, active ids
            out of range, and everything ``policy_loss`` rejects.
    """
    # Every input is checked once, here; the paths below check nothing again.
    if not isinstance(cfg, PolicyLossConfig):
        raise TypeError(f"cfg must be a PolicyLossConfig, got {type(cfg).__name__}")
    check.boolean("validate", validate)
    check.boolean("inplace_backward", inplace_backward)
    _check_source(logits, hidden, weight, bias, tp_group)
    if inplace_backward and logits is None:
        raise ValueError("inplace_backward applies to the logits path only (no logits to overwrite)")
    if logits is not None and (invariant is not False or logits_dtype is not None):
        raise ValueError("invariant and logits_dtype apply to the hidden path only (the logits are given)")
    inv_dtype = invariant_logits_dtype(invariant, logits_dtype, hidden, bias, tp_group)
    token_ids = check.int_tensor("token_ids", token_ids)
    batch = validate_batch(
        cfg,
        token_ids,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
        rollout_logp=rollout_logp,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        cu_seqlens=cu_seqlens,
        like_name="token_ids",
    )
    ids, active = token_loss.masked_token_ids(token_ids, batch.mask)
    tp = tp_group is not None
    if logits is not None:
        check.float_tensor("logits", logits, min_dim=1)
        check_common("logits", logits, ids, temperature, IGNORE_INDEX)
        vocab = logits.shape[-1]
        if vocab < 1:
            raise ValueError(f"logits must have a vocabulary dimension >= 1, got {check.describe(logits)}")
    elif not tp:  # vocab-parallel: validated across ranks by the primitive (every rank raises alike)
        check_linear_inputs(hidden, weight, ids, bias, temperature, IGNORE_INDEX)
        vocab = weight.shape[0]
    if validate and not tp:
        # On the active positions only: an active id equal to IGNORE_INDEX must be an error, not a
        # silently dropped token.
        check.token_ids_in_range(
            "token_ids (at active mask positions)", torch.where(active, token_ids, 0), vocab, None
        )
    opts = current_options()
    if _token_level(cfg, logits, opts):
        two_pass_max_vocab = opts.grad_in_forward_max_vocab
        return _fused_token_level(
            logits, (ids, active), batch, temperature, inplace_backward, two_pass_max_vocab
        )
    if not tp and _token_level_linear(cfg, hidden, weight, opts):
        return _fused_linear_token_level(hidden, weight, bias, (ids, active), batch, temperature, inv_dtype)
    want_entropy = cfg.entropy_coef != 0
    common = dict(temperature=temperature, ignore_index=IGNORE_INDEX, return_entropy=want_entropy)
    if logits is not None:
        out = token_logprobs_checked(logits, ids, inplace_backward=inplace_backward, **common)
    elif not tp:
        out = linear_token_logprobs_checked(
            hidden, weight, ids, bias=bias, invariant_logits=inv_dtype, **common
        )
    else:
        if validate:
            # The vocab-parallel primitive checks the ids against the *global* vocabulary on every
            # rank at once (a local check against this rank's shard would reject valid ids, on some
            # ranks only). An active id equal to IGNORE_INDEX must stay an error: send it as -1.
            ids = torch.where(active & (ids == IGNORE_INDEX), -1, ids)
        out = linear_token_logprobs(
            hidden, weight, ids, bias=bias, tp_group=tp_group, validate=validate, **common
        )
    logp, entropy = out if want_entropy else (out, None)
    return loss_from_batch(logp, entropy, batch)


def _output(loss, logp, entropy, batch: LossBatch) -> PolicyLossOutput:
    """The fused result with lazy metrics: the composed algebra on the detached log-probs, so the
    metrics equal the composed path's."""
    return PolicyLossOutput(loss, compute_metrics=lambda: loss_from_batch(logp, entropy, batch).metrics)


def _fused_token_level(logits, masked_ids, batch, temperature, inplace_backward, two_pass_max_vocab):
    """The eligible-config logits path: plan + one fused launch each way; metrics stay lazy.
    ``two_pass_max_vocab``: the option ``grad_in_forward_max_vocab``."""
    from rlkernel.ops._logprobs_function import token_loss_triton

    plan = token_loss.plan_from_batch(batch, masked_ids)
    two_pass = (
        logits.shape[-1] <= two_pass_max_vocab
        and not inplace_backward
        and logits.requires_grad
        and torch.is_grad_enabled()
    )
    if two_pass:
        from rlkernel.ops._logprobs_function import token_loss_grad_in_forward_triton

        loss, logp, entropy = token_loss_grad_in_forward_triton(logits, plan, temperature=temperature)
    else:
        loss, logp, entropy = token_loss_triton(
            logits, plan, temperature=temperature, inplace_backward=inplace_backward
        )
    return _output(loss, logp, entropy if plan.want_entropy else None, batch)


def _fused_linear_token_level(hidden, weight, bias, masked_ids, batch, temperature, invariant_logits=None):
    """The eligible-config hidden-state path: the plan's per-chunk coefficients drive the chunk
    engine, which forms dL/dlogits while each chunk's logits are live; metrics stay lazy."""
    from rlkernel.ops._linear_function import fused_linear_token_loss

    plan = token_loss.plan_from_batch(batch, masked_ids)
    outs = fused_linear_token_loss(
        hidden,
        weight,
        bias,
        plan.ids,
        coef_fn=token_loss.as_coef_fn(plan),
        temperature=temperature,
        ignore_index=IGNORE_INDEX,
        with_entropy=plan.want_entropy,
        invariant_logits=invariant_logits,
    )
    entropy = outs[2] if plan.want_entropy else None
    return _output(outs[0], outs[1], entropy, batch)
