"""Vocab-parallel (tensor-parallel) LM-head log-probs and global loss normalizers, on torch.distributed.

Vocab parallelism (Megatron's ``VocabParallelEmbedding``/``ColumnParallelLinear`` LM head, verl's and
vLLM's TP layouts) splits the LM-head weight ``[V, H]`` by rows: tensor-parallel rank r holds the
contiguous vocabulary range ``[vocab_start_r, vocab_start_r + V_r)``, with ``vocab_start_r`` the sum
of the shard sizes of the lower ranks (shards in rank order; uneven sizes allowed). The hidden
states and token ids are replicated: every rank sees the same ``[N, H]`` and ``[N]``.

Algorithm (per chunk of rows, as in the reference ``_ChunkedLinearLogprobs``; z = logits / T in fp32,
fp64 for fp64 inputs; y = the target id):

    z       = (h @ W_r.T + b_r) / T                       local [n, V_r], never [n, V]
    m       = all_reduce(max_v z, MAX)                    collective 1: [n]
    s, t, q = Σ_v e^{z−m},  z_y − m (owner rank only, 0 elsewhere),  Σ_v e^{z−m}·(z − m)
    s, t, q = all_reduce([s; t; q], SUM)                  collective 2: [3, n] ([2, n] without entropy)
    lse     = m + log s,   logp = t − log s,   entropy = log s − q / s

so every rank ends with the same full-vocabulary ``logp``, ``entropy`` and ``lse`` (saved for
backward). Shifting by the global max before the sum keeps every ``e^{z−m} ≤ 1``, and writing the
entropy with ``z − m`` avoids the cancellation of ``lse − Σ p z`` at large logits.

Backward recomputes each chunk's local logits and, with the saved global ``lse`` and ``entropy``
(p = e^{z − lse}, δ = one-hot of y, non-zero only on the owner rank):

    ∂z      = g_logp · (δ − p) / T  −  g_ent · p · (log p + entropy) / T          local [n, V_r]
    dW_r    = Σ_chunks ∂zᵀ h,   db_r = Σ_chunks Σ_rows ∂z                         local, fp32 accumulator
    dhidden = all_reduce(∂z @ W_r, SUM)                                           collective 3

``dhidden`` is reduced in fp32 (fp64) and cast once, in blocks of whole chunks of at most
:data:`REDUCE_BYTES`, so a 128k-token batch never holds an ``[N, H]`` fp32 buffer. Collectives run in
a fixed order (one MAX and one SUM per chunk forward, one SUM per block backward), so results are run
to run deterministic and every rank issues the same calls.

Validation (one ``all_gather`` of a small int64 descriptor per call, then one host read): each rank
runs the local checks of ``linear_token_logprobs`` and describes its call — a local error and its
message, N, H, its shard size V_r, dtype, device type, bias or not, temperature, ignore_index,
return_entropy, whether ``hidden`` needs a gradient, ``chunk_rows``, a checksum of the ids and the
min/max active id. Every rank then computes the same verdict from the same table and raises the same
``ValueError`` (a ``TypeError`` when every rank failed a type check) naming the ranks and what
differs, before any rank enters a data collective. That read also gives ``vocab_start`` and the
global V = Σ V_r, against which ``validate=True`` checks the ids.

``global_normalizers`` sums the active-token and sequence counts of a step (all micro-batches, all
data-parallel ranks) in one ``all_reduce``, for ``policy_loss(..., global_tokens=, global_seqs=)``.

Where things live: this module holds the local GEMMs (:data:`GEMM`), the autograd Function and
:func:`vocab_parallel_linear_token_logprobs`; the validation descriptor, its verdict and the
process-group helpers are in :mod:`rlkernel._distributed_checks`; :func:`global_normalizers` is in
:mod:`rlkernel.normalizers` and re-exported here.

Caveats:
    * Hidden states must be bitwise replicated across the group, and the upstream gradients of
      ``logp``/``entropy`` identical (they are when the loss is computed from the replicated outputs,
      as every rank must do). Only the ids are checksummed; different hidden states give wrong
      numbers, not an error.
    * Every rank must run backward (or none): ``dhidden`` is an all-reduce. Whether ``hidden``
      needs a gradient is checked in forward; a rank that skips backward stalls the others until the
      process group's timeout.
    * Errors raised before this module runs (the hook in ``linear_token_logprobs`` validates shapes
      first, ``fused_policy_loss`` the masks) are raised by the offending rank alone: keep the
      per-rank inputs (the weight shard, the bias) the only thing that differs.
    * A zero-row shard is rejected (every rank must own at least one vocabulary row).
    * The per-call descriptor read is a host sync; the path is not traceable by ``torch.compile``
      (``fullgraph=True`` breaks at the collectives).
    * Local GEMMs (:data:`GEMM`): for bf16/fp16 on CUDA, cuBLAS on the half-precision operands with
      fp32 output, ∂z rounded to the operand dtype for the two backward GEMMs (gradients then differ
      from the reference by ~3e-3 in norm, the bf16 rounding); otherwise the reference's fp32 GEMMs
      on the shard upcast once per call (an O(V_r·H) fp32 temporary).
    * Chunk math (:data:`ELEMENTWISE`): with half-operand GEMMs the Triton log-prob kernels of the
      single-GPU path run on each shard's raw fp32 logits and the per-rank ``(lse_r, H_r, logp_r)``
      are combined under the same two collectives (see ``_kernel_forward``), in the single-GPU
      path's large chunks; otherwise PyTorch ops on fp32 ``[rows, V_r]`` chunks (the formulas
      above), in the reference's 64 MiB chunks. 2× H200, N = 8192, V = 151,936: 34.8 vs 81.9 ms
      fwd+bwd (``benchmarks/results/nccl_tp_check_h200x2_2026-11-22.log``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlkernel._autocast import without_autocast
from rlkernel._distributed_checks import (
    _F,
    _check_global_range,
    _check_group,
    _collective_device,
    _descriptor,
    _gather,
    _local_checks,
    _raise_for,
    _verdict,
)
from rlkernel.normalizers import global_normalizers
from rlkernel.reference import logprobs as ref

# The public API of this module (docs/api/distributed.md).
__all__ = ["global_normalizers", "vocab_parallel_linear_token_logprobs"]

# dhidden is all-reduced in blocks of whole chunks holding at most this many bytes (fp32 [rows, H]).
REDUCE_BYTES = 64 * 2**20

# The local GEMMs for bf16/fp16 inputs. "auto": on CUDA, on the half-precision operands with fp32
# output (``torch.mm(out_dtype=torch.float32)``, tensor cores, ~10x the rate of an fp32 GEMM), the
# backward's ∂z rounded to the operand dtype for its two GEMMs, as the single-GPU Triton path does;
# elsewhere (CPU, fp32/fp64 inputs, no ``out_dtype`` support) "fp32". "fp32": the reference's fp32
# GEMMs on the upcast shard everywhere. "half": the half-operand GEMMs everywhere (on the CPU
# emulated with fp32 products of the same operands: for tests).
GEMM = "auto"

# The elementwise softmax work of a chunk with half-operand GEMMs: "auto" = the Triton log-prob
# kernels of the single-GPU path on the shard's raw fp32 logits (one read forward, one read + one
# bf16 write backward; on CUDA, or in the CPU interpreter) and per-rank partials combined with the
# same two collectives; "torch" = PyTorch ops on the chunk (~6 passes forward, ~8 backward).
ELEMENTWISE = "auto"

# ------------------------------------------------------------------------------------- autograd
_out_dtype_ok: dict[torch.device, bool] = {}


def _use_kernels(hidden: torch.Tensor, half: bool) -> bool:
    """Whether this call's chunk math runs on the Triton log-prob kernels (see :data:`ELEMENTWISE`)."""
    if not half or ELEMENTWISE == "torch":
        return False
    from rlkernel._dispatch import interpreter_enabled, triton_available

    return triton_available() and (hidden.device.type == "cuda" or interpreter_enabled())


def _half_gemm(weight: torch.Tensor) -> bool:
    """Whether this call's local GEMMs run on the half-precision operands (see :data:`GEMM`)."""
    if weight.dtype not in (torch.float16, torch.bfloat16) or GEMM == "fp32":
        return False
    if GEMM == "half":
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
            return ref._chunk_logits(h, self.w, self.b, self.temperature)
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

    def grad_hidden(self, g):
        """``∂z @ W_r`` in fp32, from :meth:`operand`."""
        return self._mm(g, self.w) if self.half else g @ self.w

    def add_grad_weight(self, acc, g, h):
        """``acc += ∂zᵀ h`` (fp32 ``[V_r, H]``), from :meth:`operand`."""
        if not self.half:
            acc += g.t() @ h.to(acc.dtype)
        elif g.device.type == "cuda":
            torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
        else:
            acc += g.t().float() @ h.float()


class _VocabParallelLinearLogprobs(torch.autograd.Function):
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
            outs = (lse, logp, entropy)
            _kernel_forward(gemms, hidden, kernel_ids, owned, group, temperature, chunk_rows, want_ent, outs)
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
        g_target = torch.where(owned, g_logp, 0.0)  # the one-hot term lives on the owner rank only
        d_hidden = torch.empty_like(hidden) if need_h else None
        # fp32 accumulators across chunks
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        step = ctx.chunk_rows
        # Blocks of whole chunks: the same block boundaries (and so the same all-reduces) on every rank.
        block = max(step, (REDUCE_BYTES // (4 * max(width, 1))) // step * step)
        for b_start in range(0, n, block):
            b_end = min(b_start + block, n)
            dh = torch.empty(b_end - b_start, width, dtype=acc, device=hidden.device) if need_h else None
            for start in range(b_start, b_end, step):
                rows = slice(start, min(start + step, b_end))
                g_ent_rows = None if g_ent is None else g_ent[rows]
                if ctx.kernels:
                    args = (lse[rows], entropy[rows], g_logp[rows], g_ent_rows, ctx.temperature)
                    g = _kernel_grad_chunk(gemms, hidden[rows], kernel_ids[rows], *args)
                    if need_b:
                        d_bias += g.sum(0, dtype=acc)
                else:
                    args = (
                        lse[rows],
                        entropy[rows],
                        g_logp[rows],
                        g_target[rows],
                        g_ent_rows,
                        ctx.temperature,
                    )
                    gz = _torch_grad_chunk(gemms, hidden[rows], local[rows], *args)
                    if need_b:
                        d_bias += gz.sum(0)
                    g = gemms.operand(gz) if need_h or need_w else None
                    del gz
                if need_h:
                    dh[start - b_start : rows.stop - b_start] = gemms.grad_hidden(g)
                if need_w:
                    gemms.add_grad_weight(d_weight, g, hidden[rows])
                del g
            if need_h:
                dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=ctx.group)
                d_hidden[b_start:b_end] = dh.to(hidden.dtype)
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None, None, None


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


def _kernel_forward(gemms, hidden, kernel_ids, owned, group, temperature, chunk_rows, want_ent, out):
    """Forward over all chunks with the Triton log-prob kernel on each shard's raw logits. Fills
    ``out = (lse, logp, entropy)``.

    Per chunk the kernel gives this rank's ``lse_r`` = logsumexp over V_r of z/T, its entropy
    ``H_r`` over V_r, and on the owner rank ``logp_r`` (so z_y/T = ``logp_r + lse_r``). With
    ``M = all_reduce(lse_r, MAX)`` and ``w_r = e^{lse_r − M}`` (≤ 1), one SUM of
    ``[w_r, z_y/T (owner) | 0, w_r·H_r, w_r·(M − lse_r)]`` gives, with ``S = Σ_r w_r``:
    ``lse = M + log S``, ``logp = z_y/T − lse`` and ``H = Σ_r (w_r/S)·(H_r + lse − lse_r)`` =
    ``(Σ w_r H_r + Σ w_r (M − lse_r))/S + log S``: every term ≥ 0, no cancellation.
    """
    from rlkernel.kernels import logprobs as kern

    lse, logp, entropy = out
    n = hidden.shape[0]
    for start in range(0, n, chunk_rows):
        rows = slice(start, min(start + chunk_rows, n))
        z = gemms.raw_logits(hidden[rows])
        lse_r = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
        logp_r = torch.empty_like(lse_r)
        ent_r = torch.empty_like(lse_r) if want_ent else None
        kern._token_logprobs_fwd(
            z, kernel_ids[rows], logp_r, ent_r, lse_r, temperature=temperature, ignore_index=-1
        )
        del z
        big = lse_r.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
        w = torch.exp(lse_r - big)
        parts = [w, torch.where(owned[rows], logp_r + lse_r, 0.0)]
        if want_ent:
            parts += [w * ent_r, w * (big - lse_r)]
        sums = torch.stack(parts)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        log_s = sums[0].log()
        lse[rows] = big + log_s
        logp[rows] = sums[1] - lse[rows]
        if want_ent:
            entropy[rows] = (sums[2] + sums[3]) / sums[0] + log_s


def _kernel_grad_chunk(gemms, h, kernel_ids, lse, entropy, g_logp, g_ent, temperature):
    """∂L/∂(h W_rᵀ + b_r) of one chunk in the operand dtype, from the Triton backward kernel on the
    recomputed raw logits: ``[g_logp·(δ − p) − g_ent·p·(log p + H)] / T`` with the global ``lse``
    and ``H`` (the one-hot only on the owner rank: ``kernel_ids`` is V_r elsewhere)."""
    from rlkernel.kernels import logprobs as kern

    z = gemms.raw_logits(h)
    g = torch.empty(z.shape, dtype=gemms.w.dtype, device=z.device)
    kern._token_logprobs_bwd(
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


def _default_chunk_rows(vocab_local: int, n: int, dtype: torch.dtype, kernels: bool) -> int:
    """Rows per chunk for the largest shard (the same on every rank). With the Triton chunk math:
    the single-GPU linear path's rule (an fp32 ``[C, V_r]`` chunk within its 1.28 GiB budget, C a
    power of two ≤ 4096): every chunk re-reads the weight shard in three GEMMs and read-modify-writes
    the fp32 dweight accumulator, so few large chunks (2 at N = 8192, V_r = 76k) cost far less than
    the reference's 64 MiB ones (38). Otherwise the reference's rule (the PyTorch chunk math holds
    several fp32 chunk-sized temporaries)."""
    if kernels:
        from rlkernel.ops._linear_engine import chunk_rows_for

        del dtype  # the rule counts the fp32 chunk only
        return max(1, min(n, chunk_rows_for(vocab_local, torch.float32)))
    return ref.chunk_rows_for(vocab_local, n)


# --------------------------------------------------------------------------------- public API
@without_autocast
def vocab_parallel_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    tp_group: object,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    validate: bool = True,
    chunk_rows: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-probs (and entropy) from a vocab-sharded LM head, on every rank.

    What ``linear_token_logprobs(..., tp_group=g)`` runs. Rank r of ``g`` holds rows
    ``[vocab_start_r, vocab_start_r + V_r)`` of the ``[V, H]`` LM head, ``vocab_start_r`` = the sum
    of the shard sizes of ranks ``< r`` (shards contiguous, in rank order, sizes may differ). Every
    rank passes the same ``hidden`` and ``token_ids`` and gets the same ``logp``/``entropy``: those
    of the unsharded head. Collective call: every rank of ``g`` must make it, in the same order.

    Args:
        hidden: ``[..., H]`` float, replicated across the group.
        weight: ``[V_r, H]`` this rank's shard (``V_r >= 1``), same dtype and device as ``hidden``.
            Its gradient (and the bias's) stays local: rank r gets ``dL/dW[vocab_start_r : +V_r]``.
        token_ids: ``[...]`` integer global ids in ``[0, V)`` (V = Σ V_r) or ``ignore_index``,
            replicated across the group.
        tp_group: the tensor-parallel ``torch.distributed.ProcessGroup``. NCCL for CUDA tensors,
            gloo for CPU tensors.
        bias: optional ``[V_r]`` shard of the LM-head bias (all ranks or none).
        temperature, ignore_index, return_entropy: as in :func:`rlkernel.linear_token_logprobs`;
            the same on every rank.
        validate: check the ids against the global V (free: it rides on the layout check's single
            host sync). The layout check itself always runs: it also yields ``vocab_start``.
        chunk_rows: rows per chunk (the same on every rank); ``None`` sizes chunks for the largest
            shard: with the Triton chunk math (bf16/fp16 on CUDA) as the single-GPU linear path does
            (fp32 ``[C, V_r]`` within 1.28 GiB, C ≤ 4096), else with
            :func:`rlkernel.reference.logprobs.chunk_rows_for` (64 MiB).

    Returns:
        ``logp`` float32 ``[...]`` (float64 for float64 inputs), or ``(logp, entropy)``.
        ``dhidden`` is all-reduced in backward, so every rank gets the full gradient.

    Raises:
        TypeError: ``tp_group`` is not a ProcessGroup (raised locally, before any collective).
        ValueError: on every rank, with the same message, when any rank's local checks fail (the
            messages of ``linear_token_logprobs``; a ``TypeError`` if every rank failed a type check)
            or when N, H, dtype, device type, bias presence, temperature, ignore_index,
            return_entropy, ``hidden.requires_grad``, ``chunk_rows`` or the ids differ across
            ranks, or (``validate``) an active id is outside ``[0, V)``.
    """
    _check_group("tp_group", tp_group)
    error = None
    ids = None
    try:
        ids = _local_checks(hidden, weight, bias, token_ids, temperature, ignore_index, chunk_rows)
    except (TypeError, ValueError) as err:
        error = err
    desc = _descriptor(
        hidden, weight, bias, ids, temperature, ignore_index, return_entropy, chunk_rows, error
    )
    table = _gather(desc, tp_group, _collective_device(tp_group, hidden))
    verdict = _verdict(table)
    if verdict is not None:
        _raise_for(verdict, len(table), error)
    if validate:
        _check_global_range(ids, table, int(ignore_index))
    rank = dist.get_rank(tp_group)
    vocab_start = sum(row[_F["vocab_local"]] for row in table[:rank])
    n = ids.numel()
    lead = hidden.shape[:-1]
    h = hidden.reshape(lead.numel(), hidden.shape[-1])  # rows by count: H may be 0
    half = _half_gemm(weight)
    kernels = _use_kernels(h, half)
    if chunk_rows is None:
        chunk_rows = _default_chunk_rows(
            max(row[_F["vocab_local"]] for row in table), n, hidden.dtype, kernels
        )
    flat_ids, active = ref._prepare_ids(ids, ignore_index)
    # Ignored rows may hold garbage: zero them so they reach neither the logits nor the gradients.
    h = torch.where(active[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    logp, entropy = _VocabParallelLinearLogprobs.apply(
        h,
        weight,
        bias,
        flat_ids,
        active,
        tp_group,
        vocab_start,
        float(temperature),
        int(chunk_rows),
        bool(return_entropy),
        half,
        kernels,
    )
    if return_entropy:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead)
