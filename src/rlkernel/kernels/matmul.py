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
launch configuration the sequence is the same for M = 1 and M = 100,000.

The default ``MODE = "tuned"`` picks the configuration per call from ``TUNED`` by (dtype, M's
bucket, N's weight class, grid size): the fastest candidate per shape measured on an H100
(``docs/api/invariant_linear.md``). It stays invariant across M because every configuration in a
dtype's table is in ONE measured class of mutually bitwise-equal configurations: the same k16 steps
in the same order, sequential K loop, no split-K; tile shape, BLOCK_K (64/128/256: a K tail is
zero-filled up to the tile, and the extra all-zero k16 steps add exact zeros), warps, stages,
program order (GROUP_M), TMA or pointer loads, persistent or not change no bit (H100, triton 3.6,
2026-11-21, K = N = 4096: bf16 13 configs, fp16 7, fp32 2, each one class; 33 more 16-row decode
tiles with BLOCK_K 64-256 and GROUP_M = 8, bf16 and fp16, also at K = 4072, N = 1000: the same
class per dtype). That equality is a property of the tensor-core datapath and the compiler, not of
this code, so the GPU tests (``tests/gpu/test_invariant_ops.py``) re-verify on every run that
``table_configs(dtype)`` is one class (and that the public ``linear`` is invariant from M = 1 to
100,000): a GPU or Triton version that breaks the class shows up as a FAIL there. Until a GPU model
has been checked, the tuned table is not used on it (``TUNED_CAPABILITIES``): ``MODE = "single"``
(one configuration per dtype for every M, safe by construction) runs instead, and stays available
as the conservative one-line switch.

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
      and a trainer that must agree bitwise must run the same ``TUNED``/``MODE`` and GPU model.
    * Only M = 1, 8, 64 and 8192 were timed per candidate (M = 256 and 2048: the table and the
      single configuration only, both ~2-4x cuBLAS; ``rlkernel bench invariant`` times the table
      there); the 65…1024 bucket and the tile-count thresholds
      (``MIN_TILES``, ``MIN_TILES_TMA``) are extrapolated from them (speed only, not invariance).
    * The persistent TMA kernel is slower than the pointer kernel when a grid has few tiles per SM
      (H100: k/v 4096→1024 at M = 8192, 256 tiles: 1.9x vs 1.5x cuBLAS time), hence ``MIN_TILES_TMA``.
    * fp32 inputs use IEEE FMA (``input_precision="ieee"``), ~10x slower than TF32 tensor cores but
      within 1e-5 of the fp32 reference; TF32 would not meet the fp32 accuracy contract.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from rlkernel.kernels._dot import dot, interpreted
from rlkernel.kernels._launch import FP_FUSION, FastLauncher, num_sms
from rlkernel.kernels._launch import cdiv as _cdiv
from rlkernel.kernels._launch import device_guard as _device_guard


# ------------------------------------------------------------------------------------ configuration
@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Launch configuration. ``block_k`` and the dot's instruction kind fix a row's bits; the other
    fields are free only where the GPU tests show that they change no bit. ``flatten`` and
    ``warp_specialize`` are ``tl.range`` options of the persistent TMA kernel's tile loop."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = False
    flatten: bool = False
    warp_specialize: bool = False
    name: str = ""


# Candidates (tests/gpu/test_invariant_ops.py checks the table's on every GPU run;
# scripts/gpu_decode_gemm_sweep.py sweeps 16-row decode tiles). "decode_k128" and
# "prefill_tma_s4" (over the H100's shared memory) are measured but kept out of the tables; the
# mma16* and dec_* 16-row tiles were measured in the bf16 class on the H100, the dec_* ones also in
# fp16's and at a K-tail shape (the GPU tests check every table's class on every run).
CANDIDATES_16 = {
    c.name: c
    for c in (
        MatmulConfig(128, 256, 64, 8, 8, 3, name="prefill"),
        MatmulConfig(128, 256, 64, 8, 8, 3, tma=True, name="prefill_tma"),
        MatmulConfig(128, 256, 64, 8, 8, 3, tma=True, flatten=True, name="prefill_tma_flat"),
        MatmulConfig(128, 256, 64, 8, 8, 3, tma=True, warp_specialize=True, name="prefill_tma_ws"),
        MatmulConfig(128, 256, 64, 8, 8, 4, tma=True, name="prefill_tma_s4"),
        MatmulConfig(256, 128, 64, 8, 8, 3, name="prefill_256x128"),
        MatmulConfig(128, 128, 64, 8, 4, 4, name="mid"),
        MatmulConfig(128, 128, 64, 8, 4, 4, tma=True, name="mid_tma"),
        MatmulConfig(64, 64, 64, 1, 4, 6, name="decode"),
        MatmulConfig(64, 64, 64, 1, 4, 6, tma=True, name="decode_tma"),
        MatmulConfig(64, 32, 64, 1, 4, 8, name="decode_n32"),
        MatmulConfig(64, 16, 64, 1, 4, 8, name="decode_n16"),
        MatmulConfig(64, 64, 128, 1, 4, 4, name="decode_k128"),
        MatmulConfig(16, 64, 64, 1, 4, 4, name="mma16"),
        MatmulConfig(16, 32, 64, 1, 2, 6, name="mma16_n32"),
        MatmulConfig(16, 16, 64, 1, 1, 8, name="mma16_n16"),
        # Decode (M <= 64): 16-row mma.sync tiles with 4-8x more weight bytes per pipeline stage
        # (BLOCK_K = 128/256: the same k16 steps in the same order) and GROUP_M = 8 (the <= 4 row
        # tiles of one column tile run together: the weight is read from HBM once). All 33 swept
        # variants were in the bf16 and the fp16 class on the H100 (gpu_decode_gemm_sweep_*.log).
        MatmulConfig(16, 16, 256, 8, 2, 4, name="dec_n16_k256"),
        MatmulConfig(16, 32, 256, 8, 2, 4, name="dec_n32_k256"),
        MatmulConfig(16, 64, 128, 8, 4, 8, name="dec_n64_k128_s8"),
        MatmulConfig(16, 64, 128, 8, 4, 4, name="dec_n64_k128_s4"),
        MatmulConfig(16, 64, 64, 8, 4, 12, name="dec_n64_k64_s12"),
    )
}
CANDIDATES_32 = {
    c.name: c
    for c in (
        MatmulConfig(64, 64, 32, 8, 4, 2, name="fp32"),
        MatmulConfig(16, 64, 32, 1, 4, 2, name="fp32_decode"),
    )
}

# One-line switch (see the module header): "tuned" = the measured table ``TUNED``; "single" = one
# configuration per dtype (``SINGLE``) for every M, invariant by construction.
MODE = "tuned"
# GPU models (compute capability) on which the GPU tests showed every table to be one class; on
# others "tuned" runs as "single". (9, 0): H100 (and H200, the same SM).
TUNED_CAPABILITIES = {(9, 0)}

_C16, _C32 = CANDIDATES_16, CANDIDATES_32
SINGLE = {torch.bfloat16: _C16["prefill"], torch.float16: _C16["prefill"], torch.float32: _C32["fp32"]}

# Weight classes (by N alone: the weight fixes it, never the batch): "narrow" (N <= NARROW_N: GQA
# k/v projections, few column tiles), "vocab" (N >= VOCAB_N: LM heads), "wide" (the rest: q/o, MLP).
NARROW_N = 2048
VOCAB_N = 32768
# In a table cell, the first configuration whose grid has at least MIN_TILES tiles (MIN_TILES_TMA
# for the persistent TMA kernel, which needs several tiles per SM; H100: 132 SMs) and that can run
# is used, else the cell's last one (always a pointer configuration).
MIN_TILES = 128
MIN_TILES_TMA = 512


def _cells(narrow, wide, vocab) -> dict[str, tuple[MatmulConfig, ...]]:
    return {
        cls: tuple(_C16[nm] for nm in names)
        for cls, names in (("narrow", narrow), ("wide", wide), ("vocab", vocab))
    }


# {dtype: [(max_m, {weight class: configs}), ...]}, increasing max_m, the last unbounded. From the
# H100 runs of 2026-11-21 (time ÷ cuBLAS at Qwen3-8B shapes; see the docs page).
# bf16: all measured configs are one class; "decode_k128" is left out of the prefill cells anyway.
# M <= 64 cells: scripts/gpu_decode_gemm_sweep.py (L2 flushed, kernel time), fastest in-class
# config per (M bucket, weight class); at the sweep's cells they run 0.90-1.21x cuBLAS (k/v M = 1:
# 12.8 vs 10.6 us; wide M = 64: gate/up 57.6 vs 48.5 us), where the former mma16_n16/n32 cells
# ran 1.0-4.4x (their GROUP_M = 1 read the weight once per row tile at M > 16). The vocab cell at
# M = 33-64 keeps decode_n32 (64-row wgmma tile: 454 vs 746 us for the best 16-row tile).
_TABLE_16: list[tuple[float, dict[str, tuple[MatmulConfig, ...]]]] = [
    (1, _cells(["dec_n32_k256"], ["dec_n64_k128_s8"], ["dec_n64_k128_s8"])),
    (16, _cells(["dec_n16_k256"], ["dec_n32_k256"], ["dec_n64_k128_s8"])),
    (32, _cells(["dec_n16_k256"], ["dec_n32_k256"], ["dec_n64_k64_s12"])),
    (64, _cells(["dec_n16_k256"], ["dec_n64_k128_s4"], ["decode_n32"])),
    (1024, _cells(["decode", "decode_n16"], ["mid", "decode"], ["mid"])),
    (
        float("inf"),
        _cells(
            ["prefill_256x128", "decode"],
            ["prefill_tma_flat", "prefill_256x128", "mid"],
            ["prefill_tma_ws", "prefill_256x128"],
        ),
    ),
]
TUNED: dict[torch.dtype, list[tuple[float, dict[str, tuple[MatmulConfig, ...]]]]] = {
    torch.bfloat16: _TABLE_16,
    # fp16: bf16's table. Every one of its configurations was in fp16's class on the H100 on
    # 2026-11-22 (the dec_* tiles by gpu_decode_gemm_sweep.py --fp16, the rest by the GPU check);
    # timed in fp16 at M <= 64 (0.93-1.22x cuBLAS), above that bf16's timings stand in.
    torch.float16: _TABLE_16,
    torch.float32: [
        (64, dict.fromkeys(("narrow", "wide", "vocab"), (_C32["fp32_decode"],))),
        (float("inf"), dict.fromkeys(("narrow", "wide", "vocab"), (_C32["fp32"],))),
    ],
}


def weight_class(n: int) -> str:
    """``"narrow"``, ``"wide"`` or ``"vocab"``: the column of ``TUNED`` for a weight with N outputs."""
    return "narrow" if n <= NARROW_N else "vocab" if n >= VOCAB_N else "wide"


_tma_api: bool | None = None
_tma_failed: set[str] = set()  # TMA configs whose compilation failed here: skipped from then on


def tma_api_available() -> bool:
    """Whether this Triton has what the TMA kernel uses: host tensor descriptors and the
    ``flatten``/``warp_specialize`` options of ``tl.range`` (triton >= 3.4-ish)."""
    global _tma_api
    if _tma_api is None:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

            params = inspect.signature(tl.range).parameters
            _tma_api = "flatten" in params and "warp_specialize" in params
        except (ImportError, TypeError, ValueError):
            _tma_api = False
    return _tma_api


def config_for(
    m: int, n: int, k: int, dtype: torch.dtype, mode: str | None = None, *, tma: bool | None = None
) -> MatmulConfig:
    """The configuration for an ``[m, k] @ [k, n]`` product. ``"single"``: from the dtype alone;
    ``"tuned"``: from the dtype, M's bucket, N's weight class and the grid size (every candidate of
    a dtype's table gives the same bits, so the choice may depend on M). ``tma``: whether the TMA
    kernel can run (default: this Triton has the API; assumes aligned operands on Hopper)."""
    del k  # the measured table did not need it
    if (mode or MODE) == "single":
        return SINGLE[dtype]
    if tma is None:
        tma = tma_api_available()
    buckets = TUNED[dtype]
    configs = next(cells for max_m, cells in buckets if m <= max_m)[weight_class(n)]
    for cfg in configs[:-1]:
        if cfg.tma and (not tma or cfg.name in _tma_failed):
            continue
        tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
        if tiles >= (MIN_TILES_TMA if cfg.tma else MIN_TILES):
            return cfg
    return configs[-1]


def table_configs(dtype: torch.dtype, mode: str | None = None) -> list[MatmulConfig]:
    """Every config ``config_for`` can return for ``dtype`` in ``mode``: for batch invariance they
    must all give the same bits (what ``tests/gpu/test_invariant_ops.py`` checks)."""
    if (mode or MODE) == "single":
        return [SINGLE[dtype]]
    found = [cfg for _, cells in TUNED[dtype] for cfgs in cells.values() for cfg in cfgs]
    return list(dict.fromkeys(found))  # unique, in table order


_capability: dict[int, tuple[int, int]] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_sms(device: torch.device) -> int:
    return num_sms(device, interpreter=4)  # interpreter: a few persistent programs exercise the tile loop


def _device_capability(device: torch.device) -> tuple[int, int]:
    idx = _device_index(device)
    if idx not in _capability:
        _capability[idx] = torch.cuda.get_device_capability(idx)
    return _capability[idx]


def mode_for(device: torch.device) -> str:
    """``MODE``, except ``"single"`` for "tuned" on a GPU model not in ``TUNED_CAPABILITIES``. The
    CPU interpreter runs the table (the tests check it there)."""
    if MODE == "tuned" and device.type == "cuda" and _device_capability(device) not in TUNED_CAPABILITIES:
        return "single"
    return MODE


def _tma_supported(device: torch.device) -> bool:
    if device.type == "cpu":
        return True  # interpreter
    return _device_capability(device)[0] >= 9


def _aligned(t: torch.Tensor) -> bool:
    """TMA needs a contiguous last dim, 16-byte aligned base and 16-byte aligned other strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-1])


def tma_possible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the TMA kernel can run this product (any TMA config)."""
    if a.element_size() != 2 or not tma_api_available() or not _tma_supported(a.device):
        return False
    b_nk = b.t()  # [N, K]: K-major weight, or [K, N] row-major b
    return _aligned(a) and _aligned(out) and (_aligned(b_nk) or _aligned(b))


def describe_launch(m: int, n: int, k: int, dtype: torch.dtype, mode: str | None = None) -> dict[str, object]:
    """The launch ``matmul`` makes for ``[m, k] @ [k, n]`` (for benchmarks and logs), assuming
    contiguous, 16-byte aligned operands on an H100."""
    cfg = config_for(m, n, k, dtype, mode)
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    return {
        **dataclasses.asdict(cfg),
        "mode": mode or MODE,
        "weight_class": weight_class(n),
        "kernel": "tma_persistent" if cfg.tma and dtype != torch.float32 else "pointer",
        "tiles": tiles,
    }


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
) -> None:
    """Out-variant: fills ``out [M, N]`` (any strides) with ``a [M, K] @ b [K, N] (+ bias [N])``.

    ``config`` overrides the table for tests and tuning only: a row's bits may depend on it, so
    production calls leave it None."""
    m, k = a.shape
    k2, n = b.shape
    assert k == k2 and out.shape == (m, n), (a.shape, b.shape, out.shape)
    assert a.dtype == b.dtype and a.dtype in TUNED, (a.dtype, b.dtype)
    if m == 0 or n == 0:
        return
    if k == 0:
        out.copy_(bias.expand(m, n) if bias is not None else torch.zeros((), dtype=out.dtype))
        return
    # The table is asked first as if TMA could run (no operand checks: decode-sized calls never
    # get a TMA config); only a TMA pick pays for the alignment checks, and if TMA cannot address
    # these operands the table's pointer choice for the cell runs instead.
    cfg = config or config_for(m, n, k, a.dtype, mode_for(a.device))
    tma = cfg.tma and tma_possible(a, b, out)
    if cfg.tma and not tma and config is None:
        cfg = config_for(m, n, k, a.dtype, mode_for(a.device), tma=False)
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
                _tma_failed.add(cfg.name)
            _matmul(a, b, out, bias=bias)
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


# config_for results per (shape, dtype, device, table state): a decode step asks for the same few
# shapes ~30 times. The table state (MODE, the class thresholds, failed TMA configs) is part of the
# key, so a switch of any of them is seen at once; an in-place edit of TUNED is not.
_config_memo: dict[tuple, MatmulConfig] = {}


def _config_cached(m: int, n: int, k: int, x: torch.Tensor) -> MatmulConfig:
    key = (m, n, k, x.dtype, x.get_device(), MODE, NARROW_N, VOCAB_N, MIN_TILES, MIN_TILES_TMA,
           len(_tma_failed), _tma_api)  # fmt: skip
    cfg = _config_memo.get(key)
    if cfg is None:
        if len(_config_memo) >= 4096:  # training with many distinct M: start over
            _config_memo.clear()
        cfg = _config_memo[key] = config_for(m, n, k, x.dtype, mode_for(x.device))
    return cfg


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias [N])`` as a new ``[..., N]`` tensor in x's dtype: the
    forward of ``rlkernel.invariant.linear`` with the fewest host operations for decode-sized calls
    (no reshape or transpose views: the kernel reads ``weight``'s strides as the K-major ``b``, and
    a contiguous ``x`` is read as ``[M, K]`` rows). Same configuration table, same bits as
    ``matmul(x.reshape(M, K), weight.t(), bias=bias)``. Inputs are validated by the caller."""
    k = x.shape[-1]
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if x.dim() == 2:
        (sa0, sa1), m = x.stride(), x.shape[0]
    elif x.is_contiguous():
        sa0, sa1, m = k, 1, x.numel() // k if k else 0
    else:
        sa0 = None
    if sa0 is None or m == 0 or n == 0 or k == 0:
        # Rows by count, not -1: with K = 0 or N = 0 an empty tensor's row count is ambiguous.
        m = x.shape[:-1].numel()
        _matmul(x.reshape(m, k), weight.t(), out.view(m, n), bias=bias)
        return out
    cfg = _config_cached(m, n, k, x)
    if cfg.tma:  # prefill-sized: the general launcher (TMA descriptors, alignment checks)
        _matmul(x.reshape(m, k), weight.t(), out.view(m, n), bias=bias)
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
) -> torch.Tensor:
    """Allocating: ``a [M, K] @ b [K, N] (+ bias [N])`` as a new contiguous ``[M, N]`` tensor in
    ``a``'s dtype. Operands may have any strides (``b = weight.t()`` for ``linear``)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    _matmul(a, b, out, bias=bias, config=config)
    return out
