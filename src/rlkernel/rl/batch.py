"""One validation pass over a loss call's ``[B, T]`` (or packed) inputs: :class:`LossBatch`.

``policy_loss`` and ``fused_policy_loss`` both validate their per-token inputs here, once, and hand
the resulting :class:`LossBatch` to every path below them (the composed algebra of
:mod:`rlkernel.rl.loss`, the token-level plan of :mod:`rlkernel.rl.token_loss`), which then check
nothing again. Only checks that need no device work are made (shapes, dtypes, devices, what the
configuration requires); ``cu_seqlens`` is read on the host once, here, and kept as
:class:`~rlkernel.rl.aggregate.Segments`.

The error messages name the per-token tensor every other input is checked against: ``logp`` in
``policy_loss``, ``token_ids`` in ``fused_policy_loss``.

With a ``cp_group`` (context parallelism: each rank holds a slice of every sequence) the local
checks run inside a cross-rank check (:mod:`rlkernel.rl.context_parallel_checks`): an error on any
rank, or a layout the ranks do not share, raises the same error on every rank, and the batch that
comes back carries the agreed :class:`~rlkernel.rl.context_parallel.ContextParallel` (``cp``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkernel import _validate as check
from rlkernel.rl.aggregate import Segments
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.context_parallel import ContextParallel
from rlkernel.rl.context_parallel_checks import IdCheck, agree_on_layout


@dataclass(frozen=True)
class LossBatch:
    """The validated inputs of one loss call (tensors as given: no copies, no casts).

    Attributes:
        cfg: the objective.
        segments: how the per-token tensors split into sequences (padded ``[B, T]`` or packed).
        device: the device of the per-token tensors.
        old_logp: float, the per-token shape; None for an on-policy call (the old log-probs are
            the current ones, detached).
        advantages: float, per sequence ``[S]`` (a packed ``[S, 1]`` comes here as its ``[S]``
            view) or per token (the per-token shape).
        advantages_per_seq: whether ``advantages`` holds one value per sequence (else one per
            token); decided by :func:`advantages_layout`.
        mask: bool/int/float, the per-token shape (active where ``!= 0``).
        ref_logp: float or None (present when ``cfg.kl_coef > 0``).
        rollout_logp: float or None (present when ``cfg.rollout_correction`` or ``cfg.rollout_rs``
            is set).
        rollout_weights: float or None, precomputed per-token importance weights (never with
            ``cfg.rollout_correction``).
        global_tokens, global_seqs: normalizers (None, a finite number >= 0, or a 0-dim tensor).
        cu_seqlens: int ``[S + 1]`` for packed input, else None.
        advantages_ambiguous: a context-parallel rank's packed ``[N]`` advantages with N = S, which
            read alike per sequence and per token here: the group's other ranks decide
            (:func:`validate_batch`); never True in a batch it returns.
        cp: the context-parallel group and layout (None: the call holds whole sequences).
    """

    cfg: PolicyLossConfig
    segments: Segments
    device: torch.device
    old_logp: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logp: torch.Tensor | None
    rollout_logp: torch.Tensor | None
    global_tokens: float | torch.Tensor | None
    global_seqs: float | torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    rollout_weights: torch.Tensor | None = None
    advantages_per_seq: bool = False
    advantages_ambiguous: bool = False
    cp: ContextParallel | None = None

    @property
    def token_shape(self) -> tuple[int, ...]:
        """``(B, T)`` or ``(N,)``: the shape of every per-token tensor of the call."""
        return self.segments.token_shape


def segments_for(like: torch.Tensor, cu_seqlens: object, *, name: str = "logp") -> Segments:
    """Padded ``[B, T]`` (no ``cu_seqlens``) or packed ``[N]`` (with them) segments of the
    per-token tensor ``like`` (called ``name`` in errors)."""
    shape = like.shape
    if len(shape) == 2:
        if cu_seqlens is not None:
            raise ValueError(
                f"cu_seqlens is only for packed 1-D {name}; {name} is padded {check.describe(like)}"
            )
        return Segments.padded(shape)
    if len(shape) == 1:
        if cu_seqlens is None:
            raise ValueError(
                f"cu_seqlens is required for packed 1-D {name}, got {name} {check.describe(like)}"
            )
        cu = check.cu_seqlens_tensor("cu_seqlens", cu_seqlens, shape[0])
        return Segments.packed(cu, shape[0], like.device)
    raise ValueError(
        f"{name} must be [B, T] (padded) or [N] (packed with cu_seqlens), got {check.describe(like)}"
    )


@dataclass(frozen=True)
class CallChecks:
    """What a context-parallel call adds to :func:`validate_batch`'s cross-rank check.

    Attributes:
        sources: the tensors the log-probs come from (``logp``; the logits; hidden, weight, bias):
            the first one's dtype and device type, and whether any needs a gradient, must agree
            across the ranks.
        error: a check of the caller that failed before :func:`validate_batch` (raised on every
            rank by the cross-rank check), or None.
        later: the caller's checks that come after the batch's (run inside the cross-rank check).
        entropy: whether ``entropy`` is given (``policy_loss``), else None.
        vocab: ``fused_policy_loss``: check the active ids against ``[0, vocab)`` in the cross-rank
            check; None: no id check there.
        what: the call's name in errors.
    """

    sources: tuple
    error: Exception | None = None
    later: Callable[[], None] | None = None
    entropy: bool | None = None
    vocab: int | None = None
    what: str = "policy_loss"


def validate_batch(
    cfg: PolicyLossConfig,
    like: torch.Tensor,
    *,
    old_logp: object,
    advantages: object,
    mask: object,
    ref_logp: object = None,
    rollout_logp: object = None,
    rollout_weights: object = None,
    global_tokens: object = None,
    global_seqs: object = None,
    cu_seqlens: object = None,
    like_name: str = "logp",
    cp_group: object = None,
    cp_positions: object = None,
    cp_checks: CallChecks | None = None,
) -> LossBatch:
    """Check a loss call's per-token inputs against ``like`` (``logp``, or the token ids).

    Args:
        cfg: the objective.
        like: the tensor whose shape ``[B, T]`` / ``[N]`` and device every input must share.
        like_name: its name in errors (``"logp"``; ``fused_policy_loss``: ``"token_ids"``).
        old_logp, advantages, mask, ref_logp, rollout_logp, rollout_weights, global_tokens,
            global_seqs, cu_seqlens: as in :func:`rlkernel.policy_loss` (``old_logp=None``:
            on-policy).
        cp_group: a context-parallel process group, or None (a collective when given: see the
            module docstring).
        cp_positions: int, the shape of ``like``: each token's position in its sequence (with
            ``cp_group`` only; None: contiguous slices in rank order).
        cp_checks: what the caller adds to the cross-rank check (:class:`CallChecks`); by default
            ``like`` is the only source.

    Returns:
        :class:`LossBatch` (with ``cp`` under a ``cp_group``).

    Raises:
        TypeError: ``cfg`` not a ``PolicyLossConfig``; a non-tensor or wrong-dtype input.
        ValueError: shape/device mismatches, bad ``cu_seqlens``, an input ``cfg`` needs missing,
            ``rollout_weights`` with ``cfg.rollout_correction``, a bad normalizer, advantages
            neither per sequence nor per token, ``cp_positions`` without ``cp_group``. Under a
            ``cp_group`` every rank raises the same error when any rank's checks fail or the ranks
            disagree (:mod:`rlkernel.rl.context_parallel_checks`).
    """
    local = dict(
        old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp, rollout_logp=rollout_logp,
        rollout_weights=rollout_weights, global_tokens=global_tokens, global_seqs=global_seqs,
        cu_seqlens=cu_seqlens, like_name=like_name,
    )  # fmt: skip
    if cp_group is None:
        if cp_positions is not None:
            raise ValueError("cp_positions applies with cp_group only (a context-parallel slice's positions)")
        return _local_batch(cfg, like, **local)
    calls = cp_checks if cp_checks is not None else CallChecks(sources=(like,))
    error, batch, positions, ids = calls.error, None, None, None
    if error is None:
        try:
            batch = _local_batch(cfg, like, **local, ambiguous_ok=True)
            if cp_positions is not None:
                positions = check.int_tensor("cp_positions", cp_positions)
                check.same_shape("cp_positions", positions, like_name, like.shape)
                check.same_device("cp_positions", positions, like_name, like.device)
            if calls.later is not None:
                calls.later()
        except (TypeError, ValueError) as err:
            error = err
    if error is None and calls.vocab is not None:
        ids = IdCheck("token_ids (at active mask positions)", like, batch.mask != 0, calls.vocab)
    cp = agree_on_layout(
        cp_group,
        batch=batch,
        error=error,
        positions=positions,
        has_positions=cp_positions is not None,
        sources=calls.sources,
        entropy=calls.entropy,
        ids=ids,
        what=calls.what,
    )
    return dataclasses.replace(
        batch, cp=cp, advantages_per_seq=cp.advantages_per_seq, advantages_ambiguous=False
    )


def _local_batch(
    cfg: PolicyLossConfig,
    like: torch.Tensor,
    *,
    old_logp: object,
    advantages: object,
    mask: object,
    ref_logp: object = None,
    rollout_logp: object = None,
    rollout_weights: object = None,
    global_tokens: object = None,
    global_seqs: object = None,
    cu_seqlens: object = None,
    like_name: str = "logp",
    ambiguous_ok: bool = False,
) -> LossBatch:
    """:func:`validate_batch` on this rank alone (no collective). ``ambiguous_ok``: a
    context-parallel rank's packed advantages that read alike per sequence and per token are
    marked (``advantages_ambiguous``) for the group to decide, instead of raising."""
    if not isinstance(cfg, PolicyLossConfig):
        raise TypeError(f"cfg must be a PolicyLossConfig, got {type(cfg).__name__}")
    device = like.device
    seg = segments_for(like, cu_seqlens)
    if old_logp is not None:  # None: on-policy
        check.float_like("old_logp", old_logp, like_name, like)
    mask = check.mask_tensor("mask", mask)
    check.same_shape("mask", mask, like_name, like.shape)
    check.same_device("mask", mask, like_name, device)
    tensors = (
        ("ref_logp", ref_logp),
        ("rollout_logp", rollout_logp),
        ("rollout_weights", rollout_weights),
    )
    for name, value in tensors:
        if value is not None:
            check.float_like(name, value, like_name, like)
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when cfg.kl_coef > 0 (kl_coef={cfg.kl_coef})")
    if cfg.rollout_correction is not None and rollout_logp is None:
        raise ValueError(f"rollout_logp is required when cfg.rollout_correction={cfg.rollout_correction!r}")
    if cfg.rollout_rs is not None and rollout_logp is None:
        raise ValueError(f"rollout_logp is required when cfg.rollout_rs={cfg.rollout_rs!r}")
    if cfg.rollout_correction is not None and rollout_weights is not None:
        raise ValueError(
            f"pass rollout_weights or set cfg.rollout_correction (={cfg.rollout_correction!r}), not both: "
            "both are the rollout importance weight of the policy term"
        )
    adv = check.float_tensor("advantages", advantages)
    check.same_device("advantages", adv, like_name, device)
    per_seq = advantages_layout(adv, seg, like_name, ambiguous_ok=ambiguous_ok)
    ambiguous = per_seq is None
    per_seq = bool(per_seq)
    if per_seq and adv.dim() == 2:
        adv = adv.view(seg.n_seqs)  # packed [S, 1]
    return LossBatch(
        cfg=cfg,
        segments=seg,
        device=device,
        old_logp=old_logp,
        advantages=adv,
        mask=mask,
        ref_logp=ref_logp,
        rollout_logp=rollout_logp,
        global_tokens=check.normalizer("global_tokens", global_tokens, device),
        global_seqs=check.normalizer("global_seqs", global_seqs, device),
        cu_seqlens=cu_seqlens,
        rollout_weights=rollout_weights,
        advantages_per_seq=per_seq,
        advantages_ambiguous=ambiguous,
    )


def advantages_layout(
    adv: torch.Tensor, seg: Segments, like_name: str = "logp", *, ambiguous_ok: bool = False
) -> bool | None:
    """Whether ``adv`` holds one advantage per sequence (True) or one per token (False).

    Padded ``[B, T]`` input: ``[B]`` per sequence, ``[B, T]`` per token. Packed ``[N]`` input with
    S sequences: ``[S, 1]`` always per sequence; ``[S]`` per sequence and ``[N]`` per token when
    N ≠ S. When N = S a 1-D ``[N]`` could be either: it is accepted only where both readings agree
    (every sequence holds one token); otherwise some sequence is empty (S lengths sum to S, one is
    > 1) and the call raises, naming the two unambiguous forms (issue 29: such a call was read per
    token, silently, whatever was meant).

    ``ambiguous_ok`` (a context-parallel rank's slice, whose emptiness says nothing of the whole
    sequences): None for a packed 1-D ``[N]``, N = S, whatever the lengths; the group's other ranks
    decide.

    Raises:
        ValueError: any other shape; the ambiguous packed ``[N]``, N = S (not ``ambiguous_ok``).
    """
    shape, n_seqs = tuple(adv.shape), seg.n_seqs
    token_shape = seg.token_shape
    if seg.is_packed and shape == (n_seqs, 1):
        return True
    if ambiguous_ok and seg.is_packed and shape == token_shape == (n_seqs,):
        return None
    if shape == token_shape and shape == (n_seqs,) and seg.max_len > 1:
        raise ValueError(
            f"advantages of shape ({n_seqs},) are ambiguous: the packed {like_name} has as many tokens "
            f"as sequences ({n_seqs}, some empty). Pass one per sequence as [S, 1] (advantages[:, None]); "
            "for one per token, drop the empty sequences from cu_seqlens (they hold no token: the loss "
            "is unchanged), so that N != S"
        )
    if shape == token_shape:
        return False
    if shape == (n_seqs,):
        return True
    packed = f", ({n_seqs}, 1)" if seg.is_packed else ""
    raise ValueError(
        f"advantages must have shape ({n_seqs},){packed} (one per sequence) or {token_shape} "
        f"(one per token, the shape of {like_name}), got {check.describe(adv)}"
    )
