"""``fused_policy_loss``: the RL loss straight from logits, or from hidden states and the LM head.

    logp (, entropy) = token_logprobs(logits, ids)            or linear_token_logprobs(hidden, W, ids)
    out              = policy_loss(logp, old_logp, advantages, mask, cfg, entropy=entropy, ...)

It is a thin composition of the log-prob primitives (:mod:`rlkernel.ops.logprobs`) and the loss
algebra (:mod:`rlkernel.rl.loss`): the memory-lean part — never holding fp32 ``[N, V]`` copies, or the
logits at all on the hidden-state path — is the primitives' job, and a faster kernel slots in under
them without changing this function. The ``[B, T]`` algebra that follows is cheap.

Masked positions are sent to the primitive as ``ignore_index`` (their ids may be garbage such as -1 or
a pad id out of the vocabulary), so they cost no softmax gradient and need no valid id. Entropy is
computed only when ``cfg.entropy_coef != 0``.

Caveats:
    * The caller aligns logits with ids (``logits[:, :-1]`` predicts ``ids[:, 1:]``); strided views
      are fine.
    * ``tp_group`` (vocab-parallel LM head) is forwarded to ``linear_token_logprobs`` and works only
      on the hidden-state path.
"""

from __future__ import annotations

import torch

from rlkernel import _validate as check
from rlkernel.ops.logprobs import linear_token_logprobs, token_logprobs
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.loss import PolicyLossOutput, policy_loss

IGNORE_INDEX = -100


def _masked_ids(token_ids: object, mask: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, active)``: token ids with every masked position replaced by :data:`IGNORE_INDEX`,
    and the bool mask of active positions."""
    ids = check.int_tensor("token_ids", token_ids)
    mask = check.mask_tensor("mask", mask)
    check.same_shape("mask", mask, "token_ids", ids.shape)
    check.same_device("mask", mask, "token_ids", ids.device)
    active = mask != 0
    # int64 first: IGNORE_INDEX does not fit unsigned id dtypes (uint8 would wrap it to 156).
    return torch.where(active, ids.long(), IGNORE_INDEX), active


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

    Returns:
        :class:`PolicyLossOutput`; the loss is differentiable in ``logits`` or ``hidden``/``weight``/
        ``bias``.

    Raises:
        TypeError: wrong dtypes or types (as the primitives and ``policy_loss`` do).
        ValueError: both or neither of ``logits``/``hidden``, ``weight`` missing with ``hidden``,
            ``weight``/``bias``/``tp_group`` with ``logits``, shape/device mismatches, active ids
            out of range, and everything ``policy_loss`` rejects.
    """
    if not isinstance(cfg, PolicyLossConfig):
        raise TypeError(f"cfg must be a PolicyLossConfig, got {type(cfg).__name__}")
    _check_source(logits, hidden, weight, bias, tp_group)
    ids, active = _masked_ids(token_ids, mask)
    if validate:
        # Checked here, on the active positions only: an active id equal to IGNORE_INDEX must be an
        # error, not a silently dropped token. The primitive then skips its own (second) sync.
        if logits is not None:
            vocab = check.float_tensor("logits", logits, min_dim=1).shape[-1]
        else:
            vocab = check.float_tensor("weight", weight, min_dim=1).shape[0]
        check.token_ids_in_range(
            "token_ids (at active mask positions)",
            torch.where(active, token_ids, 0),
            vocab,
            None,
        )
    want_entropy = cfg.entropy_coef != 0
    options = dict(
        temperature=temperature, ignore_index=IGNORE_INDEX, return_entropy=want_entropy, validate=False
    )
    if inplace_backward and logits is None:
        raise ValueError("inplace_backward applies to the logits path only (no logits to overwrite)")
    if logits is not None:
        out = token_logprobs(logits, ids, inplace_backward=inplace_backward, **options)
    else:
        out = linear_token_logprobs(hidden, weight, ids, bias=bias, tp_group=tp_group, **options)
    logp, entropy = out if want_entropy else (out, None)
    return policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        cfg,
        ref_logp=ref_logp,
        rollout_logp=rollout_logp,
        entropy=entropy,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        cu_seqlens=cu_seqlens,
    )
