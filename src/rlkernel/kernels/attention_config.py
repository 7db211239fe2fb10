"""The batch-invariant attention forward's launch configuration: one per (head_dim, dtype).

The configuration sets the order of every sum of a row (BLOCK_N is part of the formula; see
``rlkernel.kernels.attention``'s module header), so it depends on (head_dim, dtype) only, never on
the batch, the sequence lengths or the number of queries. Decode tiles (``DECODE_TILES``) are
allowed only once proven bitwise equal to the prefill tile on the target GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from rlkernel._dispatch import interpreter_enabled
from rlkernel.kernels._attention_common import _block_d

# Whether the kernels run in the CPU interpreter: fixed when they are decorated (Triton reads
# TRITON_INTERPRET then), so read once here rather than from the environment on every launch.
_INTERPRET = interpreter_enabled()


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Forward launch configuration. It sets the order of every sum of a row, so it must depend on
    (head_dim, dtype) only, never on the batch, the sequence lengths or the number of queries."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def fwd_config(head_dim: int, dtype: torch.dtype) -> FwdConfig:
    """The one forward configuration for (head_dim, dtype). BLOCK_N = 64 matches the reference's
    key blocks. Chosen for the H100 (D ≤ 128, 16-bit: BLOCK_M = 64 at 4 warps, measured fastest and
    bitwise equal to 128 at 8 warps; fp16 has no decode tiles, so any fixed tile is invariant)."""
    return _fwd_config(_block_d(head_dim), dtype, _INTERPRET)


@functools.lru_cache(maxsize=64)
def _fwd_config(d: int, dtype: torch.dtype, interpret: bool) -> FwdConfig:
    # Cached: a pure function of its arguments (saves host time per call).
    if interpret:  # the CPU interpreter: small tiles run faster; still fixed per mode
        return FwdConfig(16, 16, 1, 1)
    if dtype == torch.float32:
        return FwdConfig(64, 32 if d > 64 else 64, 4, 2)
    if d <= 64:
        return FwdConfig(128, 64, 4, 3)
    if d <= 128:
        # BM = 64 / 4 warps: bitwise equal to the former BM = 128 / 8 warps on an H100 (bf16) and
        # 0.864 vs 1.080 ms at B=8 T=2048 (SDPA 0.927), gpu_check_attention_h100_2026-11-21_final.log.
        return FwdConfig(64, 64, 4, 3)
    return FwdConfig(64, 32, 4, 2)


# Decode-only tiles: (block_d, dtype) -> (block_m, num_warps) for calls whose rows fit one such tile
# (seqlen_q·G ≤ block_m). EMPTY on purpose. (128, bf16) -> (16, 4) passed the short "decode BLOCK_M
# alternatives" comparison on an H100 but FAILED the full check on 2026-11-21 ("decode tile ==
# prefill tile": lse and outputs differ at positions 63, 64, 750, 1498, 1499;
# gpu_check_attention_h100_2026-11-21_decode_tile.log): with BLOCK_M = 16 the dots lower to mma.sync
# instead of the wgmma of the >= 64-row prefill tile, and the two accumulate differently for some
# inputs. A tile is allowed here only if the full check passes on the target GPU.
DECODE_TILES: dict[tuple[int, torch.dtype], tuple[int, int]] = {}


def launch_config(head_dim: int, dtype: torch.dtype, rows_per_seq: int) -> FwdConfig:
    """``fwd_config``, or a verified decode tile (``DECODE_TILES``) when every sequence's rows fit it."""
    cfg = fwd_config(head_dim, dtype)
    tile = DECODE_TILES.get((_block_d(head_dim), dtype))
    if tile is not None and rows_per_seq <= tile[0]:
        return FwdConfig(tile[0], cfg.block_n, tile[1], cfg.num_stages)
    return cfg


# ------------------------------------------------------------------------------------- kernels
