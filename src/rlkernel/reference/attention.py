"""Reference causal GQA attention, batch-invariant by construction: the CPU path and the test oracle.

Math, per sequence, query head h (kv head h // G, G = Hq / Hkv), query at key position p, its
sequence's first valid key s (``key_start``; 0 unless left-padded), c = scale·log2(e):

    out = Σ_{s ≤ j ≤ p} softmax_j(scale·q·k_j)·v_j,      lse2 = log2 Σ_{s ≤ j ≤ p} 2^(c·q·k_j)

computed exactly as the Triton kernel orders it, a two-level online softmax: splits of
``SPLIT_KEYS`` = S keys anchored at s, [s, s+S), [s+S, s+2S), …, each an online softmax over its
blocks of ``BLOCK_N`` keys, [s+i·S, s+i·S+BN), …, visited in order from the state
(m, l, acc) = (−inf, 0, 0), every product and sum rounded on its own (the kernel runs without FMA):

    t = c·(q·k)  (−inf for keys > p),   m' = max(m, max_j t_j),   α = 2^(m − m'),   P = 2^(t − m')
    l' = α·l + Σ_j P_j,   acc' = α·acc + Σ_j P_j·v_j

and the splits merged into the total (M, L, A) = (−inf, 0, 0) in order (``_merge``, the kernel's
``_merge``): μ = max(M, m) (0 if −inf), a = 2^(M − μ), b = 2^(m − μ), or exactly (a, b) = (0, 1)
while L = 0 and (1, 0) for a split the row sees no key of (l = 0);
L' = a·L + b·l,  A' = a·A + b·acc;  out = A / L,  lse2 = M + log2 L. A row with at most S keys has
one split, taken as it is (the one-level formula). S must be a multiple of BLOCK_N.

Batch invariance (what makes this usable as the CPU path of a model whose decode must equal its
prefill bit for bit): every quantity of a query row is computed by elementwise torch ops on that row
alone. The dot products q·k and the sums Σ_j P_j, Σ_j P_j v_j are not ``@``/``sum`` (CPU BLAS and the
reduction kernels choose their blocking from the tensor size) but ``tree_sum``: a fixed pairwise tree
of elementwise adds over the power-of-two padded axis. Elementwise +, ·, /, max are correctly rounded
whatever the vectorization; ``torch.exp2`` is not (ATen runs SLEEF on full vectors and libm on
the tail of a loop, which may differ by an ulp), so ``exp2`` here is built from float64 basic ops (a
Taylor polynomial and an exact power of two from exponent bits) and rounded to float32. Blocks
that a row's causal mask fully hides are exact no-ops for that row (α = 1, P = 0), so the number
of blocks visited for the *other* rows never matters; here such rows are simply skipped. Queries
are processed in chunks only to bound memory (all ops are per-row).

Provenance: the online softmax of Milakov & Gimelshein (2018) as used by FlashAttention
(Dao et al. 2022) and its split-KV merge (flash-decoding); the key-block and split anchoring at
each sequence's first real token is ours.

Caveats:
    * Slow and memory-hungry ([rows, BLOCK_N, Hq, D] temporaries, bounded by ``CHUNK_ELEMENTS``):
      meant for tests and tiny CPU models, not for speed.
    * float64 inputs run entirely in float64: ``exp2`` is then accurate to ~1e-15, not correctly
      rounded. ``log2`` (the returned LSE only, never the output) uses ``torch.log2``.
    * Backward is autograd through these ops (deterministic on CPU); the running max is detached,
      which is exact since the output does not depend on it mathematically.
    * Non-finite inputs, as in the kernel: a row that sees a NaN/±Inf in its query or in a key or
      value it attends to is NaN (the whole row); what a row does not see never reaches it, in the
      forward or the gradient. Here each (row, key) pair the causal mask hides reads 0 for a
      non-finite query, key or value entry and its P and P·v terms are selected to 0 with ``where``
      (not multiplied by 0), so 0·NaN never happens in a product or its gradient; with finite
      inputs the values and ops are those of the plain formula.
"""

from __future__ import annotations

import math

import torch

BLOCK_N = 64  # keys per block: the kernel's BLOCK_N for 16-bit inputs, head_dim ≤ 128 (fwd_config)
SPLIT_KEYS = 2048  # keys per split: the kernel's default split size (kernels.attention.split_keys)
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


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _hide_non_finite(x: torch.Tensor, hidden: torch.Tensor, *, per_key: bool) -> torch.Tensor:
    """``x`` per (row, key) pair, ``[rows, BN, Hq, D]``: its own values where the row sees the key, its
    non-finite entries read as 0 where it does not (``hidden [rows, BN]``). ``x`` is a key block
    ``[BN, Hq, D]`` (``per_key``) or the rows' queries ``[rows, Hq, D]``."""
    x = x[None] if per_key else x[:, None]
    return torch.where(hidden[:, :, None, None], _finite(x), x)


def _merge(m_t, l_t, acc_t, m, l, acc):
    """A split's state (m, l, acc) merged into the total (m_t, l_t, acc_t), as the kernel's
    ``_merge``: factors a = 2^(M − μ), b = 2^(m − μ) (μ = max(M, m), 0 if −inf), or exactly (0, 1)
    for a row that has merged nothing yet (l_t = 0) and (1, 0) for a split that holds no key the
    row sees (l = 0). The max is detached (as in the block loop: the output does not depend on it)."""
    m_new = torch.maximum(m_t, m).detach()
    m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
    first, empty = l_t == 0, l == 0
    one, zero = torch.ones_like(m_new), torch.zeros_like(m_new)
    a = torch.where(first, zero, torch.where(empty, one, _exp2(m_t - m_use)))
    b = torch.where(first, one, torch.where(empty, zero, _exp2(m - m_use)))
    m_out = torch.where(first, m, torch.where(empty, m_t, m_new))
    return m_out, l_t * a + l * b, acc_t * a[..., None] + acc * b[..., None]


def _one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_start: int,
    scale: float,
    block_n: int,
    split_keys: int,
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
    q_bad_any = not bool(torch.isfinite(qf).all())
    chunk = max(1, CHUNK_ELEMENTS // max(1, block_n * hq * d))
    m_t = torch.full((tq, hq), -math.inf, dtype=dt, device=q.device)
    l_t = torch.zeros((tq, hq), dtype=dt, device=q.device)
    acc_t = torch.zeros((tq, hq, d), dtype=dt, device=q.device)
    for s0 in range(key_start, tk, split_keys):  # splits anchored at key_start, in order
        # Each split from a fresh state; a row that sees none of its keys keeps it (an empty split).
        m = torch.full((tq, hq), -math.inf, dtype=dt, device=q.device)
        l = torch.zeros((tq, hq), dtype=dt, device=q.device)
        acc = torch.zeros((tq, hq, d), dtype=dt, device=q.device)
        for k0 in range(s0, min(s0 + split_keys, tk), block_n):  # its key blocks, in order
            i0 = max(0, k0 - offset)  # queries before i0 see no key of this block: no-ops, skipped
            kb = kf[k0 : k0 + block_n]
            vb = vf[k0 : k0 + block_n]
            if kb.shape[0] < block_n:  # block past the end of the keys: the masked keys read zeros
                pad = (0, 0, 0, 0, 0, block_n - kb.shape[0])
                kb = torch.nn.functional.pad(kb, pad)
                vb = torch.nn.functional.pad(vb, pad)
            keys = k0 + torch.arange(block_n, device=q.device)
            k_bad_any, v_bad_any = (not bool(torch.isfinite(x).all()) for x in (kb, vb))
            for r0 in range(i0, tq, chunk):
                r1 = min(tq, r0 + chunk)
                qpos = offset + torch.arange(r0, r1, device=q.device)
                hidden = keys[None, :] > qpos[:, None]  # [rows, BN]: keys after the row's query
                # A non-finite query, key or value must not reach a (row, key) pair the mask hides,
                # not even as 0·NaN in a product or in its gradient: there it reads 0 (finite
                # inputs: the same values, the same ops).
                qq = _hide_non_finite(qf[r0:r1], hidden, per_key=False) if q_bad_any else qf[r0:r1, None]
                kq = _hide_non_finite(kb, hidden, per_key=True) if k_bad_any else kb[None]
                t = tree_sum(qq * kq, dim=-1) * c  # [rows, BN, Hq]
                t = t.masked_fill(hidden[..., None], -math.inf)
                m_old = m[r0:r1]
                m_new = torch.maximum(m_old, t.amax(dim=1)).detach()
                # A row that has seen no key yet keeps m = −inf; shift by 0 so that 2^(−inf − 0) = 0.
                m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
                alpha = _exp2(m_old - m_use)
                # Hidden pairs: exactly 0 (2^(−inf − m)), also when a NaN score of the row made m NaN
                p = torch.where(hidden[..., None], 0.0, _exp2(t - m_use[:, None]))
                l_new = l[r0:r1] * alpha + tree_sum(p, dim=1)
                vq = _hide_non_finite(vb, hidden, per_key=True) if v_bad_any else vb[None]
                # Hidden pairs are P = 0 already; the where keeps a NaN output gradient of the row
                # off the hidden keys' dV (0·NaN) in the backward.
                pv_terms = torch.where(hidden[:, :, None, None], 0.0, p[..., None] * vq)
                pv = tree_sum(pv_terms, dim=1)  # [rows, Hq, D]
                acc_new = acc[r0:r1] * alpha[..., None] + pv
                m = torch.cat([m[:r0], m_new, m[r1:]])
                l = torch.cat([l[:r0], l_new, l[r1:]])
                acc = torch.cat([acc[:r0], acc_new, acc[r1:]])
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m, l, acc)
    m, l, acc = m_t, l_t, acc_t
    has_keys = l != 0  # a NaN l (a NaN score the row sees) keeps the row NaN
    safe_l = torch.where(has_keys, l, torch.ones_like(l))
    out = torch.where(has_keys[..., None], acc / safe_l[..., None], torch.zeros_like(acc))
    # As the kernel: a row that saw a non-finite value (a non-finite column of acc) is NaN whole. The
    # where keeps the gradient of such a row as it is (NaN where it sees the value).
    seen_bad = ~torch.isfinite(acc).all(-1, keepdim=True)
    out = torch.where(seen_bad, out + math.nan, out)
    lse2 = torch.where(has_keys, m + _log2(safe_l), torch.full_like(l, math.inf))
    return out, lse2


def _nan_sequence(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse2) of a sequence whose ``key_start`` is out of range: NaN (kept in q's graph)."""
    out = q.to(acc_dtype(q)) * math.nan
    return out, out[..., 0]


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
    split_keys: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` plus the base-2 log-sum-exp of each row's scaled scores.

    Returns ``(out, lse2)``: ``out`` like ``q`` in ``q.dtype``; ``lse2`` fp32 (fp64 for fp64 input),
    ``[B, Tq, Hq]`` padded or ``[Nq, Hq]`` packed, +inf for rows that see no key."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    block_n = BLOCK_N if block_n is None else block_n  # read at call time: tests may patch it
    split = SPLIT_KEYS if split_keys is None else split_keys
    if isinstance(split, bool) or not isinstance(split, int) or split < 1 or split % block_n:
        raise ValueError(
            f"attention_split_keys must be a positive multiple of the reference's key block "
            f"({block_n}), got {split!r}"
        )
    if cu_seqlens_q is not None:
        cq = cu_seqlens_q.tolist()
        ck = cu_seqlens_k.tolist()
        outs, lses = [], []
        for i in range(len(cq) - 1):
            o, s = _one_sequence(
                q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], 0, scale, block_n, split
            )
            outs.append(o)
            lses.append(s)
        dt = acc_dtype(q)
        out = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=dt)
        lse = torch.cat(lses) if lses else q.new_zeros(q.shape[:-1], dtype=dt)
        return _keep_in_graph(out.to(q.dtype), q, k, v), lse
    starts = [0] * q.shape[0] if key_start is None else [int(s) for s in key_start.tolist()]
    results = [
        _one_sequence(q[b], k[b], v[b], starts[b], scale, block_n, split)
        if 0 <= starts[b] <= k.shape[1]
        else _nan_sequence(q[b])  # key_start outside [0, Tk] (unvalidated): NaN rows, as the kernel
        for b in range(q.shape[0])
    ]
    if not results:
        return _keep_in_graph(q.new_zeros(q.shape), q, k, v), q.new_zeros(q.shape[:-1], dtype=acc_dtype(q))
    out = torch.stack([r[0] for r in results]).to(q.dtype)
    return _keep_in_graph(out, q, k, v), torch.stack([r[1] for r in results])


def _keep_in_graph(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out``, attached to every input that requires grad when it is empty or carries no autograd
    history (no query, no batch, no key seen by any row: built from fresh zeros), so that backward
    gives those inputs zero gradients of their own shape, as the kernel's backward does, instead of
    failing or leaving them out of the graph. The attachment adds the sum of an empty slice, an
    exact 0 (and in these cases ``out`` is empty or all +0), so no value changes."""
    if not torch.is_grad_enabled() or (out.numel() and out.requires_grad):
        return out
    for t in inputs:
        if t.requires_grad:
            out = out + t.reshape(-1)[:0].sum().to(out.dtype)
    return out


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
    split_keys: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention with bottom-right aligned queries (see the module header).

    Args:
        q: ``[B, Tq, Hq, D]`` (padded) or ``[Nq, Hq, D]`` (packed).
        k, v: ``[B, Tk, Hkv, D]`` or ``[Nk, Hkv, D]``; Hq a multiple of Hkv; Tk ≥ Tq.
        scale: softmax scale, default ``D ** -0.5``.
        key_start: ``[B]`` int, first valid key of each sequence (left padding), in ``[0, Tk]``;
            default 0. A sequence whose entry is outside that range (not validated here) gets NaN
            rows, as in the kernel.
        cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` cumulative lengths (packed form, both or neither).
        block_n: keys per block (the kernel's BLOCK_N; it fixes the summation order); default
            ``BLOCK_N``.
        split_keys: keys per split (the kernel's S, a multiple of ``block_n``; it fixes the
            order too); default ``SPLIT_KEYS``.

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
        split_keys=split_keys,
    )[0]
