"""The checked call of ``fused_policy_loss``: every input checked once and the route chosen
(:func:`checked_call`), or, for a repeat of an earlier plain logits call, what that call's checks
decided (:mod:`rlkernel.rl.repeat_calls`). The route builders of :mod:`rlkernel.rl.fused` read the
:class:`CheckedCall` and check nothing again."""

from __future__ import annotations

import dataclasses

import torch

from rlkernel import _validate as check
from rlkernel._options import current_options
from rlkernel.ops import _dtensor_weight
from rlkernel.ops.checks import check_common, check_linear_inputs
from rlkernel.ops.logprobs import invariant_logits_dtype
from rlkernel.ops.routes import Route
from rlkernel.ops.token_loss import IGNORE_INDEX
from rlkernel.rl import repeat_calls
from rlkernel.rl.batch import CallChecks, LossBatch, validate_batch
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.routes import choose_route, route_facts


def _cp_checks(logits, hidden, weight, bias, token_ids, temperature, tp_group, validate) -> CallChecks:
    """A context-parallel call's source checks, made inside the cross-rank check (any rank's error
    raised on every rank): the logits' or hidden states' checks, and the id check against V (the
    vocab-parallel primitive checks ids against the global V itself)."""
    error, vocab = None, None
    try:
        check.int_tensor("token_ids", token_ids)
        if logits is not None:
            check.float_tensor("logits", logits, min_dim=1)
            check_common("logits", logits, token_ids, temperature, IGNORE_INDEX)
            vocab = logits.shape[-1]
        elif tp_group is None:
            check_linear_inputs(hidden, weight, token_ids, bias, temperature, IGNORE_INDEX)
            vocab = weight.shape[0]
    except (TypeError, ValueError) as err:
        error = err
    sources = (logits,) if logits is not None else tuple(t for t in (hidden, weight, bias) if t is not None)
    return CallChecks(
        sources=sources, error=error, vocab=vocab if validate else None, what="fused_policy_loss"
    )


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


@dataclasses.dataclass(frozen=True)
class CheckedCall:
    """One checked call: what every route's builder reads (checked once, in the entry point)."""

    cfg: PolicyLossConfig
    batch: LossBatch
    token_ids: torch.Tensor  # int, as given (checked)
    vocab: int
    logits: torch.Tensor | None
    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    temperature: float
    tp_group: object | None
    validate: bool
    inplace_backward: bool
    invariant_logits: torch.dtype | None  # ops.logprobs.invariant_logits_dtype


def checked_call(cfg: object, **args) -> tuple[CheckedCall, Route, bool]:
    """``(call, route, compiling)`` of a ``fused_policy_loss`` call (``args``: its keyword
    arguments, as given): a repeat of an earlier plain logits call takes what that call's checks
    decided (:mod:`rlkernel.rl.repeat_calls`); any other call is checked in full (and kept when
    plain). Raises what ``fused_policy_loss`` documents."""
    opts = current_options()
    sig = repeat_calls.signature(cfg, opts, args)
    decided = repeat_calls.lookup(sig)
    if decided is not None:
        call = CheckedCall(
            cfg, decided.batch(cfg, args), args["token_ids"], decided.vocab, args["logits"], None, None,
            None, float(args["temperature"]), None, args["validate"], args["inplace_backward"], None,
        )  # fmt: skip
        return call, decided.route, False
    call, route, compiling = _full_checks(cfg, opts, **args)
    repeat_calls.remember(sig, route, call.vocab, call.batch)
    return call, route, compiling


def _full_checks(
    cfg, opts, *, token_ids, old_logp, advantages, mask, logits, hidden, weight, bias, temperature,
    ref_logp, rollout_logp, rollout_weights, global_tokens, global_seqs, tp_group, cu_seqlens,
    validate, inplace_backward, invariant, logits_dtype, cp_group, cp_positions,
) -> tuple[CheckedCall, Route, bool]:
    """Every check of a ``fused_policy_loss`` call, and its route: ``(call, route, compiling)``.
    Raises what ``fused_policy_loss`` documents."""
    # Every input is checked once, here; the routes below check nothing again.
    if not isinstance(cfg, PolicyLossConfig):
        raise TypeError(f"cfg must be a PolicyLossConfig, got {type(cfg).__name__}")
    check.boolean("validate", validate)
    check.boolean("inplace_backward", inplace_backward)
    _check_source(logits, hidden, weight, bias, tp_group)
    if inplace_backward and logits is None:
        raise ValueError("inplace_backward applies to the logits path only (no logits to overwrite)")
    if logits is not None and (invariant is not False or logits_dtype is not None):
        raise ValueError("invariant and logits_dtype apply to the hidden path only (the logits are given)")
    if hidden is not None:
        # FSDP2: a DTensor LM head is gathered (rlkernel.ops._dtensor_weight) after the cheap checks,
        # before the dtype checks (fp32 shards with half hidden states are cast to hidden's dtype).
        hidden, weight, bias = _dtensor_weight.local_lm_head(hidden, weight, bias, tp_group=tp_group)
    inv_dtype = invariant_logits_dtype(invariant, logits_dtype, hidden, bias, tp_group)
    cp_checks = None
    if cp_group is None:
        token_ids = check.int_tensor("token_ids", token_ids)
    else:  # the source checks first, inside the cross-rank check
        cp_checks = _cp_checks(logits, hidden, weight, bias, token_ids, temperature, tp_group, validate)
    batch = validate_batch(
        cfg,
        token_ids,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
        rollout_logp=rollout_logp,
        rollout_weights=rollout_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        cu_seqlens=cu_seqlens,
        like_name="token_ids",
        cp_group=cp_group,
        cp_positions=cp_positions,
        cp_checks=cp_checks,
    )
    tp = tp_group is not None
    if logits is not None:
        check.float_tensor("logits", logits, min_dim=1)
        check_common("logits", logits, token_ids, temperature, IGNORE_INDEX, ids_checked=True)
        vocab = logits.shape[-1]
        if vocab < 1:
            raise ValueError(f"logits must have a vocabulary dimension >= 1, got {check.describe(logits)}")
    elif not tp:  # vocab-parallel: validated across ranks by the primitive (every rank raises alike)
        check_linear_inputs(hidden, weight, token_ids, bias, temperature, IGNORE_INDEX, ids_checked=True)
        vocab = weight.shape[0]
    else:
        vocab = 0  # this rank's shard is not the vocabulary; the route does not read it
    facts = route_facts(
        batch, logits=logits, hidden=hidden, weight=weight, bias=bias, token_ids=token_ids, vocab=vocab,
        inplace_backward=inplace_backward, vocab_parallel=tp, invariant=inv_dtype is not None,
        options=opts,
    )  # fmt: skip
    route = choose_route(facts, opts)
    call = CheckedCall(
        cfg, batch, token_ids, vocab, logits, hidden, weight, bias, float(temperature), tp_group, validate,
        inplace_backward, inv_dtype,
    )  # fmt: skip
    return call, route, facts.compiling
