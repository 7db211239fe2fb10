"""Batch-invariant causal GQA attention: prefill (padded or packed), chunked prefill, KV-cache decode.

``attention(q, k, v)`` gives every query row an output that depends only on its own query and on
the keys/values of its own sequence at positions ≤ its own, computed in the same order with the same
formula whatever else is processed with it: the batch, the padding side and amount, the number of
queries processed together (full prefill, chunked prefill, one-token decode), the cache length, or
the position in a packed stream. So a token scored by KV-cache decode at batch 1 gets the same bits
as the same token scored by a training prefill at batch 32.

Design (why it is invariant; the kernel is ``rlkernel.kernels.attention``, the oracle and CPU path
``rlkernel.reference.attention``):

* Query alignment: query i of a sequence with Tq queries and Tk keys sits at key position
  p = Tk − Tq + i (bottom-right causal alignment), which covers prefill (Tq = Tk), chunked prefill
  and decode against a cache (Tq < Tk) with one rule.
* Key blocks are anchored at the sequence's first real key s (``key_start``, the left-padding
  amount; 0 for right padding and packed sequences): [s, s+BN), [s+BN, s+2BN), … in that order,
  with BN fixed per (head_dim, dtype). A left-padded decode batch, a right-padded prefill and a
  packed stream therefore cut a sequence's keys into the same blocks. Anchoring at the tensor index
  instead would shift the block boundaries by the padding amount and change the sums.
* One two-level online-softmax formula (base 2, c = scale·log2 e as one fp32 constant, fp32
  accumulation): the keys are cut into splits of S keys anchored at s, [s, s+S), [s+S, s+2S), …
  (S a multiple of BN, fixed per (head_dim, dtype): 2048; it depends neither on the batch nor on
  the cache length; option ``attention_split_keys``), each split an online softmax over its key
  blocks from a fresh state, the splits merged in split order (the kernel module's header has the
  formula). A row with at most S keys has one split and the one-level bits; S is part of the
  formula like BN, so a row with more keys changes bits with S. One launch configuration
  (BLOCK_M, BLOCK_N, num_warps) per (head_dim, dtype) whatever the shapes: a decode step is the
  prefill tile with only the rows of its last query active. Every key block is masked with the
  same ``where`` and computed by the same arithmetic (no separate unmasked fast path: a different
  instruction sequence could contract the scale into an FMA differently). A row's blocks past its
  diagonal are fully masked and are exact no-ops (α = 2^0 = 1, P = 0), and so are its splits past
  its last key (l = 0: the merge keeps the total as it is), so how far the other rows of a tile
  reach changes nothing.
* Split-KV decode with the prefill's bits: a decode step at small batch spreads each row's splits
  over separate programs (one per split, sequence and kv head) that store the fp32 split states,
  and a combine kernel merges them in split order with the prefill's merge code (one
  ``@triton.jit`` helper, FP contraction off in every kernel). Whether a call runs that way
  (option ``attention_split_decode``; ``"auto"``: some row spans two splits and the one-pass grid
  leaves SMs idle) changes speed only, never a bit.
* Non-finite inputs stay in the rows that see them: a row that sees a NaN/±Inf in its query or in a
  key or value it attends to is NaN; keys and values it does not see (later positions, right
  padding, keys before ``key_start``, other packed sequences) never change its bits, whatever they
  hold (an uninitialised cache tail, NaN activations of padding tokens). P·V is a matrix product,
  where a hidden key's P = 0 would still meet its value (0·NaN = NaN), so the blocks of a tile's
  diagonal, the only ones some of its rows do not see whole, read V's non-finite entries as 0 and
  give the rows that do see one a NaN P (a second loop over those one or two blocks, same arithmetic:
  finite inputs keep their bits). The backward treats Q, K and dO the same way.
* Rows are (query, q-head-of-the-GQA-group) pairs, so a kv head's K/V block is loaded once for its
  whole group; a row's result does not depend on which tile row it occupies (each MMA output element
  is accumulated by the same instruction sequence). ``tests/gpu/test_attention.py`` checks this
  on the GPU (decode vs prefill vs chunked, batch 1 vs 32, left vs right padding, packed).

Backward (training): FlashAttention-2 style, deterministic, not required to be batch-invariant:
delta = rowsum(dO·O); one program per key block computes dK, dV looping over the GQA group's q heads
and then query blocks in a fixed order; one program per query block computes dQ. P is recomputed
from the saved base-2 LSE. No atomics. Kernels: ``rlkernel.kernels.attention`` (forward) and
``rlkernel.kernels.attention_bwd``, behind the custom ops ``rlkernel::invariant_attention_fwd``/``_bwd``
(``torch.compile(fullgraph=True)`` traces them).

Caveats:
    * head_dim ≤ 256. fp64 inputs run the reference (no kernel).
    * The diagonal blocks' non-finite handling (above) costs an elementwise pass over their V
      tile (forward; Q and dO, or K, in the backward) and a second loop. Measured on an H100
      (bf16, Hq 32, Hkv 8, D 128, 2026-11-24, benchmarks/results/
      attention_nonfinite_ab_h100_2026-11-24.log): forward +29 % at B 8 × T 2048, +9 % at
      B 1 × T 8192; forward + backward +4-13 %. Finite inputs keep their bits, and every check of
      ``tests/gpu/test_attention.py`` passes.
    * The prefill pays one merge and one software-pipeline restart per split of S keys (static
      sm_90 count: about +3.5 % instructions for the rows past the first split at S = 2048; H200,
      prefill B = 1, T = 8192: +3.2 % time). Smaller S: more decode parallelism, more prefill merges.
    * Decode at small batch with at most S keys per row still runs one program per (sequence, kv
      head) over the whole cache (B=1, cache 4096 before the splits: 0.20 ms vs SDPA's 0.07 ms on
      the H100); longer caches run ⌈T/S⌉ programs per (sequence, kv head).
    * The packed form validates ``cu_seqlens`` (and ``max_seqlen_q``) on one host copy of both (one
      sync per call); the padded form needs none, except one to check ``key_start``'s range when
      it is given on a GPU (``validate=False`` skips it; the HF adapter, whose key_start comes from
      the mask, never pays it).
"""

from __future__ import annotations

import math

import torch

from rlkernel import _dispatch
from rlkernel import _validate as check
from rlkernel._autocast import without_autocast
from rlkernel._options import current_options
from rlkernel.reference import attention as ref

MAX_HEAD_DIM = 256
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------ custom ops
# The kernels run behind opaque torch.library ops so that torch.compile traces a call instead of
# breaking the graph at a Triton launch. The bodies import the kernels lazily: registering the ops
# needs no Triton, and TRITON_INTERPRET must be set before the kernels module is first imported.
@torch.library.custom_op("rlkernel::invariant_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_start: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    scale: float,
    max_seqlen_k: int,
    split_keys: int | None,
    split_decode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from rlkernel.kernels import attention as kern

    return kern.attention_fwd(
        q,
        k,
        v,
        scale=scale,
        key_start=key_start,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        split=split_keys,
        split_decode=split_decode,
    )


@_fwd_op.register_fake
def _(q, k, v, key_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, *split):
    total_q = q.shape[0] if cu_seqlens_q is not None else q.shape[0] * q.shape[1]
    lse = q.new_empty((q.shape[-2], total_q), dtype=torch.float32)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse


@torch.library.custom_op("rlkernel::invariant_attention_bwd", mutates_args=())
def _bwd_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_start: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from rlkernel.kernels import attention_bwd as kern

    return kern.attention_bwd(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        scale=scale,
        key_start=key_start,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
    )


@_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse, key_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, *split):
        # split: (max_seqlen_k, split_keys, split_decode) of the forward op (the backward recomputes
        # P from the saved lse2, whichever split formula produced it)
        out, lse = _dispatch.call_op(
            _fwd_op, q, k, v, key_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, *split
        )
        ctx.save_for_backward(q, k, v, out, lse, key_start, cu_seqlens_q, cu_seqlens_k)
        ctx.scale = scale
        ctx.max_seqlen_q = max_seqlen_q
        return out

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_start, cu_q, cu_k = ctx.saved_tensors
        args = (grad_out.contiguous(), q, k, v, out, lse, key_start, cu_q, cu_k, ctx.max_seqlen_q, ctx.scale)
        dq, dk, dv = _dispatch.call_op(_bwd_op, *args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _check_inputs(q, k, v, key_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, validate=True):
    """Check every argument; returns the ``(max_seqlen_q, max_seqlen_k)`` the launch uses (the
    grid's query extent; the longest key sequence, which bounds the split-decode grid).

    Index-like arguments are checked against the tensors they index, so that no kernel reads or
    writes outside them and no output row is left unwritten: ``cu_seqlens_q/_k`` (start at 0,
    non-decreasing, end at the packed lengths, as many keys as queries per sequence) and
    ``max_seqlen_q`` (>= the longest query sequence) from one host copy of both cu_seqlens (the
    packed form always needed their host values); ``key_start`` (in ``[0, Tk]``) on the host unless
    ``validate`` is False or ``torch.compile`` is tracing (one sync when it lives on a GPU)."""
    q = check.float_tensor("q", q)
    k = check.float_tensor("k", k)
    v = check.float_tensor("v", v)
    for name, t in (("k", k), ("v", v)):
        check.same_device(name, t, "q", q.device)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {check.describe(t)}")
    check.same_shape("v", v, "k", k.shape)
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    n_dim = 3 if packed else 4
    form = "[N, H, D] (packed, with cu_seqlens)" if packed else "[B, T, H, D]"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != n_dim:
            raise ValueError(f"{name} must be {form}, got {check.describe(t)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k must have head_dim {d} (the last dim of q), got {check.describe(k)}")
    if d < 1 or d > MAX_HEAD_DIM:
        raise ValueError(f"q must have 1 <= head_dim <= {MAX_HEAD_DIM}, got {check.describe(q)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"the number of q heads ({hq}) must be a multiple of the number of kv heads ({hkv}): "
            f"q {check.describe(q)}, k {check.describe(k)}"
        )
    if packed:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (packed form)")
        if key_start is not None:
            raise ValueError("key_start applies to the padded form only; packed sequences start at 0")
        if max_seqlen_q is not None:
            check.integer("max_seqlen_q", max_seqlen_q)
        check.cu_seqlens_shape("cu_seqlens_q", cu_seqlens_q)
        check.cu_seqlens_shape("cu_seqlens_k", cu_seqlens_k)
        check.same_device("cu_seqlens_q", cu_seqlens_q, "q", q.device)
        check.same_device("cu_seqlens_k", cu_seqlens_k, "q", q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
            )
        # One device-to-host copy of both (the only host sync of the packed form's checks).
        n = cu_seqlens_q.numel()
        host = torch.cat([cu_seqlens_q.detach().to(torch.int64), cu_seqlens_k.detach().to(torch.int64)]).cpu()
        cq, ck = host[:n], host[n:]
        check.cu_seqlens_values("cu_seqlens_q", cq, q.shape[0])
        check.cu_seqlens_values("cu_seqlens_k", ck, k.shape[0])
        len_q, len_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        short = (len_q > len_k).nonzero()
        if short.numel():
            i = int(short[0, 0])
            raise ValueError(
                f"every sequence needs at least as many keys as queries (cu_seqlens_q/_k): sequence {i} "
                f"has {int(len_q[i])} queries and {int(len_k[i])} keys"
            )
        longest = int(len_q.max()) if len_q.numel() else 0
        max_seqlen_k = int(len_k.max()) if len_k.numel() else 0
        if max_seqlen_q is None:
            max_seqlen_q = longest
        elif max_seqlen_q < longest:
            raise ValueError(
                f"max_seqlen_q must be >= the longest query sequence of cu_seqlens_q ({longest}), "
                f"got {max_seqlen_q}"
            )
    else:
        if max_seqlen_q is not None:
            raise ValueError(
                "max_seqlen_q applies to the packed form only (with cu_seqlens_q/_k); the padded form "
                f"takes Tq from q, got max_seqlen_q={max_seqlen_q!r}"
            )
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k must have the batch size of q ({q.shape[0]}), got {check.describe(k)}")
        if k.shape[1] < q.shape[1]:
            raise ValueError(
                f"k must have at least as many positions as q (Tk >= Tq), got q {check.describe(q)}, "
                f"k {check.describe(k)}"
            )
        if key_start is not None:
            check.int_tensor("key_start", key_start)
            check.same_shape("key_start", key_start, "the batch of q", (q.shape[0],))
            check.same_device("key_start", key_start, "q", q.device)
            if validate and key_start.numel() and not torch.compiler.is_compiling():
                _check_key_start(key_start, k.shape[1])
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    return max_seqlen_q, max_seqlen_k


def _check_key_start(key_start: torch.Tensor, tk: int) -> None:
    """Every entry in ``[0, Tk]`` (one host sync when ``key_start`` lives on a GPU)."""
    bad = (key_start < 0) | (key_start > tk)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"key_start must be in [0, Tk] = [0, {tk}] (the first valid key of each sequence), got "
            f"{int(key_start[i])} at batch index {i}; pass validate=False only if you are sure it is valid"
        )


@without_autocast
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    key_start: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Causal grouped-query attention whose every row is bitwise batch-invariant.

    Query i of a sequence with Tq queries and Tk keys sits at key position Tk − Tq + i and attends to
    keys ``key_start ≤ j ≤ Tk − Tq + i`` of its own sequence: ``Tq == Tk`` is a prefill, ``Tq < Tk``
    a chunked prefill or a decode step against a KV cache of ``Tk`` entries.

    Options (``rk.use_options``, read once per call): ``attention_split_keys``, the split size S
    of the two-level softmax (part of the formula: rows with more than S keys change bits with
    it; rollout and trainer must agree), and ``attention_split_decode``, whether a decode step
    spreads a row's splits over separate programs (speed only, the same bits).

    Args:
        q: ``[B, Tq, Hq, D]`` (padded) or ``[Nq, Hq, D]`` (packed). fp16/bf16/fp32 (fp64: reference).
            Any strides with a unit last stride are read in place (e.g. HF's ``[B, H, T, D]``
            tensors ``.transpose(1, 2)``).
        k, v: ``[B, Tk, Hkv, D]`` or ``[Nk, Hkv, D]``, same dtype/device as ``q``; ``Hq % Hkv == 0``
            (q head h reads kv head ``h // (Hq // Hkv)``); ``Tk >= Tq``; ``D <= 256``.
        scale: softmax scale; default ``D ** -0.5``.
        key_start: ``[B]`` integer tensor on q's device, the first valid key of each sequence (the
            amount of left padding), each in ``[0, Tk]`` (``Tk``: the sequence is all padding); keys
            before it are ignored and query rows before it output 0. Default: every sequence starts
            at key 0 (no padding, or right padding).
        cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` cumulative sequence lengths of the packed form (both
            or neither); sequence i has queries ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and keys
            ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``. Both start at 0, never decrease and end at
            ``Nq`` / ``Nk``; every sequence has at least as many keys as queries.
        max_seqlen_q: packed form only: a bound on the longest query sequence (it sizes the launch
            grid), ``>=`` that length; default: computed from ``cu_seqlens_q``. Either way the
            host copy of ``cu_seqlens`` that the checks read is the packed form's one host sync.
        validate: check ``key_start``'s values (``0 <= key_start <= Tk``) on the host: one sync
            when it lives on a GPU (none for the padded form otherwise). ``False`` skips that check
            only (inside ``torch.compile`` it is skipped too); an out-of-range entry then gives NaN
            rows for its sequence on both backends, never a read outside the keys. The packed form's
            ``cu_seqlens``/``max_seqlen_q`` are always checked.

    Returns:
        Tensor shaped like ``q`` in ``q.dtype``. Differentiable (deterministic backward). A row that
        sees a NaN/±Inf in its own query or in a key or value it attends to is NaN (the whole row);
        keys and values it does not see (later positions, padding, other sequences) never change
        it, whatever they hold. Likewise in the backward.

    Raises:
        TypeError/ValueError naming the argument on a wrong type, dtype, shape or device, and
        ValueError on out-of-range index arguments: ``key_start`` outside ``[0, Tk]``, ``cu_seqlens``
        that do not start at 0, decrease, do not end at the packed length or give a sequence fewer
        keys than queries, ``max_seqlen_q`` below the longest query sequence (or given for the
        padded form). Both backends reject the same inputs (the checks run before dispatch).
    """
    max_seqlen_q, max_seqlen_k = _check_inputs(
        q, k, v, key_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, validate
    )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check.positive_float("scale", scale)
    opts = current_options()
    split_keys, split_decode = opts.attention_split_keys, opts.attention_split_decode
    backend = _dispatch.resolve_backend(q.device, has_kernel=q.dtype in _KERNEL_DTYPES)
    if backend == "reference":
        return ref.attention(
            q,
            k,
            v,
            scale=scale,
            key_start=key_start,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            split_keys=split_keys,
        )
    args = (q, k, v, key_start, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale)
    args += (max_seqlen_k, split_keys, split_decode)
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        # No gradient wanted (rollout, decode): the forward op without the autograd Function's
        # host overhead; the same op, so the same bits.
        return _dispatch.call_op(_fwd_op, *args)[0]
    return _AttentionFunction.apply(*args)


def attention_heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, key_start: torch.Tensor | None
) -> torch.Tensor:
    """:func:`attention` on HF's layout: ``q [B, Hq, Tq, D]``, ``k, v [B, Hkv, Tk, D]``; returns
    ``[B, Tq, Hq, D]`` (what HF's attention functions return). Without a gradient to keep (a rollout
    or decode step) the kernel reads the three tensors through their strides (no transposed views,
    no second round of checks); otherwise, or off the common case, it is
    ``attention(q.transpose(1, 2), …)`` with every check but ``key_start``'s host-side range check
    (``validate=False``: ``key_start`` comes from the adapter's mask, in range by construction).
    Same bits either way."""
    b, hq, tq, d = q.shape
    if (
        not torch.compiler.is_compiling()
        and k.dim() == 4
        and k.dtype is q.dtype
        and v.dtype is q.dtype
        and k.shape[0] == b
        and v.shape == k.shape
        and k.shape[3] == d
        and 1 <= d <= MAX_HEAD_DIM
        and hq % k.shape[1] == 0
        and k.shape[2] >= tq
        and k.device == q.device
        and v.device == q.device
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and _dispatch.resolve_backend(q.device, has_kernel=q.dtype in _KERNEL_DTYPES) == "triton"
    ):
        from rlkernel.kernels import attention as kern

        opts = current_options()
        return kern.attention_fwd(
            q,
            k,
            v,
            scale=scale,
            key_start=key_start,
            heads_first=True,
            split=opts.attention_split_keys,
            split_decode=opts.attention_split_decode,
        )[0]
    # The adapter builds key_start from the mask, in [0, Tk] by construction: no host check (one
    # sync per layer of a training forward), the kernel's clamp and NaN rows guard it anyway.
    return attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale=scale,
        key_start=key_start,
        validate=False,
    )
