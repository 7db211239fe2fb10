"""The chunk engine of the GPU linear path: one call's staging buffers, chunk GEMMs and kernel calls.

:class:`_Engine` is the chunk loop state that both autograd Functions of
:mod:`rlkernel.ops._linear_function` drive: it stages a group's hidden rows, computes each chunk's
logits (always ``C`` rows: row invariance), runs the log-softmax forward and backward kernels on
them, and turns a group's logits gradient into dhidden, dweight and dbias contributions. This module
also holds the loop's small helpers: the ``mm(out_dtype=fp32)`` probe, the per-chunk backward kernel
call, the fp32 padding of per-row vectors, the dweight buffer, and padding compaction's row
index and scatter (:func:`_active_rows`, :func:`_scatter`), which both Functions use.

The algorithm, the chunk rule, the memory model and the Caveats are in the docstring of
:mod:`rlkernel.ops._linear_function`. The tunables (chunk and gradient budgets, logits dtype,
dweight accumulation) are options (``rlkernel.Options``: ``linear_chunk_bytes``,
``linear_grad_bytes``, ``linear_logits_dtype``, ``linear_dweight_accum``), read once per call into
an :class:`EngineSettings` that the engine gets explicitly.
"""

from __future__ import annotations

import dataclasses

import torch

from rlkernel._options import DEFAULTS, DweightAccum, LogitsDtype, MatmulThresholds, Options
from rlkernel.kernels import logprobs as lk

# Row counts are the largest powers of two whose chunk (group) fits the option's byte budget, within
# [MIN_CHUNK_ROWS, MAX_CHUNK_ROWS]: functions of V, H and the dtypes only, never of N. At V = 151,936
# and the default 1280 MiB budgets: 2048 rows of fp32 logits (1.24 GB) or 4096 of bf16; gradient
# groups of 4096 rows, fewer at H < 4096 (why these budgets: docs/api/options.md).
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 16, 4096
# Chunk and group rows of the fused loss with a frozen weight on the epilogue kernel: its gradient
# groups only feed the dhidden GEMM, as fast at M = 1024 as at 4096, and that kernel is row invariant
# at any M, so the chunk shrinks with them (no logp bit changes). H100, ragged DAPO+KL N = 8192:
# 25.2 vs 25.4 ms, peak extra 2.69 → 1.08 GB; 512 rows: 0.61 GB but +8 % (benchmarks/NOTES.md).
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
            ``ignore_index`` are staged and projected (:func:`_active_rows`: one host sync for
            their count); their results are scattered back (:func:`_scatter`), the others get
            logp = entropy = dhidden = 0.
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


_out_dtype_ok: dict[str, bool] = {}


def _mm_out_dtype_supported(device: torch.device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` runs on this device type (cached)."""
    key = device.type
    if key not in _out_dtype_ok:
        try:
            a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
            torch.mm(a, a, out_dtype=torch.float32)
            acc = torch.zeros(16, 16, dtype=torch.float32, device=device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _out_dtype_ok[key] = bool(acc[0, 0].item() == 16.0)
        except (RuntimeError, TypeError, NotImplementedError):
            _out_dtype_ok[key] = False
    return _out_dtype_ok[key]


def _bwd_into(z, ids, lse, entropy, g_logp, g_ent, grad, temperature, ignore_index):
    """The logits gradient of one chunk into ``grad``: ``z`` itself (in place) or a contiguous buffer
    of the inputs' dtype when ``z`` is fp32 (one pass: the kernel casts on store)."""
    lk.token_logprobs_bwd_into(
        z, ids, lse, entropy, g_logp, g_ent, grad, temperature=temperature, ignore_index=ignore_index
    )


class _Engine:
    """One call's chunk loop state: staging buffers, the fixed chunk sizes, and the GEMM choices.

    Rows go in *groups* of ``cg`` rows (the backward GEMMs' M, resp. K for dweight), each group in
    *chunks* of ``c`` rows (the logits GEMM's M: the unit of row invariance). ``cg`` is a multiple
    of ``c``. Group buffers: hidden rows ``[cg, H]`` and the gradient ``[cg, V]`` (input dtype); the
    fp32 logits of one chunk ``[c, V]`` (bf16 logits live in the gradient buffer, in place).

    ``dhidden_only`` (the fused loss with a frozen weight): the gradient rows feed dhidden alone;
    with the epilogue kernel and default sizes, chunks and groups are then ``FROZEN_WEIGHT_ROWS``.

    ``hidden_index``: where the rows of ``row_index`` are in ``hidden`` when that differs (a strided
    hidden read in place: :func:`hidden_rows`); dhidden rows are scattered back there too.

    ``row_index`` (padding compaction): the int64 indices of the rows to process (the active ones,
    in order); the engine's rows are then those rows only, numbered ``0 … n − 1`` in that order
    (``groups()`` slices them), gathered into the staging buffer and scattered back into
    ``dhidden`` by ``group_grads``. None: every row, in place.
    """

    def __init__(
        self,
        hidden,
        weight,
        bias,
        ids,
        temperature,
        ignore_index,
        settings: EngineSettings,
        row_index=None,
        need_dweight: bool = False,
        dhidden_only: bool = False,
        hidden_index=None,
    ):
        self.h, self.w = hidden, weight
        self.idx = row_index
        # Where those rows are in ``hidden`` (``HiddenRows.index``: a strided hidden's storage rows).
        self.hidx = row_index if hidden_index is None else hidden_index
        self.ids = ids  # all rows' ids (staged through row_index when compacted)
        self.t, self.ii = float(temperature), int(ignore_index)
        self.n, self.hdim = hidden.shape
        if row_index is not None:
            self.n = row_index.numel()
        self.v = weight.shape[0]
        dev, dt = hidden.device, hidden.dtype
        self.w32 = None
        self.inv = settings if settings.invariant else None
        # The epilogue kernel: statistics from the GEMM's accumulator, fp32 logits stored only where
        # a forward needs them (the fused loss), row invariant at any M (no chunk padding).
        self.epi = epilogue_kernel_runs(hidden, weight, bias, settings)
        zdt = dt
        if self.inv is not None:  # the invariant kernel writes fp32 or 16-bit outputs on any device
            zdt = torch.float32 if settings.logits_dtype == "fp32" else dt
        elif self.epi:
            zdt = torch.float32
        elif dt in (torch.float16, torch.bfloat16) and settings.logits_dtype == "fp32":
            if dev.type != "cuda":
                # CPU (interpreter tests): no mm(out_dtype=...) there; an fp32 weight copy per call.
                zdt, self.w32 = torch.float32, weight.float()
            elif _mm_out_dtype_supported(dev):
                zdt = torch.float32
        self.zdt = zdt
        self.c = settings.chunk_rows or chunk_rows_for(self.v, zdt, settings.chunk_bytes)
        cg = settings.grad_rows or grad_rows_for(self.v, dt, settings.grad_bytes, self.hdim)
        if self.epi and settings.chunk_rows is None and settings.grad_rows is None:
            # Row invariant at any M: the chunk follows a smaller group (its exponents live there);
            # a frozen weight shrinks both (FROZEN_WEIGHT_ROWS).
            self.c = min(self.c, cg)
            if dhidden_only:
                self.c = cg = min(self.c, FROZEN_WEIGHT_ROWS)
        self.cg = max(self.c, cg // self.c * self.c)
        # Whole batch: one group of every row (rounded up to whole chunks), when dweight is wanted.
        m_all = self._padded_rows(self.n)
        acc_dt = torch.float32 if settings.dweight_accum == "fp32" else weight.dtype
        self.whole = (
            need_dweight
            and self.n > 0
            and settings.whole_batch is not False
            and (settings.whole_batch or whole_batch_fits(m_all, self.cg, self.hdim, dt, acc_dt))
        )
        if self.whole:
            self.cg = m_all
        self.hbuf = torch.empty(self.cg, self.hdim, dtype=dt, device=dev)
        self.g = torch.empty(self.cg, self.v, dtype=dt, device=dev)
        # fp32 chunk logits (cuBLAS): made on first use; the epilogue kernel never stores any (its
        # fused loss keeps 16-bit shifted exponents in the gradient buffer; zdt = fp32 then only
        # names its fp32 accumulator and sets the chunk rows).
        self.z_in_grad, self._zbuf = zdt == dt, None
        # Every id a kernel reads is staged (a group's rows, then ignore_index on its pad rows).
        self.idbuf = torch.empty(self.cg, dtype=torch.int64, device=dev)
        # The invariant GEMM adds the bias (in its own dtype) to the fp32 accumulator before the
        # one rounding, as the patched LM head does; cuBLAS chunks add it after, in zdt.
        self.bias, self.bias_z = bias, None if bias is None else bias.to(zdt)
        self.dweight_accum = settings.dweight_accum
        # Compacted, every staged row is active: nothing to zero (one kernel less per group).
        self.inactive = None if row_index is not None else (self.ids == self.ii)[:, None]
        self.dw_started = False

    def _padded_rows(self, n: int) -> int:
        """Rows of a group of n real rows: whole chunks (cuBLAS's fixed-shape chunk GEMMs), or n
        itself with the epilogue kernel (row invariant at any M)."""
        return n if self.epi else -(-n // self.c) * self.c

    @property
    def zbuf(self) -> torch.Tensor:
        """The fp32 logits of one chunk ``[c, V]`` (allocated once, on first use)."""
        if self._zbuf is None:
            self._zbuf = torch.empty(self.c, self.v, dtype=self.zdt, device=self.h.device)
        return self._zbuf

    def groups(self):
        for start in range(0, self.n, self.cg):
            yield slice(start, min(start + self.cg, self.n))

    def stage(self, rows: slice) -> tuple[int, int]:
        """Copy a group's hidden rows and ids into the fixed buffers (ignored rows zeroed, the tail
        padded with zero rows and ignore_index ids); returns (real rows, rows of whole chunks)."""
        n = rows.stop - rows.start
        m = self._padded_rows(n)
        hb = self.hbuf
        if self.idx is None:
            hb[:n].copy_(self.h[rows])
            self.idbuf[:n].copy_(self.ids[rows])
        else:
            torch.index_select(self.h, 0, self.hidx[rows], out=hb[:n])
            torch.index_select(self.ids, 0, self.idx[rows], out=self.idbuf[:n])
        if self.inactive is not None:
            hb[:n].masked_fill_(self.inactive[rows], 0)
        if m > n:  # (each torch call costs host time before the first GEMM: none for nothing)
            hb[n:m].zero_()
            self.idbuf[n:m].fill_(self.ii)
        return n, m

    def chunk(self, k: int, n: int) -> tuple[slice, torch.Tensor]:
        """Logits of chunk k of the staged group, whose first ``n`` rows are real (always ``c``
        rows through cuBLAS: row invariance; the invariant GEMM is row invariant at any M, so it
        computes the real rows only, and the pad rows, ignored, are never read)."""
        sl = slice(k * self.c, (k + 1) * self.c)
        hb = self.hbuf[sl]
        z = self.g[sl] if self.z_in_grad else self.zbuf
        if self.inv is not None:
            from rlkernel.kernels import matmul as mk  # imports the GEMM kernels on first use

            cnt = min(self.c, n - k * self.c)
            mk.matmul_into(
                hb[:cnt],
                self.w.t(),
                z[:cnt],
                bias=self.bias,
                table=self.inv.matmul_table,
                thresholds=self.inv.matmul_thresholds,
            )
            return sl, z
        if self.w32 is not None:
            torch.mm(hb.float(), self.w32.t(), out=z)
        elif z.dtype != hb.dtype:
            torch.mm(hb, self.w.t(), out_dtype=z.dtype, out=z)
        else:
            torch.mm(hb, self.w.t(), out=z)
        if self.bias_z is not None:
            z.add_(self.bias_z)
        return sl, z

    def stats(self, sl, z, with_entropy):
        """Forward kernel over one chunk: fp32 ``(logp, entropy or None, lse)``, ``c`` rows each."""
        c, dev = self.c, z.device
        lp = torch.empty(c, dtype=torch.float32, device=dev)
        ls = torch.empty(c, dtype=torch.float32, device=dev)
        en = torch.empty(c, dtype=torch.float32, device=dev) if with_entropy else None
        lk.token_logprobs_fwd_into(z, self.idbuf[sl], lp, en, ls, temperature=self.t, ignore_index=self.ii)
        return lp, en, ls

    def chunks(self, n: int):
        """``(k, real rows)`` of each chunk of a staged group of ``n`` real rows."""
        for k in range(-(-n // self.c)):
            yield k, min(self.c, n - k * self.c)

    def forward_chunk(self, k: int, cnt: int, with_entropy: bool, keep_logits: bool):
        """Chunk k's rows ``sl``, its logits ``z`` and fp32 ``(logp, entropy or None, lse)``: ``c``
        rows each (cuBLAS, pad rows included), or its ``cnt`` real rows (the epilogue kernel, whose
        ``z`` is None unless ``keep_logits``, then the :class:`ShiftedLogits` that
        :meth:`chunk_grad` reads)."""
        if not self.epi:
            sl, z = self.chunk(k, k * self.c + cnt)
            return (sl, z, *self.stats(sl, z, with_entropy))
        from rlkernel.kernels import linear_head as lh

        sl = slice(k * self.c, k * self.c + cnt)
        if not keep_logits:
            lp, ls, en = lh.linear_head_stats(
                self.hbuf[sl], self.w, self.idbuf[sl], temperature=self.t, ignore_index=self.ii,
                with_entropy=with_entropy,
            )  # fmt: skip
            return sl, None, lp, en, ls
        # The tile-shifted exponents go straight into the chunk's rows of the gradient buffer, where
        # chunk_grad turns them into the gradient in place: no fp32 chunk logits buffer.
        lp, ls, en, tile_max = lh.linear_head_stats_shifted(
            self.hbuf[sl], self.w, self.idbuf[sl], self.g[sl], temperature=self.t,
            ignore_index=self.ii, with_entropy=with_entropy,
        )  # fmt: skip
        return sl, ShiftedLogits(self.g[sl], tile_max), lp, en, ls

    def group_stats(self, n: int, with_entropy: bool):
        """fp32 ``(logp, entropy or None, lse)`` ``[n]`` of a staged group (no logits kept): one
        epilogue-kernel launch, or the chunk loop."""
        if self.epi:
            from rlkernel.kernels import linear_head as lh

            lp, ls, en = lh.linear_head_stats(
                self.hbuf[:n], self.w, self.idbuf[:n], temperature=self.t, ignore_index=self.ii,
                with_entropy=with_entropy,
            )  # fmt: skip
            return lp, en, ls
        dev = self.h.device
        lp, ls = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2))
        en = torch.empty(n, dtype=torch.float32, device=dev) if with_entropy else None
        for k, cnt in self.chunks(n):
            sl, z = self.chunk(k, n)
            c_lp, c_en, c_ls = self.stats(sl, z, with_entropy)
            r = slice(sl.start, sl.start + cnt)
            lp[r], ls[r] = c_lp[:cnt], c_ls[:cnt]
            if en is not None:
                en[r] = c_en[:cnt]
        return lp, en, ls

    def group_logits_grad(self, n: int, lse, entropy, g_logp, g_ent) -> None:
        """The logits gradient of a staged group (``[n]`` fp32 per-row inputs, entropy/g_ent may be
        None) into the gradient buffer (whole chunks with cuBLAS, pad rows zero): the epilogue
        kernel recomputes the logits in one launch; otherwise each chunk's logits are recomputed
        and differentiated."""
        if self.epi:
            from rlkernel.kernels import linear_head as lh

            lh.linear_head_grad_into(
                self.hbuf[:n], self.w, self.idbuf[:n], lse, entropy, g_logp, g_ent, self.g[:n],
                temperature=self.t, ignore_index=self.ii,
            )  # fmt: skip
            return
        for k, cnt in self.chunks(n):
            sl, z = self.chunk(k, n)
            start = sl.start
            self.chunk_grad(
                sl, z, _padded(lse, self.c, start, cnt),
                None if g_ent is None else _padded(entropy, self.c, start, cnt),
                _padded(g_logp, self.c, start, cnt), _padded(g_ent, self.c, start, cnt),
            )  # fmt: skip

    def chunk_grad(self, sl, z, lse, entropy, g_logp, g_ent):
        """The chunk's logits gradient into rows ``sl`` of the group's gradient buffer (``z`` and the
        vectors have the rows of ``sl``: ``c``, or the real rows with the epilogue kernel)."""
        if isinstance(z, ShiftedLogits):
            from rlkernel.kernels import linear_head as lh

            lh.linear_head_grad_from_shifted(
                z.exponents, z.tile_max, self.idbuf[sl], lse, entropy, g_logp, g_ent,
                temperature=self.t, ignore_index=self.ii,
            )  # fmt: skip
            return
        _bwd_into(z, self.idbuf[sl], lse, entropy, g_logp, g_ent, self.g[sl], self.t, self.ii)

    def group_grads(self, rows, n, m, dh, dw, db):
        """dhidden rows, dweight and dbias contributions of the staged group (first m rows)."""
        g, hb = self.g[:m], self.hbuf[:m]
        if dh is not None:
            if self.idx is not None:  # scattered back to the rows' places (the others stay 0)
                dh.index_copy_(0, self.hidx[rows], torch.mm(g, self.w)[:n])
            elif n == m:
                torch.mm(g, self.w, out=dh[rows])
            else:
                dh[rows] = torch.mm(g, self.w)[:n]
        if dw is not None:
            # The first group writes (beta = 0): no zero-fill and no read of the V·H accumulator.
            first, self.dw_started = not self.dw_started, True
            for cols, part in dw.parts:  # ops._dweight_accum.DweightAccumulator: one or two row ranges
                _accumulate_dweight(part, g.t() if cols is None else g[:, cols].t(), hb, first)
        if db is not None:
            db += g.sum(0, dtype=torch.float32)

    def whole_buffers(self) -> WholeBatchGrad:
        """The staged rows and their logits gradient after a whole-batch chunk loop (the real rows:
        the chunks' pad rows have zero gradient), for :func:`whole_batch_grads` (now, or in the
        fused loss's backward)."""
        return WholeBatchGrad(self.g[: self.n], self.hbuf[: self.n], self.hidx)


@dataclasses.dataclass
class ShiftedLogits:
    """A chunk's logits as the epilogue kernel keeps them for the gradient: ``exponents`` ``[n, V]``
    (input dtype; rows of the group's gradient buffer, overwritten by the gradient) holds
    ``(z − m_t)·log2 e`` per element, ``tile_max`` fp32 ``[n_tiles, n]`` the m_t of each row's
    column tiles (``kernels.linear_head.linear_head_stats_shifted``)."""

    exponents: torch.Tensor
    tile_max: torch.Tensor


@dataclasses.dataclass
class WholeBatchGrad:
    """A whole-batch group: ``grad [n, V]`` (∂L/∂z of every staged row) and ``hidden [n, H]`` (the
    staged rows), both in the input dtype; ``row_index`` (compaction: the rows' places) or None."""

    grad: torch.Tensor
    hidden: torch.Tensor
    row_index: torch.Tensor | None


def whole_batch_grads(
    wb: WholeBatchGrad,
    weight: torch.Tensor,
    hidden_rows: int,
    need_h: bool,
    need_w: bool,
    need_b: bool,
    scale: torch.Tensor | None = None,
):
    """dhidden ``[hidden_rows, H]``, dweight ``[V, H]`` (weight dtype), fp32 dbias ``[V]`` of a
    whole-batch group, each times the fp32 0-dim ``scale`` (None: 1), from two GEMMs.

    dweight is one GEMM over every row (K = m): fp32 accumulation inside it and one rounding, no
    V·H accumulator. ``scale`` (the fused loss's upstream gradient, on the device: no sync) is
    applied to the ``[m, H]`` hidden rows before that GEMM (bf16: exact for powers of two, else one
    rounding of each hidden value, as autograd through plain torch rounds the scaled logits
    gradient), and to dhidden and dbias after theirs."""
    # The real rows only (these GEMMs' shapes fix no logp bit).
    g, hb = wb.grad, wb.hidden
    dh = dw = db = None
    if need_h:
        part = torch.mm(g, weight)
        if wb.row_index is not None:  # scattered back to the rows' places (the others stay 0)
            dh = torch.zeros(hidden_rows, part.shape[1], dtype=part.dtype, device=part.device)
            dh.index_copy_(0, wb.row_index, part)
        else:
            dh = part
        if scale is not None:
            scaled(dh, scale, out=dh)
    if need_w:
        hs = hb if scale is None else scaled(hb, scale)
        if g.device.type != "cuda" and g.dtype != torch.float32:  # CPU: fp32 math on upcast copies
            dw = torch.mm(g.t().float(), hs.float()).to(weight.dtype)
        else:
            dw = torch.mm(g.t(), hs)
    if need_b:
        db = g.sum(0, dtype=torch.float32)
        if scale is not None:
            db = db * scale
    return dh, dw, db


def scaled(x: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x · scale`` as an fp32 product (fp32 0-dim ``scale`` on the device, not rounded to ``x``'s
    dtype first, as ``torch.mul`` of a 16-bit tensor does), rounded once to ``out``'s dtype (default:
    a new tensor like ``x``); ``out`` may be ``x`` (in place). On CUDA with contiguous operands one
    streaming Triton pass (``kernels.scale_cast``: PyTorch's mixed-dtype product runs at ~1 TB/s on
    the H100), elsewhere the same arithmetic in torch ops."""
    scale = scale.reshape(()).to(torch.float32)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.is_cuda and x.is_contiguous() and out.is_contiguous() and x.numel() == out.numel():
        from rlkernel.kernels.scale_cast import scale_cast_into

        scale_cast_into(x.view(-1), out.view(-1), scale)
        return out
    return out.copy_(x.to(torch.float32) * scale)


def _padded(x, c, start, n):
    """fp32 ``[c]`` with ``x[start:start + n]`` first and zeros after (None stays None); a full chunk
    (n == c) is the fp32 slice itself, without a zero fill and a copy."""
    if x is None:
        return None
    if n == c:
        return x[start : start + n].to(torch.float32)
    out = torch.zeros(c, dtype=torch.float32, device=x.device)
    out[:n] = x[start : start + n]
    return out


def _accumulate_dweight(acc: torch.Tensor, gt: torch.Tensor, hb: torch.Tensor, first: bool) -> None:
    """``acc (=|+=) gt @ hb``: one group's dweight rows ``[R, H]`` from its gradient columns ``gt``
    ``[R, G]`` and hidden rows ``hb`` ``[G, H]``; the sum across groups in ``acc``'s dtype (fp32 via
    ``mm(out_dtype=fp32)`` for 16-bit inputs on CUDA). ``first`` writes instead of adding."""
    if acc.dtype == gt.dtype:  # fp32 inputs, or dweight_accum="weight"
        torch.mm(gt, hb, out=acc) if first else acc.addmm_(gt, hb)
    elif gt.device.type == "cuda" and _mm_out_dtype_supported(gt.device):
        if first:
            torch.mm(gt, hb, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, gt, hb, out_dtype=torch.float32, out=acc)
    elif gt.device.type == "cuda":
        # No mm(out_dtype=...) in this torch: the group's product is rounded to the input dtype
        # once (a temporary of acc's shape), the sum across groups stays fp32.
        part = torch.mm(gt, hb)
        acc.copy_(part) if first else acc.add_(part)
    else:  # CPU: fp32 math on an upcast copy of the group
        torch.mm(gt.float(), hb.float(), out=acc) if first else acc.addmm_(gt.float(), hb.float())


@dataclasses.dataclass(frozen=True)
class HiddenLayout:
    """Where the rows of the caller's ``hidden`` ``[..., H]`` sit in the engine's ``[R, H]`` row space:
    ``step`` 0, hidden flattened; else ``step`` storage rows per index of hidden's first dim."""

    shape: torch.Size
    step: int

    def grad(self, dh: torch.Tensor | None) -> torch.Tensor | None:
        """dhidden ``[R, H]`` (contiguous) as a gradient of hidden's shape (a view, no copy)."""
        if dh is None or self.step == 0:
            return None if dh is None else dh.view(self.shape)
        h = self.shape[-1]
        return dh.as_strided(self.shape, (self.step * h, h, 1))


@dataclasses.dataclass(frozen=True)
class HiddenRows:
    """How the engine reads the caller's ``hidden``: ``rows`` ``[R, H]`` (index_select reads it;
    dhidden is built in its row space), ``index`` the positions in it of the engine's rows (None:
    ``rows`` is hidden flattened and the engine's ``row_index`` applies), ``layout`` the way back."""

    rows: torch.Tensor
    index: torch.Tensor | None
    layout: HiddenLayout


def hidden_rows(hidden: torch.Tensor, row_index: torch.Tensor | None) -> HiddenRows:
    """The rows of ``hidden`` ``[..., H]`` for the engine, without copying it where it can: 2-D, or
    viewable as ``[N, H]``, as is; a 3-D ``[B, T, H]`` whose rows are evenly strided (what slicing a
    trainer's ``[B, P + T, H]`` hidden states gives: ``base[:, P - 1:-1]``), when only the
    ``row_index`` rows are read (padding compaction), through a ``[R, H]`` view of its storage rows
    (R = (B − 1)·step + T) at positions ``i + (i // T)·(step − T)``: two small ops instead of a
    ``[N, H]`` copy (67 MB at N = 8192, H = 4096). Otherwise the flattening copy."""
    hdim = hidden.shape[-1]
    n = hidden.shape[:-1].numel()
    flat = HiddenLayout(hidden.shape, 0)
    if hidden.dim() == 2:
        return HiddenRows(hidden, None, flat)
    if hidden.dim() == 3 and row_index is not None and n > 0 and hidden.stride(2) == 1:
        b, t = hidden.shape[0], hidden.shape[1]
        s0, s1 = hidden.stride(0), hidden.stride(1)
        viewable = b == 1 or s0 == t * s1
        # Rows of one pitch s1 >= H, batch starts on that pitch and never overlapping (step >= T).
        if not viewable and s1 >= hdim and s0 % s1 == 0 and s0 // s1 >= t:
            step = s0 // s1
            rows = hidden.as_strided(((b - 1) * step + t, hdim), (s1, 1))
            index = torch.add(row_index, row_index // t, alpha=step - t)  # two launches, not three
            return HiddenRows(rows, index, HiddenLayout(hidden.shape, step))
    # Rows by count, not -1: with H = 0 the row count of an empty tensor is ambiguous to reshape.
    return HiddenRows(hidden.reshape(n, hdim), None, flat)


def _active_rows(ids: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The indices of the rows whose id is not ``ignore_index`` (int64, increasing), or None when
    every row is active (nothing to compact). One host sync (the count sizes the row loop); none,
    and no compaction, inside CUDA-graph capture (a sync cannot be captured)."""
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    idx = (ids != ignore_index).nonzero().squeeze(1)
    return None if idx.numel() == ids.numel() else idx


def _scatter(x: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` zeros with ``x[i]`` at position ``idx[i]``."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_copy_(0, idx, x)
