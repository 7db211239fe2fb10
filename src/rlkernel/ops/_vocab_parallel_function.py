"""The autograd Function of the vocab-parallel LM-head log-probs: chunked local GEMMs, collectives.

Vocab parallelism splits the LM-head weight ``[V, H]`` by rows: tensor-parallel rank r holds the
contiguous vocabulary range ``[vocab_start_r, vocab_start_r + V_r)``; hidden states and ids are
replicated. :class:`VocabParallelLinearLogprobs` turns one rank's shard into the full-vocabulary
log-probs (and entropy) on every rank.
:func:`~rlkernel.ops.vocab_parallel.vocab_parallel_linear_token_logprobs` validates the call across
ranks, resolves the options (:func:`half_gemm`, :func:`use_kernels`, :func:`default_chunk_rows`) and
applies it.

Algorithm (per chunk of rows, as in the reference ``_ChunkedLinearLogprobs``; z = logits / T in fp32,
fp64 for fp64 inputs; y = the target id):

    z       = (h @ W_r.T + b_r) / T                       local [n, V_r], never [n, V]
    m       = all_reduce(max_v z, MAX)                    collective 1: [n]
    s, t, q = Σ_v e^{z−m},  z_y − m (owner rank only, 0 elsewhere),  Σ_v e^{z−m}·(z − m)
    s, t, q = all_reduce([s; t; q], SUM)                  collective 2: [3, n] ([2, n] without entropy)
    lse     = m + log s,   logp = t − log s,   entropy = log s − q / s

so every rank ends with the same full-vocabulary ``logp``, ``entropy`` and ``lse`` (saved for
backward). Shifting by the global max before the sum keeps every ``e^{z−m} ≤ 1``, and writing the
entropy with ``z − m`` avoids the cancellation of ``lse − Σ p z`` at large logits. With the Triton
chunk math the ranks combine per-rank partials instead (:func:`_kernel_forward`), under the same two
collectives.

Backward recomputes each chunk's local logits and, with the saved global ``lse`` and ``entropy``
(p = e^{z − lse}, δ = one-hot of y, non-zero only on the owner rank):

    ∂z      = g_logp · (δ − p) / T  −  g_ent · p · (log p + entropy) / T          local [n, V_r]
    dW_r    = ∂zᵀ h (all rows, one GEMM) or Σ_chunks ∂zᵀ h (fp32 accumulator)    local
    db_r    = Σ_chunks Σ_rows ∂z                                                  local, fp32
    dhidden = all_reduce(∂z @ W_r, SUM)                                           collective 3, per chunk

``dhidden`` is reduced in fp32 (fp64) and cast once (:class:`_DhiddenReducer`), asynchronously on
NCCL's stream. With the Triton chunk math and n ≤ C + H rows (bf16; the single-GPU path's rule,
:func:`rlkernel.ops._linear_engine.whole_batch_fits`) the backward is whole-batch: one all-reduce of
dhidden for all rows, running under the one dweight GEMM, which replaces the fp32 accumulator
(every row's ∂z kept, about the accumulator's memory; dweight rounded once). Otherwise chunk by
chunk, each chunk's all-reduce under the next chunk's work, at most two in flight, so a 128k-token
batch never holds an ``[N, H]`` fp32 buffer. The forward takes each rank's statistics over its
shard for every row first, then combines them in one MAX and one SUM. Collectives run in a fixed
order, so results are run to run deterministic and every rank issues the same calls (the
whole-batch rule depends on n, H and C only, never on V_r or on which inputs need gradients).

Where the time went (4× H200, N = 8192, H = 4096, V = 151,936, 2026-11-28, before this layout): on
2 ranks 34.9 ms vs 50.8 on one GPU (1.46×); GEMMs 26.1 ms (at the single GPU's rate), the fp32
``[C, V_r]`` logits written and read by the log-prob kernels 2.4 ms, the fp32 dweight accumulator's
zero-fill, read-modify-write and cast ~1.2 ms, the blocking dhidden all-reduces ~1.1 ms, and the
rest host gaps. The epilogue GEMMs (no logits buffer), the whole-batch dweight and the overlapped
reduces remove the middle three (``benchmarks/NOTES.md`` has the measured outcome).

The two choices of a call, made by the caller from :class:`rlkernel.Options` and passed in:

* Local GEMMs (``tp_gemm``, :func:`half_gemm`): half-precision operands with fp32 output (cuBLAS
  ``torch.mm(out_dtype=torch.float32)``; the products of half-precision numbers are exact in fp32,
  so the logits differ from fp32 mode only by summation order), ∂z rounded to the operand dtype for
  the two backward GEMMs (gradients then differ from the reference by ~3e-3 in norm, the bf16
  rounding), as the single-GPU Triton path does; or the reference's fp32 GEMMs on the shard upcast
  once per call (an O(V_r·H) fp32 temporary). ``"auto"`` takes the half-operand GEMMs for bf16/fp16
  on CUDA (~10x the rate of an fp32 GEMM), fp32 elsewhere; ``"half"`` everywhere (on the CPU
  emulated with fp32 products of the same operands: for tests).
* Chunk math (``tp_elementwise``, :func:`use_kernels`, with half-operand GEMMs only): ``"auto"``
  runs the single-GPU path's Triton kernels in its large chunks (on CUDA, or in the CPU
  interpreter): without a bias on a Hopper GPU the epilogue GEMMs of
  :mod:`rlkernel.kernels.linear_head` (statistics and ∂z straight from the GEMM's fp32 tiles, no
  logits buffer; :func:`epilogue_runs`), else ``torch.mm`` into an fp32 ``[C, V_r]`` buffer read by
  the log-prob kernels (one read forward, one read + one bf16 write backward);
  ``"torch"`` PyTorch ops on fp32 ``[rows, V_r]`` chunks (~6 passes
  forward, ~8 backward), in the reference's 64 MiB chunks. 2× H200, N = 8192, V = 151,936: 34.8 vs
  81.9 ms fwd+bwd (``benchmarks/NOTES.md``, ``benchmarks/results/nccl_tp_check_h200x2_2026-11-22.log``).

Caveats:
    * Hidden states must be bitwise replicated across the group, and the upstream gradients of
      ``logp``/``entropy`` identical; every rank must run backward (``dhidden`` is an all-reduce).
    * Not traceable by ``torch.compile`` (``fullgraph=True`` breaks at the collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlkernel._autocast import without_autocast
from rlkernel.reference import logprobs as ref

# ------------------------------------------------------------------------------- the two choices
_out_dtype_ok: dict[torch.device, bool] = {}


def half_gemm(weight: torch.Tensor, tp_gemm: str) -> bool:
    """Whether the local GEMMs run on the half-precision operands, for ``tp_gemm`` = the option
    ``"auto" | "half" | "fp32"`` (see the module docstring)."""
    if weight.dtype not in (torch.float16, torch.bfloat16) or tp_gemm == "fp32":
        return False
    if tp_gemm == "half":
        return True
    if weight.device.type != "cuda":
        return False
    if weight.device not in _out_dtype_ok:  # probed once per device (older torch lacks out_dtype)
        try:
            a = torch.ones(16, 16, dtype=weight.dtype, device=weight.device)
            acc = torch.zeros(16, 16, dtype=torch.float32, device=weight.device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _out_dtype_ok[weight.device] = bool(torch.mm(a, a, out_dtype=torch.float32)[0, 0] == 16)
        except (RuntimeError, TypeError, NotImplementedError):
            _out_dtype_ok[weight.device] = False
    return _out_dtype_ok[weight.device]


def use_kernels(hidden: torch.Tensor, half: bool, tp_elementwise: str) -> bool:
    """Whether the chunk math runs on the Triton log-prob kernels, for ``tp_elementwise`` = the
    option ``"auto" | "torch"``: only with half-operand GEMMs, and where the kernels run (CUDA, or
    CPU tensors under the interpreter)."""
    if not half or tp_elementwise == "torch":
        return False
    from rlkernel._dispatch import interpreter_enabled, triton_available

    return triton_available() and (hidden.device.type == "cuda" or interpreter_enabled())


def default_chunk_rows(vocab_local: int, n: int, dtype: torch.dtype, kernels: bool) -> int:
    """Rows per chunk for the largest shard (the same on every rank). With the Triton chunk math:
    the single-GPU linear path's rule (an fp32 ``[C, V_r]`` chunk within its 1.28 GiB budget, C a
    power of two ≤ 4096): every chunk re-reads the weight shard in three GEMMs and read-modify-writes
    the fp32 dweight accumulator, so few large chunks cost far less than many small ones (2 vs 38 at
    N = 8192, V_r = 76k). Otherwise the reference's rule (the PyTorch chunk math holds several fp32
    chunk-sized temporaries)."""
    if kernels:
        from rlkernel.ops._linear_engine import chunk_rows_for

        del dtype  # the rule counts the fp32 chunk only (at the default budget)
        return max(1, min(n, chunk_rows_for(vocab_local, torch.float32)))
    return ref.chunk_rows_for(vocab_local, n)


# ------------------------------------------------------------------------------------- autograd
class _ShardGemms:
    """The three local GEMMs of one vocabulary shard, for one call (forward or backward).

    fp32 mode (the reference's): the shard is upcast once per call and every product is an fp32
    GEMM. Half mode: the operands stay bf16/fp16 and cuBLAS accumulates and writes fp32 (the
    products of half-precision numbers are exact in fp32, so the logits differ from fp32 mode only
    by summation order); ∂z is rounded to the operand dtype for ``∂z @ W`` and ``∂zᵀ h``.
    """

    def __init__(self, weight, bias, temperature, half):
        self.half = half
        self.acc = torch.float32 if half else ref.acc_dtype(weight)
        self.w = weight if half else weight.to(self.acc)
        self.b = None if bias is None else bias.to(self.acc)
        self.temperature = temperature

    @staticmethod
    def _mm(a, b):
        if a.device.type == "cuda":
            return torch.mm(a, b, out_dtype=torch.float32)
        return a.float() @ b.float()  # CPU emulation of half mode (tests): the same exact products

    def logits(self, h):
        """fp32 ``(h @ W_rᵀ + b_r) / T`` for one chunk of rows."""
        if not self.half:
            return ref.chunk_logits(h, self.w, self.b, self.temperature)
        z = self._mm(h, self.w.t())
        if self.b is not None:
            z += self.b
        return z.div_(self.temperature)

    def raw_logits(self, h):
        """fp32 ``h @ W_rᵀ + b_r`` (half mode; the kernels apply the temperature themselves)."""
        z = self._mm(h, self.w.t())
        if self.b is not None:
            z += self.b
        return z

    def operand(self, gz):
        return gz.to(self.w.dtype) if self.half else gz

    def grad_hidden(self, g, out=None):
        """``∂z @ W_r`` in fp32 (fp64), from :meth:`operand`; into ``out`` (contiguous rows) when
        given."""
        if out is None:
            return self._mm(g, self.w) if self.half else g @ self.w
        if self.half and g.device.type == "cuda":
            return torch.mm(g, self.w, out_dtype=torch.float32, out=out)
        return out.copy_(self._mm(g, self.w) if self.half else g @ self.w)

    def grad_weight(self, g, h):
        """``∂zᵀ h`` over every row in one GEMM, in the operand dtype (half mode: fp32 accumulation
        inside cuBLAS, one rounding, as the single-GPU path's whole-batch dweight)."""
        if g.device.type == "cuda":
            return torch.mm(g.t(), h)
        return (g.t().float() @ h.float()).to(self.w.dtype)  # CPU emulation (tests)

    def add_grad_weight(self, acc, g, h):
        """``acc += ∂zᵀ h`` (fp32 ``[V_r, H]``), from :meth:`operand`."""
        if not self.half:
            acc += g.t() @ h.to(acc.dtype)
        elif g.device.type == "cuda":
            torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
        else:
            acc += g.t().float() @ h.float()


class VocabParallelLinearLogprobs(torch.autograd.Function):
    """Chunked vocab-parallel ``hidden @ W_r.T + b_r`` → global logp/entropy; backward recomputes."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, ids, active, group, vocab_start, temperature, chunk_rows, want_ent, half,
        kernels,
    ):  # fmt: skip
        n = hidden.shape[0]
        gemms = _ShardGemms(weight, bias, temperature, half)
        acc = gemms.acc
        local = ids - vocab_start
        owned = active & (local >= 0) & (local < weight.shape[0])
        local = torch.where(owned, local, 0)
        lse = torch.zeros(n, dtype=acc, device=hidden.device)
        logp = torch.zeros_like(lse)
        entropy = torch.zeros_like(lse)
        kernel_ids = None
        if kernels:
            # The kernels' id per row: the local target on its owner rank; V_r (no one-hot here, the
            # row still counts) for an active row owned elsewhere; -1 (skipped) for ignored rows.
            kernel_ids = torch.where(owned, local, torch.where(active, weight.shape[0], -1))
            # This rank's statistics over its shard for every row, then one MAX and one SUM.
            lse_r, logp_r = torch.empty_like(lse), torch.empty_like(lse)
            ent_r = torch.empty_like(lse) if want_ent else None
            shard_stats = (lse_r, logp_r, ent_r)
            args = (kernel_ids, temperature, chunk_rows, want_ent, shard_stats)
            if epilogue_runs(weight, bias):
                _epilogue_shard_stats(hidden, weight, *args)
            else:
                _kernel_shard_stats(gemms, hidden, *args)
            _combine_across_ranks(lse_r, logp_r, ent_r, owned, group, want_ent, (lse, logp, entropy))
        else:
            _torch_forward(gemms, hidden, local, owned, group, chunk_rows, want_ent, (lse, logp, entropy))
        logp = torch.where(active, logp, 0.0)
        entropy = torch.where(active, entropy, 0.0)
        ctx.save_for_backward(hidden, weight, bias, local, owned, active, lse, entropy, kernel_ids)
        ctx.group, ctx.temperature, ctx.chunk_rows, ctx.want_ent = group, temperature, chunk_rows, want_ent
        ctx.half, ctx.kernels = half, kernels
        if not want_ent:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @without_autocast
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, local, owned, active, lse, entropy, kernel_ids = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, width = hidden.shape
        gemms = _ShardGemms(weight, bias, ctx.temperature, ctx.half)
        acc = gemms.acc
        g_logp = torch.where(active, grad_logp.to(acc), 0.0)
        g_ent = torch.where(active, grad_entropy.to(acc), 0.0) if ctx.want_ent else None
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        step = ctx.chunk_rows
        # Whole batch (Triton chunk math, few enough rows): one dhidden all-reduce over every row; with
        # a weight gradient every chunk's gradient rows stay alive and dweight is one GEMM at the end,
        # rounded once, instead of an fp32 [V_r, H] accumulator zero-filled, read and written per
        # chunk and cast. The choice depends on n, H and the chunk rows only (the same on every rank:
        # it fixes how many all-reduces the backward issues), never on V_r or on needs_input_grad.
        whole = ctx.kernels and _whole_batch(n, step, width, weight.dtype)
        keep = whole and need_w
        g_all = torch.empty(n, weight.shape[0], dtype=weight.dtype, device=weight.device) if keep else None
        frozen_w = whole and need_h and not keep  # dhidden's rows gathered for the one all-reduce
        dh_all = torch.empty(n, width, dtype=acc, device=hidden.device) if frozen_w else None
        d_weight = None
        if need_w and not whole:
            d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)  # fp32 accumulator
        epilogue = ctx.kernels and epilogue_runs(weight, bias)
        reducer = _DhiddenReducer(d_hidden, ctx.group) if need_h else None
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            g_ent_rows = None if g_ent is None else g_ent[rows]
            if ctx.kernels:
                out = g_all[rows] if keep else None
                args = (lse[rows], entropy[rows], g_logp[rows], g_ent_rows, ctx.temperature)
                if epilogue:
                    g = _epilogue_grad_chunk(hidden[rows], weight, kernel_ids[rows], *args, out)
                else:
                    g = _kernel_grad_chunk(gemms, hidden[rows], kernel_ids[rows], *args, out)
                if need_b:
                    d_bias += g.sum(0, dtype=acc)
            else:
                g_target = torch.where(owned[rows], g_logp[rows], 0.0)  # the one-hot: owner rank only
                args = (lse[rows], entropy[rows], g_logp[rows], g_target, g_ent_rows, ctx.temperature)
                gz = _torch_grad_chunk(gemms, hidden[rows], local[rows], *args)
                if need_b:
                    d_bias += gz.sum(0)
                g = gemms.operand(gz) if need_h or need_w else None
                del gz
            if dh_all is not None:
                gemms.grad_hidden(g, out=dh_all[rows])
            elif need_h and not whole:
                reducer.add(rows, gemms.grad_hidden(g))
            if need_w and not whole:
                gemms.add_grad_weight(d_weight, g, hidden[rows])
            del g
        if whole and need_h:
            # One all-reduce, on NCCL's stream under the dweight GEMM: no collective beside the
            # persistent gradient kernels, which want every SM (overlapping them with the per-chunk
            # reduces cost more than the reduces: 4x H200, 2026-11-28, benchmarks/NOTES.md).
            reducer.add(slice(0, n), dh_all if dh_all is not None else gemms.grad_hidden(g_all))
        if keep:
            d_weight = gemms.grad_weight(g_all, hidden)
            del g_all
        if need_h:
            reducer.finish()
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None, None, None


def _whole_batch(n: int, chunk_rows: int, width: int, dtype: torch.dtype) -> bool:
    """The single-GPU path's whole-batch rule (imported where the kernels run: the engine's module
    imports Triton)."""
    from rlkernel.ops._linear_engine import whole_batch_fits

    return whole_batch_fits(n, chunk_rows, width, dtype, torch.float32)


class _DhiddenReducer:
    """All-reduces dhidden chunk by chunk while the next chunks compute.

    Each chunk's fp32 (fp64) partial ``∂z @ W_r`` goes to one asynchronous SUM (NCCL runs it on its
    own stream after this stream's pending work); at most two are in flight (two fp32 chunk buffers
    alive), and a finished one is cast into ``d_hidden``. The order of the collectives (one per
    chunk, in row order) is the same on every rank, and each sum is taken by the same NCCL algorithm
    whatever overlaps it, so the result is as deterministic as the blocking form."""

    IN_FLIGHT = 2

    def __init__(self, d_hidden: torch.Tensor, group: object):
        self.d_hidden, self.group, self.pending = d_hidden, group, []

    def add(self, rows: slice, partial: torch.Tensor) -> None:
        work = dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.pending.append((rows, partial, work))
        if len(self.pending) > self.IN_FLIGHT:
            self._retire()

    def _retire(self) -> None:
        rows, partial, work = self.pending.pop(0)
        work.wait()  # this stream waits for the collective (the host does not, on NCCL)
        self.d_hidden[rows] = partial.to(self.d_hidden.dtype)

    def finish(self) -> None:
        while self.pending:
            self._retire()


def _torch_forward(gemms, hidden, local, owned, group, chunk_rows, want_ent, out):
    """Forward over all chunks in PyTorch ops (the reference's math): per chunk the global max by
    one MAX, then Σ e^{z−m}, the owner's z_y − m and Σ e^{z−m}(z − m) by one SUM (see the module
    docstring). Fills ``out = (lse, logp, entropy)``."""
    lse, logp, entropy = out
    n = hidden.shape[0]
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        z = gemms.logits(hidden[rows])
        m = z.amax(-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z -= m[:, None]  # in place: z − m ≤ 0, one [n, V_r] buffer fewer
        e = z.exp()
        target = torch.where(owned[rows], z.gather(-1, local[rows, None]).squeeze(-1), 0.0)
        parts = [e.sum(-1), target]
        if want_ent:
            # e·(z − m) with 0 where e = 0: a −inf logit has p = 0 and contributes nothing.
            parts.append(torch.where(e > 0, e * z, 0.0).sum(-1))
        sums = torch.stack(parts)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        log_s = sums[0].log()
        lse[rows] = m + log_s
        logp[rows] = sums[1] - log_s
        if want_ent:
            entropy[rows] = log_s - sums[2] / sums[0]


def _torch_grad_chunk(gemms, h, local, lse, entropy, g_logp, g_target, g_ent, temperature):
    """∂L/∂(h W_rᵀ + b_r) of one chunk in PyTorch ops (fp32, or fp64 for fp64 inputs):
    ``[g_logp·(δ − p) − g_ent·p·(log p + H)] / T``, the one-hot only on the owner rank."""
    z = gemms.logits(h)
    z -= lse[:, None]  # log p, in place
    p = z.exp()
    gz = p * -g_logp[:, None]
    gz.scatter_add_(-1, local[:, None], g_target[:, None])
    if g_ent is not None:
        log_p = torch.where(p > 0, z, 0.0)
        gz -= g_ent[:, None] * p * (log_p + entropy[:, None])
    return gz.div_(temperature)


def epilogue_runs(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the Triton chunk math runs as the epilogue GEMMs of :mod:`rlkernel.kernels.linear_head`
    on this shard (no bias: those kernels have none; a 16-bit, contiguous, TMA-aligned shard on a
    Hopper GPU or in the interpreter), rather than ``torch.mm`` into an fp32 ``[C, V_r]`` buffer plus
    the log-prob kernels. A per-rank choice: both forms issue the same collectives per chunk."""
    from rlkernel.kernels import linear_head  # the kernels import Triton: only where they run

    return bias is None and linear_head.can_run(weight)


def _combine_across_ranks(lse_r, logp_r, ent_r, owned, group, want_ent, out_rows) -> None:
    """Turn this rank's statistics into the global ones, on every rank (two collectives for all rows).

    In: this rank's ``lse_r`` = logsumexp over V_r of z/T, ``H_r`` = its entropy over V_r and, on the
    owner rank of a row's target, ``logp_r`` (so z_y/T = ``logp_r + lse_r``). With
    ``M = all_reduce(lse_r, MAX)`` and ``w_r = e^{lse_r − M}`` (≤ 1), one SUM of
    ``[w_r, z_y/T (owner) | 0, w_r·H_r, w_r·(M − lse_r)]`` gives, with ``S = Σ_r w_r``:
    ``lse = M + log S``, ``logp = z_y/T − lse`` and ``H = Σ_r (w_r/S)·(H_r + lse − lse_r)`` =
    ``(Σ w_r H_r + Σ w_r (M − lse_r))/S + log S``: every term ≥ 0, no cancellation. Fills
    ``out_rows = (lse, logp, entropy)``."""
    lse, logp, entropy = out_rows
    big = lse_r.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    w = torch.exp(lse_r - big)
    parts = [w, torch.where(owned, logp_r + lse_r, 0.0)]
    if want_ent:
        parts += [w * ent_r, w * (big - lse_r)]
    sums = torch.stack(parts)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    log_s = sums[0].log()
    lse.copy_(big + log_s)
    logp.copy_(sums[1] - lse)
    if want_ent:
        entropy.copy_((sums[2] + sums[3]) / sums[0] + log_s)


def _kernel_shard_stats(gemms, hidden, kernel_ids, temperature, chunk_rows, want_ent, out):
    """This rank's statistics over its shard, chunk by chunk: the Triton log-prob kernel on the raw
    logits (stored in an fp32 ``[C, V_r]`` buffer). Fills ``out = (lse_r, logp_r, ent_r)`` (``ent_r``
    None without entropy) as :func:`_combine_across_ranks` takes them."""
    from rlkernel.kernels import logprobs as kern

    lse_r, logp_r, ent_r = out
    n = hidden.shape[0]
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        z = gemms.raw_logits(hidden[rows])
        ent_rows = None if ent_r is None else ent_r[rows]
        kern.token_logprobs_fwd_into(
            z, kernel_ids[rows], logp_r[rows], ent_rows, lse_r[rows], temperature=temperature, ignore_index=-1
        )
        del z


def _epilogue_shard_stats(hidden, weight, kernel_ids, temperature, chunk_rows, want_ent, out):
    """:func:`_kernel_shard_stats` with the statistics GEMM of :mod:`rlkernel.kernels.linear_head`
    (the shard's logits never leave registers). Rows whose target another rank owns
    (``kernel_ids`` = V_r) pass id 0 to the kernel: their logp_r is not used (the owner's is),
    their lse_r and H_r are."""
    from rlkernel.kernels import linear_head

    lse_r, logp_r, ent_r = out
    cfg = linear_head.default_config(hidden.dtype)
    stats_ids = torch.where(kernel_ids == weight.shape[0], 0, kernel_ids)
    n = hidden.shape[0]
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        logp, lse, ent = linear_head.linear_head_stats_unchecked(
            hidden[rows], weight, stats_ids[rows], temperature, -1, want_ent, cfg
        )
        logp_r[rows], lse_r[rows] = logp, lse
        if want_ent:
            ent_r[rows] = ent


def _kernel_grad_chunk(gemms, h, kernel_ids, lse, entropy, g_logp, g_ent, temperature, out=None):
    """∂L/∂(h W_rᵀ + b_r) of one chunk in the operand dtype, from the Triton backward kernel on the
    recomputed raw logits: ``[g_logp·(δ − p) − g_ent·p·(log p + H)] / T`` with the global ``lse``
    and ``H`` (the one-hot only on the owner rank: ``kernel_ids`` is V_r elsewhere). Written into
    ``out`` (``[rows, V_r]``) when given."""
    from rlkernel.kernels import logprobs as kern

    z = gemms.raw_logits(h)
    g = torch.empty(z.shape, dtype=gemms.w.dtype, device=z.device) if out is None else out
    kern.token_logprobs_bwd_into(
        z,
        kernel_ids,
        lse,
        entropy if g_ent is not None else None,
        g_logp,
        g_ent,
        g,
        temperature=temperature,
        ignore_index=-1,
    )
    return g


def _epilogue_grad_chunk(h, weight, kernel_ids, lse, entropy, g_logp, g_ent, temperature, out=None):
    """The same gradient as :func:`_kernel_grad_chunk` from the gradient GEMM of
    :mod:`rlkernel.kernels.linear_head` (logits recomputed tile by tile, ∂z written once in the
    operand dtype; a target id of V_r matches no column, so no one-hot off the owner rank)."""
    from rlkernel.kernels import linear_head

    g = torch.empty(h.shape[0], weight.shape[0], dtype=weight.dtype, device=h.device) if out is None else out
    linear_head.linear_head_grad_into_unchecked(
        h, weight, kernel_ids, lse, entropy if g_ent is not None else None, g_logp, g_ent, g,
        temperature, -1, linear_head.default_config(h.dtype),
    )  # fmt: skip
    return g
