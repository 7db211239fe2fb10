"""The batch-invariant GEMM's launch configurations: the candidates, the measured table and the
choice of a configuration per call (no kernels here; :mod:`rlkernel.kernels.matmul` launches them).

The default table ``"tuned"`` picks the configuration per call from ``TUNED`` by (dtype, M's
bucket, N's weight class, grid size): the fastest candidate per shape measured on an H100
(``docs/api/invariant_linear.md``). It stays invariant across M because every configuration in a
dtype's table is in ONE measured class of mutually bitwise-equal configurations: the same k16 steps
in the same order, sequential K loop, no split-K; tile shape, BLOCK_K (64/128/256: a K tail is
zero-filled up to the tile, and the extra all-zero k16 steps add exact zeros), warps, stages,
program order (GROUP_M), TMA or pointer loads, persistent or not change no bit (H100, triton 3.6,
2026-11-21, K = N = 4096: bf16 13 configs, fp16 7, fp32 2, each one class; 33 more 16-row decode
tiles with BLOCK_K 64-256 and GROUP_M = 8, bf16 and fp16, also at K = 4072, N = 1000: the same
class per dtype). That equality is a property of the tensor-core datapath and the compiler, not of
this code, so the GPU tests (``tests/gpu``) re-verify on every run that ``table_configs(dtype)``
is one class (and that the public ``linear`` is invariant from M = 1 to 100,000): a GPU or Triton
version that breaks the class fails there. Until a GPU model
has been checked, the tuned table is not used on it (``TUNED_CAPABILITIES``): ``"single"``
(one configuration per dtype for every M, safe by construction) runs instead, and stays available
as the conservative option ``matmul_table="single"``.

The table's switches are options (``rlkernel.Options``), passed in by the caller:
``table`` (``"tuned"`` | ``"single"``, the option ``matmul_table``) and ``thresholds``
(:class:`rlkernel._options.MatmulThresholds`, the option ``matmul_thresholds``: where the weight
classes and the tile-count rules switch cells; speed only).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import triton.language as tl

from rlkernel._options import DEFAULTS, MatmulThresholds
from rlkernel.kernels._launch import cdiv as _cdiv

DEFAULT_THRESHOLDS = DEFAULTS.matmul_thresholds

# ------------------------------------------------------------------------------------ configuration
@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Launch configuration. ``block_k`` and the dot's instruction kind fix a row's bits; the other
    fields are free only where the GPU check shows that they change no bit. ``flatten`` and
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
# fp16's and at a K-tail shape (the GPU script checks every table's class on every run).
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

# GPU models (compute capability) on which the GPU script showed every table to be one class; on
# others "tuned" runs as "single". (9, 0): H100 (and H200, the same SM).
TUNED_CAPABILITIES = {(9, 0)}

_C16, _C32 = CANDIDATES_16, CANDIDATES_32
SINGLE = {torch.bfloat16: _C16["prefill"], torch.float16: _C16["prefill"], torch.float32: _C32["fp32"]}

# Weight classes (by N alone: the weight fixes it, never the batch): "narrow" (N <= narrow_n: GQA
# k/v projections, few column tiles), "vocab" (N >= vocab_n: LM heads), "wide" (the rest: q/o, MLP).
# In a table cell, the first configuration whose grid has at least min_tiles tiles (min_tiles_tma
# for the persistent TMA kernel, which needs several tiles per SM; H100: 132 SMs) and that can run
# is used, else the cell's last one (always a pointer configuration). The numbers are the option
# ``matmul_thresholds`` (rlkernel._options.MatmulThresholds).


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


def weight_class(n: int, thresholds: MatmulThresholds = DEFAULT_THRESHOLDS) -> str:
    """``"narrow"``, ``"wide"`` or ``"vocab"``: the column of ``TUNED`` for a weight with N outputs."""
    return "narrow" if n <= thresholds.narrow_n else "vocab" if n >= thresholds.vocab_n else "wide"


# Facts about this process's Triton and GPU, found once (not switches):
tma_api: bool | None = None  # whether this Triton has the TMA API (tma_api_available)
tma_failed: set[str] = set()  # TMA configs whose compilation failed here: skipped from then on


def tma_api_available() -> bool:
    """Whether this Triton has what the TMA kernel uses: host tensor descriptors and the
    ``flatten``/``warp_specialize`` options of ``tl.range`` (triton >= 3.4-ish)."""
    global tma_api
    if tma_api is None:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

            params = inspect.signature(tl.range).parameters
            tma_api = "flatten" in params and "warp_specialize" in params
        except (ImportError, TypeError, ValueError):
            tma_api = False
    return tma_api


def config_for(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    table: str = "tuned",
    thresholds: MatmulThresholds = DEFAULT_THRESHOLDS,
    *,
    tma: bool | None = None,
) -> MatmulConfig:
    """The configuration for an ``[m, k] @ [k, n]`` product. ``table="single"``: from the dtype
    alone; ``"tuned"``: from the dtype, M's bucket, N's weight class and the grid size (every
    candidate of a dtype's table gives the same bits, so the choice may depend on M). ``tma``:
    whether the TMA kernel can run (default: this Triton has the API; assumes aligned operands on
    Hopper). Pass ``table_for(device, table)`` for a device (unverified GPUs run "single")."""
    del k  # the measured table did not need it
    if table == "single":
        return SINGLE[dtype]
    if tma is None:
        tma = tma_api_available()
    buckets = TUNED[dtype]
    configs = next(cells for max_m, cells in buckets if m <= max_m)[weight_class(n, thresholds)]
    for cfg in configs[:-1]:
        if cfg.tma and (not tma or cfg.name in tma_failed):
            continue
        tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
        if tiles >= (thresholds.min_tiles_tma if cfg.tma else thresholds.min_tiles):
            return cfg
    return configs[-1]


def table_configs(dtype: torch.dtype, table: str = "tuned") -> list[MatmulConfig]:
    """Every config ``config_for`` can return for ``dtype`` with ``table``: for batch invariance
    they must all give the same bits (what the GPU tests check)."""
    if table == "single":
        return [SINGLE[dtype]]
    found = [cfg for _, cells in TUNED[dtype] for cfgs in cells.values() for cfg in cfgs]
    return list(dict.fromkeys(found))  # unique, in table order


_capability: dict[int, tuple[int, int]] = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device`` (cached per device index)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _capability:
        _capability[idx] = torch.cuda.get_device_capability(idx)
    return _capability[idx]


def table_for(device: torch.device, table: str) -> str:
    """``table``, except ``"single"`` for "tuned" on a GPU model not in ``TUNED_CAPABILITIES``. The
    CPU interpreter runs the table (the tests check it there)."""
    if table == "tuned" and device.type == "cuda" and device_capability(device) not in TUNED_CAPABILITIES:
        return "single"
    return table


def describe_launch(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    table: str = "tuned",
    thresholds: MatmulThresholds = DEFAULT_THRESHOLDS,
) -> dict[str, object]:
    """The launch ``matmul`` makes for ``[m, k] @ [k, n]`` (for benchmarks and logs), assuming
    contiguous, 16-byte aligned operands on an H100."""
    cfg = config_for(m, n, k, dtype, table, thresholds)
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    return {
        **dataclasses.asdict(cfg),
        "table": table,
        "weight_class": weight_class(n, thresholds),
        "kernel": "tma_persistent" if cfg.tma and dtype != torch.float32 else "pointer",
        "tiles": tiles,
    }
