"""The chunk engine's back ends that store each chunk's logits: a GEMM writes them (cuBLAS, or the
batch-invariant GEMM), then the log-softmax kernels of :mod:`rlkernel.kernels.logprobs` read them.

Every chunk is ``chunk_rows`` rows (the chunk rule: cuBLAS picks its algorithm by shape, so a row's
bits would change with a shorter last chunk), its tail zero rows with ``ignore_index`` ids. The
logits live in a ``[C, V]`` buffer of their dtype, or, when that is the input dtype, in the chunk's
rows of the gradient buffer, where the backward kernel then writes the gradient in place.

* :class:`CublasEngine`: ``torch.mm`` with an fp32 output from 16-bit operands where torch has
  ``mm(out_dtype=...)`` (the option ``linear_logits_dtype="fp32"``), the bias added after, in the
  logits' dtype. On CPU (interpreter tests) fp32 logits come from an fp32 weight copy per call.
* :class:`InvariantGemmEngine`: ``kernels.matmul.matmul_into`` (the kernel, configuration table
  and bias-before-rounding of a patched model's LM head), in that LM head's output dtype; it is
  row invariant at any M, so it computes a chunk's real rows only (the pad rows, ignored, are never
  read).
"""

from __future__ import annotations

import torch

from rlkernel._options import MatmulThresholds
from rlkernel.kernels import logprobs as lk
from rlkernel.ops._linear_engine_base import Chunk, ChunkEngine, ChunkGeometry
from rlkernel.ops._linear_grads import mm_out_dtype_supported, padded_fp32


class StoredLogitsEngine(ChunkEngine):
    """Chunk logits written by a GEMM (:meth:`write_logits`, the subclass's), then the log-softmax
    forward and backward kernels over them; ``chunk_rows`` rows per chunk."""

    pads_chunks = True

    def __init__(self, hidden, weight, ids, temperature, ignore_index, geometry: ChunkGeometry,
                 dweight_accum: str, row_index=None, hidden_index=None):  # fmt: skip
        super().__init__(hidden, weight, ids, temperature, ignore_index, geometry, dweight_accum,
                         row_index, hidden_index)  # fmt: skip
        # Logits in the input dtype live in the gradient buffer (the backward kernel overwrites them
        # in place); others in a [C, V] buffer made on first use.
        self.logits_in_grad = geometry.logits_dtype == hidden.dtype
        self._logits_buf = None
        self._layout = None  # the kernels' row layout of a [C, V] chunk (the same for every chunk)

    def write_logits(self, hidden_rows: torch.Tensor, z: torch.Tensor, cnt: int) -> None:
        """``z [C, V]`` = the logits of the chunk's staged ``hidden_rows [C, H]`` (``cnt`` real)."""
        raise NotImplementedError

    @property
    def logits_buf(self) -> torch.Tensor:
        """The logits of one chunk ``[C, V]`` in their dtype (allocated once, on first use)."""
        if self._logits_buf is None:
            self._logits_buf = torch.empty(
                self.chunk_rows, self.vocab, dtype=self.logits_dtype, device=self.hidden.device
            )
        return self._logits_buf

    def chunk_logits(self, k: int, n: int) -> tuple[slice, torch.Tensor]:
        """Chunk k's rows of the staged group (whose first ``n`` rows are real) and its logits."""
        c = self.chunk_rows
        sl = slice(k * c, (k + 1) * c)
        z = self.grad_buf[sl] if self.logits_in_grad else self.logits_buf
        self.write_logits(self.hidden_buf[sl], z, min(c, n - k * c))
        if self._layout is None:
            self._layout = lk.row_layout(z)
        return sl, z

    def _stats(self, sl: slice, z: torch.Tensor, with_entropy: bool):
        """The forward kernel over one chunk: fp32 ``(logp, entropy or None, lse)``, C rows each."""
        c, dev = self.chunk_rows, z.device
        lp = torch.empty(c, dtype=torch.float32, device=dev)
        ls = torch.empty(c, dtype=torch.float32, device=dev)
        en = torch.empty(c, dtype=torch.float32, device=dev) if with_entropy else None
        lk.token_logprobs_fwd_into_unchecked(
            z, self._layout, self.ids_buf[sl], lp, en, ls, self.temperature, self.ignore_index
        )
        return lp, en, ls

    def _logits_grad(self, sl: slice, z: torch.Tensor, lse, entropy, g_logp, g_ent) -> None:
        """The chunk's logits gradient into rows ``sl`` of the gradient buffer, C contiguous fp32
        rows per vector (``z`` itself, in place, or a buffer of the logits' strides: one pass, the
        kernel casts on store)."""
        layout = self._layout
        lk.token_logprobs_bwd_into_unchecked(
            z, layout, self.ids_buf[sl], lse, entropy if g_ent is not None else None, g_logp, g_ent,
            self.grad_buf[sl], layout[1:], self.temperature, self.ignore_index,
        )  # fmt: skip

    # --------------------------------------------------------------------------------- protocol
    def forward_chunk(self, k: int, cnt: int, with_entropy: bool, keep_logits: bool) -> Chunk:
        c = self.chunk_rows
        sl, z = self.chunk_logits(k, k * c + cnt)
        lp, en, ls = self._stats(sl, z, with_entropy)
        return Chunk(sl, cnt, lp, en, ls, z)

    def chunk_grad(self, chunk: Chunk, g_logp, g_ent) -> None:
        c, cnt = self.chunk_rows, chunk.real
        self._logits_grad(
            chunk.rows, chunk.logits, chunk.lse, chunk.entropy, padded_fp32(g_logp, c, 0, cnt),
            padded_fp32(g_ent if chunk.entropy is not None else None, c, 0, cnt),
        )  # fmt: skip

    def group_stats(self, n: int, with_entropy: bool):
        dev = self.hidden.device
        lp, ls = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2))
        en = torch.empty(n, dtype=torch.float32, device=dev) if with_entropy else None
        for k, cnt in self.chunks(n):
            sl, z = self.chunk_logits(k, n)
            c_lp, c_en, c_ls = self._stats(sl, z, with_entropy)
            r = slice(sl.start, sl.start + cnt)
            lp[r], ls[r] = c_lp[:cnt], c_ls[:cnt]
            if en is not None:
                en[r] = c_en[:cnt]
        return lp, en, ls

    def group_logits_grad(self, n: int, lse, entropy, g_logp, g_ent) -> None:
        c = self.chunk_rows
        for k, cnt in self.chunks(n):
            sl, z = self.chunk_logits(k, n)
            start = sl.start
            self._logits_grad(
                sl, z, padded_fp32(lse, c, start, cnt),
                None if g_ent is None else padded_fp32(entropy, c, start, cnt),
                padded_fp32(g_logp, c, start, cnt), padded_fp32(g_ent, c, start, cnt),
            )  # fmt: skip


class CublasEngine(StoredLogitsEngine):
    """Chunk logits from ``torch.mm`` (cuBLAS on the GPU), the bias added after, in their dtype."""

    backend = "cublas"

    @staticmethod
    def chunk_logits_dtype(hidden: torch.Tensor, logits_dtype: str) -> torch.dtype:
        """fp32 chunk logits from 16-bit operands (``logits_dtype="fp32"``) where torch can make
        them (the CPU: from an fp32 weight copy; a GPU: ``mm(out_dtype=fp32)``), else the input's."""
        dt = hidden.dtype
        if dt in (torch.float16, torch.bfloat16) and logits_dtype == "fp32":
            if hidden.device.type != "cuda" or mm_out_dtype_supported(hidden.device):
                return torch.float32
        return dt

    def __init__(self, hidden, weight, bias, ids, temperature, ignore_index, geometry: ChunkGeometry,
                 dweight_accum: str, row_index=None, hidden_index=None):  # fmt: skip
        # CPU (interpreter tests): no mm(out_dtype=...) there; an fp32 weight copy per call.
        fp32_copy = geometry.logits_dtype != hidden.dtype and hidden.device.type != "cuda"
        self.weight_fp32 = weight.float() if fp32_copy else None
        super().__init__(hidden, weight, ids, temperature, ignore_index, geometry, dweight_accum,
                         row_index, hidden_index)  # fmt: skip
        self.weight_t = weight.t()
        self.bias_logits = None if bias is None else bias.to(geometry.logits_dtype)

    def write_logits(self, hidden_rows: torch.Tensor, z: torch.Tensor, cnt: int) -> None:
        if self.weight_fp32 is not None:
            torch.mm(hidden_rows.float(), self.weight_fp32.t(), out=z)
        elif z.dtype != hidden_rows.dtype:
            torch.mm(hidden_rows, self.weight_t, out_dtype=z.dtype, out=z)
        else:
            torch.mm(hidden_rows, self.weight_t, out=z)
        if self.bias_logits is not None:
            z.add_(self.bias_logits)


class InvariantGemmEngine(StoredLogitsEngine):
    """Chunk logits from the batch-invariant GEMM of a patched model's LM head (its real rows).

    The chunk follows the gradient group (``chunk_follows_group``): that GEMM gives a row the same
    bits at any M, so the chunk may shrink with the group at no logp bit. Below H = 4096 the group is
    capped at max(1024, H) rows, and a chunk of 4096 rows would hold 4× the epilogue path's logits
    (anchor model, H = 1024, V = 151,936, training at T = 8192 on an H200, 2026-11-28: 1.25 GB of
    bf16 chunk logits alive at the step's peak, 3.62 GB against the unpatched model's 3.39 GB;
    ``benchmarks/results/mem_anchor_8k_h200_2026-11-28.txt``)."""

    backend = "invariant"
    chunk_follows_group = True

    @staticmethod
    def chunk_logits_dtype(hidden: torch.Tensor, logits_dtype: str) -> torch.dtype:
        """That LM head's output dtype: its fp32 accumulator, or rounded to the input dtype."""
        return torch.float32 if logits_dtype == "fp32" else hidden.dtype

    def __init__(self, hidden, weight, bias, ids, temperature, ignore_index, geometry: ChunkGeometry,
                 dweight_accum: str, row_index=None, hidden_index=None, *, table: str,
                 thresholds: MatmulThresholds):  # fmt: skip
        super().__init__(hidden, weight, ids, temperature, ignore_index, geometry, dweight_accum,
                         row_index, hidden_index)  # fmt: skip
        # The bias in its own dtype, added to the fp32 accumulator before the one rounding, as the
        # patched LM head does.
        self.bias = bias
        self.weight_t = weight.t()
        self.table, self.thresholds = table, thresholds  # the options matmul_table, matmul_thresholds

    def write_logits(self, hidden_rows: torch.Tensor, z: torch.Tensor, cnt: int) -> None:
        from rlkernel.kernels import matmul as mk  # imports the GEMM kernels on first use

        mk.matmul_into(
            hidden_rows[:cnt], self.weight_t, z[:cnt], bias=self.bias, table=self.table,
            thresholds=self.thresholds,
        )  # fmt: skip
