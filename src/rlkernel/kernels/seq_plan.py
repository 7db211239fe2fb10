"""The device-built sequence-ratio loss from logits (gspo, gspo_token, gmpo): three launches forward.

For a :class:`rlkernel._token_loss_plan.DeviceSeqPlan` (a padded ``[S, T]`` batch of a closed-form
sequence-ratio objective) the host launches

    mask counts   ONE program (``kernels.token_loss_rows``' count kernel, shared with the token-level
                  device plan): the aggregation's denominator counted from the mask,
                  ``seq-mean-token-mean``'s 1/max(n_i, 1) per sequence, and the counters zeroed;
    rows          one program per row (``_seq_rows_kernel``): the masked id and the id check of the
                  row (``max(id, -1)`` where ``mask != 0``, ``ignore_index`` elsewhere; an active id
                  outside [0, V) counted with integer atomics: the count and the first bad one do not
                  depend on the order), the row's log-prob statistics (``logprobs.row_logprob_stats``:
                  the logp bits of every other path), and the backward's lse and masked id; rows
                  ``< S`` also write the policy-free plan's zero advantage;
    sequences     one program per sequence (``kernels.seq_token_loss``'s kernel with ``FINISH``): the
                  closed form's two passes over the sequence's tokens (its log-ratio sums, n_i, W_i,
                  then each token's dL/dlogp, the token-local KL and entropy terms), the sequence's
                  loss; the last program to finish sums the ``[S]`` partials in order and copies the
                  id check's result into pinned host memory

instead of the masking launch, the log-prob launch, the host plan's ~15 torch ops, the sequence
kernel, the partial sum and the id check's launches (``rlkernel.rl.seq_token_loss``,
``ops.id_checks``). The backward is the token-level device plan's one launch.

The per-token constants are those of the host-built policy-free plan (integer counts, the same IEEE
division for the factor, inputs read as fp32 as that plan casts them) and the sequence kernel is the
same code: the coefficients have the host route's bits; the loss is the same fixed-order sum.

Caveats:
    * The logits' rows must be in the flat ``[S·T]`` order of the ids and mask (``row_layout``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel._token_loss_plan import DeviceSeqPlan
from rlkernel.kernels import logprobs as lp
from rlkernel.kernels import seq_token_loss as seq_kernels
from rlkernel.kernels._launch import FP_FUSION, FastLauncher
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels.ids import count_bad_id
from rlkernel.kernels.logprobs import row_logprob_stats
from rlkernel.kernels.token_loss_rows import COUNT_BLOCK, N_COUNTS, SUM_BLOCK, _mask_counts_kernel


@triton.jit(do_not_specialize=["ignore_index"])
def _seq_rows_kernel(
    # outputs
    logp_ptr,  # fp32 [N] (0 at inactive rows)
    entropy_ptr,  # fp32 [N] (HAS_ENTROPY)
    lse_ptr,  # fp32 [N]
    ids_out_ptr,  # int32 [N]: the masked ids
    zero_adv_ptr,  # fp32 [S]: zeros (the policy-free plan's advantage)
    counts_ptr,  # int64 [4]: counts[2:4] the id check's (CHECK_IDS)
    # inputs
    x_ptr,
    stride_xb,
    stride_xt,
    stride_xv,
    ids_ptr,  # [N] any integer dtype
    mask_ptr,  # [N] any dtype
    # sizes
    n_seqs,
    n_inner,
    n_cols,
    # runtime scalars
    temperature,
    ignore_index,
    # meta
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    CHECK_IDS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // n_inner
    inner = row % n_inner
    raw = tl.load(ids_ptr + row).to(tl.int64)
    active = tl.load(mask_ptr + row) != 0  # NaN: != 0 (unordered), as torch's mask != 0
    y = tl.where(active, tl.maximum(raw, -1), ignore_index)
    if CHECK_IDS:
        count_bad_id(counts_ptr + 2, row, raw, active, n_cols)
    x_row = x_ptr + outer * stride_xb + inner * stride_xt
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    logp, lse, h = row_logprob_stats(
        x_row, stride_xv, y, active, n_cols, inv_t, BLOCK_V, NUM_STAGES, HAS_ENTROPY
    )
    tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(active, h, 0.0))
    tl.store(lse_ptr + row, tl.where(active, lse, 0.0))
    tl.store(ids_out_ptr + row, y.to(tl.int32))
    if row < n_seqs:
        tl.store(zero_adv_ptr + row, 0.0)


_launch_counts = FastLauncher(_mask_counts_kernel)
_launch_rows = FastLauncher(_seq_rows_kernel)
_launch_seqs = FastLauncher(seq_kernels._seq_token_loss_kernel)


def seq_plan_forward(
    logits: torch.Tensor,
    plan: DeviceSeqPlan,
    *,
    temperature: float,
    row_layout: tuple[int, int, int, int],
    host: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The three launches over the ``N`` rows of ``logits`` (kernel layout, ``row_layout`` computed by
    the caller) for ``plan`` (the same N tokens); nothing is checked here (the public op validated the
    call).

    Args:
        host: CUDA only, with ``plan.check_ids``: a pinned int64 ``[2]`` host buffer that the last
            sequence program fills with the id check's count and first-bad key
            (``ops.id_checks.defer_written``); None: read them from ``counts``.

    Returns:
        ``(loss, logp, entropy, lse, g_logp, g_entropy, ids, counts)``: the fp32 ``[1]`` loss, fp32
        ``[N]`` each (``entropy``/``g_entropy`` empty without an entropy term), the masked ids int32
        ``[N]`` and ``counts`` int64 ``[4]`` (``counts[2:4]``: the id check's count and first-bad key).
    """
    p = plan.tokens
    n_cols = logits.shape[-1]
    n_inner, stride_b, stride_t, stride_v = row_layout
    n, n_seqs = p.token_ids.numel(), p.n_seqs
    dev = logits.device
    want_entropy = plan.want_entropy
    # One fp32 block for every output: one allocation, one split.
    ne = n if want_entropy else 0
    sizes = [1, n, ne, n, n, ne, n_seqs, n_seqs, n_seqs if p.factor_per_seq else 0]
    block = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
    loss, logp, entropy, lse, g_logp, g_entropy, partial, zero_adv, factor = block.split(sizes)
    counts = torch.empty(N_COUNTS, dtype=torch.int64, device=dev)
    ids_out = torch.empty(n, dtype=torch.int32, device=dev)
    if n == 0:  # no token: nothing to count or score (no launch reads an empty tensor's pointer)
        loss.zero_()
        counts.zero_()
        if host is not None:  # no kernel to write the id check's result: none is bad
            host.zero_()
        return loss, logp, entropy, lse, g_logp, g_entropy, ids_out, counts
    with _device_guard(logits):
        _launch_counts(
            (1,),
            (counts, factor if p.factor_per_seq else block, p.mask, n_seqs, p.seq_len),
            {"COUNT": p.count, "FACTOR": p.factor_per_seq, "BLOCK": COUNT_BLOCK},
            {"num_warps": 4},
        )
        cfg = lp.fwd_config(n_cols, logits.dtype, with_entropy=want_entropy)
        _launch_rows(
            (n,),
            (logp, entropy if want_entropy else block, lse, ids_out, zero_adv, counts,
             logits, stride_b, stride_t, stride_v, p.token_ids, p.mask, n_seqs, n_inner, n_cols,
             float(temperature), int(p.ignore_index)),
            {"BLOCK_V": cfg.block_v, "NUM_STAGES": cfg.num_stages, "HAS_ENTROPY": want_entropy,
             "CHECK_IDS": p.check_ids},
            {"num_warps": cfg.num_warps, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
        _launch_seqs(
            (n_seqs,),
            (partial, g_logp, g_entropy if want_entropy else g_logp, logp, entropy if want_entropy else logp,
             ids_out, p.old if p.old is not None else logp, p.adv, ids_out,
             plan.kernel_inputs(counts, factor, zero_adv, block), int(p.seq_len), int(p.ignore_index),
             float(plan.clip_lo), float(plan.clip_hi), float(plan.eps_low), float(plan.eps_high),
             float(plan.log_ratio_max), p.scalars.kernel_args(), loss, counts,
             host if host is not None else counts),
            {"KIND": seq_kernels.SEQ_KINDS[plan.kind], "GEO_MEAN": bool(plan.geo_mean),
             "HAS_OLD": p.old is not None, "ADV_SEQ": bool(p.adv_per_seq), "PACKED": False,
             "BLOCK": seq_kernels.BLOCK, "BRANCH": plan.kernel_branches(), "FINISH": True,
             "HOST_COPY": host is not None, "SUM_BLOCK": SUM_BLOCK},
            {"num_warps": seq_kernels.NUM_WARPS, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
    return loss, logp, entropy, lse, g_logp, g_entropy, ids_out, counts
