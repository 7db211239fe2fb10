"""The typed interface of the fused token-level loss: the plan, its scalars, and their kernel forms.

A token-level loss (see :mod:`rlkernel.rl.token_loss` for the math and when it applies) is, once
the RL algebra has run, a handful of per-token constants and a handful of scalars:

* :class:`TokenLossScalars`: the loss's scalar settings (loss type, clip bounds, KL estimator,
  coefficients, aggregation normalizer), from a ``PolicyLossConfig`` and the batch.
* :class:`TokenLossPlan`: the per-token constants of one micro-batch (``ids``, ``old``, ``adv``,
  ``ref``, ``rollout_w``, ``factor``, ``denom``) over a row range of the flat tokens, their layout
  (per-sequence or per-token), and its :class:`TokenLossScalars`.

``rlkernel.rl.token_loss.build_plan`` builds a plan; ``rlkernel.ops.token_loss.token_loss`` runs it
through the Triton kernels (:mod:`rlkernel.kernels.token_loss`) or the reference
(:mod:`rlkernel.reference.token_loss`), both of which take the plan itself.

The kernels receive the plan as three named tuples, each built by one method so that the kernel
order is written once, here: :meth:`TokenLossPlan.kernel_inputs` (the per-token pointers),
:meth:`TokenLossScalars.kernel_args` (the fp32 runtime scalars) and
:meth:`TokenLossPlan.kernel_branches` (the ``tl.constexpr`` branch choices). Triton (>= 3.4 for
a constexpr named tuple) passes a named tuple to a kernel flattened, field by field, in field
order, so each kernel's compiled signature is the same as if the fields were listed one by one
(the same PTX); the kernels and their jit helper read the fields by name (``s.clip_lo``,
``BRANCH.LOSS``), so one list of names serves the launcher, both kernels and the helper.

Why here and not in ``ops``: the reference and the kernels take the plan, and they may not import
``ops`` or ``rl`` (``tests/test_layering.py``); a private module at the package root is below every
layer. It imports only torch, so importing it needs no Triton.

Caveats:
    * The plan's checks are structural (types, dims, sizes, devices, consistency of the flags):
      they cost no device work and no host sync. Values (NaN, a zero denominator) are the kernels'
      business; see :mod:`rlkernel.kernels._token_loss_math`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

import torch

from rlkernel import _validate as check
from rlkernel._memo import memoized

IGNORE_INDEX = -100
# verl's numerical guards, defined once for the reference, the kernels and the rl algebra: the log
# ratio logp − old_logp is clamped to ±LOG_RATIO_BOUND before its exponential (ppo, cispo, sapo,
# dppo); k3's log ratio to ±K3_LOG_RATIO_BOUND and its value to ±K3_VALUE_BOUND.
LOG_RATIO_BOUND = 20.0
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0

LossType = Literal["ppo", "cispo", "sapo", "reinforce"]
KlEstimator = Literal["k1", "k2", "k3", "abs", "k3_unclamped"]

# Branch codes of the kernels' ``BRANCH.LOSS`` / ``BRANCH.KL`` (each a constexpr branch of one kernel).
LOSS_CODES: dict[str, int] = {"ppo": 0, "cispo": 1, "sapo": 2, "reinforce": 3}
KL_CODES: dict[str | None, int] = {None: 0, "k1": 1, "k2": 2, "k3": 3, "abs": 4, "k3_unclamped": 5}


class TokenLossKernelScalars(NamedTuple):
    """The fp32 runtime scalars of the token-loss kernels, in kernel order
    (:meth:`TokenLossScalars.kernel_args`); see :class:`TokenLossScalars` for each."""

    norm_mult: float
    denom_floor: float
    clip_lo: float
    clip_hi: float
    delta: float
    dual_clip: float  # 0.0 without a dual clip (BRANCH.HAS_DUAL is then False)
    tau_pos: float
    tau_neg: float
    kl_coef: float
    entropy_coef: float


class TokenLossKernelInputs(NamedTuple):
    """The per-token input pointers of the token-loss kernels, in kernel order
    (:meth:`TokenLossPlan.kernel_inputs`). An absent input is a placeholder tensor that the kernel
    never reads (its ``BRANCH`` flag is off)."""

    old: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor
    rollout_w: torch.Tensor
    factor: torch.Tensor
    denom: torch.Tensor


class TokenLossBranches(NamedTuple):
    """The ``tl.constexpr`` branch choices of the token-loss kernels (:meth:`TokenLossPlan.kernel_branches`),
    passed as one constexpr ``BRANCH``: each distinct value is one compiled kernel."""

    LOSS: int  # LOSS_CODES
    KL: int  # KL_CODES (0: no KL term)
    KL_STRAIGHT: bool  # the "+" estimators: the value of KL, the gradient of k2
    HAS_DUAL: bool
    HAS_OLD: bool  # False: on-policy, the kernel's own logp is old (no old tensor is read)
    HAS_ENTROPY: bool
    HAS_ROLLOUT: bool
    HAS_FACTOR: bool
    HAS_DENOM: bool
    ADV_PER_SEQ: bool
    FACTOR_PER_SEQ: bool


@dataclasses.dataclass(frozen=True)
class TokenLossScalars:
    """The scalar settings of a token-level loss (see :mod:`rlkernel.kernels._token_loss_math` for
    the formulas they enter).

    Attributes:
        loss: the policy term P: ``"ppo"`` (with ``delta`` and ``dual_clip``), ``"cispo"``,
            ``"sapo"`` or ``"reinforce"``.
        clip_lo, clip_hi: the ratio clip interval [clip_lo, clip_hi] of ppo and cispo (−inf: no
            lower bound).
        delta: ppo's cap on the unclipped ratio (inf: none).
        dual_clip: ppo's dual-clip constant c > 1, or None.
        tau_pos, tau_neg: sapo's temperatures for A > 0 and A ≤ 0.
        kl: the KL estimator K against ``ref`` (``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``,
            ``"k3_unclamped"``), or None for no KL term.
        kl_straight: the ``"+"`` form of ``kl``: K's value with k2's gradient ``logp − ref``.
        kl_coef: the KL term's coefficient.
        entropy_coef: the entropy bonus's coefficient (0: the loss reads no entropy).
        norm_mult, denom_floor: the aggregation denominator D = norm_mult · max(denom, denom_floor)
            (just ``norm_mult`` when the plan has no ``denom`` tensor).

    Raises:
        ValueError: an unknown ``loss`` or ``kl``, or ``kl_straight`` without ``kl``.
    """

    loss: LossType
    clip_lo: float
    clip_hi: float
    delta: float
    dual_clip: float | None
    tau_pos: float
    tau_neg: float
    kl: KlEstimator | None
    kl_straight: bool
    kl_coef: float
    entropy_coef: float
    norm_mult: float
    denom_floor: float

    def __post_init__(self):
        if self.loss not in LOSS_CODES:
            raise ValueError(f"loss must be one of {tuple(LOSS_CODES)}, got {self.loss!r}")
        if self.kl not in KL_CODES:
            raise ValueError(f"kl must be one of {tuple(KL_CODES)}, got {self.kl!r}")
        if self.kl_straight and self.kl is None:
            raise ValueError("kl_straight=True needs a KL estimator (kl is None)")

    @property
    def want_entropy(self) -> bool:
        """Whether the loss has an entropy term (and so reads the entropy)."""
        return self.entropy_coef != 0

    def kernel_args(self) -> TokenLossKernelScalars:
        """The runtime scalars, as Python floats in kernel order (one named tuple argument);
        memoized on the frozen scalars (built on every launch otherwise)."""
        return memoized(_KERNEL_ARGS, self, self._kernel_args)

    def _kernel_args(self) -> TokenLossKernelScalars:
        return TokenLossKernelScalars(
            norm_mult=float(self.norm_mult),
            denom_floor=float(self.denom_floor),
            clip_lo=float(self.clip_lo),
            clip_hi=float(self.clip_hi),
            delta=float(self.delta),
            dual_clip=float(self.dual_clip) if self.dual_clip is not None else 0.0,
            tau_pos=float(self.tau_pos),
            tau_neg=float(self.tau_neg),
            kl_coef=float(self.kl_coef),
            entropy_coef=float(self.entropy_coef),
        )


_KERNEL_ARGS: dict[TokenLossScalars, TokenLossKernelScalars] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class TokenLossPlan:
    """The per-token constants and scalars of one micro-batch's token-level loss, over the flat
    tokens ``[row0, row0 + n_tokens)`` (``[B, T]`` row-major, or the packed order).

    All tensors are on one device and are read, never written. "Per token" means a contiguous
    ``[n_tokens]`` tensor; "per sequence" an ``[S]`` tensor of a padded ``[S, seq_len]`` batch,
    read for token i at sequence ``(row0 + i) // seq_len`` (no broadcast copy).

    Attributes:
        ids: int (int64 from ``build_plan``) per token, the sampled token ids with ``ignore_index``
            at inactive (masked) tokens; pass them to a log-prob engine as its ids.
        old: fp32 per token, the behaviour policy's log-probs (ppo, cispo, sapo read them), or None
            for an on-policy loss: the kernels then use each token's own log-prob as old
            (ratio 1, its gradient that of logp).
        adv: fp32 advantages, per token, or per sequence when ``adv_per_seq``.
        ref: fp32 per token, the reference policy's log-probs; required when ``scalars.kl`` is set,
            else None.
        rollout_w: fp32 per token, the detached weight ρ_t of the policy term: a rollout
            correction's weight or the given ``rollout_weights``, times the NaN marker of rollout
            rejection (NaN where old or rollout log-probs are not finite), or None without any.
        factor: fp32 aggregation factor (1/n_i for ``seq-mean-token-mean``), per token, or per
            sequence when ``factor_per_seq``; None means 1.
        denom: 0-dim tensor (any numeric dtype), the aggregation denominator read on the device (an
            active-token or sequence count, or a device normalizer), or None.
        scalars: the loss's :class:`TokenLossScalars`.
        seq_len: the padded sequence length (≥ 1) of the per-sequence reads.
        adv_per_seq, factor_per_seq: ``adv`` / ``factor`` are per sequence.
        row0: the flat index of ``ids[0]`` in the whole micro-batch (0 for a whole plan; a row
            range from :meth:`rows` keeps the per-sequence tensors whole and offsets by it).
        ignore_index: the id that marks inactive tokens.

    Raises:
        TypeError / ValueError: naming the field, for a tensor of the wrong kind, dims, size or
        device, or flags that do not match the tensors.
    """

    ids: torch.Tensor
    old: torch.Tensor | None
    adv: torch.Tensor
    ref: torch.Tensor | None
    rollout_w: torch.Tensor | None
    factor: torch.Tensor | None
    denom: torch.Tensor | None
    scalars: TokenLossScalars
    seq_len: int
    adv_per_seq: bool
    factor_per_seq: bool
    row0: int = 0
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self):
        if not isinstance(self.scalars, TokenLossScalars):
            raise TypeError(f"scalars must be a TokenLossScalars, got {type(self.scalars).__name__}")
        ids = check.int_tensor("ids", self.ids)
        if ids.dim() != 1:
            raise ValueError(f"ids must be flat [N], got {check.describe(ids)}")
        if self.seq_len < 1 or self.row0 < 0:
            raise ValueError(f"seq_len must be >= 1 and row0 >= 0, got {self.seq_len} and {self.row0}")
        if self.factor_per_seq and self.factor is None:
            raise ValueError("factor_per_seq=True needs a factor tensor (factor is None)")
        if self.scalars.kl is not None and self.ref is None:
            raise ValueError(f"ref is required with a KL term (scalars.kl={self.scalars.kl!r})")
        n = ids.numel()
        # A per-sequence tensor must cover every sequence that tokens [row0, row0 + n) fall in.
        n_seqs = math.ceil((self.row0 + n) / self.seq_len)
        floats = (  # (name, tensor, per sequence, optional)
            ("old", self.old, False, True),
            ("adv", self.adv, self.adv_per_seq, False),
            ("ref", self.ref, False, True),
            ("rollout_w", self.rollout_w, False, True),
            ("factor", self.factor, self.factor_per_seq, True),
        )
        for name, t, per_seq, optional in floats:
            if t is None and optional:
                continue
            check.float_tensor(name, t)
            if t.dim() != 1 or (t.numel() < n_seqs if per_seq else t.numel() != n):
                want = f"[S >= {n_seqs}] (one per sequence)" if per_seq else f"[{n}] (one per token)"
                raise ValueError(f"{name} must be {want}, got {check.describe(t)}")
            check.same_device(name, t, "ids", ids.device)
        if self.denom is not None:
            if check.tensor("denom", self.denom).dim() != 0:
                raise ValueError(f"denom must be a 0-dim tensor, got {check.describe(self.denom)}")
            check.same_device("denom", self.denom, "ids", ids.device)

    @property
    def n_tokens(self) -> int:
        """N, the number of tokens (rows) the plan covers."""
        return self.ids.numel()

    @property
    def want_entropy(self) -> bool:
        """Whether the loss has an entropy term (``scalars.entropy_coef != 0``)."""
        return self.scalars.want_entropy

    def rows(self, start: int, stop: int) -> TokenLossPlan:
        """The plan of tokens ``[start, stop)`` of this one (views, no copies): per-token tensors are
        sliced, per-sequence ones and the 0-dim ``denom`` are kept whole, ``row0`` moves by ``start``.
        The whole range is the plan itself (the logits path's one call: no slicing, no checks)."""
        if start == 0 and stop == self.n_tokens:
            return self

        def cut(t: torch.Tensor | None, per_seq: bool = False) -> torch.Tensor | None:
            return t if t is None or per_seq else t[start:stop]

        return dataclasses.replace(
            self,
            ids=cut(self.ids),
            old=cut(self.old),
            adv=cut(self.adv, self.adv_per_seq),
            ref=cut(self.ref),
            rollout_w=cut(self.rollout_w),
            factor=cut(self.factor, self.factor_per_seq),
            row0=self.row0 + start,
        )

    def take(self, index: torch.Tensor) -> TokenLossPlan:
        """The plan of the tokens at positions ``index`` (int64 ``[n]`` into this plan's rows, e.g.
        the active rows of a compacted chunk): per-token tensors gathered, per-sequence ones gathered
        per token (``adv``/``factor`` become per token, so ``row0`` no longer matters), ``denom``
        kept. Each token keeps the constants it has here, so its loss terms and coefficients are
        the same numbers; device ops only, no host sync."""
        seq = None

        def gather(t: torch.Tensor | None, per_seq: bool = False) -> torch.Tensor | None:
            nonlocal seq
            if t is None:
                return None
            if not per_seq:
                return t.index_select(0, index)
            if seq is None:
                seq = (index + self.row0).div(self.seq_len, rounding_mode="floor")
            return t.index_select(0, seq)

        return dataclasses.replace(
            self,
            ids=gather(self.ids),
            old=gather(self.old),
            adv=gather(self.adv, self.adv_per_seq),
            ref=gather(self.ref),
            rollout_w=gather(self.rollout_w),
            factor=gather(self.factor, self.factor_per_seq),
            adv_per_seq=False,
            factor_per_seq=False,
            row0=0,
        )

    def kernel_inputs(self, absent: torch.Tensor) -> TokenLossKernelInputs:
        """The per-token input pointers in kernel order; ``absent`` (any tensor on the device, never
        read) stands in for the inputs the plan does not have."""

        def given(t: torch.Tensor | None) -> torch.Tensor:
            return t if t is not None else absent

        return TokenLossKernelInputs(
            old=given(self.old),
            adv=self.adv,
            ref=given(self.ref),
            rollout_w=given(self.rollout_w),
            factor=given(self.factor),
            denom=given(self.denom),
        )

    def kernel_branches(self) -> TokenLossBranches:
        """The kernels' constexpr branch choices for this plan (one compiled kernel per value)."""
        return _branches(
            self.scalars, self.old is not None, self.rollout_w is not None, self.factor is not None,
            self.denom is not None, self.adv_per_seq, self.factor_per_seq,
        )  # fmt: skip

    # ------------------------------------------------------------------ as custom-op arguments
    def op_args(self) -> tuple:
        """The plan flattened into ``torch.library`` schema types (tensors, two ``str``, ``float[]``,
        ``int[]``), in the order of :meth:`from_op_args`: how a registered custom op
        (``rlkernel::token_loss_from_logits``) receives it under ``torch.compile``."""
        s = self.scalars
        floats = [s.clip_lo, s.clip_hi, s.delta, math.nan if s.dual_clip is None else s.dual_clip,
                  s.tau_pos, s.tau_neg, s.kl_coef, s.entropy_coef, s.norm_mult, s.denom_floor]  # fmt: skip
        flags = [int(s.kl_straight), int(s.dual_clip is not None), int(self.seq_len), int(self.adv_per_seq),
                 int(self.factor_per_seq), int(self.row0), int(self.ignore_index)]  # fmt: skip
        tensors = (self.ids, self.old, self.adv, self.ref, self.rollout_w, self.factor, self.denom)
        return (*tensors, s.loss, s.kl or "", [float(f) for f in floats], flags)

    @classmethod
    def from_op_args(
        cls, ids, old, adv, ref, rollout_w, factor, denom, loss, kl, floats, flags
    ) -> TokenLossPlan:
        """The plan that :meth:`op_args` flattened."""
        clip_lo, clip_hi, delta, dual, tau_pos, tau_neg, kl_coef, entropy_coef, norm_mult, floor = floats
        kl_straight, has_dual, seq_len, adv_per_seq, factor_per_seq, row0, ignore_index = flags
        scalars = TokenLossScalars(
            loss=loss, clip_lo=clip_lo, clip_hi=clip_hi, delta=delta,
            dual_clip=dual if has_dual else None, tau_pos=tau_pos, tau_neg=tau_neg,
            kl=kl or None, kl_straight=bool(kl_straight), kl_coef=kl_coef,
            entropy_coef=entropy_coef, norm_mult=norm_mult, denom_floor=floor,
        )  # fmt: skip
        return cls(
            ids=ids, old=old, adv=adv, ref=ref, rollout_w=rollout_w, factor=factor, denom=denom,
            scalars=scalars, seq_len=seq_len, adv_per_seq=bool(adv_per_seq),
            factor_per_seq=bool(factor_per_seq), row0=row0, ignore_index=ignore_index,
        )  # fmt: skip


# ------------------------------------------------------------------------ the device-built plan
COUNT_NONE, COUNT_TOKENS, COUNT_SEQS = 0, 1, 2  # what the mask-count kernel counts for the denominator


class DevicePlan(NamedTuple):
    """A token-level loss over a padded ``[S, T]`` batch whose count-derived constants, masked ids
    and id check the kernels compute themselves (``rlkernel.kernels.token_loss_rows``), so that the
    host launches two kernels instead of building a :class:`TokenLossPlan` with torch ops.

    The kernels then see the same per-token constants a :class:`TokenLossPlan` of the batch holds:
    ``ids`` = ``max(token_id, -1)`` where ``mask != 0``, ``ignore_index`` elsewhere; the
    aggregation's denominator counted from the mask (``count``: active tokens for ``token-mean``,
    sequences with an active token for the ``seq-mean-*`` modes) unless a global normalizer is
    given (``denom`` / ``scalars.norm_mult``); ``seq-mean-token-mean``'s factor 1/max(n_i, 1) per
    sequence (``factor_per_seq``). Same bits, fewer host operations. (A named tuple, not a
    dataclass: it is built on every call, and its construction is host time before the kernels.)

    Attributes:
        token_ids: int ``[S, T]`` (contiguous, any integer dtype): the sampled ids as given; the
            kernels read every per-token tensor flat, by offset.
        mask: ``[S, T]`` (contiguous, bool / integer / floating): active where ``!= 0``.
        old, adv, ref: as :class:`TokenLossPlan`'s, as given (contiguous ``[S, T]``, ``adv`` also
            ``[S]``; any float dtype, read as fp32, never written: no detached copy is needed).
        scalars: the loss's :class:`TokenLossScalars`.
        seq_len: T.
        n_seqs: S.
        adv_per_seq: ``adv`` is ``[S]``.
        count: ``COUNT_NONE`` (a global normalizer, or ``token-sum``), ``COUNT_TOKENS`` or
            ``COUNT_SEQS``: what the denominator counts.
        denom: a 0-dim device normalizer (``count == COUNT_NONE``), or None.
        factor_per_seq: ``seq-mean-token-mean``'s 1/n_i factor.
        check_ids: count the active ids outside ``[0, V)`` (the deferred id check).
        ignore_index: the id given to inactive tokens.
    """

    token_ids: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor | None
    adv: torch.Tensor
    ref: torch.Tensor | None
    scalars: TokenLossScalars
    seq_len: int
    n_seqs: int
    adv_per_seq: bool
    count: int
    denom: torch.Tensor | None
    factor_per_seq: bool
    check_ids: bool
    ignore_index: int = IGNORE_INDEX

    @property
    def want_entropy(self) -> bool:
        """Whether the loss has an entropy term (``scalars.entropy_coef != 0``)."""
        return self.scalars.want_entropy

    def kernel_inputs(
        self, counts: torch.Tensor, factor: torch.Tensor, absent: torch.Tensor
    ) -> TokenLossKernelInputs:
        """The per-token pointers in kernel order; ``counts`` (int64, its element 0 the counted
        denominator) and ``factor`` (fp32 ``[S]``) are the mask-count kernel's outputs."""
        denom = counts if self.count != COUNT_NONE else self.denom
        return TokenLossKernelInputs(
            old=self.old if self.old is not None else absent,
            adv=self.adv,
            ref=self.ref if self.ref is not None else absent,
            rollout_w=absent,
            factor=factor if self.factor_per_seq else absent,
            denom=denom if denom is not None else absent,
        )

    def kernel_branches(self) -> TokenLossBranches:
        """The constexpr branch choices (those of the equivalent :class:`TokenLossPlan`); memoized,
        a function of the scalars and four flags."""
        key = (self.scalars, self.old is not None, self.factor_per_seq, self.count, self.denom is not None,
               self.adv_per_seq)  # fmt: skip
        return memoized(_BRANCHES, key, lambda: _branches(
            self.scalars, self.old is not None, False, self.factor_per_seq,
            self.count != COUNT_NONE or self.denom is not None, self.adv_per_seq, self.factor_per_seq,
        ))  # fmt: skip


_BRANCHES: dict[tuple, TokenLossBranches] = {}


def _branches(
    s: TokenLossScalars,
    has_old: bool,
    has_rollout: bool,
    has_factor: bool,
    has_denom: bool,
    adv_per_seq: bool,
    factor_per_seq: bool,
) -> TokenLossBranches:
    """The constexpr branch choices of a token-level loss: its scalars and which inputs it has."""
    return TokenLossBranches(
        LOSS=LOSS_CODES[s.loss],
        KL=KL_CODES[s.kl],
        KL_STRAIGHT=bool(s.kl_straight),
        HAS_DUAL=s.dual_clip is not None,
        HAS_OLD=has_old,
        HAS_ENTROPY=s.want_entropy,
        HAS_ROLLOUT=has_rollout,
        HAS_FACTOR=has_factor,
        HAS_DENOM=has_denom,
        ADV_PER_SEQ=bool(adv_per_seq),
        FACTOR_PER_SEQ=bool(factor_per_seq),
    )


# ------------------------------------------------------------- the device-built sequence-level plan
class DeviceSeqPlan(NamedTuple):
    """A sequence-ratio loss (gspo, gspo_token, gmpo in closed form, :mod:`rlkernel.rl.seq_token_loss`)
    over a padded ``[S, T]`` batch whose counts, masked ids and id check the kernels compute
    themselves (``rlkernel.kernels.seq_plan``): three launches forward, no plan built with torch ops.

    Attributes:
        tokens: the policy-free :class:`DevicePlan` of the batch (its ``scalars`` are those of
            ``plan_from_batch(..., policy_term=False)``: the KL and entropy terms and the
            aggregation; ``old``/``adv`` are the call's own, read by the sequence kernel).
        kind: ``"gspo"``, ``"gspo_token"`` or ``"gmpo"``.
        geo_mean: the sequence ratio is the geometric mean of the token ratios (else their product).
        clip_lo, clip_hi: the ratio clip interval; eps_low, eps_high: gmpo's log-ratio caps;
        log_ratio_max: gspo's clamp of log s.
    """

    tokens: DevicePlan
    kind: str
    geo_mean: bool
    clip_lo: float
    clip_hi: float
    eps_low: float
    eps_high: float
    log_ratio_max: float

    @property
    def want_entropy(self) -> bool:
        return self.tokens.scalars.want_entropy

    @property
    def check_ids(self) -> bool:
        return self.tokens.check_ids

    @property
    def ignore_index(self) -> int:
        return self.tokens.ignore_index

    def kernel_inputs(
        self, counts: torch.Tensor, factor: torch.Tensor, zero_adv: torch.Tensor, absent: torch.Tensor
    ) -> TokenLossKernelInputs:
        """The policy-free token terms' pointers: ``zero_adv`` (fp32 ``[S]`` zeros, written by the
        rows kernel) is the advantage of the policy-free plan's ``reinforce`` term (0: no term), which
        has no old log-probs (the sequence kernel reads the call's)."""
        return self.tokens.kernel_inputs(counts, factor, absent)._replace(old=absent, adv=zero_adv)

    def kernel_branches(self) -> TokenLossBranches:
        """The branches of the policy-free plan that ``plan_from_batch(..., policy_term=False)``
        gives for the same batch (no old, per-sequence zero advantages); memoized."""
        p = self.tokens
        has_denom = p.count != COUNT_NONE or p.denom is not None
        key = ("seq", p.scalars, p.factor_per_seq, has_denom)
        return memoized(_BRANCHES, key, lambda: _branches(
            p.scalars, False, False, p.factor_per_seq, has_denom, True, p.factor_per_seq,
        ))  # fmt: skip
