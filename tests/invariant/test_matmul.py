"""Batch-invariant ``matmul``/``linear``: invariance across M (torch.equal on row slices, padding,
offsets), accuracy against fp64, deterministic backward, the config table, bad input.

Kernels run on CUDA when present, else in the CPU interpreter (``TRITON_INTERPRET=1`` from the root
conftest) at tiny sizes. Each test picks its backend with ``RLKERNEL_BACKEND`` via monkeypatch.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.invariant.matmul import _linear_op, _mm_op, linear, matmul
from rlkernel.kernels import matmul as km
from rlkernel.kernels import matmul_table as mt
from rlkernel.reference import matmul as ref

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")

# ||out - exact|| / ||exact|| (DESIGN.md, numerical contract)
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["triton", "reference"]
# Small tiles so that the interpreter runs several programs (and the persistent loop several tiles).
SMALL = mt.MatmulConfig(16, 32, 16, 2, 4, 2, name="small")
SMALL_TMA = mt.MatmulConfig(16, 32, 16, 2, 4, 2, tma=True, name="small_tma")


def _rel(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    return x, w, b


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", request.param)
    return request.param


# ------------------------------------------------------------------------------------ invariance
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_bitwise_independent_of_batch(backend, dtype):
    x, w, b = _inputs(67, 72, 40, dtype)  # K = 72: not a multiple of BLOCK_K (masked K tail)
    full = linear(x, w, b)
    for m in (1, 3, 8, 37, 64, 65):
        assert torch.equal(linear(x[:m], w, b), full[:m]), m
        assert torch.equal(linear(x[2 : 2 + m], w, b), full[2 : 2 + m]), m  # offset slice
    padded = torch.cat([x[:5], torch.zeros(11, 72, dtype=dtype, device=DEVICE)])
    assert torch.equal(linear(padded, w, b)[:5], full[:5])
    batched = linear(x[:60].reshape(3, 20, 72), w, b)  # leading dims fold into rows
    assert torch.equal(batched.reshape(60, 40), full[:60])


def test_reference_rows_invariant_up_to_512(monkeypatch):
    """The CPU path must be invariant too (``rlkernel consistency`` runs on CPU): M = 1, 37, 512."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "reference")
    x, w, _ = _inputs(512, 64, 48, torch.float32, seed=1)
    x, w = x.cpu(), w.cpu()
    full = linear(x, w)
    for m in (1, 37, 512):
        assert torch.equal(linear(x[:m], w), full[:m])
    assert torch.equal(linear(x[400:401], w), full[400:401])


@pytest.mark.parametrize("cfg", [SMALL, SMALL_TMA], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_config_invariant_across_m(cfg, dtype):
    """One config: rows equal for every M, with several tiles and programs (pointer and TMA)."""
    x, w, b = _inputs(70, 48, 72, dtype, seed=2)
    full = km.matmul(x, w.t(), bias=b, config=cfg)
    for m in (1, 17, 33):
        assert torch.equal(km.matmul(x[5 : 5 + m], w.t(), bias=b, config=cfg), full[5 : 5 + m])
    # b as a row-major [K, N] matrix (the other TMA descriptor) gives the same numbers
    assert torch.equal(km.matmul(x, w.t().contiguous(), bias=b, config=cfg), full)


# Configs that the H100 runs (benchmarks/results/gpu_check_invariant_ops_h100_2026-11-21.log, and
# _tuned.log for mma16_n32/mma16_n16 in bf16) found mutually bitwise equal, per dtype: the only ones
# a dtype's tuned table may use.
VERIFIED_CLASS = {
    torch.bfloat16: {
        "prefill", "prefill_tma", "prefill_tma_flat", "prefill_tma_ws", "prefill_256x128", "mid", "mid_tma",
        "decode", "decode_tma", "decode_n32", "decode_n16", "decode_k128", "mma16", "mma16_n32", "mma16_n16",
        # 2026-11-21 decode sweep (gpu_decode_gemm_sweep_h100_2026-11-21.log): BLOCK_K 64-256, GROUP_M 8
        "dec_n16_k256", "dec_n32_k256", "dec_n64_k128_s8", "dec_n64_k128_s4", "dec_n64_k64_s12",
    },
    torch.float16: {
        "prefill", "prefill_tma", "mid", "decode", "decode_tma", "decode_n32", "decode_n16",
        # the decode sweep in fp16 (gpu_decode_gemm_sweep_fp16_h100_2026-11-22.log) and the GPU check
        # of bf16's table in fp16 (gpu_check_invariant_ops_h100_2026-11-22_fp16.log and later runs)
        "dec_n16_k256", "dec_n32_k256", "dec_n64_k128_s8", "dec_n64_k128_s4", "dec_n64_k64_s12",
        "prefill_256x128", "prefill_tma_flat", "prefill_tma_ws",
    },
    torch.float32: {"fp32", "fp32_decode"},
}  # fmt: skip
NK = ((1024, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096), (24, 72))  # Qwen3-8B, tiny
SHAPES_MNK = [(m, n, k) for m in (1, 8, 16, 17, 64, 65, 1000, 1024, 1025, 8192, 10**5) for n, k in NK]


def test_single_table_ignores_m():
    for dtype in DTYPES:
        assert {mt.config_for(m, n, k, dtype, "single") for m, n, k in SHAPES_MNK} == {mt.SINGLE[dtype]}
        assert mt.table_configs(dtype, "single") == [mt.SINGLE[dtype]]
        assert mt.SINGLE[dtype].name in VERIFIED_CLASS[dtype]


def test_matmul_table_option_reaches_the_kernel_launch(monkeypatch):
    """``rk.use_options(matmul_table=...)`` decides the launch of the public ``linear`` (forward and
    backward): "single" runs ``SINGLE``'s configuration wherever the tuned table picks another."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    seen = []
    real = km._pointer_gemm

    def spy(*args):
        seen.append(args[-1].name)
        return real(*args)

    monkeypatch.setattr(km, "_pointer_gemm", spy)  # seam: a spy on the launch, not a setting
    x, w, b = (t.requires_grad_() for t in _inputs(3, 72, 40, torch.float32, seed=5))
    for table, expected in (("tuned", "fp32_decode"), ("single", "fp32")):
        seen.clear()
        with rk.use_options(matmul_table=table):
            out = linear(x, w, b)
        out.sum().backward()  # the backward uses the forward's options, outside the block
        assert seen == [expected] * 3, (table, seen)  # forward, dx, dweight: all M <= 64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tuned_table_uses_only_the_verified_class(dtype):
    table = mt.table_configs(dtype, "tuned")
    assert {c.name for c in table} <= VERIFIED_CLASS[dtype]
    if dtype != torch.float32:  # k16 tensor-core steps: BLOCK_K a multiple of 64 (fp32: 32, FMA)
        assert all(c.block_k in (64, 128, 256) for c in table)
    for max_m, cells in mt.TUNED[dtype]:
        assert set(cells) == {"narrow", "wide", "vocab"}
        assert all(not cfgs[-1].tma for cfgs in cells.values()), max_m  # a pointer config to fall to
    assert mt.TUNED[dtype][-1][0] == float("inf")
    for tma in (True, False):
        for m, n, k in SHAPES_MNK:
            cfg = mt.config_for(m, n, k, dtype, "tuned", tma=tma)
            assert cfg in table and (tma or not cfg.tma), (m, n, k)


def test_tuned_table_choices_follow_the_h100_measurements():
    """The picks the logs support (bf16): 16-row tiles with deep K stages for decode (the decode
    sweep's fastest per M bucket and weight class; the LM head at M = 33-64 on the 64-row wgmma
    tile), 128x256 TMA for big prefill."""
    bf16 = torch.bfloat16

    def pick(m, n, k=4096, tma=True):
        return mt.config_for(m, n, k, bf16, "tuned", tma=tma).name

    decode = {  # M: (narrow, wide, vocab)
        1: ("dec_n32_k256", "dec_n64_k128_s8", "dec_n64_k128_s8"),
        8: ("dec_n16_k256", "dec_n32_k256", "dec_n64_k128_s8"),
        16: ("dec_n16_k256", "dec_n32_k256", "dec_n64_k128_s8"),
        17: ("dec_n16_k256", "dec_n32_k256", "dec_n64_k64_s12"),
        32: ("dec_n16_k256", "dec_n32_k256", "dec_n64_k64_s12"),
        33: ("dec_n16_k256", "dec_n64_k128_s4", "decode_n32"),
        64: ("dec_n16_k256", "dec_n64_k128_s4", "decode_n32"),
    }
    for m, names in decode.items():
        assert tuple(pick(m, n) for n in (1024, 12288, 151936)) == names, m
        assert pick(m, 4096) == names[1], m
    assert [pick(8192, n) for n in (1024, 4096, 12288)] == ["prefill_256x128"] + ["prefill_tma_flat"] * 2
    assert pick(8192, 151936) == "prefill_tma_ws"
    assert pick(8192, 4096, tma=False) == "prefill_256x128"  # no TMA: the bucket's pointer config
    assert mt.weight_class(1024) == "narrow" and mt.weight_class(151936) == "vocab"
    info = mt.describe_launch(8192, 4096, 4096, bf16)
    assert {"block_m", "block_n", "block_k", "kernel", "tiles", "table", "weight_class"} <= set(info)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("cls", ["narrow", "wide", "vocab"])
def test_tuned_linear_invariant_across_bucket_edges(monkeypatch, cls, dtype):
    """The public linear with the tuned table, M = 1 ... 1100 across every bucket edge (16/17,
    64/65, 1024/1025), each weight class, every config of the cell (tile thresholds off: the first
    config, TMA ones included, runs wherever it fits)."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    narrow_n, vocab_n = {"narrow": (10**6, 10**7), "wide": (8, 10**7), "vocab": (8, 16)}[cls]
    th = rk.MatmulThresholds(narrow_n=narrow_n, vocab_n=vocab_n, min_tiles=1, min_tiles_tma=1)
    x, w, b = _inputs(1100, 72, 40, dtype, seed=12)  # K = 72: a masked / zero-filled K tail
    with rk.use_options(matmul_table="tuned", matmul_thresholds=th):
        full = linear(x, w, b)
        used = set()
        for m in (1, 3, 16, 17, 64, 65, 1024, 1025):
            for start in {0, 1100 - m}:
                used.add(mt.config_for(m, 40, 72, dtype, "tuned", th).name)
                assert torch.equal(linear(x[start : start + m], w, b), full[start : start + m]), (m, start)
    assert len(used) >= 2, used


def test_tma_unavailable_or_failing_falls_back_within_the_class(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    th = rk.MatmulThresholds(narrow_n=8, min_tiles_tma=1)  # N = 40 is "wide": prefill_tma_flat first
    # seams: the process's TMA facts (what this Triton has, which configs failed to build here)
    monkeypatch.setattr(mt, "tma_failed", set())  # seam: process fact
    x, w, b = _inputs(1030, 64, 40, torch.bfloat16, seed=13)
    assert mt.config_for(1030, 40, 64, torch.bfloat16, "tuned", th).name == "prefill_tma_flat"
    with rk.use_options(matmul_thresholds=th):
        expected = linear(x, w, b)
        # seam (fake Triton): an older one without TMA runs the bucket's pointer config
        monkeypatch.setattr(mt, "tma_api", False)
        assert not mt.config_for(1030, 40, 64, torch.bfloat16, "tuned", th).tma
        assert torch.equal(linear(x, w, b), expected)
        monkeypatch.setattr(mt, "tma_api", True)  # seam: fake Triton

        def broken(*args, **kwargs):
            raise km.OutOfResources(262176, 232448, "shared memory")

        monkeypatch.setattr(km, "_launch_tma", broken)  # seam: compiles nowhere, skipped from now on
        assert torch.equal(linear(x, w, b), expected)
    assert mt.tma_failed == {"prefill_tma_flat"}
    with pytest.raises(km.OutOfResources):  # an explicit config is never swapped
        km.matmul(x, w.t(), config=mt.CANDIDATES_16["prefill_tma"])


def test_tuned_runs_single_on_unverified_gpus(monkeypatch):
    """The table is one class only where the GPU tests showed it: elsewhere "single" runs."""
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(mt, "device_capability", lambda device: (8, 0))  # seam: a fake GPU model
    assert mt.table_for(cuda0, "tuned") == "single"
    monkeypatch.setattr(mt, "device_capability", lambda device: (9, 0))  # seam: fake GPU model
    assert mt.table_for(cuda0, "tuned") == "tuned"
    assert mt.table_for(torch.device("cpu"), "tuned") == "tuned"  # the interpreter runs (and tests) it
    assert mt.table_for(cuda0, "single") == "single"


@pytest.mark.gpu
@requires_cuda
def test_gpu_invariance_across_buckets(monkeypatch):
    """On the GPU, with the default (tuned) table, across every bucket boundary and weight class."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    for n in (384, 4096, 40000):
        x, w, b = _inputs(2048, 512, n, torch.bfloat16)
        full = linear(x, w, b)
        for m in (1, 8, 16, 17, 64, 65, 1000, 1024, 1025):
            assert torch.equal(linear(x[:m], w, b), full[:m]), (n, m)


# -------------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_accuracy_vs_fp64(backend, dtype):
    x, w, b = _inputs(33, 128, 80, dtype, seed=3)  # K = 128: the unmasked (EVEN_K) loop
    out = linear(x, w, b)
    assert out.dtype == dtype and out.shape == (33, 80)
    exact = x.double() @ w.double().T + b.double()
    assert _rel(out, exact) <= REL_TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_matmul_is_linear_of_transpose(backend):
    x, w, _ = _inputs(9, 64, 24, torch.float32, seed=4)
    b = w.t().contiguous()  # [K, N]
    out = matmul(x.reshape(3, 3, 64), b)
    assert out.shape == (3, 3, 24)
    if backend == "triton":  # the kernel's arithmetic ignores strides; BLAS may not (transpose flags)
        assert torch.equal(out.reshape(9, 24), linear(x, w))
    assert _rel(out.reshape(9, 24), x.double() @ b.double()) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_strided_inputs(backend):
    x, w, b = _inputs(20, 64, 32, torch.float32, seed=5)
    xt = x.t().contiguous().t()  # column-major x
    wide = torch.randn(32, 128, device=DEVICE)[:, ::2]  # weight with a K stride of 2
    out = linear(xt, wide, b)
    assert _rel(out, x.double() @ wide.double().T + b.double()) <= 1e-5
    assert torch.equal(linear(xt[:7], wide, b), out[:7])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_empty_and_fp64(backend):
    x, w, b = _inputs(0, 16, 8, torch.float32)
    assert linear(x, w, b).shape == (0, 8)
    x, w, b = _inputs(4, 16, 8, torch.float64)  # no kernel: the reference under every mode
    assert torch.allclose(linear(x, w, b), x @ w.T + b, rtol=1e-12, atol=1e-12)


def test_autocast_casts_inputs(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "reference")
    x, w, b = _inputs(4, 16, 8, torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = linear(x, w, b)
    assert out.dtype == torch.bfloat16


# -------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_autograd(backend, dtype):
    x, w, b = _inputs(19, 40, 24, dtype, seed=6)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    gy = torch.randn(19, 24, device=DEVICE).to(dtype)
    linear(x, w, b).backward(gy)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(xd, wd, bd).backward(gy.double())
    for ours, exact in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        assert ours.dtype == dtype
        assert _rel(ours, exact) <= REL_TOL[dtype]


@pytest.mark.parametrize("choice", ["torch", "kernel"])
def test_backward_gemm_option(monkeypatch, choice):
    """``invariant_backward="torch"``: the triton forward with cuBLAS/torch.mm gradients (no kernel
    launch in backward); ``"kernel"``: both gradients through the invariant kernel."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    launches = []
    real = km._pointer_gemm
    monkeypatch.setattr(km, "_pointer_gemm", lambda *a: launches.append(a[-1].name) or real(*a))  # seam: spy
    x, w, b = (t.requires_grad_() for t in _inputs(9, 32, 16, torch.float32, seed=11))
    with rk.use_options(invariant_backward=choice):
        out = linear(x, w, b)
    out.backward(torch.ones(9, 16, device=DEVICE))
    assert len(launches) == (1 if choice == "torch" else 3), launches
    torch.testing.assert_close(x.grad, w.detach().sum(0).expand(9, 32))
    torch.testing.assert_close(w.grad, x.detach().sum(0).expand(16, 32))
    torch.testing.assert_close(b.grad, torch.full((16,), 9.0, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_forward_backward_deterministic(backend):
    def run():
        x, w, b = _inputs(37, 48, 40, torch.bfloat16, seed=7)
        x, w, b = (t.requires_grad_() for t in (x, w, b))
        out = linear(x, w, b)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad, w.grad, b.grad

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


def test_custom_ops_opcheck_and_compile(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    x, w, b = _inputs(5, 32, 16, torch.float32, seed=8)
    th = [2048, 32768, 128, 512]
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(_linear_op, (x, w, b, "tuned", th, None), test_utils=utils)
    xh, wh, bh = x.bfloat16(), w.bfloat16(), b.bfloat16()
    torch.library.opcheck(_linear_op, (xh, wh, bh, "tuned", th, torch.float32), test_utils=utils)
    torch.library.opcheck(_mm_op, (x, w.t(), "single", th), test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda a: linear(a, w, b), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), linear(x, w, b))


def test_reference_rowwise_mm_matches_mm():
    x, w, _ = _inputs(6, 32, 12, torch.float32)
    assert _rel(ref.rowwise_mm(x.cpu(), w.cpu().t()), x.double().cpu() @ w.double().cpu().t()) <= 1e-6


# ------------------------------------------------------------------------------------- bad input
def test_bad_input():
    x, w, b = _inputs(4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        linear(x, w[:, :15])
    with pytest.raises(ValueError, match="weight must be 2-D"):
        linear(x, w.reshape(8, 16, 1))
    with pytest.raises(TypeError, match="weight dtype"):
        linear(x, w.double())
    with pytest.raises(TypeError, match="x must be a floating-point"):
        linear(x.long(), w)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        linear([[1.0]], w)
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, b[:7])
    with pytest.raises(TypeError, match="bias dtype"):
        linear(x, w, b.double())
    with pytest.raises(ValueError, match="weight must be on"):
        linear(x, w.to("meta"))
    with pytest.raises(ValueError, match="b must be"):
        matmul(x, w)  # b must be [K, N]
    with pytest.raises(ValueError, match="x must have at least 1"):
        linear(torch.tensor(1.0), w)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["2d", "3d", "3d_strided", "bias_strided"])
def test_no_grad_fast_path_same_bits(backend, layout):
    """Without gradients the forward runs the launcher directly (no autograd Function, no reshape
    or transpose views: ``kernels.matmul.linear_forward``): same bits as the gradient path, for
    2-D and batched x, a non-contiguous x (read through a copy) and a strided bias."""
    x, w, b = _inputs(6, 40, 24, torch.bfloat16, seed=5)
    if layout == "3d":
        x = x.reshape(2, 3, 40)
    elif layout == "3d_strided":
        x = torch.stack([x, x], dim=-1).reshape(2, 3, 40, 2)[..., 0]
        assert not x.is_contiguous()
    elif layout == "bias_strided":
        b = torch.stack([b, b], dim=1)[:, 0]
        assert not b.is_contiguous()
    with torch.no_grad():
        fast = linear(x, w, b)
    slow = linear(x, w.clone().requires_grad_(True), b)
    assert slow.requires_grad and not fast.requires_grad
    assert fast.shape == (*x.shape[:-1], 24)
    assert torch.equal(fast, slow.detach())
