"""Context parallelism for the RL algebra: :class:`ContextParallel`, the reductions a loss call makes
across the ranks of a ``cp_group`` when each rank holds a slice of the token positions of every
sequence.

Layout. The S sequences are the same on every rank of the group, in the same order; rank r holds
some positions of each (its per-token tensors are ``[S, T_r]`` padded, or packed ``[N_r]`` with its
own ``cu_seqlens``). Which positions: contiguous slices in rank order by default (rank 0 the first
piece of every sequence, rank 1 the next, …; pieces of any length, 0 included), or any partition
given by ``cp_positions`` (each local token's position in its sequence), e.g. Megatron's
load-balanced layout (``rlkernel.distributed.context_parallel_split``). The unsplit batch is the
one whose sequence i holds all its ranks' tokens at their positions: ``[S, Σ_r T_r]`` padded, or
packed with lengths n_i = Σ_r n_ir.

Exactness. Every quantity of the algebra is a per-token term, a sum over a sequence, or a sum over
the batch, and those sums do not depend on the order of the tokens (up to float rounding):

    per-sequence sum     Σ_{t ∈ i} x_t      = all_reduce_r(Σ_{t ∈ i, on r} x_t)        :meth:`seq_sum`
    per-sequence count   n_i                 the same on the mask                       :meth:`seq_count`
    per-sequence max     max_{t ∈ i} x_t     all_reduce MAX                             :meth:`max`
    batch sum / count    Σ_t x_t             all_reduce of the rank's sum               :meth:`sum`

so each rank computes, from the reduced sums, the same per-sequence quantities (ratios, normalizers,
corrections, masks) as the unsplit call, and its loss is the unsplit loss's sum restricted to its
own tokens: the rank losses add up to the unsplit loss. Where a reduced sum depends on the log-probs
(gspo's Σ_t m·lr, gmpo's capped sum, the ratio of a ratio-weighted KL) it goes through
:func:`rlkernel.ops.context_parallel.all_reduce_sum`, whose backward all-reduces the gradient: each
rank's gradient is then its slice of the unsplit gradient. The two batch-wide order statistics — the
top-entropy quantile and ``clip_cov``/``kl_cov``'s covariance selection — gather the (detached)
values of every rank into the unsplit ``[S, L]`` layout (:meth:`to_global`) and select there,
exactly as the unsplit call does (the same values in the same layout: the same bits).

Tensors in ``[S]`` (per sequence) computed from reduced sums are the same on every rank; tensors in
``[S, L_r]`` are the rank's own slice. The algebra's functions take ``cp=None`` (one rank: no
collective) or a :class:`ContextParallel` and reduce only what spans ranks.

Caveats:
    * Each reduction is a collective of the group: every rank makes the same calls in the same
      order. The algebra guarantees it when the ranks agree on the configuration and the layout,
      which :mod:`rlkernel.rl.context_parallel_checks` verifies at the door of every call.
    * Reading the width of a packed layout (``seq-mean-token-sum-norm`` without ``norm_length``)
      reads one all-reduced maximum on the host.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rlkernel.ops.context_parallel import all_reduce_sum
from rlkernel.rl.aggregate import Segments


@dataclasses.dataclass(eq=False)
class ContextParallel:
    """One call's context-parallel group and layout, agreed by every rank (built by
    :func:`rlkernel.rl.context_parallel_checks.agree_on_layout`).

    Attributes:
        group: the ``torch.distributed`` process group.
        rank, world: this rank's index in ``group`` and the group's size.
        device: where the group's collectives run (CUDA for NCCL, the CPU for gloo).
        segments: this rank's :class:`~rlkernel.rl.aggregate.Segments`.
        local_widths: every rank's padded width L_r (padded: T_r; packed: its longest piece).
        local_tokens: every rank's token count (the numel of its per-token tensors).
        positions: this rank's ``cp_positions`` (the per-token shape, int), or None for contiguous
            slices in rank order.
        advantages_per_seq: how every rank reads ``advantages`` (agreed: a rank whose own shapes
            are ambiguous follows the others').
    """

    group: object
    rank: int
    world: int
    device: torch.device
    segments: Segments
    local_widths: tuple[int, ...]
    local_tokens: tuple[int, ...]
    positions: torch.Tensor | None = None
    advantages_per_seq: bool = False
    _counts: list = dataclasses.field(default_factory=list, repr=False)
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------------------ reductions
    def _here(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over the ranks (differentiable when ``t`` requires grad: the backward all-reduces the
        gradient, :mod:`rlkernel.ops.context_parallel`)."""
        return all_reduce_sum(self._here(t), self.group).to(t.device)

    def _extreme(self, t: torch.Tensor, op) -> torch.Tensor:
        out = self._here(t.detach()).clone()
        dist.all_reduce(out, op=op, group=self.group)
        return out.to(t.device)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise max over the ranks (detached; NaN propagates)."""
        return self._extreme(t, dist.ReduceOp.MAX)

    def min(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise min over the ranks (detached; NaN propagates)."""
        return self._extreme(t, dist.ReduceOp.MIN)

    def seq_count(self, mask: torch.Tensor) -> torch.Tensor:
        """int64 ``[S]``: n_i, the active tokens of each sequence over every rank (``mask``:
        bool ``[S, L_r]``). One all-reduce per mask object, kept for the call."""
        for seen, counts in self._counts:
            if seen is mask:
                return counts
        counts = self.sum(mask.sum(-1, dtype=torch.int64))
        self._counts.append((mask, counts))  # holds the mask: its id cannot be reused meanwhile
        return counts

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``t`` of group rank ``src`` on every rank (a copy; bool tensors travel as uint8)."""
        out = self._here(t.detach()).clone()
        wire = out.to(torch.uint8) if out.dtype == torch.bool else out
        dist.broadcast(wire, src=dist.get_global_rank(self.group, src), group=self.group)
        return wire.to(t.dtype).to(t.device)

    # ------------------------------------------------------------------------------ the layout
    def _local_lengths(self) -> torch.Tensor:
        """int64 ``[S]`` on the collective device: the length of each sequence's piece here."""
        seg = self.segments
        if seg.gather_index is None:
            return torch.full((seg.n_seqs,), seg.max_len, dtype=torch.int64, device=self.device)
        n_tokens = seg.token_shape[0]
        return (seg.gather_index < n_tokens).sum(-1).to(self.device)

    def _all_lengths(self) -> torch.Tensor:
        """int64 ``[world, S]``: every rank's piece lengths (one all_gather, kept for the call)."""
        if "lengths" not in self._cache:
            mine = self._local_lengths()
            parts = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(parts, mine, group=self.group)
            self._cache["lengths"] = torch.stack(parts)
        return self._cache["lengths"]

    @property
    def width(self) -> int:
        """L, the padded width of the unsplit batch: Σ_r T_r (padded), the longest sequence (packed;
        one all-reduce and a host read, kept for the call)."""
        if "width" not in self._cache:
            if self.segments.gather_index is None:
                self._cache["width"] = sum(self.local_widths)
            else:
                total = self.sum(self._local_lengths())
                self._cache["width"] = int(total.max()) if total.numel() else 0
        return self._cache["width"]

    def global_positions(self) -> torch.Tensor:
        """int64 ``[S, L_r]`` on the collective device: the position in its sequence of each slot
        of this rank's padded layout (-1 past the end of its piece)."""
        if "positions" in self._cache:
            return self._cache["positions"]
        seg = self.segments
        if self.positions is not None:
            pos = seg.to_padded(self.positions.to(torch.int64), fill=-1).to(self.device)
        else:
            if seg.gather_index is None:
                offsets = torch.full((seg.n_seqs,), sum(self.local_widths[: self.rank]), dtype=torch.int64)
                offsets = offsets.to(self.device)
            else:
                offsets = self._all_lengths()[: self.rank].sum(0)
            local = torch.arange(seg.max_len, dtype=torch.int64, device=self.device)
            inside = local[None, :] < self._local_lengths()[:, None]
            pos = torch.where(inside, offsets[:, None] + local[None, :], -1)
        self._cache["positions"] = pos
        return pos

    def _gathered(self, x: torch.Tensor, fill) -> torch.Tensor:
        """``[world, S, max L_r]``: every rank's ``[S, L_r]`` ``x``, padded with ``fill``."""
        widest = max(self.local_widths)
        x = self._here(x.detach())
        wire = x.to(torch.uint8) if x.dtype == torch.bool else x
        wire = torch.nn.functional.pad(wire, (0, widest - wire.shape[-1]), value=fill)
        parts = [torch.empty_like(wire) for _ in range(self.world)]
        dist.all_gather(parts, wire.contiguous(), group=self.group)
        return torch.stack(parts)

    def to_global(self, x: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """``[S, L_r]`` on each rank → the unsplit ``[S, L]`` (the same on every rank; detached;
        ``fill`` at the padding slots). Two all_gathers the first time (the positions are kept)."""
        if "all_positions" not in self._cache:
            self._cache["all_positions"] = self._gathered(self.global_positions(), -1)
        pos = self._cache["all_positions"]  # [world, S, W]
        values = self._gathered(x, fill)
        n_seqs, width = self.segments.n_seqs, self.width
        out = torch.full((n_seqs, width + 1), fill, dtype=values.dtype, device=self.device)
        index = torch.where(pos >= 0, pos, width).permute(1, 0, 2).reshape(n_seqs, -1)
        out.scatter_(1, index, values.permute(1, 0, 2).reshape(n_seqs, -1))  # padding slots → column L
        return out[:, :width].to(x.dtype).to(x.device)

    def to_local(self, x: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """The unsplit ``[S, L]`` → this rank's ``[S, L_r]`` (``fill`` past the end of its piece)."""
        pos = self.global_positions().to(x.device)
        picked = x.gather(1, pos.clamp_min(0))
        return torch.where(pos >= 0, picked, fill)

