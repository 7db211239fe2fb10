"""Sequence segmentation and loss aggregation for padded ``[B, T]`` or packed ``[N]`` token tensors.

Every per-token quantity of the RL algebra is brought to one layout, a padded ``[S, L]`` matrix
(S sequences, L = the longest one), by :class:`Segments`:

* padded input ``[B, T]``: S = B, L = T, the tensors are used as they are (no copy);
* packed input ``[N]`` with ``cu_seqlens`` ``[S + 1]``: sequence ``i`` is ``x[cu[i]:cu[i+1]]``, and
  it becomes row ``i`` of an ``[S, L]`` matrix, L = max length, filled with 0 (mask ``False``)
  past its end. The gather is differentiable, so gradients flow back to the packed stream.

Per-sequence sums are then plain ``sum(-1)`` reductions: deterministic (no atomics, run to run
bitwise equal), and one code path for both layouts, so packed and padded inputs agree to rounding
(a reduction over a wider padded row may associate its terms differently).

Aggregation (m = active-token mask, ℓ = per-token loss, n_i = Σ_t m_it, seqs = {i : n_i > 0}):

    token-mean                Σ mℓ / (global_tokens or Σ m)
    seq-mean-token-mean       Σ_i (Σ_t mℓ / n_i) / (global_seqs or |seqs|)
    seq-mean-token-sum        Σ mℓ / (global_seqs or |seqs|)
    seq-mean-token-sum-norm   Σ mℓ / ((global_seqs or |seqs|) · (norm_length or L))
    token-sum                 Σ mℓ                      (no normalizer; the global ones are ignored)

``token-sum`` is verl's ``loss_agg_mode="token-sum"``: verl returns Σ mℓ · dp_size, where the
``dp_size`` factor undoes the data-parallel gradient averaging of DDP/FSDP, as it does for every
mode; here, as for every mode, that factor is the caller's (multiply the loss by the world size
before ``backward()`` under DDP/FSDP). Its micro-batch losses add up to the step's loss without any
global count.

With global normalizers (the counts of the whole optimizer step, over all micro-batches and
data-parallel ranks) each micro-batch's loss is its share of the step's loss: the losses, and their
gradients, add up to those of the whole step. An empty batch (no active token) gives exactly 0
rather than 0/0, with local counts and with global ones: a global normalizer of 0 (a step that is
all-masked on every rank) included. A global normalizer that is 0, negative or not finite while the
batch has active tokens is inconsistent with it, and gives NaN.

Caveats:
    * Packed input is padded to ``[S, L]``; for very uneven lengths that is up to S·L elements per
      per-token tensor (small next to the ``[N, V]`` logits, but not free). Building the gather
      index reads ``cu_seqlens`` on the host (the validation does already).
    * ``seq-mean-token-sum-norm`` without ``norm_length`` divides by L: the padded width for padded
      input, the longest sequence for packed input. Micro-batches of different widths then use
      different constants; pass ``norm_length`` (e.g. the maximum response length) to make the
      normalizer a true constant (Dr. GRPO's ``MAX_TOKENS``).
    * verl before its global-batch rewrite divided ``seq-mean-token-sum-norm`` by L only (no
      sequence count); current verl and this module divide by both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)

Normalizer = float | torch.Tensor | None


@dataclass(frozen=True)
class Segments:
    """How a per-token tensor splits into sequences, and how to bring it to ``[S, L]``.

    Attributes:
        n_seqs: S, the number of sequences (rows of the padded layout).
        max_len: L, the padded width: T for padded input, the longest sequence for packed input.
        token_shape: the shape of the caller's per-token tensors (``(B, T)`` or ``(N,)``).
        gather_index: packed input only: int64 ``[S, L]`` indices into the packed stream, with
            ``N`` (one past the end, a zero slot) at padding positions; ``None`` for padded input.
    """

    n_seqs: int
    max_len: int
    token_shape: tuple[int, ...]
    gather_index: torch.Tensor | None = None

    @classmethod
    def padded(cls, shape: torch.Size | tuple[int, ...]) -> Segments:
        batch, width = shape
        return cls(n_seqs=int(batch), max_len=int(width), token_shape=(int(batch), int(width)))

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, n_tokens: int, device: torch.device) -> Segments:
        """From validated cumulative lengths ``[S + 1]`` (any device; read once on the host)."""
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        n_seqs = int(lengths.numel())
        max_len = int(lengths.max()) if n_seqs > 0 else 0
        pos = torch.arange(max_len, dtype=torch.int64)
        inside = pos[None, :] < lengths[:, None]
        index = torch.where(
            inside, starts[:, None] + pos[None, :], torch.full_like(inside, n_tokens, dtype=torch.int64)
        )
        return cls(
            n_seqs=n_seqs, max_len=max_len, token_shape=(int(n_tokens),), gather_index=index.to(device)
        )

    @property
    def is_packed(self) -> bool:
        return self.gather_index is not None

    def to_padded(self, x: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """``[B, T]`` → itself; packed ``[N]`` → ``[S, L]`` with ``fill`` past each sequence's end."""
        if self.gather_index is None:
            return x
        return torch.cat([x, x.new_full((1,), fill)])[self.gather_index]


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask``, exactly 0 elsewhere; the gradient at masked positions is exactly 0.

    ``torch.where`` rather than ``x * mask``: a NaN or inf at a masked position stays out of the
    result and out of the gradient (0 · NaN would be NaN).
    """
    return torch.where(mask, x, 0.0)  # a Python scalar: no 0-dim tensor (and no kernel) per call


def finite_or_nan(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every ±inf replaced by NaN (NaN stays NaN, finite values keep their bits).

    The RL algebra clamps log-ratios and KL values (verl's guards), and a clamp turns ±inf into a
    finite number: an input that was inf would silently become an ordinary-looking loss. Passing
    inputs through this first makes them NaN instead, which every later op propagates. The gradient
    passes through unchanged (the NaN branch is ``x + nan``, not a constant), so a token with a
    non-finite input also gets a NaN gradient rather than a silent 0.
    """
    finite = torch.isfinite(x.detach())
    return torch.where(finite, x, x + float("nan") if x.requires_grad else float("nan"))


def seq_sum(x: torch.Tensor, mask: torch.Tensor, cp=None) -> torch.Tensor:
    """``[S, L]`` → ``[S]``: Σ_t m_it x_it over the whole sequence.

    With ``cp`` (a :class:`rlkernel.rl.context_parallel.ContextParallel`: each rank holds a slice
    of every sequence) this rank's sum is all-reduced over the group, differentiably: the one place
    every sequence-level quantity of the algebra is summed across ranks. (``cp`` is untyped here:
    that module imports this one.)
    """
    local = masked(x, mask).sum(-1)
    return local if cp is None else cp.sum(local)


def seq_count(mask: torch.Tensor, dtype: torch.dtype, cp=None) -> torch.Tensor:
    """``[S, L]`` bool → ``[S]``: n_i = number of active tokens of each sequence (over every rank
    of ``cp``), as ``dtype``."""
    counts = mask.sum(-1) if cp is None else cp.seq_count(mask)
    return counts.to(dtype)


def seq_any(mask: torch.Tensor, cp=None) -> torch.Tensor:
    """``[S, L]`` bool → ``[S]`` bool: the sequence has an active token (on any rank of ``cp``)."""
    return mask.any(-1) if cp is None else cp.seq_count(mask) > 0


def seq_mean(x: torch.Tensor, mask: torch.Tensor, cp=None) -> torch.Tensor:
    """``[S]``: Σ_t m x / n_i, and exactly 0 for a sequence without active tokens."""
    return seq_sum(x, mask, cp) / seq_count(mask, x.dtype, cp).clamp_min(1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, cp=None) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (any shape); exactly 0 when nothing is active. With ``cp`` the
    mean over every rank's tokens (``x`` a per-token ``[S, L_r]`` slice; not differentiable)."""
    total, count = masked(x, mask).sum(), mask.sum()
    if cp is not None:
        total, count = cp.sum(total.detach()), cp.sum(count)
    return total / count.to(x.dtype).clamp_min(1)


def _global_divisor(value: Normalizer, like: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | float:
    """A global normalizer as the divisor of the aggregation.

    Itself when it is finite and > 0. When this call has no active token the loss is exactly 0
    whatever the normalizer (a normalizer of 0, as ``global_normalizers`` returns for a step that is
    all-masked on every rank, divides by 1 instead of giving 0/0 = NaN). A normalizer that is 0,
    negative or not finite while this call has active tokens does not count them: the divisor is
    NaN, so the loss is NaN rather than silently wrong (a tensor's value cannot be checked on the
    host without a sync; a Python number < 0 or not finite is rejected by the argument checks).
    """
    if not isinstance(value, torch.Tensor):
        value = float(value)
        if value > 0:  # the common case: no tensor op
            return value
        return torch.where(mask.any(), float("nan"), 1.0).to(like.dtype)
    # A CPU 0-dim tensor combines with a CUDA tensor without a copy; keep it where it is.
    device = like.device if value.device == like.device else value.device
    value = value.to(device=device, dtype=like.dtype)
    valid = torch.isfinite(value) & (value > 0)
    return torch.where(valid, value, torch.where(mask.any(), float("nan"), 1.0).to(like.dtype))


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: Normalizer = None,
    global_seqs: Normalizer = None,
    norm_length: int | None = None,
    width: int = 1,
    cp=None,
) -> torch.Tensor:
    """Reduce a per-token ``[S, L]`` loss to a scalar with one of :data:`AGGREGATIONS`.

    Args:
        loss: ``[S, L]`` float, per-token loss; values at masked positions are ignored (they may
            be garbage) and receive exactly zero gradient.
        mask: ``[S, L]`` bool, the active tokens.
        mode: one of :data:`AGGREGATIONS`.
        global_tokens: the token normalizer of ``token-mean`` (number, or 0-dim tensor); local Σm
            when ``None``. (``token-sum`` reads no normalizer.)
        global_seqs: the sequence normalizer of the ``seq-mean-*`` modes; the local number of
            sequences with at least one active token when ``None``.
        norm_length: the length constant of ``seq-mean-token-sum-norm``; ``width`` when ``None``.
        width: L, the padded width (used only as the default ``norm_length``; with ``cp``, the
            unsplit batch's).
        cp: context parallelism: ``loss`` and ``mask`` are this rank's slice of every sequence;
            the local counts (n_i, the active tokens and sequences) are those of every rank, and
            the result is this rank's share of the unsplit loss (the shares add up to it).

    Returns:
        0-dim tensor of ``loss.dtype``; exactly 0 (with zero gradients) when nothing is active, with
        local or global normalizers (a global normalizer of 0 included). A global normalizer that
        is 0, negative or not finite while tokens are active gives NaN.
    """
    dtype = loss.dtype
    if mode == "token-sum":
        return masked(loss, mask).sum()
    if mode == "token-mean":
        if global_tokens is None:
            count = mask.sum() if cp is None else cp.sum(mask.sum())
            tokens = count.to(dtype).clamp_min(1)
        else:
            tokens = _global_divisor(global_tokens, loss, mask)
        return masked(loss, mask).sum() / tokens
    counts = seq_count(mask, dtype, cp)
    if global_seqs is None:
        seqs = (counts > 0).sum().to(dtype).clamp_min(1)
    else:
        seqs = _global_divisor(global_seqs, loss, mask)
    if mode == "seq-mean-token-mean":
        return (seq_sum(loss, mask) / counts.clamp_min(1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return masked(loss, mask).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        length = norm_length if norm_length is not None else max(width, 1)
        return masked(loss, mask).sum() / (seqs * length)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
