"""The chunk engine of the GPU linear path: its settings, its chunk rules, and which GEMM back end
runs a call (:func:`make_engine`).

Both autograd Functions of :mod:`rlkernel.ops._linear_function` drive one engine per call through
the protocol of :class:`rlkernel.ops._linear_engine_base.ChunkEngine` (stage a group, a chunk's or a
group's statistics, a chunk's or a group's logits gradient, a group's dhidden/dweight/dbias). Three
back ends implement it:

    back end                 chunk logits                          statistics / logits gradient
    ``CublasEngine``         ``torch.mm`` into a [C, V] buffer     ``kernels.logprobs`` kernels
    ``InvariantGemmEngine``  ``kernels.matmul`` (patched LM head)  ``kernels.logprobs`` kernels
    ``EpilogueEngine``       none stored                           ``kernels.linear_head`` epilogues

(:mod:`rlkernel.ops._linear_stored_logits`, :mod:`rlkernel.ops._linear_epilogue`).
:func:`gemm_backend` chooses one from the settings and operands (a pure function);
:func:`chunk_geometry` sets the call's chunk and group rows. The algorithm, the chunk rule, the
memory model and the Caveats are in the docstring of :mod:`rlkernel.ops._linear_function`. The
tunables (chunk and gradient budgets, logits dtype, dweight accumulation, the LM-head GEMM) are
options (``rlkernel.Options``: ``linear_chunk_bytes``, ``linear_grad_bytes``,
``linear_logits_dtype``, ``linear_dweight_accum``, ``linear_head_gemm``), read once per call into
an :class:`EngineSettings` that the engine gets explicitly.
"""

from __future__ import annotations

import dataclasses

import torch

from rlkernel._options import DEFAULTS, DweightAccum, LogitsDtype, MatmulThresholds, Options
from rlkernel.ops._linear_engine_base import ChunkEngine, ChunkGeometry
from rlkernel.ops._linear_epilogue import EpilogueEngine
from rlkernel.ops._linear_stored_logits import CublasEngine, InvariantGemmEngine

# Row counts are the largest powers of two whose chunk (group) fits the option's byte budget, within
# [MIN_CHUNK_ROWS, MAX_CHUNK_ROWS]: functions of V, H and the dtypes only, never of N. At V = 151,936
# and the default 1280 MiB budgets: 2048 rows of fp32 logits (1.24 GB) or 4096 of bf16; gradient
# groups of 4096 rows, fewer at H < 4096 (why these budgets: docs/api/options.md).
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 16, 4096
# Chunk and group rows of the fused loss with a frozen weight on a back end whose chunk follows the
# group (the epilogue kernel, the batch-invariant GEMM): its gradient groups only feed the dhidden
# GEMM, as fast at M = 1024 as at 4096, and those GEMMs are row invariant at any M, so the chunk
# shrinks with them (no logp bit changes). Measured on the epilogue kernel, H100, ragged DAPO+KL
# N = 8192: 25.2 vs 25.4 ms, peak extra 2.69 → 1.08 GB; 512 rows: 0.61 GB but +8 % (benchmarks/NOTES.md).
FROZEN_WEIGHT_ROWS = 1024
# The fewest rows the hidden-size cap of ``grad_rows_for`` leaves a gradient group: below ~1024 rows
# the dhidden GEMM's [G, H] output has too few tiles for the GPU, and tiny test shapes keep one group.
# Why the cap: trl_trainer_compare (H = 1024, 3,790 scored rows, H100, 2026-11-25) peaked in the LM
# head's backward with the whole batch's 1.07 GiB of gradient rows alive (benchmarks/NOTES.md).
H_GROUP_FLOOR = 1024


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """One call's engine settings.

    Attributes:
        chunk_rows: rows per logits chunk, or None for :func:`chunk_rows_for` (tests and tuning
            only: a row's bits depend on it).
        grad_rows: rows per gradient group, or None for :func:`grad_rows_for` (no logp bit depends
            on it).
        logits_dtype, dweight_accum, chunk_bytes, grad_bytes: the options ``linear_logits_dtype``,
            ``linear_dweight_accum``, ``linear_chunk_bytes``, ``linear_grad_bytes``.
        grad_enabled: whether the fused loss computes gradients (``torch.is_grad_enabled()`` at the
            call; the primitive's backward ignores it).
        invariant: the chunk logits come from the batch-invariant GEMM
            (:func:`rlkernel.kernels.matmul.matmul_into`, the kernel of a patched model's LM head)
            in ``logits_dtype`` (``"input"``: rounded to the input dtype as that LM head's output;
            ``"fp32"``: its fp32 accumulator), instead of cuBLAS.
        matmul_table, matmul_thresholds: the options of the invariant GEMM (read with the others).
        compact: padding compaction (both Functions): only the rows whose id is not
            ``ignore_index`` are staged and projected (``_linear_rows.active_rows``: one host sync
            for their count); their results are scattered back (``_linear_rows.scatter_rows``),
            the others get logp = entropy = dhidden = 0.
        whole_batch: one gradient group for every row when the weight needs a gradient
            (:func:`whole_batch_fits`): dweight is then one GEMM over all rows (fp32 accumulation
            inside it, one rounding), with no V·H fp32 accumulator and no final cast. None: when
            it takes no more memory than the grouped loop (the default); False: never; True:
            whenever there are rows (tests).
        head_gemm: the option ``linear_head_gemm`` (:func:`epilogue_kernel_runs`).
    """

    chunk_rows: int | None = None
    grad_rows: int | None = None
    logits_dtype: LogitsDtype = DEFAULTS.linear_logits_dtype
    dweight_accum: DweightAccum = DEFAULTS.linear_dweight_accum
    chunk_bytes: int = DEFAULTS.linear_chunk_bytes
    grad_bytes: int = DEFAULTS.linear_grad_bytes
    grad_enabled: bool = True
    invariant: bool = False
    matmul_table: str = DEFAULTS.matmul_table
    matmul_thresholds: MatmulThresholds = DEFAULTS.matmul_thresholds
    compact: bool = True
    whole_batch: bool | None = None
    head_gemm: str = DEFAULTS.linear_head_gemm

    @classmethod
    def from_options(
        cls,
        options: Options,
        *,
        chunk_rows: int | None = None,
        grad_rows: int | None = None,
        logits_dtype: LogitsDtype | None = None,
        dweight_accum: DweightAccum | None = None,
        grad_enabled: bool = True,
        invariant: bool = False,
        compact: bool = True,
        whole_batch: bool | None = None,
    ) -> EngineSettings:
        """The settings of one call: explicit arguments, else the options (validated). With
        ``invariant`` a ``logits_dtype`` of None means ``"input"`` (the logits of a default
        patched LM head), not the option ``linear_logits_dtype``.

        Raises:
            ValueError: a bad ``chunk_rows``/``grad_rows``/``logits_dtype``/``dweight_accum``.
        """
        if logits_dtype is None:
            logits_dtype = "input" if invariant else options.linear_logits_dtype
        dweight_accum = options.linear_dweight_accum if dweight_accum is None else dweight_accum
        if logits_dtype not in ("fp32", "input"):
            raise ValueError(f"logits_dtype must be 'fp32' or 'input', got {logits_dtype!r}")
        if dweight_accum not in ("fp32", "weight"):
            raise ValueError(f"dweight_accum must be 'fp32' or 'weight', got {dweight_accum!r}")
        if whole_batch not in (None, True, False):
            raise ValueError(f"whole_batch must be None, True or False, got {whole_batch!r}")
        for name, x in (("chunk_rows", chunk_rows), ("grad_rows", grad_rows)):
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
                raise ValueError(f"{name} must be a positive int or None, got {x!r}")
        return cls(
            chunk_rows,
            grad_rows,
            logits_dtype,
            dweight_accum,
            options.linear_chunk_bytes,
            options.linear_grad_bytes,
            grad_enabled,
            bool(invariant),
            options.matmul_table,
            options.matmul_thresholds,
            bool(compact),
            whole_batch,
            options.linear_head_gemm,
        )


def _pow2_rows(budget: int, per_row: int, lo: int, hi: int) -> int:
    rows = max(1, budget // max(per_row, 1))
    return max(lo, min(hi, 1 << (rows.bit_length() - 1)))


def chunk_rows_for(
    vocab: int, logits_dtype: torch.dtype, chunk_bytes: int = DEFAULTS.linear_chunk_bytes
) -> int:
    """Rows per logits chunk (the row-invariance unit): the largest power of two whose ``[C, V]``
    logits fit ``chunk_bytes`` (the option ``linear_chunk_bytes``), within [MIN_CHUNK_ROWS,
    MAX_CHUNK_ROWS]. A function of V, the dtype and the budget only, never of N."""
    return _pow2_rows(chunk_bytes, vocab * logits_dtype.itemsize, MIN_CHUNK_ROWS, MAX_CHUNK_ROWS)


def grad_rows_for(
    vocab: int,
    grad_dtype: torch.dtype,
    grad_bytes: int = DEFAULTS.linear_grad_bytes,
    hdim: int | None = None,
) -> int:
    """Rows per gradient group (the M of the dhidden GEMM and K of the dweight GEMM): the largest
    power of two whose ``[G, V]`` gradient fits ``grad_bytes`` (the option ``linear_grad_bytes``)
    and, given the hidden size ``hdim``, at most ``max(H_GROUP_FLOOR, H)`` rows: a group then holds
    no more than the ``[V, H]`` weight gradient the step returns anyway (4096 rows at H = 4096 and
    V = 151,936 either way; 1024 at H = 1024, where the budget's 4096 rows would hold 1.2 GB next to
    a 0.3 GB weight gradient). Fewer, larger groups mean fewer read-modify-writes of the V·H dweight
    accumulator (one each). A function of V, H and the dtype, never of N."""
    rows = _pow2_rows(grad_bytes, vocab * grad_dtype.itemsize, MIN_CHUNK_ROWS, MAX_CHUNK_ROWS)
    if hdim is not None:
        rows = min(rows, _pow2_rows(max(hdim, H_GROUP_FLOOR), 1, MIN_CHUNK_ROWS, MAX_CHUNK_ROWS))
    return rows


def whole_batch_fits(
    rows: int, group_rows: int, hdim: int, grad_dtype: torch.dtype, accum_dtype: torch.dtype
) -> bool:
    """Whether one ``[rows, V]`` gradient group (``rows`` rounded up to whole chunks) plus the V·H
    dweight it yields in the gradient's dtype take no more memory than the grouped loop: a
    ``[group_rows, V]`` group plus the V·H accumulator in ``accum_dtype`` (whose storage the
    grouped loop casts dweight into). At bf16 with the fp32 accumulator that is
    ``rows <= group_rows + H`` (8192 at H = 4096 and the default 4096-row groups)."""
    b, acc = grad_dtype.itemsize, accum_dtype.itemsize
    return rows * b <= group_rows * b + hdim * (acc - b)


def epilogue_kernel_runs(hidden, weight, bias, settings: EngineSettings) -> bool:
    """Whether the chunk logits come from ``kernels.linear_head`` (the LM-head GEMM whose epilogue
    computes the log-softmax statistics, and the logits gradient by recomputation) instead of
    cuBLAS + the log-softmax kernels over stored logits. ``"auto"``: on CUDA (TMA: sm90+) for
    16-bit operands with fp32 logits, no bias, not the invariant mode; ``"triton"``: wherever the
    kernel runs (the CPU interpreter too); ``"cublas"``: never. Its results are row invariant at
    any M (no chunk padding needed)."""
    mode = settings.head_gemm
    if mode == "cublas" or settings.invariant or bias is not None or settings.logits_dtype != "fp32":
        return False
    if hidden.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != hidden.dtype:
        return False
    if mode == "auto" and hidden.device.type != "cuda":
        return False
    from rlkernel.kernels import linear_head as lh  # imports the kernels on first use

    return lh.can_run(weight)


def gemm_backend(hidden, weight, bias, settings: EngineSettings) -> type[ChunkEngine]:
    """The back end of a call: the batch-invariant GEMM (``settings.invariant``), the epilogue
    kernel (:func:`epilogue_kernel_runs`), else cuBLAS chunks. A function of the settings, the
    operands' dtypes, device and layout, and whether there is a bias; never of N."""
    if settings.invariant:
        return InvariantGemmEngine
    if epilogue_kernel_runs(hidden, weight, bias, settings):
        return EpilogueEngine
    return CublasEngine


def chunk_geometry(
    backend: type[ChunkEngine],
    rows: int,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    settings: EngineSettings,
    need_dweight: bool = False,
    dhidden_only: bool = False,
) -> ChunkGeometry:
    """The chunk and group rows of a call of ``rows`` engine rows on ``backend``.

    C = ``settings.chunk_rows`` or :func:`chunk_rows_for` of the chunk logits' dtype; G =
    ``settings.grad_rows`` or :func:`grad_rows_for`, rounded down to whole chunks. A back end whose
    chunk follows the group (row invariant at any M: the epilogue kernel, whose exponents live in
    the group buffer, and the batch-invariant GEMM) takes C = min(C, G) with default sizes, and
    with ``dhidden_only`` (the fused loss with a frozen weight: its groups feed the dhidden GEMM
    alone) C = G = ``FROZEN_WEIGHT_ROWS``.
    Whole batch (``need_dweight``: dweight wanted): one group of every row, rounded up to whole
    chunks where the back end pads them, when :func:`whole_batch_fits` (or as
    ``settings.whole_batch`` forces)."""
    dt = hidden.dtype
    vocab, hdim = weight.shape[0], hidden.shape[1]
    zdt = backend.chunk_logits_dtype(hidden, settings.logits_dtype)
    c = settings.chunk_rows or chunk_rows_for(vocab, zdt, settings.chunk_bytes)
    cg = settings.grad_rows or grad_rows_for(vocab, dt, settings.grad_bytes, hdim)
    if backend.chunk_follows_group and settings.chunk_rows is None and settings.grad_rows is None:
        c = min(c, cg)
        if dhidden_only:
            c = cg = min(c, FROZEN_WEIGHT_ROWS)
    cg = max(c, cg // c * c)
    every_row = -(-rows // c) * c if backend.pads_chunks else rows
    acc_dt = torch.float32 if settings.dweight_accum == "fp32" else weight.dtype
    whole = (
        need_dweight
        and rows > 0
        and settings.whole_batch is not False
        and bool(settings.whole_batch or whole_batch_fits(every_row, cg, hdim, dt, acc_dt))
    )
    return ChunkGeometry(rows, c, every_row if whole else cg, whole, zdt)


def make_engine(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    temperature: float,
    ignore_index: int,
    settings: EngineSettings,
    row_index: torch.Tensor | None = None,
    need_dweight: bool = False,
    dhidden_only: bool = False,
    hidden_index: torch.Tensor | None = None,
) -> ChunkEngine:
    """One call's chunk engine on its back end (:func:`gemm_backend`) and geometry
    (:func:`chunk_geometry`).

    Args:
        hidden: ``[R, H]`` rows (``_linear_rows.hidden_rows``); weight ``[V, H]``; bias ``[V]`` or None.
        ids: every row's int64 id ``[N]``.
        row_index: padding compaction's active rows (the engine's rows), or None (every row).
        need_dweight: dweight is wanted (the whole-batch rule applies).
        dhidden_only: the fused loss with a frozen weight (its gradient rows feed dhidden alone).
        hidden_index: where ``row_index``'s rows are in ``hidden`` when that differs.
    """
    backend = gemm_backend(hidden, weight, bias, settings)
    rows = hidden.shape[0] if row_index is None else row_index.numel()
    geometry = chunk_geometry(backend, rows, hidden, weight, settings, need_dweight, dhidden_only)
    args = (hidden, weight, bias, ids, temperature, ignore_index, geometry, settings.dweight_accum,
            row_index, hidden_index)  # fmt: skip
    if backend is InvariantGemmEngine:
        return backend(*args, table=settings.matmul_table, thresholds=settings.matmul_thresholds)
    return backend(*args)
