"""The chunk engine's back end on the LM-head GEMM with log-softmax epilogues
(:mod:`rlkernel.kernels.linear_head`): no chunk logits are stored.

* Statistics: the GEMM's epilogue reduces each logits tile to per-row partials, a combine kernel
  folds them into logp, entropy and lse (one launch per group in the primitive's forward, per
  chunk in the fused loss).
* Fused loss: the statistics GEMM also writes each logit's tile-shifted exponent, in 16 bits, into
  the chunk's rows of the gradient buffer (:class:`ShiftedLogits`); once the coefficients are known
  one elementwise kernel turns them into the logits gradient in place.
* Primitive backward: the GEMM is run again and its epilogue writes the logits gradient from the
  saved lse and entropy.

The kernels are row invariant at any M: chunks are not padded, and with default sizes the chunk
follows the group (a frozen weight's both shrink to ``FROZEN_WEIGHT_ROWS``). Launches go through
the kernels' unchecked entries: the operands are the engine's own buffers and the call's validated
weight, every per-row vector contiguous fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from rlkernel.kernels import linear_head as lh
from rlkernel.ops._linear_engine_base import Chunk, ChunkEngine, ChunkGeometry
from rlkernel.ops._linear_grads import padded_fp32


@dataclasses.dataclass
class ShiftedLogits:
    """A chunk's logits as the epilogue kernel keeps them for the gradient: ``exponents`` ``[n, V]``
    (input dtype; rows of the group's gradient buffer, overwritten by the gradient) holds
    ``(z − m_t)·log2 e`` per element, ``tile_max`` fp32 ``[n_tiles, n]`` the m_t of each row's
    column tiles (``kernels.linear_head.linear_head_stats_shifted``)."""

    exponents: torch.Tensor
    tile_max: torch.Tensor


class EpilogueEngine(ChunkEngine):
    """Statistics and logits gradients from the LM-head GEMM's epilogues (``kernels.linear_head``)."""

    backend = "epilogue"
    pads_chunks = False
    chunk_follows_group = True

    @staticmethod
    def chunk_logits_dtype(hidden: torch.Tensor, logits_dtype: str) -> torch.dtype:
        """fp32: the kernel's accumulator (it names the chunk rule's bytes per logit; none are stored)."""
        return torch.float32

    def __init__(self, hidden, weight, bias, ids, temperature, ignore_index, geometry: ChunkGeometry,
                 dweight_accum: str, row_index=None, hidden_index=None):  # fmt: skip
        del bias  # the kernel has no bias epilogue: epilogue_kernel_runs is False with one
        super().__init__(hidden, weight, ids, temperature, ignore_index, geometry, dweight_accum,
                         row_index, hidden_index)  # fmt: skip
        self.config = lh.default_config(hidden.dtype)

    def _stats(self, rows: slice, with_entropy: bool):
        """``(logp, lse, entropy or None)`` of staged rows ``rows``, no logits kept."""
        return lh.linear_head_stats_unchecked(
            self.hidden_buf[rows], self.weight, self.ids_buf[rows], self.temperature, self.ignore_index,
            with_entropy, self.config,
        )  # fmt: skip

    def forward_chunk(self, k: int, cnt: int, with_entropy: bool, keep_logits: bool) -> Chunk:
        start = k * self.chunk_rows
        sl = slice(start, start + cnt)  # the real rows only: no padding at any M
        if not keep_logits:
            lp, ls, en = self._stats(sl, with_entropy)
            return Chunk(sl, cnt, lp, en, ls)
        # The tile-shifted exponents go straight into the chunk's rows of the gradient buffer, where
        # chunk_grad turns them into the gradient in place: no fp32 chunk logits buffer.
        exponents = self.grad_buf[sl]
        lp, ls, en, tile_max = lh.linear_head_stats_shifted_unchecked(
            self.hidden_buf[sl], self.weight, self.ids_buf[sl], exponents, self.temperature,
            self.ignore_index, with_entropy, self.config,
        )  # fmt: skip
        return Chunk(sl, cnt, lp, en, ls, ShiftedLogits(exponents, tile_max))

    def chunk_grad(self, chunk: Chunk, g_logp, g_ent) -> None:
        cnt = chunk.real
        g_logp = padded_fp32(g_logp, cnt, 0, cnt)
        g_ent = padded_fp32(g_ent if chunk.entropy is not None else None, cnt, 0, cnt)
        shifted = chunk.logits
        lh.linear_head_grad_from_shifted_unchecked(
            shifted.exponents, shifted.tile_max, self.ids_buf[chunk.rows], chunk.lse,
            chunk.entropy if g_ent is not None else None, g_logp, g_ent, shifted.exponents,
            self.temperature, self.ignore_index, self.config,
        )  # fmt: skip

    def group_stats(self, n: int, with_entropy: bool):
        lp, ls, en = self._stats(slice(0, n), with_entropy)
        return lp, en, ls

    def group_logits_grad(self, n: int, lse, entropy, g_logp, g_ent) -> None:
        lh.linear_head_grad_into_unchecked(
            self.hidden_buf[:n], self.weight, self.ids_buf[:n], lse, entropy if g_ent is not None else None,
            g_logp, g_ent, self.grad_buf[:n], self.temperature, self.ignore_index, self.config,
        )  # fmt: skip
