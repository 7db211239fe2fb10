"""The device-built token-level loss from logits: two launches, no plan built with torch ops.

For a :class:`rlkernel._token_loss_plan.DevicePlan` (a padded ``[S, T]`` batch of a token-level
objective) the host launches

    mask counts   ONE program (``_mask_counts_kernel``): the aggregation's denominator counted from
                  the mask (active tokens, or sequences with one), ``seq-mean-token-mean``'s
                  1/max(n_i, 1) per sequence, and the id check's two counters set to "none yet";
    rows          one program per row (``_device_rows_kernel``): the masked id and the id check of
                  the row (``max(id, -1)`` where ``mask != 0``, ``ignore_index`` elsewhere; an
                  active id outside [0, V) counted with integer atomics, so the count and the first
                  bad one do not depend on the order), the row's log-prob statistics
                  (``logprobs.row_logprob_stats``: the same tiles, the same logp bits as every
                  other path), the token's loss terms (``_token_loss_math.token_terms``: the same
                  formulas and constants as a host-built :class:`TokenLossPlan`), and either the
                  backward's inputs (lse, dL/dlogp, dL/dH, the masked id: 3 passes over the logits
                  in all) or the gradient itself (``GRAD_IN_FWD``: pass 2 of
                  ``token_loss.row_grad_pass``, 2 passes in all)

instead of the masking launch, the log-prob launch, ~20 small torch ops of the host plan, the
token-loss launch and the id check's launches (``rlkernel.rl.token_loss``, ``ops.id_checks``).
Every per-token constant, and so every coefficient, has the bits of the host plan's: the counts are
integers, the factor is the same IEEE division 1/max(n_i, 1), the other inputs are read as fp32 as
the host plan casts them.

Caveats:
    * The count kernel is one program looping over the ``[S, T]`` mask (per sequence only when
      ``seq-mean-token-mean`` needs the per-sequence counts): ~1 µs per 4k mask entries, serial
      before the rows kernel.
    * Rows are those of the logits' kernel layout (``logprobs.row_layout``), in the order of the
      flat ``[S·T]`` ids and mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel._token_loss_plan import COUNT_SEQS, COUNT_TOKENS, DevicePlan
from rlkernel.kernels import logprobs as lp
from rlkernel.kernels._launch import FP_FUSION, FastLauncher
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels._reduce import last_program_sum
from rlkernel.kernels._token_loss_math import token_terms
from rlkernel.kernels.ids import NO_BAD_ID, count_bad_id
from rlkernel.kernels.logprobs import program_row, row_logprob_stats
from rlkernel.kernels.token_loss import row_grad_pass

COUNT_BLOCK = 4096
SUM_BLOCK = 1024  # the loss's final sum: lanes of the last program (fixes its order)
# counts[0]: the counted denominator; counts[1]: the rows kernel's finished programs; counts[2:4]:
# the id check's count and first-bad key (kernels.ids' layout, read by ops.id_checks).
N_COUNTS = 4
_COUNT_TOKENS = tl.constexpr(COUNT_TOKENS)
_COUNT_SEQS = tl.constexpr(COUNT_SEQS)
_NO_BAD_ID = tl.constexpr(NO_BAD_ID)


@triton.jit
def _active_count(ptr, n, BLOCK: tl.constexpr):
    """int64: how many of the ``n`` mask values at ``ptr`` are ``!= 0`` (NaN included, as torch)."""
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = tl.load(ptr + offs, mask=offs < n, other=0)
        acc += (m != 0).to(tl.int64)
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["n_seqs", "seq_len"])
def _mask_counts_kernel(
    counts_ptr,  # int64 [4]
    factor_ptr,  # fp32 [S] (FACTOR)
    mask_ptr,  # [S·T] contiguous, any dtype (active: != 0, NaN included)
    n_seqs,
    seq_len,
    COUNT: tl.constexpr,
    FACTOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: counts[0] = active tokens (COUNT_TOKENS) or sequences with an active token
    (COUNT_SEQS); factor[s] = 1 / max(n_s, 1) (FACTOR); counts[1] = 0 (the rows kernel's finished
    programs); counts[2] = 0, counts[3] = "no bad id"."""
    zero = tl.sum(tl.zeros((BLOCK,), dtype=tl.int64), axis=0)
    tokens = zero
    seqs = zero
    if COUNT == _COUNT_TOKENS and not FACTOR:  # one stream over the whole mask (< 2^31 tokens)
        tokens = _active_count(mask_ptr, n_seqs * seq_len, BLOCK)
    elif COUNT != 0 or FACTOR:  # per sequence
        for s in range(0, n_seqs):
            c = _active_count(mask_ptr + s * seq_len, seq_len, BLOCK)
            if FACTOR:
                # div_rn: the IEEE division of the host plan's torch op (a plain ``/`` compiles to
                # the approximate div.full.f32 on the GPU: 1-ulp different factors for some n_s)
                one = tl.cast(1.0, tl.float32)
                tl.store(factor_ptr + s, tl.math.div_rn(one, tl.maximum(c, 1).to(tl.float32)))
            tokens += c
            seqs += (c > 0).to(tl.int64)
    if COUNT == _COUNT_SEQS:
        tl.store(counts_ptr, seqs)
    else:
        tl.store(counts_ptr, tokens)
    tl.store(counts_ptr + 1, zero)  # the rows kernel's count of finished programs
    tl.store(counts_ptr + 2, zero)
    tl.store(counts_ptr + 3, zero + _NO_BAD_ID)


@triton.jit(do_not_specialize=["ignore_index", "seq_len", "base_inner", "win_start", "win_len"])
def _device_rows_kernel(
    # outputs
    loss_out_ptr,  # fp32 [1]: Σ ℓ over the rows, written by the last program to finish
    loss_ptr,  # fp32 [N]: the row's ℓ (0 when inactive)
    logp_ptr,  # fp32 [N]
    entropy_ptr,  # fp32 [N] (HAS_ENTROPY)
    lse_ptr,  # fp32 [N] (not GRAD_IN_FWD)
    g_logp_ptr,  # fp32 [N] (not GRAD_IN_FWD)
    g_entropy_ptr,  # fp32 [N] (HAS_ENTROPY, not GRAD_IN_FWD)
    ids_out_ptr,  # int32 [N]: the masked ids (not GRAD_IN_FWD)
    counts_ptr,  # int64 [4]: counts[1] finished programs; counts[2:4] the id check's (CHECK_IDS)
    host_ptr,  # int64 [2] pinned host memory (HOST_COPY): counts[2:4], written by the last program
    dx_ptr,  # [N, V] gradient rows (GRAD_IN_FWD), the logits' dtype
    stride_db,
    stride_dt,
    # inputs
    x_ptr,
    stride_xb,
    stride_xt,
    stride_xv,
    ids_ptr,  # [N] any integer dtype
    mask_ptr,  # [N] any dtype
    inputs,  # TokenLossKernelInputs
    # sizes
    n_rows,  # N
    n_programs,  # the grid (N, or the base's rows when WINDOWED)
    n_inner,
    n_cols,
    seq_len,
    base_inner,  # WINDOWED: rows of the base's last leading dim
    win_start,  # WINDOWED: the window's first row there
    win_len,  # WINDOWED: its rows there
    # runtime scalars
    temperature,
    ignore_index,
    scalars,  # TokenLossKernelScalars
    # meta
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    BRANCH: tl.constexpr,  # TokenLossBranches
    GRAD_IN_FWD: tl.constexpr,
    CHECK_IDS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SUM_BLOCK: tl.constexpr,
    HOST_COPY: tl.constexpr,
):
    """One row per program (see the module docstring). With ``WINDOWED`` (gradient in forward only)
    the grid covers every row of a base ``[outer, base_inner, V]`` (``x_ptr``, ``dx_ptr``: the base
    and its gradient) whose inner rows ``[win_start, win_start + win_len)`` are the logits: the
    rows outside write a zero gradient row and nothing else (no separate zero fill)."""
    row, outer, inner, in_window = program_row(n_inner, base_inner, win_start, win_len, WINDOWED)
    raw = tl.load(ids_ptr + row, mask=in_window, other=0).to(tl.int64)
    # NaN: != 0 (unordered), as torch's mask != 0
    active = in_window & (tl.load(mask_ptr + row, mask=in_window, other=0) != 0)
    y = tl.where(active, tl.maximum(raw, -1), ignore_index)
    if CHECK_IDS:
        count_bad_id(counts_ptr + 2, row, raw, active, n_cols)
    x_row = x_ptr + outer * stride_xb + inner * stride_xt
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    logp, lse, h = row_logprob_stats(
        x_row, stride_xv, y, active, n_cols, inv_t, BLOCK_V, NUM_STAGES, BRANCH.HAS_ENTROPY
    )
    loss, g_logp, g_h = token_terms(row, active, row // seq_len, logp, h, inputs, scalars, BRANCH)
    tl.store(logp_ptr + row, tl.where(active, logp, 0.0), mask=in_window)
    tl.store(loss_ptr + row, tl.where(active, loss, 0.0), mask=in_window)
    if BRANCH.HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(active, h, 0.0), mask=in_window)
    if GRAD_IN_FWD:
        dx_row = dx_ptr + outer * stride_db + inner * stride_dt
        row_grad_pass(dx_row, x_row, stride_xv, y, active, n_cols, inv_t, lse, h, g_logp, g_h, BLOCK_V,
                      BRANCH.HAS_ENTROPY)  # fmt: skip
    else:
        tl.store(lse_ptr + row, tl.where(active, lse, 0.0))
        tl.store(g_logp_ptr + row, tl.where(active, g_logp, 0.0))
        if BRANCH.HAS_ENTROPY:
            tl.store(g_entropy_ptr + row, tl.where(active, g_h, 0.0))
        tl.store(ids_out_ptr + row, y.to(tl.int32))
    # The loss without a reduction launch (the last program sums the rows' terms in a fixed order).
    last_program_sum(counts_ptr, n_programs, loss_ptr, n_rows, loss_out_ptr, host_ptr, SUM_BLOCK, HOST_COPY)


_launch_counts = FastLauncher(_mask_counts_kernel)
_launch_rows = FastLauncher(_device_rows_kernel)


def device_plan_forward(
    logits: torch.Tensor,
    plan: DevicePlan,
    *,
    temperature: float,
    grad: torch.Tensor | None,
    row_layout: tuple[int, int, int, int] | None,
    window_rows: tuple[int, int, int] | None = None,
    host: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Both launches over the ``N`` rows of ``logits`` (kernel layout, whose ``row_layout`` the caller
    computed) for ``plan`` (the same N tokens); nothing is checked here (the public op validated
    the call).

    Args:
        grad: None (3 passes: the backward's inputs are returned), or the gradient buffer to write
            during the forward (2 passes): the logits' shape and strides (e.g. the same window of
            a base-shaped buffer), or contiguous.
        window_rows: 2 passes only: ``(L, start, count)`` when ``logits`` is a contiguous base
            ``[..., L, V]`` whose rows ``[start, start + count)`` of every slab are the scored
            logits (``ops._views.Window.rows``), and ``grad`` a contiguous tensor of the base's
            shape: the rows kernel runs over every base row and writes the zero rows too
            (``row_layout`` is then unused).
        host: CUDA only, with ``plan.check_ids``: a pinned int64 ``[2]`` host buffer (mapped into
            the GPU's address space) that the last program fills with the id check's count and
            first-bad key (``ops.id_checks.defer_written``); None: read them from ``counts``.

    Returns:
        ``(loss, logp, entropy, lse, g_logp, g_entropy, ids, counts)``: the fp32 ``[1]`` loss (the
        fixed-order sum of the rows' terms), fp32 ``[N]`` each (``entropy``/``g_entropy`` empty
        without an entropy term; ``lse``/``g_logp``/``g_entropy`` empty with ``grad``),
        the masked ids int32 ``[N]`` (None with ``grad``), and ``counts`` int64 ``[4]``
        (``counts[2:4]``: the id check's count and first-bad key).
    """
    n_cols = logits.shape[-1]
    if window_rows is not None:  # the base's rows: [outer, L, V] contiguous
        stride_t, stride_v = n_cols, 1
        n_inner, stride_b = window_rows[0], window_rows[0] * n_cols
    else:
        n_inner, stride_b, stride_t, stride_v = row_layout
    n = plan.token_ids.numel()
    dev = logits.device
    want_entropy = plan.want_entropy
    two_pass = grad is not None
    # One fp32 block for every per-row output: one allocation, one split.
    per_row = 0 if two_pass else n
    sizes = [1, n, n, n if want_entropy else 0, per_row, per_row, per_row if want_entropy else 0,
             plan.n_seqs if plan.factor_per_seq else 0]  # fmt: skip
    block = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
    # (torch.split_with_sizes: Tensor.split is a Python wrapper, two calls more per call)
    loss, loss_rows, logp, entropy, lse, g_logp, g_entropy, factor = torch.split_with_sizes(block, sizes)
    counts = torch.empty(N_COUNTS, dtype=torch.int64, device=dev)
    ids_out = None if two_pass else torch.empty(n, dtype=torch.int32, device=dev)  # (2 passes: no alloc)
    if two_pass:
        if window_rows is not None or grad.stride() == logits.stride():
            stride_db, stride_dt = stride_b, stride_t
        else:
            stride_db, stride_dt = n_inner * n_cols, n_cols
    else:
        grad, stride_db, stride_dt = block, 0, 0
    count = plan.count
    if n == 0:  # no token: nothing to count or score (no launch reads an empty tensor's pointer)
        loss.zero_()
        counts.zero_()
        if host is not None:  # no rows kernel to write the id check's result: none is bad
            host.zero_()
        return loss, logp, entropy, lse, g_logp, g_entropy, ids_out, counts
    with _device_guard(logits):
        _launch_counts(
            (1,),
            (counts, factor if plan.factor_per_seq else block, plan.mask, plan.n_seqs, plan.seq_len),
            {"COUNT": count, "FACTOR": plan.factor_per_seq, "BLOCK": COUNT_BLOCK},
            {"num_warps": 4},
        )
        cfg = lp.fwd_config(n_cols, logits.dtype, with_entropy=want_entropy)
        absent = block
        rows = (1, 0, 0) if window_rows is None else window_rows
        grid = n if window_rows is None else logits.numel() // n_cols
        _launch_rows(
            (grid,),
            (loss, loss_rows, logp, entropy if want_entropy else block, lse if not two_pass else block,
             g_logp if not two_pass else block, g_entropy if want_entropy and not two_pass else block,
             ids_out if not two_pass else counts, counts, host if host is not None else counts,
             grad, stride_db, stride_dt,
             logits, stride_b, stride_t, stride_v, plan.token_ids, plan.mask,
             plan.kernel_inputs(counts, factor, absent), n, grid, n_inner, n_cols, int(plan.seq_len), *rows,
             float(temperature), int(plan.ignore_index), plan.scalars.kernel_args()),
            {"BLOCK_V": cfg.block_v, "NUM_STAGES": cfg.num_stages, "BRANCH": plan.kernel_branches(),
             "GRAD_IN_FWD": two_pass, "CHECK_IDS": plan.check_ids, "WINDOWED": window_rows is not None,
             "SUM_BLOCK": SUM_BLOCK, "HOST_COPY": host is not None},
            {"num_warps": cfg.num_warps, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
    return loss, logp, entropy, lse, g_logp, g_entropy, ids_out, counts

