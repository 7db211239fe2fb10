"""The linear path on the epilogue kernel (``kernels.linear_head``, option ``linear_head_gemm``): the
primitive (statistics from the GEMM's epilogue, the logits gradient recomputed in backward) and the
fused loss (statistics + stored fp32 logits) against the float64 reference and against the cuBLAS
chunk engine on the same inputs; which path runs when. CPU: the kernels in the interpreter."""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from _linear_helpers import autograd_coef_fn
from rlkernel.kernels import linear_head as lh
from rlkernel.ops import _linear_engine as engine
from rlkernel.ops import _linear_function as lf
from rlkernel.reference import logprobs as ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, V, N = 16, 61, 45
IGNORED = [0, 7, 8, 30, N - 1]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")


def make(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).to(DEVICE)
    ids = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    ids[IGNORED] = -100
    ids[3], ids[4] = 0, V - 1
    return h, w, ids


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


class Spy:
    """Counts the epilogue kernel's launches through its unchecked entries, which the engine calls
    (seam: a spy on the kernels module)."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("linear_head_stats_unchecked", "linear_head_grad_into_unchecked",
                     "linear_head_stats_shifted_unchecked",
                     "linear_head_grad_from_shifted_unchecked"):  # fmt: skip
            real = getattr(lh, name)
            monkeypatch.setattr(lh, name, self._wrap(name, real))  # seam: spy

    def _wrap(self, name, real):
        def call(*a, **k):
            self.calls.append(name)
            return real(*a, **k)

        return call


def primitive(h, w, ids, mode, **kw):
    hh, ww = leaves(h, w)
    g = torch.Generator().manual_seed(1)
    gl, ge = torch.randn(N, generator=g).to(DEVICE), torch.randn(N, generator=g).to(DEVICE)
    with rk.use_options(linear_head_gemm=mode):
        lp, en = lf.linear_token_logprobs_triton(
            hh, ww, ids, temperature=0.8, return_entropy=True, chunk_rows=8, grad_rows=16, **kw
        )
    return lp.detach(), en.detach(), torch.autograd.grad((lp, en), (hh, ww), (gl, ge)), (gl, ge)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("whole_batch", [None, False, True])
def test_primitive_on_epilogue_kernel(dtype, whole_batch, monkeypatch):
    h, w, ids = make(dtype)
    spy = Spy(monkeypatch)
    lp, en, grads, (gl, ge) = primitive(h, w, ids, "triton", whole_batch=whole_batch)
    assert "linear_head_stats_unchecked" in spy.calls and "linear_head_grad_into_unchecked" in spy.calls
    n_calls = len(spy.calls)
    clp, cen, cgrads, _ = primitive(h, w, ids, "cublas", whole_batch=whole_batch)
    assert len(spy.calls) == n_calls  # cublas: the kernel never runs
    hh, ww = leaves(h, w)
    rlp, ren = ref.linear_token_logprobs(hh, ww, ids, temperature=0.8, return_entropy=True)
    rgrads = torch.autograd.grad((rlp, ren), (hh, ww), (gl, ge))
    torch.testing.assert_close(lp, rlp.float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(en, ren.float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(lp, clp, atol=2e-6, rtol=0)
    for got, cub, want in zip(grads, cgrads, rgrads, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel(got, want) <= 1e-2 and rel(got, cub) <= 1e-2
    assert bool((lp[IGNORED] == 0).all()) and bool((grads[0][IGNORED] == 0).all())


@pytest.mark.parametrize("whole_batch", [None, False])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fused_loss_on_epilogue_kernel(whole_batch, scale, monkeypatch):
    h, w, ids = make(seed=2)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    spy = Spy(monkeypatch)

    def run(mode):
        hh, ww = leaves(h, w)
        coef_fn = autograd_coef_fn(lambda r, lp, e: (coef[r] * lp).sum() - 0.05 * e.sum())
        with rk.use_options(linear_head_gemm=mode):
            loss, lp, _ = lf.fused_linear_token_loss(
                hh, ww, None, ids, coef_fn=coef_fn, temperature=0.9, with_entropy=True,
                chunk_rows=8, grad_rows=16, whole_batch=whole_batch,
            )  # fmt: skip
        return loss.detach(), lp, torch.autograd.grad(loss * scale, (hh, ww))

    loss, lp, grads = run("triton")
    # Each chunk: statistics + shifted exponents from the GEMM, then the gradient from them.
    assert spy.calls and set(spy.calls) == {
        "linear_head_stats_shifted_unchecked", "linear_head_grad_from_shifted_unchecked"
    }
    closs, clp, cgrads = run("cublas")
    hh, ww = leaves(h, w)
    rlp, ren = ref.linear_token_logprobs(hh, ww, ids, temperature=0.9, return_entropy=True)
    active = (ids != -100).double()
    rloss = ((coef.double() * rlp.double() - 0.05 * ren.double()) * active).sum()
    rgrads = torch.autograd.grad(rloss * scale, (hh, ww))
    torch.testing.assert_close(loss.double(), rloss.detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(loss, closs, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(lp, clp, atol=2e-6, rtol=0)
    for got, cub, want in zip(grads, cgrads, rgrads, strict=True):
        assert rel(got, want) <= 1e-2 and rel(got, cub) <= 1e-2


def test_row_invariance_on_epilogue_kernel():
    """A row's log-prob is bitwise the same alone, in the batch, and with other rows around it."""
    h, w, ids = make()
    with rk.use_options(linear_head_gemm="triton"):
        full = lf.linear_token_logprobs_triton(h, w, ids, chunk_rows=8)
        for r in (3, 4, 20):
            alone = lf.linear_token_logprobs_triton(h[r : r + 1], w, ids[r : r + 1], chunk_rows=8)
            assert torch.equal(alone[0], full[r])
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        shuffled = lf.linear_token_logprobs_triton(h[perm], w, ids[perm], chunk_rows=8)
        assert torch.equal(shuffled, full[perm])


def test_which_path_runs():
    h, w, ids = make()

    def runs(mode, hh=h, ww=w, bias=None, **kw):
        settings = engine.EngineSettings.from_options(rk.Options(linear_head_gemm=mode), **kw)
        return engine.epilogue_kernel_runs(hh, ww, bias, settings)

    assert runs("triton")
    assert not runs("cublas")
    assert runs("auto") == (DEVICE.type == "cuda" and lh.can_run(w))  # auto: CUDA only
    assert not runs("triton", bias=torch.zeros(V, dtype=w.dtype, device=DEVICE))  # no bias epilogue
    assert not runs("triton", invariant=True)  # the invariant mode keeps its own GEMM
    assert not runs("triton", logits_dtype="input")  # bf16 logits: cuBLAS chunks
    assert not runs("triton", hh=h.float(), ww=w.float())  # fp32 operands: cuBLAS chunks
    assert not runs("triton", ww=w[:, :15].contiguous(), hh=h[:, :15])  # 30-byte rows: no TMA
    with pytest.raises(ValueError, match="linear_head_gemm"):
        rk.Options(linear_head_gemm="cutlass")


def test_gemm_backend_is_a_function_of_settings_and_operands():
    """``gemm_backend`` picks the engine's back end from the settings and the operands alone (meta
    tensors: nothing runs), and ``chunk_geometry`` pads a group to whole chunks only on the back ends
    with fixed-shape chunk GEMMs."""
    w = torch.empty(V, H, dtype=torch.bfloat16, device="meta")
    h = torch.empty(N, H, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(V, dtype=torch.bfloat16, device="meta")

    def backend(mode, bias=None, **kw):
        settings = engine.EngineSettings.from_options(rk.Options(linear_head_gemm=mode), **kw)
        return engine.gemm_backend(h, w, bias, settings).backend

    assert backend("triton") == "epilogue"
    assert backend("triton", bias=bias) == backend("cublas") == "cublas"
    assert backend("triton", invariant=True) == backend("cublas", invariant=True) == "invariant"
    settings = engine.EngineSettings(chunk_rows=8, grad_rows=16, whole_batch=True)
    for mode, rows in (("epilogue", N), ("cublas", 48), ("invariant", 48)):
        cls = {b.backend: b for b in (engine.EpilogueEngine, engine.CublasEngine, engine.InvariantGemmEngine)}
        geo = engine.chunk_geometry(cls[mode], N, h, w, settings, need_dweight=True)
        assert (geo.chunk_rows, geo.group_rows, geo.whole_batch) == (8, rows, True), mode


def _assert_grads_match_reference(h, w, ids, coef, *grads) -> None:
    """Each ``(dhidden, dweight)`` of ``grads`` within 1e-2 (relative) of the reference's for the
    loss Σ coef·logp over the active rows."""
    hh, ww = leaves(h, w)
    rlp = ref.linear_token_logprobs(hh, ww, ids)
    rdh, rdw = torch.autograd.grad((coef.double() * rlp.double() * (ids != -100)).sum(), (hh, ww))
    for dh, dw in grads:
        assert rel(dh, rdh) <= 1e-2 and rel(dw, rdw) <= 1e-2


def _spy_statistics_rows(monkeypatch) -> list[int]:
    """A list that records the rows of each fused-loss statistics launch (seam: a spy)."""
    rows_per_launch = []
    real = lh.linear_head_stats_shifted_unchecked

    def spy(h, *a, **k):
        rows_per_launch.append(h.shape[0])
        return real(h, *a, **k)

    monkeypatch.setattr(lh, "linear_head_stats_shifted_unchecked", spy)  # seam: spy
    return rows_per_launch


def test_small_hidden_size_caps_groups_with_the_same_logprobs(monkeypatch):
    """A gradient group holds at most max(H_GROUP_FLOOR, H) rows (default sizes), and on the epilogue
    kernel the chunk follows it: the fused loss then runs grouped (an fp32 dweight accumulator)
    instead of one whole-batch group; the log-probs keep their bits and the gradients match the
    reference."""
    rows_per_launch = _spy_statistics_rows(monkeypatch)
    h, w, ids = make(seed=6)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(DEVICE)

    def run():
        hh, ww = leaves(h, w)
        coef_fn = autograd_coef_fn(lambda r, lp, e: (coef[r] * lp).sum())
        rows_per_launch.clear()
        with rk.use_options(linear_head_gemm="triton"):
            loss, lp = lf.fused_linear_token_loss(hh, ww, None, ids, coef_fn=coef_fn)
        dh, dw = torch.autograd.grad(loss, (hh, ww))
        return lp.detach(), dh, dw, list(rows_per_launch)

    active = int((ids != -100).sum())
    lp_one, dh_one, dw_one, launches = run()
    assert launches == [active]  # H = 16 under the floor: one chunk, one whole-batch group
    monkeypatch.setattr(engine, "H_GROUP_FLOOR", 8)  # seam: H = 16 caps groups at 16 of 40 rows
    lp_cap, dh_cap, dw_cap, launches = run()
    assert launches == [16, 16, active - 32]
    assert torch.equal(lp_cap, lp_one)
    _assert_grads_match_reference(h, w, ids, coef, (dh_one, dw_one), (dh_cap, dw_cap))


def test_frozen_weight_uses_small_chunks_with_the_same_logprobs(monkeypatch):
    """With a frozen weight the fused loss's chunks and groups shrink to FROZEN_WEIGHT_ROWS on the
    epilogue kernel (default sizes only); the log-probs keep their bits (the kernel is row
    invariant at any M) and dhidden matches the reference."""
    monkeypatch.setattr(engine, "FROZEN_WEIGHT_ROWS", 16)  # seam: 45 rows make several chunks
    rows_per_launch = _spy_statistics_rows(monkeypatch)
    h, w, ids = make(seed=4)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(DEVICE)

    def run(frozen, **kw):
        hh, ww = leaves(h, w)
        ww.requires_grad_(not frozen)
        coef_fn = autograd_coef_fn(lambda r, lp, e: (coef[r] * lp).sum())
        rows_per_launch.clear()
        with rk.use_options(linear_head_gemm="triton"):
            loss, lp = lf.fused_linear_token_loss(hh, ww, None, ids, coef_fn=coef_fn, **kw)
        (dh,) = torch.autograd.grad(loss, (hh,))
        return lp.detach(), dh, list(rows_per_launch)

    active = int((ids != -100).sum())
    lp_frozen, dh_frozen, launches = run(True)
    assert launches == [16, 16, active - 32]
    lp_trained, _, launches = run(False)
    assert launches == [active]  # a trainable weight keeps the default chunk
    assert torch.equal(lp_frozen, lp_trained)
    _, _, launches = run(True, chunk_rows=8, grad_rows=8)
    assert launches == [8] * (active // 8) + ([active % 8] if active % 8 else [])  # explicit sizes win
    hh = leaves(h)[0]
    rlp = ref.linear_token_logprobs(hh, w, ids)
    (rdh,) = torch.autograd.grad((coef.double() * rlp.double() * (ids != -100)).sum(), (hh,))
    assert rel(dh_frozen, rdh) <= 1e-2


@pytest.mark.parametrize("hdim, chunk, group", [(4096, 2048, 4096), (1024, 1024, 1024), (2048, 2048, 2048)])
def test_default_chunk_and_group_rows_at_the_real_vocabulary(hdim, chunk, group):
    """The engine's C and G with default sizes on the epilogue kernel at V = 151,936 (bf16, fp32
    statistics): the group is capped at max(1024, H) rows, the chunk at the group, a trainable
    weight's group never below that cap (so the whole-batch rule keeps its G + H rows); a frozen
    weight's both at FROZEN_WEIGHT_ROWS. Meta tensors: no memory, nothing runs."""
    w = torch.empty(151936, hdim, dtype=torch.bfloat16, device="meta")
    h = torch.empty(8, hdim, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(8, dtype=torch.int64, device="meta")
    settings = engine.EngineSettings(head_gemm="triton", whole_batch=False)  # 8 rows: the groups'
    eng = engine.make_engine(h, w, None, ids, 1.0, -100, settings, need_dweight=True)
    assert eng.backend == "epilogue" and (eng.chunk_rows, eng.group_rows) == (chunk, group)
    frozen = engine.make_engine(h, w, None, ids, 1.0, -100, settings, dhidden_only=True)
    assert frozen.chunk_rows == frozen.group_rows == engine.FROZEN_WEIGHT_ROWS


@pytest.mark.parametrize("hdim, rows", [(4096, 4096), (2048, 2048), (1024, 1024)])
def test_invariant_chunk_follows_the_group_at_the_real_vocabulary(hdim, rows):
    """The batch-invariant GEMM's chunk shrinks with the gradient group (default sizes, V = 151,936,
    bf16 logits): max(1024, H) rows under H = 4096, not the 4096 rows its logits budget allows; a
    frozen weight's both at FROZEN_WEIGHT_ROWS. Meta tensors: no memory, nothing runs."""
    w = torch.empty(151936, hdim, dtype=torch.bfloat16, device="meta")
    h = torch.empty(8, hdim, dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(8, dtype=torch.int64, device="meta")
    settings = engine.EngineSettings.from_options(rk.Options(), invariant=True, whole_batch=False)
    eng = engine.make_engine(h, w, None, ids, 1.0, -100, settings, need_dweight=True)
    assert eng.backend == "invariant" and (eng.chunk_rows, eng.group_rows) == (rows, rows)
    frozen = engine.make_engine(h, w, None, ids, 1.0, -100, settings, dhidden_only=True)
    assert frozen.chunk_rows == frozen.group_rows == engine.FROZEN_WEIGHT_ROWS


def test_invariant_chunks_follow_capped_groups_with_the_same_logprobs(monkeypatch):
    """On the batch-invariant GEMM, groups capped under the row count (the H_GROUP_FLOOR seam) make
    the chunks follow them: more, smaller chunks, the same log-prob bits as one chunk (the GEMM is
    row invariant at any M), and gradients that match the reference."""
    h, w, ids = make(seed=8)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    chunks = []
    real_make = engine.make_engine

    def spy_make(*a, **k):  # records each engine's back end, chunk and group rows
        eng = real_make(*a, **k)
        chunks.append((eng.backend, eng.chunk_rows, eng.group_rows))
        return eng

    monkeypatch.setattr(lf, "make_engine", spy_make)  # seam: spy

    def run():
        hh, ww = leaves(h, w)
        coef_fn = autograd_coef_fn(lambda r, lp, e: (coef[r] * lp).sum())
        chunks.clear()
        loss, lp = lf.fused_linear_token_loss(
            hh, ww, None, ids, coef_fn=coef_fn, invariant_logits=torch.bfloat16
        )
        dh, dw = torch.autograd.grad(loss, (hh, ww))
        return lp.detach(), dh, dw, list(chunks)

    lp_one, dh_one, dw_one, made = run()
    assert made[0][0] == "invariant" and made[0][1] >= N  # H = 16 under the floor: one chunk
    monkeypatch.setattr(engine, "H_GROUP_FLOOR", 8)  # seam: H = 16 caps groups at 16 rows
    lp_cap, dh_cap, dw_cap, made = run()
    assert made[0] == ("invariant", 16, 16)
    assert torch.equal(lp_cap, lp_one)
    _assert_grads_match_reference(h, w, ids, coef, (dh_one, dw_one), (dh_cap, dw_cap))
