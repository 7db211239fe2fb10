"""Triton kernels for the batch-invariant GEMM ``c = a @ b (+ bias)`` and their launchers.

Math: ``c[m, n] = Σ_k a[m, k]·b[k, n] (+ bias[n])`` with an fp32 accumulator, rounded once to the
output dtype (bias added before the rounding). ``a [M, K]`` and ``b [K, N]`` may have any strides;
``linear(x, W)`` passes ``b = W.t()`` (a K-major view of the ``[N, K]`` weight, no copy).

Batch invariance (why a row's bits do not depend on M). A GEMM's result for one element is fixed
by the sequence of operations that reduces its K dimension. Here that sequence is: tiles of
``BLOCK_K`` values in increasing k, each folded into the fp32 accumulator by one ``tl.dot`` — on
Hopper a chain of k16 tensor-core steps (``wgmma`` for >= 64-row tiles, ``mma.sync`` for 16-row
ones) in increasing k, so BLOCK_K = 64, 128 or 256 run the same chain; for fp32 inputs an IEEE FMA
loop, never TF32. There is no split-K, no stream-K, no autotuning. Rows beyond M read row 0
(pointer kernel) or zeros (TMA) and are never stored; rows never interact inside a dot. So for one
launch configuration the sequence is the same for M = 1 and M = 100,000. Which configuration runs
is chosen per call by :mod:`rlkernel.kernels.matmul_table` (the candidates, the measured table);
the caller passes the table option and its thresholds in (``table``, ``thresholds``).

Two kernels with the same per-element arithmetic:
    * ``_matmul_kernel``: pointer loads (``cp.async`` pipelined by ``num_stages``), one program per
      output tile, grouped ("swizzled") tile order so that ``GROUP_M`` row-tiles reuse each
      column-tile of ``b`` from L2. Any strides, any dtype.
    * ``_matmul_tma_kernel``: persistent (one program per SM looping over tiles in the same grouped
      order), Hopper TMA descriptors for ``a``, ``b`` and ``c`` (the bulk-copy engine does address
      generation and zero-fills out-of-bounds rows, no masks). 16-bit dtypes with 16-byte aligned
      rows, Triton with host tensor descriptors and ``tl.range(flatten=, warp_specialize=)`` only;
      otherwise the table's next (pointer) configuration of the same bucket runs.

Memory traffic: ``2·(M·K + K·N + M·N)`` bytes at best for bf16; at M = 1 the weight (K·N) is all of
it, so decode is bandwidth bound and wants many tiles in flight; at M = 8192 it is compute bound
(2·M·N·K flops) and wants 128×256 tiles fed by TMA.

Caveats:
    * Invariance holds for one configuration table on one GPU model and compiler version: a rollout
      and a trainer that must agree bitwise must run the same ``TUNED`` table, ``matmul_table``
      option and GPU model.
    * Only M = 1, 8, 64 and 8192 were timed per candidate (M = 256 and 2048: the table and the
      single configuration only, both ~2-4x cuBLAS; the GPU script now times the candidates
      there); the 65…1024 bucket and the tile-count thresholds
      (``min_tiles``, ``min_tiles_tma``) are extrapolated from them (speed only, not invariance).
    * The persistent TMA kernel is slower than the pointer kernel when a grid has few tiles per SM
      (H100: k/v 4096→1024 at M = 8192, 256 tiles: 1.9x vs 1.5x cuBLAS time), hence ``min_tiles_tma``.
    * fp32 inputs use IEEE FMA (``input_precision="ieee"``), ~10x slower than TF32 tensor cores but
      within 1e-5 of the fp32 reference; TF32 would not meet the fp32 accuracy contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from rlkernel.kernels import matmul_table as mt
from rlkernel.kernels._dot import dot, interpreted
from rlkernel.kernels._launch import FP_FUSION, FastLauncher, num_sms
from rlkernel.kernels._launch import cdiv as _cdiv
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels.matmul_table import DEFAULT_THRESHOLDS, MatmulConfig, MatmulThresholds


def _num_sms(device: torch.device) -> int:
    return num_sms(device, interpreter=4)  # interpreter: a few persistent programs exercise the tile loop

def _tma_supported(device: torch.device) -> bool:
    if device.type == "cpu":
        return True  # interpreter
    return mt.device_capability(device)[0] >= 9


def _aligned(t: torch.Tensor) -> bool:
    """TMA needs a contiguous last dim, 16-byte aligned base and 16-byte aligned other strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-1])


def tma_possible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the TMA kernel can run this product (any TMA config). An output dtype other than
    the operands' (fp32 logits from bf16 operands) runs the pointer kernel: the TMA configurations'
    epilogue tile was sized (and its shared memory measured) for 16-bit outputs."""
    if a.element_size() != 2 or out.dtype != a.dtype:
        return False
    if not mt.tma_api_available() or not _tma_supported(a.device):
        return False
    b_nk = b.t()  # [N, K]: K-major weight, or [K, N] row-major b
    return _aligned(a) and _aligned(out) and (_aligned(b_nk) or _aligned(b))



# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: ``GROUP_M`` consecutive row-tiles sweep the column-tiles together, so a
    column-tile of ``b`` is read from DRAM once per group and from L2 after that."""
    width = GROUP_M * num_pid_n
    group = tile_id // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % width) % group_size
    pid_n = (tile_id % width) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    # output
    c_ptr,
    stride_cm,
    stride_cn,
    # inputs
    a_ptr,
    stride_am,
    stride_ak,
    b_ptr,
    stride_bk,
    stride_bn,
    bias_ptr,
    # sizes
    M,
    N,
    K,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HINT_M: tl.constexpr,
    HINT_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One output tile per program. Rows/columns beyond M/N read row/column 0 (in bounds, so the
    loads need no M/N mask) and are never stored; K tails are zero-filled (adds exact zeros)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < M, offs_m, 0)
    cols = tl.where(offs_n < N, offs_n, 0)
    # Operands contiguous along M or N (the backward's transposed views) vectorize only if the
    # compiler knows the indices are contiguous; the launcher sets these where M (N) % 16 == 0, so
    # no vector straddles the end. The forward's operands are contiguous along K: no hint needed.
    if HINT_M:
        rows = tl.max_contiguous(tl.multiple_of(rows, BLOCK_M), BLOCK_M)
    if HINT_N:
        cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        # The K-reduction order of every output element: this one dot per BLOCK_K, in increasing k.
        acc = dot(a, b, acc, INPUT_PRECISION, INTERPRETED)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "num_programs"])
def _matmul_tma_kernel(
    # output
    c_desc,
    # inputs
    a_desc,
    b_desc,
    bias_ptr,
    # sizes
    M,
    N,
    K,
    num_programs,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_NK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Persistent: program p computes tiles p, p + num_programs, … in grouped order. TMA loads
    zero-fill out-of-bounds rows and K tails, TMA stores clip them. ``B_NK``: ``b_desc`` describes
    the ``[N, K]`` (K-major) weight, loaded as ``[BLOCK_N, BLOCK_K]`` and transposed in shared
    memory (a free view for ``wgmma``); else the ``[K, N]`` row-major ``b``."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(start, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Pipelined to the launch's num_stages (also across tiles when the tile loop is flattened).
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            if B_NK:
                b = b_desc.load([off_n, ki * BLOCK_K]).T
            else:
                b = b_desc.load([ki * BLOCK_K, off_n])
            acc = dot(a, b, acc, "tf32", INTERPRETED)  # 16-bit operands: the precision is unused
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# ------------------------------------------------------------------------------------- launchers
_launch_pointer = FastLauncher(_matmul_kernel)  # decode steps call it ~8 times per layer


def _matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    table: str = "tuned",
    thresholds: MatmulThresholds = DEFAULT_THRESHOLDS,
) -> None:
    """Out-variant: fills ``out [M, N]`` (any strides) with ``a [M, K] @ b [K, N] (+ bias [N])``.

    ``table``/``thresholds``: the options ``matmul_table``/``matmul_thresholds``. ``config``
    overrides the table for tests and tuning only: a row's bits may depend on it, so production
    calls leave it None."""
    m, k = a.shape
    k2, n = b.shape
    assert k == k2 and out.shape == (m, n), (a.shape, b.shape, out.shape)
    assert a.dtype == b.dtype and a.dtype in mt.TUNED, (a.dtype, b.dtype)
    if m == 0 or n == 0:
        return
    if k == 0:
        out.copy_(bias.expand(m, n) if bias is not None else torch.zeros((), dtype=out.dtype))
        return
    # The table is asked first as if TMA could run (no operand checks: decode-sized calls never
    # get a TMA config); only a TMA pick pays for the alignment checks, and if TMA cannot address
    # these operands the table's pointer choice for the cell runs instead.
    table = mt.table_for(a.device, table)
    cfg = config or mt.config_for(m, n, k, a.dtype, table, thresholds)
    tma = cfg.tma and tma_possible(a, b, out)
    if cfg.tma and not tma and config is None:
        cfg = mt.config_for(m, n, k, a.dtype, table, thresholds, tma=False)
    if bias is not None:
        bias = bias.contiguous()
    with _device_guard(a):
        if tma:
            try:
                _launch_tma(a, b, out, bias, cfg)
                return
            except (CompilationError, OutOfResources):
                if config is not None:
                    raise
                # A Triton that cannot build this TMA variant (or a GPU with less shared memory):
                # the table's next config of the bucket, in the same bitwise class, from now on.
                mt.tma_failed.add(cfg.name)
            _matmul(a, b, out, bias=bias, table=table, thresholds=thresholds)
            return
        # An explicit TMA config on operands TMA cannot address runs the pointer kernel, same tiles.
        (so0, so1), (sa0, sa1), (sb0, sb1) = out.stride(), a.stride(), b.stride()
        _pointer_gemm(out, so0, so1, a, sa0, sa1, b, sb0, sb1, bias, m, n, k, cfg)


def _pointer_gemm(out, so0, so1, a, sa0, sa1, b, sb0, sb1, bias, m, n, k, cfg: MatmulConfig) -> None:
    """Launch ``_matmul_kernel`` for given strides (the caller holds the device guard)."""
    _launch_pointer(
        (_cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n),),
        (out, so0, so1, a, sa0, sa1, b, sb0, sb1, bias if bias is not None else out, m, n, k),
        {
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m,
            "NUM_STAGES": cfg.num_stages,
            "EVEN_K": k % cfg.block_k == 0,
            "HAS_BIAS": bias is not None,
            "INPUT_PRECISION": "ieee" if a.dtype == torch.float32 else "tf32",
            "HINT_M": sa0 == 1 and m % 16 == 0,
            "HINT_N": sb1 == 1 and n % 16 == 0,
            "INTERPRETED": interpreted(a),
        },
        {"num_warps": cfg.num_warps, "enable_fp_fusion": FP_FUSION},
    )


# config_for results per (shape, dtype, device, table options, TMA facts): a decode step asks for the
# same few shapes ~30 times. The default thresholds are keyed as None (no dataclass hash per call);
# an in-place edit of TUNED is not seen.
_config_memo: dict[tuple, MatmulConfig] = {}


def _config_cached(
    m: int, n: int, k: int, x: torch.Tensor, table: str, thresholds: MatmulThresholds
) -> MatmulConfig:
    th_key = None if thresholds is DEFAULT_THRESHOLDS else thresholds
    key = (m, n, k, x.dtype, x.get_device(), table, th_key, len(mt.tma_failed), mt.tma_api)
    cfg = _config_memo.get(key)
    if cfg is None:
        if len(_config_memo) >= 4096:  # training with many distinct M: start over
            _config_memo.clear()
        cfg = _config_memo[key] = mt.config_for(m, n, k, x.dtype, mt.table_for(x.device, table), thresholds)
    return cfg


def linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    table: str = "tuned",
    thresholds: MatmulThresholds = DEFAULT_THRESHOLDS,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias [N])`` as a new ``[..., N]`` tensor in ``out_dtype``
    (None: x's dtype): the forward of ``rlkernel.invariant.linear`` with the fewest host operations
    for decode-sized calls (no reshape or transpose views: the kernel reads ``weight``'s strides as
    the K-major ``b``, and a contiguous ``x`` is read as ``[M, K]`` rows). Same configuration
    table, same bits as ``matmul(x.reshape(M, K), weight.t(), bias=bias, out_dtype=out_dtype)``.
    Inputs are validated by the caller; ``table``/``thresholds`` as in :func:`matmul`."""
    k = x.shape[-1]
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype, device=x.device)
    if x.dim() == 2:
        (sa0, sa1), m = x.stride(), x.shape[0]
    elif x.is_contiguous():
        sa0, sa1, m = k, 1, x.numel() // k if k else 0
    else:
        sa0 = None
    if sa0 is None or m == 0 or n == 0 or k == 0:
        # Rows by count, not -1: with K = 0 or N = 0 an empty tensor's row count is ambiguous.
        m = x.shape[:-1].numel()
        _matmul(x.reshape(m, k), weight.t(), out.view(m, n), bias=bias, table=table, thresholds=thresholds)
        return out
    cfg = _config_cached(m, n, k, x, table, thresholds)
    if cfg.tma:  # prefill-sized: the general launcher (TMA descriptors, alignment checks)
        _matmul(x.reshape(m, k), weight.t(), out.view(m, n), bias=bias, table=table, thresholds=thresholds)
        return out
    if bias is not None:
        bias = bias.contiguous()
    sw0, sw1 = weight.stride()
    with _device_guard(x):
        _pointer_gemm(out, n, 1, x, sa0, sa1, weight, sw1, sw0, bias, m, n, k, cfg)
    return out


def _launch_tma(a, b, out, bias, cfg: MatmulConfig) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    n = b.shape[1]
    b_nk = b.t()
    use_nk = _aligned(b_nk)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    if use_nk:
        b_desc = TensorDescriptor.from_tensor(b_nk, [cfg.block_n, cfg.block_k])
    else:
        b_desc = TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n])
    c_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    programs = min(_num_sms(a.device), tiles)
    _matmul_tma_kernel[(programs,)](
        c_desc,
        a_desc,
        b_desc,
        bias if bias is not None else out,
        m,
        n,
        k,
        programs,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        B_NK=use_nk,
        HAS_BIAS=bias is not None,
        FLATTEN=cfg.flatten,
        WARP_SPECIALIZE=cfg.warp_specialize,
        INTERPRETED=interpreted(a),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=FP_FUSION,
    )


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    table: str = "tuned",
    thresholds: MatmulThresholds = DEFAULT_THRESHOLDS,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Allocating: ``a [M, K] @ b [K, N] (+ bias [N])`` as a new contiguous ``[M, N]`` tensor in
    ``out_dtype`` (None: ``a``'s dtype; ``torch.float32`` keeps the fp32 accumulator of 16-bit
    operands unrounded). Operands may have any strides (``b = weight.t()`` for ``linear``).
    ``table`` (``"tuned"`` | ``"single"``) and ``thresholds``: the options ``matmul_table`` and
    ``matmul_thresholds`` (the caller reads them; unverified GPU models run "single")."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype, device=a.device)
    _matmul(a, b, out, bias=bias, config=config, table=table, thresholds=thresholds)
    return out


def matmul_into(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    table: str = "tuned",
    thresholds: MatmulThresholds = DEFAULT_THRESHOLDS,
) -> None:
    """Out-variant of :func:`matmul`: fills ``out [M, N]`` (any strides, fp16/bf16/fp32: the
    accumulator is rounded once to its dtype) with ``a [M, K] @ b [K, N] (+ bias [N])``. The same
    configuration choice and so the same bits per row as :func:`matmul` and :func:`linear_forward`
    (the fused LM head of ``rlkernel.linear_token_logprobs(..., invariant=True)`` writes its chunk
    logits here)."""
    _matmul(a, b, out, bias=bias, table=table, thresholds=thresholds)
