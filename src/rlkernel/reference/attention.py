"""Reference causal GQA attention, batch-invariant by construction: the CPU path and the test oracle.

Math, per sequence, query head h (kv head h // G, G = Hq / Hkv), query at key position p, its
sequence's first valid key s (``key_start``; 0 unless left-padded), c = scale·log2(e):

    out = Σ_{s ≤ j ≤ p} softmax_j(scale·q·k_j)·v_j,      lse2 = log2 Σ_{s ≤ j ≤ p} 2^(c·q·k_j)

computed exactly as the Triton kernel orders it, a two-level online softmax. Keys are cut into
splits of ``SPLIT_N`` keys anchored at s, [s, s+S), [s+S, s+2S), …, and each split into blocks of
``BLOCK_N`` keys, [s+jS, s+jS+BN), … Within a split, from a fresh state (m, l, acc) = (−inf, 0, 0),
the blocks are visited in order with the online softmax

    t = c·(q·k)  (−inf for keys > p),   m' = max(m, max_j t_j),   α = 2^(m − m'),   P = 2^(t − m')
    l' = α·l + Σ_j P_j,   acc' = α·acc + Σ_j P_j·v_j

and the split states are merged, in split order, into a running state (M, L, A) that starts at
(−inf, 0, 0) (``merge``; every product and sum rounded on its own):

    M' = max(M, m),   μ = M' (0 if −inf),   α = 2^(M − μ),   β = 2^(m − μ)
    L' = α·L + β·l,   A' = α·A + β·acc,    out = A / L,   lse2 = M + log2 L

The splits are what lets a KV-cache decode step spread one row over several GPU programs (one per
split, then a merge kernel) and still give the bits of a prefill that runs the same formula in one
program. A single split is exactly the one-level online softmax (the first merge is exact).
In production ``SPLIT_N`` = 2^30: every call is one split (the two-level path is disabled after an
H100 failure, see ``rlkernel.kernels.attention``); tests monkeypatch small values.

Batch invariance (what makes this usable as the CPU path of a model whose decode must equal its
prefill bit for bit): every quantity of a query row is computed by elementwise torch ops on that row
alone. The dot products q·k and the sums Σ_j P_j, Σ_j P_j v_j are not ``@``/``sum`` (CPU BLAS and the
reduction kernels choose their blocking from the tensor size) but ``tree_sum``: a fixed pairwise tree
of elementwise adds over the power-of-two padded axis. Elementwise +, ·, /, max are correctly rounded
whatever the vectorization; ``torch.exp2`` is not (ATen runs SLEEF on full vectors and libm on
the tail of a loop, which may differ by an ulp), so ``exp2`` here is built from float64 basic ops (a
Taylor polynomial and an exact power of two from exponent bits) and rounded to float32. Blocks
(and splits) that a row's causal mask fully hides are exact no-ops for that row
(α = 1, P = 0; β = 0), so the number of blocks visited for the *other* rows never matters; here such rows
are simply skipped. Queries are processed in chunks only to bound memory (all ops are per-row).

Provenance: the online softmax of Milakov & Gimelshein (2018) as used by FlashAttention
(Dao et al. 2022); the key-block anchoring at each sequence's first real token is ours.

Caveats:
    * Slow and memory-hungry ([rows, BLOCK_N, Hq, D] temporaries, bounded by ``CHUNK_ELEMENTS``):
      meant for tests and tiny CPU models, not for speed.
    * float64 inputs run entirely in float64: ``exp2`` is then accurate to ~1e-15, not correctly
      rounded. ``log2`` (the returned LSE only, never the output) uses ``torch.log2``.
    * Backward is autograd through these ops (deterministic on CPU); the running max is detached,
      which is exact since the output does not depend on it mathematically.
"""

from __future__ import annotations

import math

import torch

BLOCK_N = 64
SPLIT_N = 1 << 30  # keys per split; must equal rlkernel.kernels.attention.SPLIT_N (2^30: one split)
LOG2E = 1.4426950408889634
CHUNK_ELEMENTS = 1 << 22  # ≤ 16 MiB fp32 per [rows, BLOCK_N, Hq, D] temporary


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ over ``dim`` by a fixed pairwise tree of elementwise adds (zero-padded to a power of two).

    The order of the adds depends only on ``x.shape[dim]``, never on the other dims or on how ATen
    vectorizes, so each output element is bitwise the same whatever else is in ``x``."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


# Taylor coefficients of e^y, y = f·ln 2, f ∈ [0, 1): 17 terms leave a remainder < 2e-16 relative.
_LN2 = 0.6931471805599453
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(17)]


def exp2(x: torch.Tensor) -> torch.Tensor:
    """2^x from elementwise float64 +, ·, floor and an exponent-bit construction only.

    ``torch.exp2`` is not position-independent on CPU (SLEEF on full vectors, libm on a loop's
    tail, which can differ by an ulp). Here every step is a correctly rounded basic op or exact
    integer work, so each element's result depends on its value alone. Accurate to ~2e-16
    relative in float64 before the final rounding to ``x.dtype``; −inf gives 0, NaN gives NaN."""
    xd = x.double()
    n = torch.floor(xd)
    y = (xd - n) * _LN2  # xd − n is exact
    r = torch.full_like(y, _EXP_COEFFS[-1])
    for coeff in reversed(_EXP_COEFFS[:-1]):
        r = r * y + coeff
    exponent = n.clamp(-1022.0, 1023.0).nan_to_num(0.0).long() + 1023
    out = r * (exponent << 52).view(torch.float64)  # 2^n built from its exponent bits: exact
    out = torch.where(xd < -1022.0, torch.zeros_like(out), out)
    out = torch.where(xd > 1023.0, torch.full_like(out, math.inf), out)
    return torch.where(torch.isnan(xd), xd, out).to(x.dtype)


_exp2 = exp2


def _log2(x: torch.Tensor) -> torch.Tensor:
    return torch.log2(x.double()).to(x.dtype)


def merge(
    m_run: torch.Tensor,
    l_run: torch.Tensor,
    acc_run: torch.Tensor,
    m_s: torch.Tensor,
    l_s: torch.Tensor,
    acc_s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge a split's state (m_s [rows, Hq], l_s, acc_s [rows, Hq, D]) into the running one, the
    kernel's ``_merge``: every product and sum rounded on its own (the kernel runs without FMA)."""
    m_new = torch.maximum(m_run, m_s).detach()
    m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
    alpha = _exp2(m_run - m_use)
    beta = _exp2(m_s - m_use)
    l_new = l_run * alpha + l_s * beta
    acc_new = acc_run * alpha[..., None] + acc_s * beta[..., None]
    return m_new, l_new, acc_new


def _one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_start: int,
    scale: float,
    block_n: int,
    split_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] of one sequence (query i at key position Tk − Tq + i; keys
    before ``key_start`` are padding). Returns out [Tq, Hq, D] (accumulation dtype) and lse2 [Tq, Hq]."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    dt = acc_dtype(q)
    group = hq // hkv
    qf = q.to(dt)
    kf = k.to(dt).repeat_interleave(group, dim=1)  # [Tk, Hq, D]: q head h reads kv head h // G
    vf = v.to(dt).repeat_interleave(group, dim=1)
    # The kernel's fp32 constant c = scale·log2(e) (kept in fp64 for the fp64 accuracy path).
    c = torch.tensor(scale * LOG2E, dtype=torch.float32 if dt == torch.float32 else dt).to(dt)
    offset = tk - tq  # key position of query 0
    chunk = max(1, CHUNK_ELEMENTS // max(1, block_n * hq * d))
    m_run = torch.full((tq, hq), -math.inf, dtype=dt, device=q.device)
    l_run = torch.zeros((tq, hq), dtype=dt, device=q.device)
    acc_run = torch.zeros((tq, hq, d), dtype=dt, device=q.device)
    for s0 in range(key_start, tk, split_n):  # splits of split_n keys anchored at key_start, in order
        m = torch.full((tq, hq), -math.inf, dtype=dt, device=q.device)  # fresh state per split
        l = torch.zeros((tq, hq), dtype=dt, device=q.device)
        acc = torch.zeros((tq, hq, d), dtype=dt, device=q.device)
        for k0 in range(s0, min(s0 + split_n, tk), block_n):
            i0 = max(0, k0 - offset)  # queries before i0 see no key of this block: exact no-ops, skipped
            kb = kf[k0 : k0 + block_n]
            vb = vf[k0 : k0 + block_n]
            if kb.shape[0] < block_n:  # block past the end of the keys: the masked keys read zeros
                pad = (0, 0, 0, 0, 0, block_n - kb.shape[0])
                kb = torch.nn.functional.pad(kb, pad)
                vb = torch.nn.functional.pad(vb, pad)
            keys = k0 + torch.arange(block_n, device=q.device)
            for r0 in range(i0, tq, chunk):
                r1 = min(tq, r0 + chunk)
                qpos = offset + torch.arange(r0, r1, device=q.device)
                t = tree_sum(qf[r0:r1, None] * kb[None], dim=-1) * c  # [rows, BN, Hq]
                t = t.masked_fill((keys[None, :] > qpos[:, None])[..., None], -math.inf)
                m_old = m[r0:r1]
                m_new = torch.maximum(m_old, t.amax(dim=1)).detach()
                # A row that has seen no key yet keeps m = −inf; shift by 0 so that 2^(−inf − 0) = 0.
                m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
                alpha = _exp2(m_old - m_use)
                p = _exp2(t - m_use[:, None])
                l_new = l[r0:r1] * alpha + tree_sum(p, dim=1)
                pv = tree_sum(p[..., None] * vb[None], dim=1)  # [rows, Hq, D]
                acc_new = acc[r0:r1] * alpha[..., None] + pv
                m = torch.cat([m[:r0], m_new, m[r1:]])
                l = torch.cat([l[:r0], l_new, l[r1:]])
                acc = torch.cat([acc[:r0], acc_new, acc[r1:]])
        m_run, l_run, acc_run = merge(m_run, l_run, acc_run, m, l, acc)
    m, l, acc = m_run, l_run, acc_run
    has_keys = l > 0
    safe_l = torch.where(has_keys, l, torch.ones_like(l))
    out = torch.where(has_keys[..., None], acc / safe_l[..., None], torch.zeros_like(acc))
    lse2 = torch.where(has_keys, m + _log2(safe_l), torch.full_like(l, math.inf))
    return out, lse2


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    key_start: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    block_n: int | None = None,
    split_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` plus the base-2 log-sum-exp of each row's scaled scores.

    Returns ``(out, lse2)``: ``out`` like ``q`` in ``q.dtype``; ``lse2`` fp32 (fp64 for fp64 input),
    ``[B, Tq, Hq]`` padded or ``[Nq, Hq]`` packed, +inf for rows that see no key."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    block_n = BLOCK_N if block_n is None else block_n  # read at call time: tests may patch them
    split_n = SPLIT_N if split_n is None else split_n
    if split_n % block_n:
        raise ValueError(f"split_n ({split_n}) must be a multiple of block_n ({block_n})")
    if cu_seqlens_q is not None:
        cq = cu_seqlens_q.tolist()
        ck = cu_seqlens_k.tolist()
        outs, lses = [], []
        for i in range(len(cq) - 1):
            o, s = _one_sequence(
                q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], 0, scale, block_n, split_n
            )
            outs.append(o)
            lses.append(s)
        dt = acc_dtype(q)
        out = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=dt)
        lse = torch.cat(lses) if lses else q.new_zeros(q.shape[:-1], dtype=dt)
        return out.to(q.dtype), lse
    starts = [0] * q.shape[0] if key_start is None else [int(s) for s in key_start.tolist()]
    results = [_one_sequence(q[b], k[b], v[b], starts[b], scale, block_n, split_n) for b in range(q.shape[0])]
    if not results:
        return q.clone(), q.new_zeros(q.shape[:-1], dtype=acc_dtype(q))
    out = torch.stack([r[0] for r in results]).to(q.dtype)
    return out, torch.stack([r[1] for r in results])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    key_start: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    block_n: int | None = None,
    split_n: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention with bottom-right aligned queries (see the module header).

    Args:
        q: ``[B, Tq, Hq, D]`` (padded) or ``[Nq, Hq, D]`` (packed).
        k, v: ``[B, Tk, Hkv, D]`` or ``[Nk, Hkv, D]``; Hq a multiple of Hkv; Tk ≥ Tq.
        scale: softmax scale, default ``D ** -0.5``.
        key_start: ``[B]`` int, first valid key of each sequence (left padding); default 0.
        cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` cumulative lengths (packed form, both or neither).
        block_n: keys per block (the kernel's BLOCK_N; it fixes the summation order); default
            ``BLOCK_N``.
        split_n: keys per split of the two-level softmax (the kernel's SPLIT_N; a multiple of
            block_n); default ``SPLIT_N``.

    Returns:
        ``out`` shaped like ``q``, in ``q.dtype``; rows that see no key (left padding) are 0.
    """
    return attention_with_lse(
        q,
        k,
        v,
        scale=scale,
        key_start=key_start,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        block_n=block_n,
        split_n=split_n,
    )[0]
