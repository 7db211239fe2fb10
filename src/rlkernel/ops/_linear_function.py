"""The GPU linear path: hidden states → log-probs / entropy / token-level loss, chunk by chunk.

Two autograd Functions drive one chunk engine per call (``_linear_engine.make_engine``: cuBLAS
chunks, the batch-invariant GEMM or the LM-head epilogue kernel behind one protocol,
:class:`rlkernel.ops._linear_engine_base.ChunkEngine`):

    linear_token_logprobs_triton   the primitive behind ``rlkernel.linear_token_logprobs``: forward
                                   streams the rows in chunks (1 GEMM); backward recomputes each
                                   chunk's logits and applies the upstream gradients (1 + 2 GEMMs).
    fused_linear_token_loss        a token-level loss whose per-token coefficients are known while a
                                   chunk's logits are live (``coef_fn``): the gradient is computed in
                                   the forward pass (3 GEMMs in all); backward only scales it.

This module keeps the final dweight cast, both Functions and their entry points, which read the
options (``linear_chunk_bytes``, ``linear_grad_bytes``, ``linear_logits_dtype``,
``linear_dweight_accum``, ``linear_head_gemm``) once per call into an ``EngineSettings``;
:mod:`rlkernel.ops._linear_engine` holds the chunk rules and the back-end choice, its back ends
the chunk loop state (``_linear_engine_base``, ``_linear_stored_logits``, ``_linear_epilogue``);
``_linear_rows`` the compaction and hidden-row helpers, ``_linear_grads`` the gradient ones.

Rows go in *groups* of ``G`` rows, each group in *chunks* of ``C`` rows (G a multiple of C). The
group's hidden rows are staged into a fixed ``[G, H]`` buffer; then, per chunk:

    z      = h_c @ Wᵀ (+ b)       cuBLAS, M = C; fp32 output from bf16/fp16 inputs (mm(out_dtype=fp32))
    logp, entropy, lse             rlkernel.kernels.logprobs forward kernel (fp32 statistics)
    g_logp, g_entropy              fused loss: coef_fn(rows, logp, entropy); primitive: from autograd
    Gr[chunk] = ∂L/∂z              the same module's backward kernel, into the group's bf16 gradient

and per group (M = G, resp. K = G):

    dh[group] = Gr @ W             cuBLAS (the K = V reduction in fp32 inside one GEMM)
    dW       += Grᵀ @ h_group      cuBLAS, fp32 accumulator across groups (addmm(out_dtype=fp32));
                                   the first group writes it (beta = 0: no zero-fill, no read)
    db       += Σ_rows Gr          fp32 column sums (no atomics)

Whole batch (``EngineSettings.whole_batch``; by default when ``_linear_engine.whole_batch_fits``:
at bf16 with the fp32 accumulator, at most G + H rows after compaction). When the weight needs a
gradient, every row goes into one group: dweight is ONE GEMM over all rows (K = N: fp32
accumulation inside it, one rounding), so there is no V·H fp32 accumulator, no read-modify-write
of it per group and no final cast — and the memory is never more than the grouped loop's
(``N·V·2 + V·H·2 ≤ G·V·2 + V·H·4``). The primitive runs the two GEMMs at the end of its backward;
the fused loss keeps the bf16 gradient rows (and the staged hidden rows) from its forward to its
backward, which runs them with the upstream scalar ``g`` known: ``g`` scales the ``[N, H]`` hidden
rows before the dweight GEMM and dhidden/dbias after theirs (``_linear_grads.whole_batch_grads``).
Both GEMMs take the real rows only (the chunks' pad rows have zero gradient).

Why two levels. The logits chunk C bounds the fp32 logits buffer and fixes the bits of every row
(see the chunk rule). The group G sets how often the V·H dweight accumulator is read and written
back: once per group, V·H·8 bytes in fp32 (5 GB at V = 151,936, H = 4096: ~1.5 ms at 3.3 TB/s
unless cuBLAS hides its epilogue). Larger G costs G·V·2 bytes of gradient buffer, so G is also
capped at ``max(1024, H)`` rows (``grad_rows_for``): a group is never larger than the V·H weight
gradient itself (at H = 1024 the 4096 rows of the byte budget would hold 1.2 GB of gradient rows
next to a 0.3 GB weight gradient: a trainer's peak).

Cost (H100, bf16, N = 8192, H = 4096, V = 151,936): GEMM-bound, each GEMM 2·N·H·V = 10.2 TFLOP
≈ 13.6 ms; the primitive needs a 4th GEMM because its backward starts only when autograd hands it
the upstream gradients, when the chunk logits are gone; the fused loss keeps 3
(docs/guides/linear-path.md). C and G were swept on an H100
(benchmarks/results/gpu_check_linear_h100_2026-11-24.log).

Chunk rule (row invariance). cuBLAS picks its algorithm from the problem shape and pointer
alignment, and different algorithms round differently, so a row's logits would change bits with
N if the last chunk were shorter. Every logits GEMM therefore has exactly ``C`` rows, read from the
same offset of the same kind of staging buffer: the tail is zero-padded (pad rows get
``ignore_index`` ids, hence zero gradient), and C (``_linear_engine.chunk_rows_for``) and G
(``grad_rows_for``) depend only on V, H and the dtypes, never on N; a row's chunk position (row
mod G; with padding compaction, its rank among the active rows mod G) is fixed by its index. The
log-softmax kernels are row-invariant already. Cost: up to C − 1 padded rows of logits GEMM per
call (nothing at N ≫ C; a whole C-row GEMM for a decode-sized N), plus one N·H staging copy. The
staging also zeroes ignored rows, so garbage (NaN) hidden states at ignored positions reach
neither dweight nor dbias (as in the reference).

Padding compaction (both Functions; ``compact=True``, the default). Rows with ``ignore_index`` ids
are not staged: the active rows are gathered (``kernels.stage_rows``) into the staging buffer,
packed, so every GEMM runs over active rows only, and the results are scattered back
(``index_copy``; ignored rows: logp = entropy = 0, dhidden rows exactly 0, nothing in
dweight/dbias). One launch and one host sync per call (``kernels.ids.active_rows``: the active
count sizes the host loop); none, and no compaction, inside CUDA-graph capture
(``_linear_rows.active_rows``). The fused loss's ``coef_fn`` then gets,
instead of a contiguous ``slice``, the int64 flat positions of the chunk's rows (increasing).
A compacted row sits at another position of its chunk than uncompacted: its logits keep their
bits with the invariant GEMM, and with cuBLAS as long as it computes every row of a fixed-shape
GEMM alike (checked at real size by tests/gpu/test_linear_invariant.py and
tests/gpu/test_linear.py); its logp, entropy, per-token coefficients and logits-gradient row
follow from them elementwise, so they keep their bits too. What changes is the order of the sums
over rows: the loss (a sum of per-chunk partial sums), dweight and dbias (sums over other row
groupings) and dhidden (the same gradient rows in group GEMMs of other shapes) agree with the
uncompacted path to fp32 rounding of those sums (tests/ops/test_linear_compaction.py).

Invariant mode (``invariant_logits``: ``linear_token_logprobs(..., invariant=True)``). The chunk
logits come from the batch-invariant GEMM (``kernels.matmul.matmul_into``: the kernel, the
configuration table and the bias-before-rounding of a patched model's LM head) in that LM head's
output dtype, so each row's logits, and then its log-probs from the same log-softmax kernel as
``token_logprobs``, are those of the patched LM head bit for bit. That GEMM is row invariant at
any M, so a chunk's GEMM covers its real rows only (the pad rows are ignored and never read).
Backward as above (cuBLAS, at the logits the forward used).

Memory (docs/guides/linear-path.md, Memory model): C·V·4 fp32 chunk logits (cuBLAS chunks with
fp32 logits; the epilogue kernel keeps none), G·V·2 gradient and G·H·2 staged rows, the V·H dweight
accumulator (fp32, two allocations cast into their own bytes at the end: ``ops._dweight_accum``;
``dweight_accum="weight"``: V·H·2 in the weight's dtype); a whole batch holds its N'·V·2 gradient
rows instead of the accumulator. Flat in N, but for the dhidden output (N·H·2).

Upstream scale of the fused loss. The forward computes gradients for upstream gradient 1; backward
multiplies by the upstream scalar ``g`` without a host sync (whole batch: see above). For
fp32-accumulated dweight the multiply is folded into the final fp32 → weight-dtype cast
(``torch.mul(acc, g, out=bf16)``: one pass that runs anyway); dhidden (N·H) and dbias are
multiplied in place (``g == 1`` is exact).

Caveats:
    * fp64 inputs have no kernel (the public op sends them to the reference).
    * On CPU (tests, ``TRITON_INTERPRET=1``) ``mm(out_dtype=fp32)`` is unavailable: fp32 chunk logits
      from half inputs then come from an fp32 copy of the weight made once per call.
    * Without ``mm(out_dtype=...)`` on the GPU (older torch), chunk logits fall back to bf16 (the
      kernels still reduce in fp32) and each group's dweight product is rounded to bf16 before the
      fp32 sum, rather than an O(V·H) fp32 weight copy.
    * fp32 logits need their gradient in bf16 (tensor-core GEMMs): the logprobs backward kernel
      reads the fp32 chunk and writes the bf16 gradient in one pass (it casts on store).
    * ``coef_fn`` runs once per chunk on the host; it must not sync (``.item()``), and must be
      elementwise in the rows it is given (token-level losses), which are a ``slice`` or, with
      padding compaction, an index tensor. Sequence-level losses (GSPO, GMPO) use the primitive
      (4 GEMMs).
    * The fused loss (grouped loop) hands its forward-computed gradients to the last backward
      (scaled in place); a backward that retains the graph (``retain_graph=True``) gets scaled
      copies instead, so a second backward accumulates the same gradients again. Telling the two
      apart needs torch >= 2.5 (see ``rlkernel.ops._autograd.graph_retained``); on older torch a
      second backward raises a RuntimeError saying how to avoid it.
"""

from __future__ import annotations

import torch

from rlkernel._autocast import without_autocast
from rlkernel._options import DweightAccum, LogitsDtype, current_options
from rlkernel.ops import _autograd as autograd_state
from rlkernel.ops._dweight_accum import DweightAccumulator
from rlkernel.ops._linear_engine import EngineSettings, make_engine
from rlkernel.ops._linear_engine_base import ChunkEngine
from rlkernel.ops._linear_grads import scaled, whole_batch_grads
from rlkernel.ops._linear_rows import active_rows, hidden_rows, scatter_rows, strided_rows
from rlkernel.ops.token_loss import CoefFn


def _grad_buffers(eng: ChunkEngine, bias, need_h, need_w, need_b):
    """The grouped loop's dhidden, dweight accumulator and fp32 dbias (None where not needed).
    Compacted: the ignored rows are never projected, their dhidden rows stay exactly 0."""
    h = eng.hidden
    dh = (torch.zeros_like(h) if eng.row_index is not None else torch.empty_like(h)) if need_h else None
    dw = DweightAccumulator(eng.weight, eng.dweight_accum) if need_w else None
    db = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if need_b else None
    return dh, dw, db


def _row_vectors(rows: int, count: int, device: torch.device) -> list[torch.Tensor | None]:
    """``count`` fp32 ``[rows]`` vectors, then None up to three. Separate allocations, not views of
    one: they are the Functions' outputs, which a caller may modify in place."""
    return [torch.empty(rows, dtype=torch.float32, device=device) if i < count else None for i in range(3)]


def _engine_rows(g: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor | None:
    """An upstream gradient ``[...]`` as contiguous fp32 ``[n]`` in the engine's row order (the
    active rows, when compacted): what the gradient kernels read, one slice per group."""
    if g is None:
        return None
    g = g.reshape(-1).to(torch.float32)
    return g.contiguous() if idx is None else g.index_select(0, idx)


# -------------------------------------------------------------------------------------- primitive
class _LinearLogprobsFunction(torch.autograd.Function):
    """logp, entropy = f(hidden, weight, bias); backward recomputes each chunk (4 GEMMs in all)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, ignore_index, return_entropy, settings):
        idx, hidx = active_rows(ids, ignore_index, strided_rows(hidden)) if settings.compact else (None, None)
        hr = hidden_rows(hidden, idx, hidx)
        eng = make_engine(
            hr.rows, weight, bias, ids, temperature, ignore_index, settings, idx, hidden_index=hr.index
        )
        dev = hidden.device
        # Per-row results in the engine's row order (the active rows only, when compacted): one
        # group's own outputs (no copies), else buffers made after the first group's launch.
        logp = lse = entropy = None
        for rows in eng.groups():
            n, _ = eng.stage(rows)
            lp, en, ls = eng.group_stats(n, return_entropy)
            if n == eng.rows:
                logp, lse, entropy = lp, ls, en
                continue
            if logp is None:
                logp, lse, entropy = _row_vectors(eng.rows, 2 + return_entropy, dev)
            logp[rows], lse[rows] = lp, ls
            if en is not None:
                entropy[rows] = en
        if logp is None:  # no rows
            logp, lse, entropy = _row_vectors(0, 3, dev)
        if entropy is None:
            entropy = torch.empty(0, dtype=torch.float32, device=dev)
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy, idx, hr.index)
        ctx.args = (temperature, ignore_index, return_entropy, settings)
        ctx.set_materialize_grads(False)
        if idx is not None:  # scattered back; the ignored rows' logp and entropy are 0
            logp = scatter_rows(logp, idx, ids.numel())
            entropy = scatter_rows(entropy, idx, ids.numel()) if return_entropy else entropy
        if not return_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @without_autocast
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, ids, lse, entropy, idx, hidx = ctx.saved_tensors
        temperature, ignore_index, return_entropy, settings = ctx.args
        none = (None,) * 8
        if not return_entropy:
            g_ent = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return none
        hr = hidden_rows(hidden, idx, hidx)
        eng = make_engine(
            hr.rows, weight, bias, ids, temperature, ignore_index, settings, idx, need_dweight=need_w,
            hidden_index=hr.index,
        )  # fmt: skip
        gl, ge = _engine_rows(g_logp, idx), _engine_rows(g_ent, idx)
        # The grouped loop accumulates into these; a whole batch makes them at the end.
        whole = eng.whole_batch
        dh, dw, db = (None,) * 3 if whole else _grad_buffers(eng, bias, need_h, need_w, need_b)
        for rows in eng.groups():
            n, m = eng.stage(rows)
            eng.group_logits_grad(
                n, lse[rows], entropy[rows] if ge is not None else None,
                None if gl is None else gl[rows], None if ge is None else ge[rows],
            )  # fmt: skip
            if whole:
                dh, dw, db = whole_batch_grads(
                    eng.whole_buffers(), weight, hr.rows.shape[0], need_h, need_w, need_b
                )
            else:
                eng.group_grads(rows, n, m, dh, dw, db)
        grouped = not whole
        if dw is not None and grouped and not eng.dweight_started:
            dw.zero_()
        del eng
        if dw is not None and grouped:
            dw = dw.finish()  # the weight's dtype; a whole batch's GEMM made it so already
        db = None if db is None else db.to(bias.dtype)
        return hr.layout.grad(dh), dw, db, None, None, None, None, None


def _settings(
    chunk_rows,
    grad_rows,
    logits_dtype,
    dweight_accum,
    invariant_logits,
    grad_enabled=True,
    compact=True,
    whole_batch=None,
):
    """The call's :class:`EngineSettings` (options read once, here). ``invariant_logits``, the
    dtype of the patched LM head's logits, decides the chunk logits' dtype: fp32 or the input's."""
    if invariant_logits is not None:
        logits_dtype = "fp32" if invariant_logits == torch.float32 else "input"
    return EngineSettings.from_options(
        current_options(),
        chunk_rows=chunk_rows,
        grad_rows=grad_rows,
        logits_dtype=logits_dtype,
        dweight_accum=dweight_accum,
        grad_enabled=grad_enabled,
        invariant=invariant_logits is not None,
        compact=compact,
        whole_batch=whole_batch,
    )


def _flatten(hidden, token_ids):
    """``(hidden, flat int64 ids)``: hidden as ``[N, H]``, or 3-D as given — the Functions read a 3-D
    hidden's rows through ``_linear_rows.hidden_rows`` (in place for a slice of longer sequences,
    which a reshape here would copy)."""
    # the staging and compaction kernels read it flat (already flat: no view op)
    ids = (token_ids if token_ids.dim() == 1 else token_ids.reshape(-1)).long().contiguous()
    if hidden.dim() == 3:
        return hidden, ids
    # Rows by count, not -1: with H = 0 the row count of an empty tensor is ambiguous to reshape.
    return hidden.reshape(hidden.shape[:-1].numel(), hidden.shape[-1]), ids


def linear_token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_rows: int | None = None,
    grad_rows: int | None = None,
    logits_dtype: LogitsDtype | None = None,
    dweight_accum: DweightAccum | None = None,
    invariant_logits: torch.dtype | None = None,
    compact: bool = True,
    whole_batch: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rlkernel.linear_token_logprobs`` through the chunk engine (inputs already validated).

    Args:
        hidden ``[..., H]``, weight ``[V, H]``, token_ids ``[...]``, bias ``[V]``: fp16/bf16/fp32.
        chunk_rows: rows per logits chunk (tests and tuning; ``None``: ``chunk_rows_for`` of the
            option ``linear_chunk_bytes``). A row's bits depend on it: production calls leave it None.
        grad_rows: rows per gradient group (``None``: ``grad_rows_for`` of ``linear_grad_bytes``;
            rounded down to a multiple of the chunk rows). Changes no logp bit, only GEMM shapes.
        logits_dtype: ``"fp32"`` chunk logits (from ``mm(out_dtype=fp32)``) or ``"input"`` (the
            input dtype, e.g. bf16, as the model's own LM head gives); None: the option
            ``linear_logits_dtype``.
        dweight_accum: ``"fp32"`` accumulator across chunks or ``"weight"`` (the weight's dtype);
            None: the option ``linear_dweight_accum``.
        invariant_logits: None, or the dtype of the logits of a patched model's LM head (the input
            dtype, or ``torch.float32``): each chunk's logits come from the batch-invariant GEMM in
            that dtype (``logits_dtype`` is then ignored), so every logp/entropy is bitwise
            ``token_logprobs`` of that LM head's logits, whatever the other rows and ``chunk_rows``.
        compact: padding compaction: the rows with ``ignore_index`` ids are neither staged nor
            projected (the GEMMs run over the active rows only, packed; one host sync for their
            count); their logp/entropy are 0 and their dhidden rows exactly 0. ``False`` (tests):
            every row is projected. The active rows' logp/entropy are the same either way:
            bitwise with ``invariant_logits`` (a row-invariant GEMM), and with cuBLAS as far as a
            row's bits do not depend on its row position inside the fixed-shape chunk GEMM
            (tests/gpu/test_linear_invariant.py checks it at real size).
        whole_batch: the backward's rows in one gradient group when the weight needs a gradient
            (dweight from one GEMM, no V·H fp32 accumulator, no final cast): None when it takes
            no more memory than the grouped loop (``_linear_engine.whole_batch_fits``), False
            never, True always (tests). Changes no logp bit; dweight's sums run in another order.

    The options in force (``rlkernel.use_options``) are read once, here.

    Returns:
        fp32 ``logp [...]``, or ``(logp, entropy)``.
    """
    settings = _settings(
        chunk_rows,
        grad_rows,
        logits_dtype,
        dweight_accum,
        invariant_logits,
        compact=compact,
        whole_batch=whole_batch,
    )
    if hidden.dtype == torch.float64:  # no fp64 kernel (fp32 statistics): the reference, in double
        from rlkernel.reference import logprobs as ref

        return ref.linear_token_logprobs(
            hidden,
            weight,
            token_ids,
            bias=bias,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            invariant_logits=invariant_logits,
        )
    lead = hidden.shape[:-1]
    h, ids = _flatten(hidden, token_ids)
    logp, entropy = _LinearLogprobsFunction.apply(
        h, weight, bias, ids, float(temperature), int(ignore_index), bool(return_entropy), settings
    )
    if return_entropy:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead)


# ------------------------------------------------------------------------------------- fused loss
def _fused_outputs(eng: ChunkEngine, bias, with_entropy: bool, need_h, need_w, need_b):
    """The fused loss's fp32 per-row logp and entropy (None without) ``[rows]``, its 0-dim fp32 loss
    accumulator (zero) and, for the grouped loop, its gradient buffers (:func:`_grad_buffers`).
    Made after the first chunk's statistics launch, so that their host time overlaps that GEMM
    instead of delaying its start (an isolated call's GPU waits for the host until then)."""
    dev = eng.hidden.device
    logp, entropy, _ = _row_vectors(eng.rows, 1 + with_entropy, dev)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    grads = (None,) * 3 if eng.whole_batch else _grad_buffers(eng, bias, need_h, need_w, need_b)
    return (logp, entropy, loss, *grads)


class _FusedLinearLossFunction(torch.autograd.Function):
    """loss = Σ_chunks coef_fn(...)[0]; gradients computed in forward for upstream 1 (3 GEMMs)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, ids, temperature, ignore_index, with_entropy, coef_fn, settings, compaction
    ):
        if not settings.compact:
            idx, hidx = None, None
        elif compaction is not None:  # found by the caller (``_linear_rows.masked_active_rows``)
            idx, hidx = compaction
        else:
            idx, hidx = active_rows(ids, ignore_index, strided_rows(hidden))
        # Gradients only where autograd will ask for them (none under torch.no_grad(): 1 GEMM).
        grad_on = settings.grad_enabled
        need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
        need_b = grad_on and bias is not None and bias.requires_grad
        any_grad = need_h or need_w or need_b
        needs = (need_h, need_w, need_b)
        hr = hidden_rows(hidden, idx, hidx)
        eng = make_engine(
            hr.rows, weight, bias, ids, temperature, ignore_index, settings, idx, need_dweight=need_w,
            dhidden_only=any_grad and not need_w, hidden_index=hr.index,
        )  # fmt: skip
        ctx.whole = None  # whole batch: the gradient rows, kept for the backward's two GEMMs
        whole = eng.whole_batch
        # The per-row results (in the engine's row order: the active rows only, when compacted), the
        # loss and the grouped loop's gradient buffers are made after the first chunk's launch.
        logp = entropy = loss = dh = dw = db = None
        for rows in eng.groups():
            n, m = eng.stage(rows)
            for k, cnt in eng.chunks(n):
                chunk = eng.forward_chunk(k, cnt, with_entropy, keep_logits=any_grad)
                if loss is None:
                    logp, entropy, loss, dh, dw, db = _fused_outputs(eng, bias, with_entropy, *needs)
                start = rows.start + chunk.rows.start
                r = slice(start, start + cnt)
                lp = chunk.logp[:cnt]
                en = None if chunk.entropy is None else chunk.entropy[:cnt]
                logp[r] = lp
                if en is not None:
                    entropy[r] = en
                where = r if idx is None else idx[r]  # compacted: the rows' flat positions
                with torch.enable_grad():
                    part, g_logp, g_ent = coef_fn(where, lp, en)
                loss += part.detach()
                if any_grad:
                    g_ent = None if g_ent is None else g_ent.detach()
                    eng.chunk_grad(chunk, None if g_logp is None else g_logp.detach(), g_ent)
            if any_grad and whole:
                ctx.whole = eng.whole_buffers()
            elif any_grad:
                eng.group_grads(rows, n, m, dh, dw, db)
        if loss is None:  # no rows
            logp, entropy, loss, dh, dw, db = _fused_outputs(eng, bias, with_entropy, *needs)
        if dw is not None and not eng.dweight_started:
            dw.zero_()
        del eng
        if ctx.whole is not None:
            ctx.save_for_backward(weight)
            ctx.needs = (need_h, need_w, need_b, hr.rows.shape[0])
        ctx.grads = (dh, dw, db)
        ctx.hidden_layout = hr.layout  # dhidden rows → hidden's shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        if idx is not None:  # scattered back; the ignored rows' logp and entropy are 0
            logp = scatter_rows(logp, idx, ids.numel())
            entropy = None if entropy is None else scatter_rows(entropy, idx, ids.numel())
        outs = [logp] + ([entropy] if entropy is not None else [])
        ctx.mark_non_differentiable(*outs)
        return (loss, *outs)

    @staticmethod
    @without_autocast
    def backward(ctx, g_loss, *_):
        if ctx.whole is not None:
            return _FusedLinearLossFunction._whole_backward(ctx, g_loss)
        if ctx.grads is None:
            raise autograd_state.second_backward_error(
                "the first backward handed out the gradients computed in the forward (the fused "
                "hidden-state loss), scaled in place",
                "run it under rlkernel.use_options(token_level_fusion=False) (the 4-GEMM composed path)",
            )
        dh, dw, db = ctx.grads
        b_dtype = ctx.bias_dtype
        if g_loss is None:
            return (None,) * 10
        scale = g_loss.to(torch.float32)
        if autograd_state.graph_retained():
            # Another backward will read the buffers: hand out scaled copies (same numbers: fp32 math,
            # one rounding to the output dtype) and keep the buffers as they are.
            dh = None if dh is None else scaled(dh, scale)
            dw = None if dw is None else dw.scaled_copy(scale)
            db = None if db is None else (db * scale).to(b_dtype)
            return ctx.hidden_layout.grad(dh), dw, db, None, None, None, None, None, None, None
        ctx.grads = None  # the buffers become the caller's gradients
        if dh is not None:
            dh = scaled(dh, scale, out=dh)  # in place, computed in fp32; exact for g == 1
        if dw is not None:
            # fp32 accumulator: the scale is folded into the final cast (one pass that runs anyway).
            dw = dw.finish(scale)
        if db is not None:
            db = (db * scale).to(b_dtype)
        return ctx.hidden_layout.grad(dh), dw, db, None, None, None, None, None, None, None


    @staticmethod
    def _whole_backward(ctx, g_loss):
        """Whole batch: dhidden, dweight and dbias from the kept gradient rows, two GEMMs scaled by
        the upstream gradient. Nothing kept is modified, so a retained graph's second backward
        computes the same gradients again; otherwise the rows are released here."""
        wb = ctx.whole
        if autograd_state.graph_retained() is False:  # known not retained (torch < 2.5: unknown, kept)
            ctx.whole = None
        if g_loss is None:
            return (None,) * 10
        (weight,) = ctx.saved_tensors
        need_h, need_w, need_b, n_rows = ctx.needs
        dh, dw, db = whole_batch_grads(
            wb, weight, n_rows, need_h, need_w, need_b, scale=g_loss.to(torch.float32)
        )
        db = None if db is None else db.to(ctx.bias_dtype)
        return ctx.hidden_layout.grad(dh), dw, db, None, None, None, None, None, None, None


def fused_linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    *,
    coef_fn: CoefFn,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
    grad_rows: int | None = None,
    logits_dtype: LogitsDtype | None = None,
    dweight_accum: DweightAccum | None = None,
    invariant_logits: torch.dtype | None = None,
    compact: bool = True,
    whole_batch: bool | None = None,
    compaction: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """A token-level loss from hidden states with its gradient computed in the forward pass.

    For each chunk of ``n`` rows of the flattened ``N = hidden.numel() // H`` tokens,
    ``coef_fn(rows, logp, entropy)`` receives the chunk's rows, its fp32 log-probs ``[n]`` (and
    entropy ``[n]`` when ``with_entropy``, else None) and returns ``(loss_part, g_logp,
    g_entropy)``: the chunk's 0-dim fp32 contribution to the loss and ∂loss/∂logp, ∂loss/∂entropy
    ``[n]`` (fp32; None for zero) for upstream gradient 1. ``rows`` is a ``slice`` (step 1) of the
    flat tokens, or, with padding compaction, an int64 ``[n]`` tensor of the flat positions of the
    chunk's rows (increasing; only rows whose id is not ``ignore_index``): index per-token tensors
    with it (``t[rows]`` works for both). Ignored positions (``token_ids == ignore_index``) have
    logp = entropy = 0 and get no gradient whatever ``coef_fn`` returns for them. It is called once
    per chunk, in order, under ``torch.enable_grad()`` (so it may use autograd on the detached
    inputs); a chunk-wise sum of its loss parts is the loss, so the parts of ignored rows must be 0.

    Returns:
        ``(loss, logp)`` or ``(loss, logp, entropy)``: ``loss`` 0-dim fp32, differentiable in
        hidden, weight and bias (whichever require grad; the others' GEMMs are skipped); ``logp``
        and ``entropy`` fp32 ``[...]`` (the leading shape of hidden), not differentiable.
        Under ``torch.no_grad()`` no gradient is computed (1 GEMM).

    Args:
        hidden ``[..., H]``, weight ``[V, H]``, bias ``[V]`` or None: fp16/bf16/fp32, one dtype (the
            caller validates shapes and ids, as the public ops do; fp64 has no kernel: TypeError).
        token_ids: ``[...]`` integer ids, ``ignore_index`` at positions outside the loss.
        chunk_rows, grad_rows, logits_dtype, dweight_accum, invariant_logits: as in
            :func:`linear_token_logprobs_triton`.
        compact: padding compaction (module docstring): the rows with ``ignore_index`` ids are
            neither staged, projected nor given gradient work, and ``coef_fn`` gets index tensors;
            the loss and gradients change only by the order of their sums over rows. ``False``
            (tests): every row is projected, ``coef_fn`` gets slices.
        whole_batch: as in :func:`linear_token_logprobs_triton`; here the whole-batch gradient
            rows are kept from the forward to the backward, which runs the dhidden and dweight
            GEMMs with the upstream gradient known (module docstring).
        compaction: padding compaction's ``(row_index, storage_index)`` of these ids and hidden's
            layout as :func:`rlkernel.ops._linear_rows.active_rows` gives them (``(None, None)``:
            every row active), when the caller found them already (one launch with the id masking:
            ``_linear_rows.masked_active_rows``); None: found here (one launch, one host sync).

    Raises:
        TypeError: fp64 (or non-float) inputs, or weight/hidden dtypes that differ.
        ValueError: a bad option.
    """
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weight.dtype != hidden.dtype:
        raise TypeError(
            f"fused_linear_token_loss takes fp16/bf16/fp32 hidden and weight of one dtype, got hidden "
            f"{hidden.dtype} and weight {weight.dtype} (fp64 has no kernel: use the reference path)"
        )
    settings = _settings(
        chunk_rows,
        grad_rows,
        logits_dtype,
        dweight_accum,
        invariant_logits,
        torch.is_grad_enabled(),
        compact,
        whole_batch,
    )
    lead = hidden.shape[:-1]
    h, ids = _flatten(hidden, token_ids)
    outs = _FusedLinearLossFunction.apply(
        h, weight, bias, ids, float(temperature), int(ignore_index), bool(with_entropy), coef_fn, settings,
        compaction,
    )
    return (outs[0], *(o.reshape(lead) for o in outs[1:]))
