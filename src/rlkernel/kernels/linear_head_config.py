"""The launch configuration of the LM-head kernels (``kernels/linear_head.py``): one
:class:`LinearHeadConfig` per operand dtype (``default_config``), never a function of M, so that a
row's bits do not depend on the batch."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LinearHeadConfig:
    """Launch configuration of both GEMM kernels (and the combine's rows per program). A row's bits
    depend on ``block_n`` (the partials' tiling) and ``block_k``/the MMA kind (the GEMM's order);
    never on M. ``flatten``/``warp_specialize``: ``tl.range`` options of the persistent tile loop.
    ``tma_store``/``store_bytes``: how an output tile (``store_z``, the gradient) is stored
    (``kernels/_linear_head_tiles.py``); ``combine_rows`` × ``combine_tiles``: the combine kernel's
    block (rows per program × column tiles per step)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False
    warp_specialize: bool = False
    tma_store: bool = True
    store_bytes: int = 65536
    # The combine kernel's block: rows per program × column tiles per loop step. Its two loops
    # over the tiles are latency bound (a row-at-a-time fold of 32 rows per program took 0.14 ms
    # at M = 2048, V = 151,936 on the H100 for ~15 MB of partials), so each step reads a
    # [combine_tiles, combine_rows] block and many programs run: 128 at M = 2048.
    combine_rows: int = 16
    combine_tiles: int = 64
    name: str = ""

    def __post_init__(self) -> None:
        powers_of_two = ("block_m", "block_n", "block_k", "group_m", "num_warps", "combine_rows",
                         "combine_tiles", "store_bytes")  # fmt: skip
        for field in powers_of_two:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"config.{field} must be a power of two, got {value!r}")
        if self.block_k < 16 or self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"config blocks must be >= 16 (tl.dot), got {self}")

    def store_split(self, itemsize: int) -> int:
        """Column slices (1, 2 or 4) of a TMA-stored output tile with ``itemsize``-byte elements."""
        return min(4, max(1, self.block_m * self.block_n * itemsize // self.store_bytes))


# The matmul table's M = 8192 vocab cell (``prefill_tma_ws``: 128x256x64, GROUP_M 8, 8 warps, 3
# stages) without warp specialization (Triton 3.9 builds the same sm_90 PTX with or without it
# for these kernels; scripts/bench_linear_head_kernel.py times both on the GPU's Triton); fp32:
# the table's fp32 tile (IEEE FMA, no tensor cores: small tiles).
_DEFAULTS = {
    torch.bfloat16: LinearHeadConfig(name="bf16_128x256x64"),
    torch.float16: LinearHeadConfig(name="fp16_128x256x64"),
    torch.float32: LinearHeadConfig(64, 64, 32, 8, 4, 2, name="fp32_64x64x32"),
}


def default_config(dtype: torch.dtype) -> LinearHeadConfig:
    """The configuration for operands of ``dtype``: a function of the dtype alone (row invariance)."""
    return _DEFAULTS[dtype]
