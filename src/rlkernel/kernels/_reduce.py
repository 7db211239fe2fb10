"""Shared Triton reduction helpers: one definition of each reduction step, used by every kernel family.

Two ideas live here.

1. **Online log-sum-exp with per-lane accumulators.** A row is streamed in tiles of ``BLOCK`` values.
   The running max ``m`` is one scalar (an exact reduction: ``max`` is order-independent), but the
   running sums stay ``[BLOCK]`` vectors, one per lane, rescaled elementwise when ``m`` grows. That
   costs one ``exp`` per element plus one scalar ``exp`` per tile, and one cross-warp reduction per
   tile (the max) instead of three. The per-lane sums are reduced once, at the end of the row.
2. **Fixed-order final sums.** ``tl.sum`` reduces in an order set by the tensor's layout, and the
   layout follows the compiler's vectorization, which depends on the pointer alignment and the
   strides Triton specializes on. ``pairwise_sum`` reduces through a tree of two-element sums
   instead: ``a + b == b + a`` bitwise in IEEE arithmetic, so the result depends only on the block
   size, never on ``num_warps``, vector width or alignment. That is what makes a row's result
   bitwise identical whatever batch (or slice, or padding) it sits in.

The sum of ``p·z`` (for the entropy) is kept relative to the running shift: with
``s = Σ e_j·zs_j``, ``e_j = exp(zs_j)``, ``zs_j = (x_j − shift)/T``, a new shift with
``d = (shift_old − shift_new)/T`` gives ``s_new = exp(d)·(s_old + d·l_old)``. The entropy is then
``log l − s/l`` without the cancellation of ``lse − E[z]`` for large logits.
"""

from __future__ import annotations

import triton
import triton.language as tl

# log2 of the largest block a kernel may pass to ``pairwise_sum`` (Triton caps a block at 2^20).
_MAX_LOG2_BLOCK = tl.constexpr(20)


@triton.jit
def is_nonfinite(x):
    """Elementwise: NaN, +inf or −inf. (Not a reduction, but shared by the kernels that must make a
    non-finite input visible rather than let a clamp or a zero weight absorb it.)"""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def pairwise_sum(x):
    """Σ x over a 1-D power-of-two block, in a fixed pairwise order independent of the layout.

    Each level sums adjacent pairs (``reshape`` to ``[n/2, 2]``, sum over the pair). With linear
    layouts the reshape moves no data; levels whose pair sits in one thread are plain adds, the
    others are one shuffle (or one shared-memory exchange across warps). It runs once per row, not
    per tile, so its cost is a few hundred cycles against a whole row's stream.
    """
    for _ in tl.static_range(_MAX_LOG2_BLOCK):
        if x.shape[0] > 1:
            x = tl.sum(tl.reshape(x, (x.shape[0] // 2, 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def finite_shift(m):
    """The running max as a finite shift: 0 while every value so far is −inf.

    Subtracting a finite shift keeps ``exp(−inf − shift) = 0`` instead of ``exp(−inf + inf) = NaN``
    for rows (or row prefixes) of −inf logits and for masked lanes. A +inf max stays +inf so the
    row becomes NaN, as in ``torch.log_softmax``.
    """
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def online_lse_step(x, m_i, l_i, s_i, inv_t, WITH_SUM_PZ: tl.constexpr):
    """Fold one tile ``x`` (fp32 ``[BLOCK]``, masked lanes = −inf) into the running statistics.

    Args:
        x: raw logits of the tile (not yet divided by the temperature).
        m_i: running max of the raw logits (scalar fp32, −inf before the first finite value).
        l_i: per-lane ``Σ exp((x − shift)·inv_t)`` (fp32 ``[BLOCK]``), ``shift = finite_shift(m_i)``.
        s_i: per-lane ``Σ exp(zs)·zs`` with ``zs = (x − shift)·inv_t`` (only with ``WITH_SUM_PZ``).
        inv_t: 1 / temperature (fp32 scalar). Scaling after subtracting the max is exact for the
            max itself (``max(x/T) = max(x)/T`` for T > 0) and keeps every exponent ≤ 0.

    Returns:
        ``(m_new, l_new, s_new)``.
    """
    m_new = tl.maximum(m_i, tl.max(x, axis=0))
    shift = finite_shift(m_new)
    # d = (old shift − new shift)/T ≤ 0; −inf on the first finite tile, where l_i = s_i = 0.
    d = (m_i - shift) * inv_t
    alpha = tl.exp(d)
    zs = (x - shift) * inv_t
    e = tl.exp(zs)
    if WITH_SUM_PZ:
        d_fin = tl.where(m_i == float("-inf"), 0.0, d)
        # e·zs is 0·(−inf) = NaN for −inf logits and masked lanes; their probability is exactly 0.
        s_i = alpha * (s_i + d_fin * l_i) + tl.where(e > 0.0, e * zs, 0.0)
    l_i = alpha * l_i + e
    return m_new, l_i, s_i


@triton.jit
def last_program_sum(
    counts_ptr, n_programs, terms_ptr, n_terms, loss_out_ptr, host_ptr, SUM_BLOCK: tl.constexpr,
    HOST_COPY: tl.constexpr,
):  # fmt: skip
    """A loss without a reduction launch: each program calls this after storing its term; the last
    to finish (an integer atomic on ``counts_ptr[1]``, acquire-release at GPU scope: every other
    program's term is visible to it) sums the ``n_terms`` fp32 terms in a fixed order (blocks of
    ``SUM_BLOCK`` in order, then ``pairwise_sum``), whichever program that is: deterministic. With
    ``HOST_COPY`` it also copies the id check's two numbers (``counts_ptr[2:4]``) into the pinned
    host buffer ``host_ptr`` (no copy launch)."""
    if tl.atomic_add(counts_ptr + 1, 1) == n_programs - 1:
        acc = tl.zeros((SUM_BLOCK,), dtype=tl.float32)
        for start in range(0, n_terms, SUM_BLOCK):
            offs = start + tl.arange(0, SUM_BLOCK)
            acc += tl.load(terms_ptr + offs, mask=offs < n_terms, other=0.0, cache_modifier=".cg")
        tl.store(loss_out_ptr, pairwise_sum(acc))
        if HOST_COPY:
            tl.store(host_ptr, tl.load(counts_ptr + 2, cache_modifier=".cg"))
            tl.store(host_ptr + 1, tl.load(counts_ptr + 3, cache_modifier=".cg"))
