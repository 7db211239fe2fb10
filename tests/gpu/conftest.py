"""Shared setup of the real-size GPU tests (``tests/gpu``, every test marked ``gpu``).

These tests check at the sizes users run (V = 151,936, H = 4096, N = 8192 ...) what the CPU suite
checks at tiny sizes in the interpreter: accuracy against the fp32 references, bitwise batch
invariance, bitwise determinism, the fused paths against the composed ones. They need a CUDA device
and skip cleanly without one.

Without a GPU the sizes are ``SMOKE_SIZES`` (tiny, Triton interpreter). The few tests marked
``cpu_smoke`` (cheap ones, one or two per module) run there in the CPU suite, so that the test code
keeps working while nobody runs it on a GPU (a few seconds in all); ``RLKERNEL_GPU_SMOKE=1`` runs
every test that way, a dry run of the whole GPU suite (~2 minutes on 2 cores). Tests whose point is
the size itself (more than 65,535 rows, more than 2^31 elements, peak memory, kernel launch counts,
``torch.compile``) skip on the CPU (:data:`real_size_only`).

Shared here: :data:`SIZES` (the sizes of this run, per test module; a constant, because
``parametrize`` reads it at collection), :func:`generator` (seeded, on the device, for
module-scoped inputs), :func:`rel_err`, :func:`no_tf32`, and the fixtures

    device     the CUDA device (or the CPU)
    randn      seeded normal values on the device (never zeros), any float dtype
    randint    seeded integers on the device

Every test runs with the Triton backend forced (``rk.use_backend("triton")``) and frees the CUDA
cache after itself (the tests allocate several GB each).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import rlkernel as rk

ON_GPU = torch.cuda.is_available()
SMOKE = not ON_GPU  # tiny sizes in the interpreter
RUN_ALL = ON_GPU or os.environ.get("RLKERNEL_GPU_SMOKE", "0") not in ("", "0")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

real_size_only = pytest.mark.skipif(SMOKE, reason="only meaningful at real size on a GPU")


def pytest_collection_modifyitems(config, items):
    """Without CUDA (and without ``RLKERNEL_GPU_SMOKE=1``) skip every test of this folder but the
    ``cpu_smoke`` ones. A skip mark, not a fixture: module-scoped inputs are never built for them."""
    if RUN_ALL:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="needs a CUDA device (RLKERNEL_GPU_SMOKE=1 runs it tiny on the CPU)")
    for item in items:
        if here in item.path.parents and item.get_closest_marker("cpu_smoke") is None:
            item.add_marker(skip)


@dataclass(frozen=True)
class LogprobSizes:
    """``tests/gpu/test_logprobs.py``: token_logprobs on bf16 logits ``[n, V]``."""

    n: int  # rows of the main checks
    vocabs: tuple[int, ...]  # (Qwen3, Llama-2-sized)
    ref_rows: int  # rows compared with the fp32 reference at each end of the batch
    strided: tuple[int, int, int]  # [B, T+1, V] of the logits[:, :-1] check
    invariance_n: tuple[int, ...]  # batch sizes compared with the full batch
    invariance_starts: tuple[int, ...]  # offsets of those batches (plus n - size)
    layout_n: int  # rows of the launch-configuration check
    other_dtypes_n: int  # rows of the fp16 / fp32 check


@dataclass(frozen=True)
class LossSizes:
    """``tests/gpu/test_loss.py``: fused_policy_loss(logits=...) on ``[B, T, V]`` bf16 logits."""

    batch: int
    seq_len: int
    vocabs: tuple[int, ...]


@dataclass(frozen=True)
class LinearSizes:
    """``tests/gpu/test_linear.py``: the chunked linear path from bf16 hidden ``[n, H]``."""

    n: int
    hidden: int
    vocab: int
    large_n: int  # n·V > 2^31 at real size
    large_rows: int  # rows compared at each end of the large batch
    invariance_n: tuple[int, ...]  # the first is the compared prefix
    seq_len: int  # T of the [B, T] loss inputs
    chunk_bytes: int | None  # linear_chunk_bytes / linear_grad_bytes options (None: the defaults)


@dataclass(frozen=True)
class InvariantOpsSizes:
    """``tests/gpu/test_invariant_ops.py``: the invariant GEMM and RMSNorm."""

    k: int
    n: int
    m_full: int
    offset: int
    ms: tuple[int, ...]  # row counts compared with the full product (bucket edges)
    big_m: int  # the public linear's rows-across-M check
    class_m: dict[str, int]  # M of the class check per dtype name
    class_configs: int | None  # check the first this many table configs (None: all of them)
    k_tail: tuple[int, int]  # (K, N) of the K-tail class check
    shapes: dict[str, tuple[int, int]]  # layer name -> (K, N)
    layer_ms: tuple[int, ...]  # M compared with the last one at every layer shape
    accuracy_m: int
    rms_m: int
    qk_heads: tuple[int, int]  # (heads, head_dim) of the QK-norm check
    thresholds: rk.MatmulThresholds | None  # smoke: every weight class and cell at tiny sizes


@dataclass(frozen=True)
class AttentionSizes:
    """``tests/gpu/test_attention.py``: invariant attention, ``[B, T, H, D]``."""

    dtype: torch.dtype
    head_dim: int
    heads: tuple[tuple[int, int], ...]  # (Hq, Hkv)
    n_seq: int
    max_len: int
    decode_positions: tuple[int, ...]
    adapter_lens: tuple[int, ...]
    tile_len: int
    accuracy: tuple[int, int]  # (B, T)
    backward: tuple[int, int]
    long_len: int  # tests/gpu/test_attention_long.py: the longest sequence (a multiple of the split)
    long_n_seq: int  # its batch
    long_split: int | None  # option attention_split_keys there (None: the default, 2048)


@dataclass(frozen=True)
class Sizes:
    logprobs: LogprobSizes
    loss: LossSizes
    linear: LinearSizes
    invariant_ops: InvariantOpsSizes
    attention: AttentionSizes


def _qwen3_8b_shapes() -> dict[str, tuple[int, int]]:
    from rlkernel.bench.invariant import GEMM_SHAPES

    return {f"{name.removesuffix('_proj')} {k}->{n}": (k, n) for n, k, name in GEMM_SHAPES}


GPU_SIZES = Sizes(
    logprobs=LogprobSizes(
        n=8192,
        vocabs=(151936, 32768),
        ref_rows=1024,
        strided=(8, 513, 151936),
        invariance_n=(1, 7, 64),
        invariance_starts=(0, 1000),
        layout_n=1024,
        other_dtypes_n=256,
    ),
    loss=LossSizes(batch=8, seq_len=1024, vocabs=(151936, 32768)),
    linear=LinearSizes(
        n=8192,
        hidden=4096,
        vocab=151936,
        large_n=16384,
        large_rows=256,
        invariance_n=(100, 4096, 16384),
        seq_len=1024,
        chunk_bytes=None,
    ),
    invariant_ops=InvariantOpsSizes(
        k=4096,
        n=4096,
        m_full=8192,
        offset=37,
        ms=(1, 2, 8, 16, 17, 32, 33, 64, 65, 1000, 1024, 1025, 8192),
        big_m=100_000,
        class_m={"bfloat16": 8192, "float16": 2048, "float32": 1024},
        class_configs=None,
        k_tail=(4072, 1000),
        shapes=_qwen3_8b_shapes(),
        layer_ms=(1, 8, 32, 64, 256, 2048, 8192),
        accuracy_m=2048,
        rms_m=8192,
        qk_heads=(32, 128),
        thresholds=None,
    ),
    attention=AttentionSizes(
        dtype=torch.bfloat16,
        head_dim=128,
        heads=((32, 8), (16, 8)),
        n_seq=32,
        max_len=2600,
        decode_positions=(0, 63, 64, 1023, 1024, 2047, 2048, 2049),
        adapter_lens=(300, 1200, 777, 1024, 2600),
        tile_len=1500,
        accuracy=(4, 2048),
        backward=(2, 2048),
        long_len=32768,
        long_n_seq=32,
        long_split=None,
    ),
)

SMOKE_SIZES = Sizes(
    logprobs=LogprobSizes(
        n=64,
        vocabs=(101, 37),
        ref_rows=16,
        strided=(2, 9, 101),
        invariance_n=(1, 7),
        invariance_starts=(0, 20),
        layout_n=8,
        other_dtypes_n=8,
    ),
    loss=LossSizes(batch=4, seq_len=16, vocabs=(101, 37)),
    linear=LinearSizes(
        n=64,
        hidden=16,
        vocab=100,
        large_n=96,
        large_rows=8,
        invariance_n=(5, 32, 96),
        seq_len=16,
        chunk_bytes=16 * 100 * 4,  # 16-row chunks: the real budgets pad every call to 4096 rows
    ),
    invariant_ops=InvariantOpsSizes(
        k=64,
        n=48,
        m_full=80,
        offset=5,
        ms=(1, 17),
        big_m=80,
        class_m={"bfloat16": 80, "float16": 40, "float32": 40},
        class_configs=3,  # the interpreter takes seconds per launch of a 128x256 tile
        k_tail=(40, 24),
        shapes={"q/o": (64, 64), "k/v": (64, 16), "lm_head": (32, 240)},
        layer_ms=(1, 17, 80),
        accuracy_m=16,
        rms_m=64,
        qk_heads=(4, 16),
        thresholds=rk.MatmulThresholds(narrow_n=16, vocab_n=200, min_tiles=1, min_tiles_tma=1),
    ),
    attention=AttentionSizes(
        dtype=torch.float32,
        head_dim=16,
        heads=((4, 2),),
        n_seq=3,
        max_len=40,
        decode_positions=(0, 15, 16),
        adapter_lens=(12, 30, 21),
        tile_len=40,
        accuracy=(2, 24),
        backward=(2, 24),
        long_len=96,
        long_n_seq=6,
        long_split=32,  # two interpreter key blocks
    ),
)

SIZES = SMOKE_SIZES if SMOKE else GPU_SIZES


@pytest.fixture(autouse=True)
def _triton_backend_and_cleanup():
    """Run with the Triton backend; free the CUDA cache after the test."""
    with rk.use_backend("triton"):
        yield
    gc.collect()
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def generator(seed: int) -> torch.Generator:
    """A generator on the test device, seeded (for module-scoped inputs; tests use the fixtures)."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


@pytest.fixture
def randn():
    """``randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0)``: ``scale·N(0, 1)`` values drawn
    on the device in ``dtype`` itself (no fp32 temporary of a multi-GB tensor)."""

    def make(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 1.0):
        out = torch.randn(*shape, device=DEVICE, dtype=dtype, generator=generator(seed))
        return out.mul_(scale) if scale != 1.0 else out

    return make


@pytest.fixture
def randint():
    """``randint(high, *shape, seed=0)``: int64 values uniform in ``[0, high)`` on the device."""

    def make(high: int, *shape: int, seed: int = 0):
        return torch.randint(0, high, shape, device=DEVICE, generator=generator(seed))

    return make


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` in float64 (DESIGN's measure for matmul-bearing ops)."""
    a, e = actual.double(), expected.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """fp32 GEMMs in true fp32 inside the block (an fp32 reference or baseline computed with TF32
    would be a 1e-3 one); the flag is restored after."""
    flags = torch.backends.cuda.matmul
    saved = flags.allow_tf32
    flags.allow_tf32 = False
    try:
        yield
    finally:
        flags.allow_tf32 = saved
