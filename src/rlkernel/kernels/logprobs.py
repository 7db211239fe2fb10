"""Triton kernels for per-token log-probabilities and entropy from logits, and their gradient.

Math (T = temperature, y = token id, z = x / T for the raw logits x of one row; see
``rlkernel.reference.logprobs`` for the oracle):

    lse = log Σ_j exp(z_j),   logp = z_y − lse,   H = −Σ_j p_j log p_j = lse − Σ_j p_j z_j
    ∂L/∂x_k = [ g_logp·(δ_ky − p_k) − g_H·p_k·(log p_k + H) ] / T,   p_k = exp(z_k − lse)

Algorithm. Forward: one program per row (grid axis 0, so N may exceed 65,535) streams the row in
tiles of ``BLOCK_V`` values with an online log-sum-exp (``_reduce.online_lse_step``: scalar running
max, per-lane running sums, rescaled when the max grows; for the entropy also the running Σ p·z by
the same rescaling). It writes fp32 ``logp``, ``entropy`` (when asked) and ``lse`` (saved for
backward). The row statistics are one jit helper, ``row_logprob_stats``, which the
gradient-in-forward loss kernel (``kernels/token_loss.py``) calls too: same tiles, same logp bits.
Backward: a 2-D grid (rows on axis 0, vocab tiles on axis 1, at most ceil(V / BLOCK_V) ≤ 65,535)
recomputes ``p`` from the saved ``lse`` and writes the gradient in the logits' dtype, optionally
into the logits' own storage, optionally scaling both upstream gradients by a device scalar
(``grad_scale``: a fused scalar loss's upstream gradient, read in-kernel: no launch, no sync).

Memory traffic, b = bytes per logit (2 for bf16), N rows, V vocab:
    forward   reads N·V·b once; writes 12·N bytes (logp, entropy, lse). One pass.
    backward  reads N·V·b, writes N·V·b (into a new tensor, or in place into the logits). Two passes.
    fwd + bwd three passes over the logits: at N = 8192, V = 151,936, bf16 that is 3 × 2.49 GB,
              2.49 ms at 3.0 TB/s (``log_softmax(x.float()).gather``: fp32 [N, V] copies written
              and re-read, several times the traffic, one alive until backward).

Batch invariance. Block sizes depend only on V and the dtype (``fwd_config``/``bwd_config``), never
on N. Every per-element operation is elementwise, the tile max is exact, and the final per-row sums
use ``_reduce.pairwise_sum``, whose order is fixed by BLOCK_V alone. So a row's outputs are bitwise
identical whatever else is in the batch, whatever its strides, and from run to run (no atomics).

Layout. ``logits`` may be any ``[..., V]`` view whose leading dims fold into at most two strided
dims (row = outer·stride_b + inner·stride_t), e.g. ``logits[:, :-1]`` of a contiguous
``[B, T, V]`` tensor, and whose column stride s satisfies (V − 1)·s < 2^31; anything else is copied
once (``as_kernel_layout``). Row offsets are int64, so N·V ≥ 2^31 works.

Provenance: the online softmax of Milakov & Gimelshein (2018); ignore-index, saved LSE and in-place
backward shaped like FlashAttention's and Liger-Kernel's ``cross_entropy.py``, written anew here.

Caveats:
    * An id outside [0, V) that is not ``ignore_index`` (possible only with ``validate=False``)
      reads nothing out of bounds: its logp is NaN and its gradient has no one-hot term.
    * Small N (decode-sized batches) leave most SMs idle (one program per row; a split-V forward,
      split count a function of V, would keep invariance).
    * fp64 logits are not handled here; the public op sends them to the reference.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlkernel.kernels._launch import FP_FUSION, FastLauncher, cdiv
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels._reduce import finite_shift, online_lse_step, pairwise_sum

# Launch configuration, measured on an H100 80GB (torch 2.11, triton 3.6, 2026-11-21, a sweep of
# launch configurations, benchmarks/results/gpu_check_logprobs_h100_2026-11-21.log; bf16,
# N = 8192, D2D copy 3.02 TB/s):
#   forward, V = 151,936: 2048-value tiles, 4 warps: 0.827 ms without entropy (98% of copy
#   bandwidth; the best point, 4096/8 warps, was 0.818 ms) and 0.965 ms with entropy at 1 stage
#   (the per-lane Σp·z accumulator doubles the registers, so deeper pipelines lose occupancy); the
#   first guess, 8192-value tiles at 16 warps, gave 0.895 / 1.438 ms. V = 32,768: 0.191 / 0.222 ms.
#   backward: 8192-value tiles, 4 warps: 1.743 ms at V = 151,936 (2.86 TB/s read + write). Re-swept
#   2026-11-28 on the users' layout (the gradient of the whole [8, 1152, V] output, ragged rows, the
#   windowed launch): 4096-value tiles, 4 warps 1.699 ms vs 1.765 (V = 151,936), 0.391 vs 0.424 ms
#   (V = 32,768); 2048 and 16384 slower, 16 warps slower (.gpu sweep, H100). Elementwise: no bit moves.
# The forward tile is the same with and without entropy on purpose: BLOCK_V fixes the order of the
# per-row sums, so logp must not change its bits when the caller also asks for the entropy (a
# rollout that skips the entropy must score tokens exactly as the trainer that wants it).
FWD_BLOCK_V = 2048
FWD_WARPS = 4
FWD_STAGES = 4
FWD_STAGES_ENTROPY = 1
BWD_TILE_BYTES = 8 * 1024
BWD_WARPS = 4
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch configuration. ``block_v`` of the forward sets which values share a lane and so the
    bits of the result; it must depend on (V, dtype) only, never on N (batch invariance)."""

    block_v: int
    num_warps: int
    num_stages: int = 1


def _block(n_cols: int, max_block: int) -> int:
    """The next power of 2 >= V, >= 16 (no 1-wide block), in ints (no ConstexprFunction's host cost)."""
    return max(16, min(1 << max(n_cols - 1, 0).bit_length(), max_block))


def fwd_config(n_cols: int, dtype: torch.dtype, with_entropy: bool = False) -> KernelConfig:
    """Forward launch configuration. ``block_v`` is a function of V only (batch invariance, and the
    same bits with or without entropy); ``num_stages`` changes no bit (pairwise final sums)."""
    del dtype  # the tile is counted in values: the per-lane accumulators are fp32 for every dtype
    stages = FWD_STAGES_ENTROPY if with_entropy else FWD_STAGES
    return KernelConfig(_block(n_cols, FWD_BLOCK_V), FWD_WARPS, stages)


def bwd_config(n_cols: int, dtype: torch.dtype) -> KernelConfig:
    """Backward launch configuration (the kernel is elementwise: any choice is invariant)."""
    return KernelConfig(_block(n_cols, BWD_TILE_BYTES // dtype.itemsize), BWD_WARPS, 1)


# ---------------------------------------------------------------------------------------- layout
def row_layout(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(n_inner, stride_b, stride_t, stride_v)`` addressing row r of ``x [..., V]`` at
    ``(r // n_inner)·stride_b + (r % n_inner)·stride_t``, or ``None`` when the leading dims do not
    fold into two strided dims or the column offsets could overflow int32."""
    n_cols = x.shape[-1]
    stride_v = x.stride(-1) if n_cols > 1 else 1
    if stride_v != 1 and (stride_v <= 0 or (n_cols - 1) * stride_v > _INT32_MAX):
        return None
    merged: list[list[int]] = []  # [size, stride], outermost first
    for size, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if not merged:
        return 1, 0, 0, stride_v
    if len(merged) == 1:
        return merged[0][0], 0, merged[0][1], stride_v
    if len(merged) == 2:
        return merged[1][0], merged[0][1], merged[1][1], stride_v
    return None


def as_kernel_layout(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` itself when the kernels can address it in place, else one contiguous copy.

    No copy for contiguous tensors, for ``logits[:, :-1]`` of a ``[B, T, V]`` tensor, or for any
    view whose leading dims fold into two strided dims. A copy (N·V values, once) for e.g. a
    ``[A, B, C, V]`` view sliced in two leading dims, or a transposed ``[V, N].T`` at large N·V.
    """
    return logits if row_layout(logits) is not None else logits.contiguous()


def can_write_in_place(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` has its own memory (no stride-0 or overlapping dims)."""
    dims = sorted((st, s) for s, st in zip(x.shape, x.stride(), strict=True) if s > 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            return False
        reach = stride * size
    return True


def _flat_ids(token_ids: torch.Tensor) -> torch.Tensor:
    # N ids: a copy costs nothing next to the N·V logits. The kernel loads any integer dtype.
    return token_ids.reshape(-1).contiguous()


def _flat_f32(t: torch.Tensor) -> torch.Tensor:
    # Upstream gradients may arrive expanded (stride 0) or in another float dtype.
    return t.reshape(-1).to(torch.float32).contiguous()


# --------------------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["ignore_index"])
def _token_logprobs_fwd_kernel(
    # outputs
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    # inputs
    x_ptr,
    stride_xb,
    stride_xt,
    stride_xv,
    ids_ptr,
    # sizes
    n_inner,
    n_cols,
    # runtime scalars
    temperature,
    ignore_index,
    # meta
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
):
    """One row per program: logp = (x_y − m)/T − log l, lse = m/T + log l, H = log l − s/l, with
    m = max x, l = Σ exp((x − m)/T), s = Σ exp((x − m)/T)·(x − m)/T. Ignored rows write 0 and
    read no logits (their loop runs zero times)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // n_inner) * stride_xb + (row % n_inner) * stride_xt
    y = tl.load(ids_ptr + row).to(tl.int64)
    active = y != ignore_index
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    logp, lse, entropy = row_logprob_stats(
        x_row, stride_xv, y, active, n_cols, inv_t, BLOCK_V, NUM_STAGES, HAS_ENTROPY
    )
    tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
    tl.store(lse_ptr + row, tl.where(active, lse, 0.0))
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(active, entropy, 0.0))


@triton.jit
def row_logprob_stats(
    x_row,
    stride_xv,
    y,
    active,
    n_cols,
    inv_t,
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
):
    """``(logp, lse, entropy)`` (fp32 scalars) of one row streamed from ``x_row``: the forward's
    one-pass online log-sum-exp. Shared by every kernel that needs a row's log-prob (the one place
    that fixes the bits of logp: same ``BLOCK_V`` → same result). Inactive rows read nothing (their
    loop runs zero times); an id outside [0, V) gives a NaN logp; ``entropy`` is ``logp`` (unused)
    without ``HAS_ENTROPY``."""
    offs_v = tl.arange(0, BLOCK_V)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_V,), dtype=tl.float32)
    s_i = tl.zeros((BLOCK_V,), dtype=tl.float32)
    n_stream = tl.where(active, n_cols, 0)
    # NUM_STAGES > 1 lets Triton stage the next tiles through shared memory (cp.async) while this
    # one is reduced: more bytes in flight per SM at no register cost. It changes no arithmetic.
    for v0 in tl.range(0, n_stream, BLOCK_V, num_stages=NUM_STAGES):
        cols = v0 + offs_v
        # Upcast on load: all statistics are fp32 whatever the logits' dtype.
        x = tl.load(x_row + cols * stride_xv, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_i, l_i, s_i = online_lse_step(x, m_i, l_i, s_i, inv_t, HAS_ENTROPY)

    shift = finite_shift(m_i)
    l_sum = pairwise_sum(l_i)
    log_l = tl.log(l_sum)
    in_vocab = active & (y >= 0) & (y < n_cols)
    x_y = tl.load(x_row + tl.where(in_vocab, y, 0) * stride_xv, mask=in_vocab, other=float("nan"))
    logp = (x_y.to(tl.float32) - shift) * inv_t - log_l
    entropy = logp
    if HAS_ENTROPY:
        entropy = log_l - pairwise_sum(s_i) / l_sum
    return logp, shift * inv_t + log_l, entropy


@triton.jit
def program_row(n_inner, base_inner, win_start, win_len, WINDOWED: tl.constexpr):
    """``(row, outer, inner, in_window)`` of this program (grid axis 0): its row of the logits
    (addressed at ``outer``·stride_b + ``inner``·stride_t). ``WINDOWED``: the grid covers every row of
    a base ``[outer, base_inner, V]`` whose inner rows ``[win_start, win_start + win_len)`` are the
    logits; ``row`` is then the window's row (0 outside it, where ``in_window`` is False). Shared by
    the kernels that write the base's zero rows themselves (here and ``kernels.token_loss_rows``)."""
    if WINDOWED:
        base_row = tl.program_id(0).to(tl.int64)
        outer = base_row // base_inner
        inner = base_row % base_inner
        local = inner - win_start
        in_window = (local >= 0) & (local < win_len)
        row = outer * win_len + tl.where(in_window, local, 0)
    else:
        row = tl.program_id(0).to(tl.int64)
        outer = row // n_inner
        inner = row % n_inner
        in_window = row >= 0
    return row, outer, inner, in_window


@triton.jit(do_not_specialize=["ignore_index", "base_inner", "win_start", "win_len"])
def _token_logprobs_bwd_kernel(
    # outputs
    dx_ptr,
    stride_db,
    stride_dt,
    stride_dv,
    # inputs
    x_ptr,
    stride_xb,
    stride_xt,
    stride_xv,
    ids_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    scale_ptr,
    # sizes
    n_inner,
    n_cols,
    base_inner,  # WINDOWED: rows of the base's last leading dim
    win_start,  # WINDOWED: the window's first row there
    win_len,  # WINDOWED: its rows there
    # runtime scalars
    temperature,
    ignore_index,
    # meta
    BLOCK_V: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """dx = [g_logp·(onehot − p) − g_H·p·(log p + H)] / T on one tile of one row, p = exp(x/T − lse).

    ``dx_ptr`` may equal ``x_ptr`` (in-place): each element is loaded before it is overwritten by
    the same program. Ignored rows store exact zeros and load nothing. With ``HAS_SCALE`` both
    upstream gradients are multiplied by the device scalar ``*scale_ptr`` (the 0-dim upstream
    gradient of a fused loss: no extra launch, no host read). With ``WINDOWED`` the grid covers every
    row of a base ``[outer, base_inner, V]`` whose rows ``[win_start, win_start + win_len)`` of the
    inner dim are the logits (``x_ptr``, ``dx_ptr``: the base and its gradient); the rows outside
    store zeros, so the base's gradient needs no separate zero fill."""
    row, outer, inner, in_window = program_row(n_inner, base_inner, win_start, win_len, WINDOWED)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = cols < n_cols
    y = tl.load(ids_ptr + row).to(tl.int64)
    active = in_window & (y != ignore_index)
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    lse = tl.load(lse_ptr + row)

    x_row = x_ptr + outer * stride_xb + inner * stride_xt
    n_load = tl.where(active, n_cols, 0)  # ignored rows load nothing
    x = tl.load(x_row + cols * stride_xv, mask=cols < n_load, other=0.0).to(tl.float32)
    log_p = x * inv_t - lse
    p = tl.exp(log_p)
    dz = tl.zeros((BLOCK_V,), dtype=tl.float32)
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row)
        dz += tl.where(cols == y, g_logp, 0.0) - g_logp * p
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(grad_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        # A −inf logit has p = 0 exactly; p·(log p + H) would be 0·(−inf) = NaN.
        dz -= g_entropy * tl.where(x == float("-inf"), 0.0, p * (log_p + entropy))
    if HAS_SCALE:
        dz = dz * tl.load(scale_ptr).to(tl.float32)
    dx = tl.where(active, dz * inv_t, 0.0)
    dx_row = dx_ptr + outer * stride_db + inner * stride_dt
    tl.store(dx_row + cols * stride_dv, dx.to(dx_ptr.dtype.element_ty), mask=mask_v)


# ------------------------------------------------------------------------------------- launchers
# Every fused-loss call launches both (and the linear engine once per chunk): FastLauncher saves
# ~15 us of Triton's per-launch host work each time (kernels/_launch.py).
_launch_fwd = FastLauncher(_token_logprobs_fwd_kernel)
_launch_bwd = FastLauncher(_token_logprobs_bwd_kernel)


def _check_layout(logits: torch.Tensor) -> tuple[int, int, int, int]:
    layout = row_layout(logits)
    assert layout is not None, "call as_kernel_layout(logits) first"
    assert logits.dtype in (torch.float16, torch.bfloat16, torch.float32), logits.dtype
    return layout


def token_logprobs_fwd_into(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    lse: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
    config: KernelConfig | None = None,
) -> None:
    """Out-variant forward: fills fp32 contiguous ``logp``, ``lse`` and (unless None) ``entropy``,
    each with ``logits.shape[:-1]`` elements. ``logits`` must be in kernel layout
    (``as_kernel_layout``). ``config`` overrides ``fwd_config`` for tests and tuning only: a row's
    bits depend on its ``block_v``, so production calls leave it None."""
    layout = _check_layout(logits)
    n_rows = logp.numel()
    if n_rows == 0:
        return
    for out in (logp, lse) if entropy is None else (logp, lse, entropy):
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == n_rows
    ids = _flat_ids(token_ids)
    token_logprobs_fwd_into_unchecked(
        logits, layout, ids, logp, entropy, lse, float(temperature), int(ignore_index), config
    )


def token_logprobs_fwd_into_unchecked(
    logits: torch.Tensor,
    layout: tuple[int, int, int, int],
    ids: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    lse: torch.Tensor,
    temperature: float,
    ignore_index: int,
    config: KernelConfig | None = None,
) -> None:
    """:func:`token_logprobs_fwd_into` without its checks, for a caller that launches it per chunk on
    inputs it made itself (the linear path's chunk engine): ``layout`` is ``row_layout(logits)``
    (not None), ``ids`` the flat contiguous ids, the outputs fp32 contiguous of ``n_rows > 0``
    elements each."""
    n_inner, stride_b, stride_t, stride_v = layout
    n_rows, n_cols = logp.numel(), logits.shape[-1]
    cfg = config or fwd_config(n_cols, logits.dtype, with_entropy=entropy is not None)
    with _device_guard(logits):
        _launch_fwd(
            (n_rows,),
            (logp, entropy if entropy is not None else logp, lse, logits, stride_b, stride_t, stride_v,
             ids, n_inner, n_cols, temperature, ignore_index),
            {"BLOCK_V": cfg.block_v, "NUM_STAGES": cfg.num_stages, "HAS_ENTROPY": entropy is not None},
            {"num_warps": cfg.num_warps, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip


def token_logprobs_fwd(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocating forward: ``(logp, entropy, lse)``, fp32 with ``logits.shape[:-1]``; ``entropy``
    is an empty ``[0]`` tensor unless ``return_entropy``. Copies ``logits`` only if its layout
    needs it (``as_kernel_layout``)."""
    x = as_kernel_layout(logits)
    lead = x.shape[:-1]
    logp = torch.empty(lead, dtype=torch.float32, device=x.device)
    lse = torch.empty(lead, dtype=torch.float32, device=x.device)
    entropy = torch.empty(lead if return_entropy else (0,), dtype=torch.float32, device=x.device)
    token_logprobs_fwd_into(
        x,
        token_ids,
        logp,
        entropy if return_entropy else None,
        lse,
        temperature=temperature,
        ignore_index=ignore_index,
        config=config,
    )
    return logp, entropy, lse


def token_logprobs_bwd_into(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_logits: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
    config: KernelConfig | None = None,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Out-variant backward: fills ``grad_logits`` (fp16/bf16/fp32, usually the logits' dtype),
    which is a contiguous tensor of ``logits.shape``, a tensor with the logits' shape and strides
    (e.g. the same window of a base-shaped buffer), or ``logits`` itself (in place: the logits are
    destroyed).
    ``grad_logp``/``grad_entropy`` None mean zero; ``entropy`` is needed with ``grad_entropy``.
    ``grad_scale`` (a one-element tensor on the logits' device, e.g. the 0-dim upstream gradient
    of a loss) multiplies both, read inside the kernel."""
    layout = _check_layout(logits)
    n_inner, stride_xb, stride_xt, stride_xv = layout
    n_cols = logits.shape[-1]
    n_rows = logits.numel() // max(n_cols, 1)
    # The gradient may have another float dtype than the logits (the kernel casts on store): the
    # linear path writes the bf16 gradient of fp32 chunk logits in one pass.
    assert grad_logits.shape == logits.shape
    assert grad_logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if grad_logits.stride() == logits.stride():  # the logits themselves, or a window like theirs
        grad_strides = (stride_xb, stride_xt, stride_xv)
    else:
        assert grad_logits.is_contiguous(), "grad_logits must be contiguous or have the logits' strides"
        grad_strides = (n_inner * n_cols, n_cols, 1)
    if n_rows == 0:
        return
    assert grad_entropy is None or entropy is not None, "grad_entropy needs the saved entropy"
    token_logprobs_bwd_into_unchecked(
        logits, layout, _flat_ids(token_ids), _flat_f32(lse),
        _flat_f32(entropy) if grad_entropy is not None else None,
        _flat_f32(grad_logp) if grad_logp is not None else None,
        _flat_f32(grad_entropy) if grad_entropy is not None else None,
        grad_logits, grad_strides, float(temperature), int(ignore_index), config, grad_scale,
    )  # fmt: skip


def token_logprobs_bwd_into_unchecked(
    logits: torch.Tensor,
    layout: tuple[int, int, int, int],
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_logits: torch.Tensor,
    grad_strides: tuple[int, int, int],
    temperature: float,
    ignore_index: int,
    config: KernelConfig | None = None,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """:func:`token_logprobs_bwd_into` without its checks, for a caller that launches it per chunk on
    inputs it made itself (the linear path's chunk engine): ``layout`` is ``row_layout(logits)``,
    ``grad_strides`` the (outer, inner, column) strides of ``grad_logits`` in that layout, ``ids``
    the flat contiguous ids, the vectors fp32 contiguous ``[n_rows]`` (``entropy`` given, or read,
    only with ``grad_entropy``), at least one row."""
    n_inner, stride_xb, stride_xt, stride_xv = layout
    n_cols = logits.shape[-1]
    n_rows = logits.numel() // max(n_cols, 1)
    cfg = config or bwd_config(n_cols, logits.dtype)
    grid = (n_rows, cdiv(n_cols, cfg.block_v))
    assert grid[1] <= 65535, f"vocabulary {n_cols} needs {grid[1]} tiles on grid axis 1 (> 65,535)"
    with _device_guard(logits):
        _launch_bwd(
            grid,
            (grad_logits, *grad_strides, logits, stride_xb, stride_xt, stride_xv, ids, lse,
             entropy if grad_entropy is not None else lse, grad_logp if grad_logp is not None else lse,
             grad_entropy if grad_entropy is not None else lse, grad_scale if grad_scale is not None else lse,
             n_inner, n_cols, 1, 0, 0, temperature, ignore_index),
            {"BLOCK_V": cfg.block_v, "HAS_GRAD_LOGP": grad_logp is not None,
             "HAS_GRAD_ENTROPY": grad_entropy is not None, "HAS_SCALE": grad_scale is not None,
             "WINDOWED": False},
            {"num_warps": cfg.num_warps, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip


def token_logprobs_bwd(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Allocating backward: a new contiguous ``grad_logits`` in the logits' dtype and shape."""
    x = as_kernel_layout(logits)
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    token_logprobs_bwd_into(
        x,
        token_ids,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        grad,
        temperature=temperature,
        ignore_index=ignore_index,
        config=config,
    )
    return grad


def token_logprobs_bwd_window_into(
    base: torch.Tensor,
    rows: tuple[int, int, int],
    token_ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    grad_base: torch.Tensor,
    grad_scale: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
) -> None:
    """Backward of logits that are the rows ``[start, start + count)`` of every ``[L, V]`` slab of a
    contiguous ``base`` ``[..., L, V]`` (``rows = (L, start, count)``; e.g. ``base[:, P - 1 : -1]``):
    one launch over every row of the base, writing the window's gradient into ``grad_base`` (the
    base itself for in place, or a contiguous tensor of its shape and dtype) and zeros elsewhere.
    The per-row inputs (``token_ids`` any integer dtype, fp32 ``lse``, ``grad_logp``, and with an
    entropy term ``entropy``, ``grad_entropy``) are flat contiguous ``[outer·count]`` in the
    window's row order; ``grad_scale`` a one-element fp32 device tensor. Unchecked (the caller's)."""
    n_cols = base.shape[-1]
    base_inner, win_start, win_len = rows
    n_base_rows = base.numel() // max(n_cols, 1)
    if n_base_rows == 0:
        return
    cfg = bwd_config(n_cols, base.dtype)
    row_stride = base.stride(-2)  # V: the base is contiguous
    slab = base_inner * row_stride
    ent = entropy if grad_entropy is not None else lse
    with _device_guard(base):
        _launch_bwd(
            (n_base_rows, cdiv(n_cols, cfg.block_v)),
            (grad_base, slab, row_stride, 1, base, slab, row_stride, 1, token_ids, lse, ent, grad_logp,
             grad_entropy if grad_entropy is not None else lse, grad_scale, 1, n_cols, base_inner,
             win_start, win_len, float(temperature), int(ignore_index)),
            {"BLOCK_V": cfg.block_v, "HAS_GRAD_LOGP": True, "HAS_GRAD_ENTROPY": grad_entropy is not None,
             "HAS_SCALE": True, "WINDOWED": True},
            {"num_warps": cfg.num_warps, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
