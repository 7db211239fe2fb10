"""The chunk engine's common part: one call's staging buffers and row bookkeeping, and the protocol
its GEMM back ends implement.

Rows go in *groups* of ``group_rows`` rows (the backward GEMMs' M, resp. K for dweight), each group
in *chunks* of ``chunk_rows`` rows (the logits GEMM's M: the unit of row invariance); a group is a
whole number of chunks. :class:`ChunkEngine` holds the group buffers (hidden rows ``[G, H]``, the
logits gradient ``[G, V]`` in the input dtype, the staged ids ``[G]``), stages a group's rows into
them (:meth:`ChunkEngine.stage`: compacted rows gathered, ignored rows zeroed, the tail padded),
and turns a group's logits gradient into dhidden, dweight and dbias (:meth:`ChunkEngine.group_grads`,
or :meth:`ChunkEngine.whole_buffers` for a whole batch). The back ends
(:mod:`rlkernel.ops._linear_stored_logits`: cuBLAS or the batch-invariant GEMM, then the
log-softmax kernels over stored chunk logits; :mod:`rlkernel.ops._linear_epilogue`: the LM-head GEMM
with log-softmax epilogues) produce the statistics and the logits gradient. The protocol, in the
order the autograd Functions of :mod:`rlkernel.ops._linear_function` call it::

    for rows in engine.groups():
        n, m = engine.stage(rows)                          # common: the group into the buffers
        # primitive forward: one call per group
        logp, entropy, lse = engine.group_stats(n, with_entropy)
        # fused loss forward: per chunk, statistics, then the coefficients' logits gradient
        for k, cnt in engine.chunks(n):
            chunk = engine.forward_chunk(k, cnt, with_entropy, keep_logits)
            engine.chunk_grad(chunk, g_logp, g_entropy)    # ∂L/∂z into the gradient buffer
        # primitive backward: the group's logits gradient from saved statistics
        engine.group_logits_grad(n, lse, entropy, g_logp, g_entropy)
        engine.group_grads(rows, n, m, dh, dw, db)         # common: dhidden, dweight, dbias

Which back end runs, and the chunk and group sizes: :func:`rlkernel.ops._linear_engine.make_engine`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from rlkernel.kernels.stage_rows import stage_rows_unchecked
from rlkernel.ops._linear_grads import WholeBatchGrad, accumulate_dweight


@dataclasses.dataclass(frozen=True)
class ChunkGeometry:
    """One call's chunk sizes (``rlkernel.ops._linear_engine.chunk_geometry``).

    Attributes:
        rows: the engine's rows (the active ones when compacted).
        chunk_rows: rows per chunk (C).
        group_rows: rows per group (G, a multiple of C), or with ``whole_batch`` every row (rounded
            up to whole chunks where the back end pads them).
        whole_batch: one group of every row, kept for dweight's single GEMM.
        logits_dtype: the chunk logits' dtype (the epilogue kernel: its fp32 accumulator).
    """

    rows: int
    chunk_rows: int
    group_rows: int
    whole_batch: bool
    logits_dtype: torch.dtype


@dataclasses.dataclass
class Chunk:
    """One chunk's forward results. ``rows``: its kernel rows in the staged group (``chunk_rows`` of
    them where the back end pads chunks, else the real ones); ``real``: how many are real rows (the
    first ones); ``logp``, ``entropy`` (None without), ``lse``: fp32, one per kernel row;
    ``logits``: what :meth:`ChunkEngine.chunk_grad` reads (the back end's: the chunk logits, the
    epilogue kernel's shifted exponents, or None when not kept)."""

    rows: slice
    real: int
    logp: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor
    logits: object = None


class ChunkEngine:
    """One call's staging buffers, row bookkeeping and gradient groups; a back end subclasses it.

    ``row_index`` (padding compaction): the int64 indices of the rows to process (the active ones, in
    order); the engine's rows are then those rows only, numbered ``0 … n − 1`` in that order
    (:meth:`groups` slices them), gathered into the staging buffer and scattered back into dhidden
    by :meth:`group_grads`. None: every row, in place. ``hidden_index``: where the rows of
    ``row_index`` are in ``hidden`` when that differs (a strided hidden read in place:
    ``_linear_rows.hidden_rows``); dhidden rows are scattered back there too.

    Class attributes a back end sets: ``backend`` (its name), ``pads_chunks`` (every chunk's
    kernels run over ``chunk_rows`` rows, the tail zero-padded: fixed-shape GEMMs), and
    ``chunk_follows_group`` (with default sizes the chunk shrinks to the group, and a frozen
    weight's both to ``FROZEN_WEIGHT_ROWS``: a kernel row invariant at any M).
    """

    backend: ClassVar[str] = ""
    pads_chunks: ClassVar[bool] = True
    chunk_follows_group: ClassVar[bool] = False

    def __init__(self, hidden, weight, ids, temperature, ignore_index, geometry: ChunkGeometry,
                 dweight_accum: str, row_index=None, hidden_index=None):  # fmt: skip
        # ids: every row's, flat and contiguous (staged by index when compacted)
        self.hidden, self.weight, self.ids = hidden, weight, ids
        self.temperature, self.ignore_index = float(temperature), int(ignore_index)
        self.row_index = row_index
        self.hidden_index = row_index if hidden_index is None else hidden_index
        self.rows = geometry.rows
        self.chunk_rows, self.group_rows = geometry.chunk_rows, geometry.group_rows
        self.whole_batch = geometry.whole_batch
        self.logits_dtype = geometry.logits_dtype
        self.vocab, self.hidden_size = weight.shape[0], hidden.shape[1]
        self.dweight_accum = dweight_accum
        dev, dt = hidden.device, hidden.dtype
        self.hidden_buf = torch.empty(self.group_rows, self.hidden_size, dtype=dt, device=dev)
        # Every id a kernel reads is staged (a group's rows, then ignore_index on its pad rows).
        self.ids_buf = torch.empty(self.group_rows, dtype=torch.int64, device=dev)
        self._grad_buf = None
        self.dweight_started = False  # the first group writes dweight (beta = 0), the others add

    @property
    def grad_buf(self) -> torch.Tensor:
        """The group's logits gradient ``[G, V]`` in the input dtype (made on first use: a forward
        that keeps no logits, the primitive's on the epilogue kernel, never needs its G·V·2 bytes)."""
        if self._grad_buf is None:
            self._grad_buf = torch.empty(self.group_rows, self.vocab, dtype=self.hidden.dtype,
                                         device=self.hidden.device)  # fmt: skip
        return self._grad_buf

    # ------------------------------------------------------------------------------ bookkeeping
    def padded_rows(self, n: int) -> int:
        """Rows of a group of n real rows: whole chunks (fixed-shape chunk GEMMs), or n itself."""
        return -(-n // self.chunk_rows) * self.chunk_rows if self.pads_chunks else n

    def groups(self):
        """A ``slice`` of the engine's rows per group."""
        for start in range(0, self.rows, self.group_rows):
            yield slice(start, min(start + self.group_rows, self.rows))

    def chunks(self, n: int):
        """``(k, real rows)`` of each chunk of a staged group of ``n`` real rows."""
        c = self.chunk_rows
        for k in range(-(-n // c)):
            yield k, min(c, n - k * c)

    def stage(self, rows: slice) -> tuple[int, int]:
        """Copy a group's hidden rows and ids into the fixed buffers (gathered by index when
        compacted; ignored rows zeroed, which compacted rows never are; the tail padded with zero
        rows and ignore_index ids), in one launch (``kernels.stage_rows``); returns (real rows,
        rows of whole chunks)."""
        n = rows.stop - rows.start
        m = self.padded_rows(n)
        stage_rows_unchecked(
            self.hidden_buf, self.ids_buf, self.hidden, self.ids, rows.start, n, m, self.ignore_index,
            self.hidden_index, self.row_index, zero_ignored=self.row_index is None,
        )  # fmt: skip
        return n, m

    # ----------------------------------------------------------------- the back end's protocol
    def group_stats(self, n: int, with_entropy: bool):
        """fp32 ``(logp, entropy or None, lse)`` ``[n]`` of a staged group (no logits kept)."""
        raise NotImplementedError

    def forward_chunk(self, k: int, cnt: int, with_entropy: bool, keep_logits: bool) -> Chunk:
        """Chunk k (``cnt`` real rows) of the staged group: its statistics, and with ``keep_logits``
        what :meth:`chunk_grad` needs."""
        raise NotImplementedError

    def chunk_grad(self, chunk: Chunk, g_logp, g_ent) -> None:
        """The chunk's logits gradient into its rows of the gradient buffer, from fp32 ``[real]``
        upstream gradients (None: zero; padded to the kernel rows here)."""
        raise NotImplementedError

    def group_logits_grad(self, n: int, lse, entropy, g_logp, g_ent) -> None:
        """The logits gradient of a staged group into the gradient buffer (whole chunks where they
        are padded, pad rows zero), from contiguous fp32 ``[n]`` per-row inputs (entropy and g_ent
        may be None)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------- gradients
    def group_grads(self, rows: slice, n: int, m: int, dh, dw, db) -> None:
        """dhidden rows, dweight and dbias contributions of the staged group (first m rows)."""
        g, hb = self.grad_buf[:m], self.hidden_buf[:m]
        if dh is not None:
            if self.row_index is not None:  # scattered back to the rows' places (the others stay 0)
                dh.index_copy_(0, self.hidden_index[rows], torch.mm(g, self.weight)[:n])
            elif n == m:
                torch.mm(g, self.weight, out=dh[rows])
            else:
                dh[rows] = torch.mm(g, self.weight)[:n]
        if dw is not None:
            # The first group writes (beta = 0): no zero-fill and no read of the V·H accumulator.
            first, self.dweight_started = not self.dweight_started, True
            for cols, part in dw.parts:  # ops._dweight_accum.DweightAccumulator: one or two row ranges
                accumulate_dweight(part, g.t() if cols is None else g[:, cols].t(), hb, first)
        if db is not None:
            db += g.sum(0, dtype=torch.float32)

    def whole_buffers(self) -> WholeBatchGrad:
        """The staged rows and their logits gradient after a whole-batch chunk loop (the real rows:
        the chunks' pad rows have zero gradient), for ``whole_batch_grads`` (now, or in the fused
        loss's backward)."""
        return WholeBatchGrad(self.grad_buf[: self.rows], self.hidden_buf[: self.rows], self.hidden_index)
