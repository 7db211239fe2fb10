"""Reference per-token log-probabilities and entropy: the CPU path and the test oracle.

Math (fp32 for every input dtype, fp64 for fp64 inputs; T = temperature, y = token id, z = logits / T):

    lse      = log Σ_j exp(z_j)
    logp     = z_y − lse
    entropy  = −Σ_j p_j log p_j = lse − Σ_j p_j z_j,        p = softmax(z)

Gradients with respect to the *logits* x (z = x / T), for upstream g_logp, g_entropy:

    ∂logp/∂x_k    = (δ_{ky} − p_k) / T
    ∂entropy/∂x_k = −p_k (log p_k + entropy) / T

Positions whose id equals ``ignore_index`` give logp = entropy = 0 and receive no gradient.

Caveats:
    * ``token_logprobs`` here leans on autograd and keeps ``[N, V]`` fp32 intermediates alive: it is
      the readable definition, not the memory-lean path (that is the Triton kernel).
    * ``linear_token_logprobs`` bounds the logits to one chunk of rows at a time in forward and
      backward (it recomputes the chunk's logits in backward). For bf16/fp16 weights it upcasts the
      weight once per call to fp32, an O(V·H) temporary, so that the logits are exact fp32 products
      rather than half-precision roundings. With ``invariant_logits`` it computes each chunk's
      logits with the batch-invariant row-by-row GEMM of :mod:`rlkernel.reference.matmul` instead
      (what a patched model's LM head runs on the CPU) and its log-probs with
      :func:`token_logprobs` itself, so that they are bitwise those of the patched model's logits.
    * Row invariance on the CPU holds per row of a multi-row call and between single-row calls:
      for V > 32,768 and several threads, ATen splits the entropy's sum over V of a *single* row
      across threads (a different order than the same row in a batch), so the entropy of a
      one-row call can differ in its last bits from that row's entropy in a batch (logp does not).
"""

from __future__ import annotations

import torch

from rlkernel._autocast import without_autocast
from rlkernel.reference import matmul as ref_matmul

# One chunk of fp32 logits is at most this many bytes (see ``chunk_rows_for``).
CHUNK_BYTES = 64 * 2**20


def chunk_rows_for(vocab_size: int, n_rows: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one fp32 ``[rows, V]`` logits chunk stays within ``chunk_bytes``.

    The rule: ``rows = max(1, chunk_bytes // (4 * V))``, capped at ``n_rows``. With the default
    64 MiB and V = 151,936 that is 110 rows; with V = 32,768, 512 rows. Peak extra memory of the
    reference linear path is then a small multiple of one chunk (logits, probabilities, gradient),
    whatever N is.
    """
    return max(1, min(max(n_rows, 1), chunk_bytes // (4 * max(vocab_size, 1))))


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for every float dtype but fp64, which stays fp64 so the math can be checked in double."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def prepare_ids(token_ids: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat int64 ids with ignored positions replaced by 0, and the bool mask of active positions."""
    ids = token_ids.reshape(-1).long()
    active = ids != ignore_index
    return torch.where(active, ids, torch.zeros_like(ids)), active


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """logp (and entropy) of ``token_ids`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V]`` float tensor (any float dtype, any strides).
        token_ids: ``[...]`` integer tensor, the leading shape of ``logits``.
        temperature: divides the logits before the softmax (> 0).
        ignore_index: ids equal to it give 0 and no gradient.
        return_entropy: also return the entropy of each position's distribution.

    Returns:
        float32 ``[...]`` logp, or ``(logp, entropy)``. Differentiable through autograd.
    """
    lead = logits.shape[:-1]
    z = logits.reshape(lead.numel(), logits.shape[-1]).to(acc_dtype(logits)) / temperature
    ids, active = prepare_ids(token_ids, ignore_index)
    # Ignored rows may hold garbage (NaN/inf padding): zero them first, or log_softmax's backward
    # would turn their 0 upstream gradient into NaN (0·NaN) instead of an exact 0.
    z = torch.where(active[:, None], z, torch.zeros((), dtype=z.dtype, device=z.device))
    logp_all = torch.log_softmax(z, dim=-1)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    logp = torch.where(active, logp_all.gather(-1, ids[:, None]).squeeze(-1), zero).reshape(lead)
    if not return_entropy:
        return logp
    # Σ p log p with 0·(−inf) treated as 0 (a −inf logit has p = 0 and contributes nothing). The
    # −inf is masked *inside* the product: masking its result instead would leave 0·(−inf) = NaN in
    # the backward of the discarded branch and make the whole row's gradient NaN.
    plogp = logp_all.exp() * torch.where(logp_all.isneginf(), zero, logp_all)
    entropy = torch.where(active, -plogp.sum(-1), zero).reshape(lead)
    return logp, entropy


def logprob_grad_from_logits(
    z: torch.Tensor,
    token_ids: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """∂L/∂x for one block of rows, from scaled logits ``z = x / T`` (fp32 ``[n, V]``).

    ``token_ids`` are flat int64 ids with ignored rows already mapped to a valid id, and the
    upstream gradients already zero on ignored rows. Returns fp32 ``[n, V]``.
    """
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    grad = torch.zeros_like(z)
    if grad_logp is not None:
        grad -= grad_logp[:, None] * p
        grad.scatter_add_(-1, token_ids[:, None], grad_logp[:, None].to(grad.dtype))
    if grad_entropy is not None:
        safe_logp = torch.where(p > 0, logp_all, torch.zeros_like(logp_all))
        entropy = -(p * safe_logp).sum(-1, keepdim=True)
        grad -= grad_entropy[:, None] * p * (safe_logp + entropy)
    return grad / temperature


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """Chunked ``hidden @ weight.T + bias`` → logp/entropy; backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, active, temperature, chunk_rows, return_entropy, inv_dtype):
        n = hidden.shape[0]
        acc = acc_dtype(hidden)
        weight_f = weight.to(acc) if inv_dtype is None else None
        bias_f = None if bias is None or inv_dtype is not None else bias.to(acc)
        logp = torch.zeros(n, dtype=acc, device=hidden.device)
        entropy = torch.zeros(n, dtype=acc, device=hidden.device)
        for start in range(0, n, chunk_rows):
            rows = slice(start, min(start + chunk_rows, n))
            if inv_dtype is not None:
                # The patched LM head's logits (the same per-row GEMM), then token_logprobs itself:
                # every row's bits are those of token_logprobs(patched lm_head(hidden)). The ids
                # are non-negative here (ignored rows mapped to 0, zeroed below): -1 ignores none.
                raw = ref_matmul.linear(hidden[rows], weight, bias, out_dtype=inv_dtype)
                out = token_logprobs(
                    raw, ids[rows], temperature=temperature, ignore_index=-1, return_entropy=return_entropy
                )
                logp[rows], entropy[rows] = out if return_entropy else (out, 0.0)
                continue
            z = chunk_logits(hidden[rows], weight_f, bias_f, temperature)
            logp_all = torch.log_softmax(z, dim=-1)
            logp[rows] = logp_all.gather(-1, ids[rows, None]).squeeze(-1)
            if return_entropy:
                p = logp_all.exp()
                entropy[rows] = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
            del z, logp_all
        logp = torch.where(active, logp, torch.zeros_like(logp))
        entropy = torch.where(active, entropy, torch.zeros_like(entropy))
        ctx.save_for_backward(hidden, weight, bias, ids, active)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.return_entropy = return_entropy
        ctx.inv_dtype = inv_dtype
        if not return_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @without_autocast
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, ids, active = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n = hidden.shape[0]
        acc = acc_dtype(hidden)
        weight_f = weight.to(acc)
        bias_f = None if bias is None else bias.to(acc)
        zero = torch.zeros((), dtype=acc, device=hidden.device)
        g_logp = torch.where(active, grad_logp.to(acc), zero) if grad_logp is not None else None
        g_ent = None
        if ctx.return_entropy and grad_entropy is not None:
            g_ent = torch.where(active, grad_entropy.to(acc), zero)
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros_like(weight_f) if need_w else None  # fp32 accumulator across chunks
        d_bias = torch.zeros_like(bias_f) if need_b else None
        for start in range(0, n, ctx.chunk_rows):
            rows = slice(start, min(start + ctx.chunk_rows, n))
            if ctx.inv_dtype is None:
                z = chunk_logits(hidden[rows], weight_f, bias_f, ctx.temperature)
            else:  # the gradient at the logits the forward used (the patched LM head's)
                raw = ref_matmul.linear(hidden[rows], weight, bias, out_dtype=ctx.inv_dtype)
                z = raw.to(acc) / ctx.temperature
            gz = logprob_grad_from_logits(
                z,
                ids[rows],
                None if g_logp is None else g_logp[rows],
                None if g_ent is None else g_ent[rows],
                ctx.temperature,
            )
            if need_h:
                d_hidden[rows] = (gz @ weight_f).to(hidden.dtype)
            if need_w:
                d_weight += gz.t() @ hidden[rows].to(acc)
            if need_b:
                d_bias += gz.sum(0)
            del z, gz
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


def chunk_logits(h: torch.Tensor, weight_f: torch.Tensor, bias_f: torch.Tensor | None, temperature: float):
    """``(h @ weight_fᵀ + bias_f) / T`` of one chunk of rows, in the dtype of the upcast weight."""
    z = h.to(weight_f.dtype) @ weight_f.t()
    if bias_f is not None:
        z = z + bias_f
    return z / temperature


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_rows: int | None = None,
    invariant_logits: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """logp (and entropy) of ``token_ids`` under ``softmax((hidden @ weight.T + bias) / T)``.

    Never holds more than one chunk of ``[rows, V]`` fp32 logits (see :func:`chunk_rows_for`).

    Args:
        hidden: ``[..., H]`` float.
        weight: ``[V, H]`` float, same dtype as ``hidden``.
        token_ids: ``[...]`` integer, the leading shape of ``hidden``.
        bias: optional ``[V]`` (with ``invariant_logits``: ``hidden``'s dtype).
        chunk_rows: rows per chunk; ``None`` picks :func:`chunk_rows_for`.
        invariant_logits: None: the logits are exact fp32 products (fp32 GEMM of the upcast
            operands). A dtype (``hidden``'s, or ``torch.float32`` for 16-bit inputs): the logits
            are ``rlkernel.reference.matmul.linear(hidden, weight, bias, out_dtype=...)``, the
            batch-invariant CPU linear of a patched model's LM head, and logp/entropy are
            :func:`token_logprobs` of them: bitwise ``token_logprobs(patched_lm_head(hidden))``
            whatever the chunk rows. The gradient is that of the same logits (fp32 math).

    Returns:
        float32 ``[...]`` logp, or ``(logp, entropy)``; differentiable in hidden, weight and bias.
    """
    lead = hidden.shape[:-1]
    # Rows by count, not -1: with H = 0 the row count of an empty tensor is ambiguous to reshape.
    h = hidden.reshape(lead.numel(), hidden.shape[-1])
    ids, active = prepare_ids(token_ids, ignore_index)
    # Ignored rows may hold garbage: zero them so they reach neither the logits nor dweight/dbias.
    h = torch.where(active[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    rows = chunk_rows if chunk_rows is not None else chunk_rows_for(weight.shape[0], h.shape[0])
    logp, entropy = _ChunkedLinearLogprobs.apply(
        h, weight, bias, ids, active, float(temperature), int(rows), bool(return_entropy), invariant_logits
    )
    if return_entropy:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead)
