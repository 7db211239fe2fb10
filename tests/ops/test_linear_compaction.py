"""Padding compaction of the chunk engine, in the linear primitive (``linear_token_logprobs``) and
in the fused token-level loss (``fused_linear_token_loss``, whose ``coef_fn`` then gets the flat
positions of each chunk's rows): rows whose id is ``ignore_index`` are neither staged, projected
nor given gradient work; the active rows are packed, their results scattered back.

Checked in the Triton interpreter (the GPU code, with ``torch.mm`` on the CPU for the default
path's GEMMs): the compacted and uncompacted (``compact=False``) paths agree, bitwise with
``invariant_logits`` (our own row-invariant GEMM on both sides) and to fp32 rounding on the default
path (its CPU GEMMs are BLAS calls whose bits may depend on a row's position, which compaction
moves); only the active rows reach a GEMM; ignored rows, garbage included, get logp = entropy = 0
and exactly zero dhidden, and reach neither dweight nor dbias.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.kernels import matmul as mk
from rlkernel.ops import _linear_function as lf
from rlkernel.ops import _linear_stored_logits as stored

H, V = 16, 53
# the default path, compacted vs not: (max |Δlogp|, max ‖Δgrad‖/‖grad‖) per dtype
TOLS = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-6, 1e-2)}


@pytest.fixture(autouse=True)
def _triton_small():
    with rk.use_backend("triton"), rk.use_options(matmul_table="single"):
        yield


def make(n=64, dtype=torch.float32, seed=0, active_frac=0.4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype)
    ids = torch.randint(0, V, (n,), generator=g)
    ids[torch.rand(n, generator=g) > active_frac] = -100  # ragged padding: ~60% ignored
    h[ids == -100] = float("nan")  # garbage where nothing may be read
    return h, w, b, ids


def upstream(n):
    g = torch.Generator().manual_seed(9)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


def run(h, w, b, ids, up=None, **kw):
    params = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    gl, ge = upstream(ids.numel()) if up is None else up
    logp, ent = lf.linear_token_logprobs_triton(
        params[0], params[1], ids, bias=params[2], temperature=0.8, return_entropy=True,
        chunk_rows=8, grad_rows=16, **kw,
    )  # fmt: skip
    grads = torch.autograd.grad((logp, ent), params, (gl, ge))
    return logp.detach(), ent.detach(), grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("invariant_logits", [torch.bfloat16, torch.float32])
def test_invariant_mode_compacted_equals_uncompacted_bitwise(invariant_logits):
    h, w, b, ids = make(dtype=torch.bfloat16)
    got = run(h, w, b, ids, invariant_logits=invariant_logits)
    full = run(h, w, b, ids, invariant_logits=invariant_logits, compact=False)
    assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
    for a, e in zip(got[2], full[2], strict=True):
        assert _rel(a, e) < 1e-2  # bf16 backward GEMMs over other row groupings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_path_compacted_matches_uncompacted(dtype):
    h, w, b, ids = make(dtype=dtype, seed=1)
    got = run(h, w, b, ids)
    full = run(h, w, b, ids, compact=False)
    logp_tol, grad_tol = TOLS[dtype]
    assert (got[0] - full[0]).abs().max() <= logp_tol and (got[1] - full[1]).abs().max() <= logp_tol
    for a, e in zip(got[2], full[2], strict=True):
        assert _rel(a, e) <= grad_tol


def test_ignored_rows_are_exactly_zero_and_leak_nowhere():
    h, w, b, ids = make(dtype=torch.float32, seed=2)
    logp, ent, (dh, dw, db) = run(h, w, b, ids)
    ignored = ids == -100
    assert bool(ignored.any()) and bool((~ignored).any())
    assert bool((logp[ignored] == 0).all()) and bool((ent[ignored] == 0).all())
    assert bool((dh[ignored] == 0).all()) and not bool(torch.signbit(dh[ignored]).any())
    assert bool(torch.isfinite(dh[~ignored]).all() and torch.isfinite(dw).all() and torch.isfinite(db).all())
    assert bool((logp[~ignored] < 0).all())
    # The reference on the active rows alone: the same per-row function (fp32, to rounding).
    gl, ge = upstream(ids.numel())
    want = run(h[~ignored], w, b, ids[~ignored], (gl[~ignored], ge[~ignored]), compact=False)
    torch.testing.assert_close(logp[~ignored], want[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(dh[~ignored], want[2][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dw, want[2][1], atol=1e-6, rtol=1e-5)


def test_only_active_rows_are_projected(monkeypatch):
    """Forward and backward GEMM rows: the invariant GEMM sees exactly the active rows (its chunk
    GEMMs cover the real rows only), the default path ceil(active / C) chunks instead of N / C."""
    h, w, b, ids = make(n=64, dtype=torch.bfloat16, seed=3)
    n_active = int((ids != -100).sum())
    rows, chunks = [], []
    real_mm, real_chunk = mk.matmul_into, stored.StoredLogitsEngine.chunk_logits
    # seam: count the rows each GEMM projects
    monkeypatch.setattr(mk, "matmul_into", lambda a, *x, **k: rows.append(a.shape[0]) or real_mm(a, *x, **k))
    # seam: count the chunk GEMMs
    monkeypatch.setattr(
        stored.StoredLogitsEngine, "chunk_logits", lambda self, *a: chunks.append(1) or real_chunk(self, *a)
    )
    run(h, w, b, ids, invariant_logits=torch.bfloat16)
    assert sum(rows) == 2 * n_active  # forward, and the backward's recomputation
    rows.clear()
    run(h, w, b, ids, invariant_logits=torch.bfloat16, compact=False)
    assert sum(rows) == 2 * 64
    chunks.clear()
    run(h, w, b, ids)
    assert len(chunks) == 2 * -(-n_active // 8) < 2 * 64 // 8


def test_all_rows_ignored_and_none_ignored():
    h, w, b, ids = make(n=20, seed=4)
    logp, ent, (dh, dw, db) = run(h, w, b, torch.full_like(ids, -100))
    assert not bool(logp.any() or ent.any() or dh.any() or dw.any() or db.any())
    h, w, b, ids = make(n=20, seed=5, active_frac=1.1)  # every row active: nothing to compact
    assert bool((ids != -100).all())
    got, full = run(h, w, b, ids), run(h, w, b, ids, compact=False)
    assert torch.equal(got[0], full[0])
    assert all(torch.equal(x, y) for x, y in zip(got[2], full[2], strict=True))


# ------------------------------------------------------------------------------------- fused loss
B, T = 4, 16  # [B, T] padded, or a packed stream of the same 64 tokens
PACKED_LENS = (10, 23, 7, 24)
PATTERNS = ("none", "all", "ragged", "packed")


def loss_case(pattern, dtype=torch.float32, seed=11):
    """Hidden/weight/bias, flat ids with ``-100`` at masked rows (NaN hidden there) and a token-loss
    plan with per-sequence constants. Masks: ``none`` masked; ``all`` masked; ``ragged`` responses
    of length U[T/4, T], masked at the end of each sequence; ``packed`` sequences of PACKED_LENS,
    a masked prompt at the start of each."""
    from rlkernel.rl import token_loss as tl

    g = torch.Generator().manual_seed(seed)
    n = B * T
    h, w, b, ids = make(n=n, dtype=dtype, seed=seed, active_frac=1.1)
    cu = None
    if pattern in ("none", "all"):
        mask = torch.full((B, T), pattern == "none")
    elif pattern == "ragged":
        lengths = torch.randint(T // 4, T + 1, (B, 1), generator=g)
        mask = torch.arange(T) < lengths
    else:
        cu = torch.tensor([0, *torch.tensor(PACKED_LENS).cumsum(0).tolist()])
        mask = torch.ones(n, dtype=torch.bool)
        for start, length in zip(cu[:-1].tolist(), PACKED_LENS, strict=True):
            mask[start : start + int(torch.randint(1, length // 2 + 1, (), generator=g))] = False
    shape = mask.shape
    ids = torch.where(mask.reshape(-1), ids, -100)
    h[ids == -100] = float("nan")  # garbage where nothing may be read
    old = torch.randn(shape, generator=g) * 0.3 - 3.0
    # seq-mean-token-mean with an entropy bonus: per-sequence advantages and 1/n_i factors (padded)
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
                                     aggregation="seq-mean-token-mean")  # fmt: skip
    adv, ref_logp = torch.randn(len(PACKED_LENS), generator=g), old + 0.2 * torch.randn(shape, generator=g)
    plan = tl.build_plan(
        cfg, token_ids=ids.reshape(shape), old_logp=old, advantages=adv, mask=mask, ref_logp=ref_logp,
        cu_seqlens=cu,
    )  # fmt: skip
    return h, w, b, plan


def run_loss(h, w, b, plan, **kw):
    """The fused engine driven by the plan's coefficients: (loss, logp, entropy, grads, g_logp) with
    the per-token coefficients ``coef_fn`` returned, scattered to their flat positions."""
    from rlkernel.ops import token_loss as tl_ops

    inner = tl_ops.as_coef_fn(plan)
    g_logp = torch.full((plan.n_tokens,), float("nan"))

    def coef_fn(rows, logp, entropy):
        out = inner(rows, logp, entropy)
        g_logp[rows] = out[1]
        return out

    params = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    loss, logp, ent = lf.fused_linear_token_loss(
        *params, plan.ids, coef_fn=coef_fn, temperature=0.8, with_entropy=True, chunk_rows=8, grad_rows=16,
        **kw,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), logp, ent, grads, g_logp


@pytest.mark.parametrize("pattern", PATTERNS)
def test_fused_loss_invariant_mode_compacted_equals_uncompacted(pattern):
    """With the invariant GEMM on both sides: logp, entropy and the per-token coefficients bitwise;
    the loss, whose chunk sums run over other rows, to fp32 rounding; gradients to bf16 rounding
    of the backward GEMMs over other row groupings. Masked rows: logp = entropy = 0, dhidden
    exactly +0 (NaN garbage there reaches nothing)."""
    h, w, b, plan = loss_case(pattern, torch.bfloat16)
    got = run_loss(h, w, b, plan, invariant_logits=torch.bfloat16)
    full = run_loss(h, w, b, plan, invariant_logits=torch.bfloat16, compact=False)
    ignored = plan.ids == -100
    assert torch.equal(got[1], full[1]) and torch.equal(got[2], full[2])
    assert torch.equal(got[4][~ignored], full[4][~ignored])
    assert bool(got[4][ignored].isnan().all()), "coef_fn saw a masked row"
    torch.testing.assert_close(got[0], full[0], atol=1e-6, rtol=1e-6)
    for a, e in zip(got[3], full[3], strict=True):
        assert bool(torch.isfinite(a).all()) and (pattern == "all" or _rel(a, e) < 1e-2)
    dh = got[3][0]
    assert bool((dh[ignored] == 0).all()) and not bool(torch.signbit(dh[ignored]).any())
    assert bool((got[1][ignored] == 0).all()) and bool((got[2][ignored] == 0).all())
    if pattern == "none":  # nothing to compact: the same path, bitwise
        assert torch.equal(got[0], full[0])
        assert all(torch.equal(x, y) for x, y in zip(got[3], full[3], strict=True))
    if pattern == "all":
        assert got[0].item() == 0 and not any(bool(g.any()) for g in got[3])


@pytest.mark.parametrize("pattern", ["ragged", "packed"])
def test_fused_loss_default_path_compacted_matches_uncompacted_and_reference(pattern):
    """The default (cuBLAS; here CPU torch.mm) path in fp32: compacted vs uncompacted to fp32
    rounding (the CPU GEMMs' bits may depend on a row's position), and the loss and gradients
    against ``policy_loss`` of the fp32 reference's log-probs (an independent oracle)."""
    from rlkernel.reference import logprobs as ref

    h, w, b, plan = loss_case(pattern, seed=12)
    got = run_loss(h, w, b, plan)
    full = run_loss(h, w, b, plan, compact=False)
    active = plan.ids != -100
    assert (got[1] - full[1]).abs().max() <= 1e-6 and (got[2] - full[2]).abs().max() <= 1e-6
    assert (got[4][active] - full[4][active]).abs().max() <= 1e-6
    torch.testing.assert_close(got[0], full[0], atol=1e-6, rtol=1e-6)
    for a, e in zip(got[3], full[3], strict=True):
        assert _rel(a, e) <= 1e-6
    # the oracle: the plan's loss (reference backend) on the reference's fp32 log-probs, autograd
    from rlkernel.ops import token_loss as tl_ops

    params = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    logp, ent = ref.linear_token_logprobs(
        *params[:2], plan.ids, bias=params[2], temperature=0.8, return_entropy=True
    )
    terms = tl_ops.token_loss(plan, logp, ent, backend="reference")
    ref_logp, ref_ent = logp.detach(), ent.detach()
    # token_loss returns the coefficients, not a graph: the gradient is their chain rule
    want = torch.autograd.grad((logp, ent), params, (terms.g_logp, terms.g_entropy))
    torch.testing.assert_close(got[0], terms.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], ref_logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(got[2], ref_ent, atol=2e-5, rtol=0)
    for a, e in zip(got[3], want, strict=True):
        assert _rel(a, e) < 1e-5


def test_fused_loss_projects_only_active_rows(monkeypatch):
    h, w, b, plan = loss_case("ragged", torch.bfloat16, seed=13)
    n_active = int((plan.ids != -100).sum())
    chunks = []
    real_chunk = stored.StoredLogitsEngine.chunk_logits
    # seam: count the chunk GEMMs
    monkeypatch.setattr(
        stored.StoredLogitsEngine, "chunk_logits", lambda self, *a: chunks.append(1) or real_chunk(self, *a)
    )
    run_loss(h, w, b, plan)
    assert len(chunks) == -(-n_active // 8) < B * T // 8


@pytest.mark.parametrize(
    ("id_dtype", "mask_dtype", "layout"),
    [(torch.int64, torch.bool, "sliced"), (torch.int32, torch.float32, "contiguous"),
     (torch.uint8, torch.int32, "sliced"), (torch.int64, torch.bfloat16, "contiguous")],
)  # fmt: skip
def test_hidden_token_route_masks_compacts_and_checks_in_one_launch(id_dtype, mask_dtype, layout):
    """rk.fused_policy_loss(hidden=...), token-level route: the id masking, padding compaction and id
    check come from one launch (``kernels.ids.masked_rows``, tests/kernels/test_ids.py) and one host
    read (scripts/count_host_work.py counts them); loss, gradients and
    metrics match the reference backend on fresh random inputs with garbage ids at masked positions
    (a NaN mask entry counts as active, as in torch), a hidden sliced from longer sequences (read in
    place) or contiguous, every mask / id dtype the route takes, one batch without padding; an active
    id out of range raises
    (CPU: in the call) naming the argument, the count and the first bad id; ``validate=False`` gives
    a NaN loss instead."""
    b, t, vocab, hdim = 3, 5, 37, 16
    g = torch.Generator().manual_seed(int(id_dtype.itemsize) + 7 * int(mask_dtype.itemsize))
    base = torch.randn(b, t + 2, hdim, generator=g)
    weight = (torch.randn(vocab, hdim, generator=g) * 0.3)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    maskf = (torch.rand(b, t, generator=g) > 0.35).float()
    maskf[0, 0], maskf[2, 4] = 1.0, 0.0  # one active, one padded position at least
    if id_dtype == torch.int32:
        maskf.fill_(1.0)  # every row active: nothing to compact
    if mask_dtype.is_floating_point:
        maskf[1, 1] = float("nan")  # active
    active = maskf != 0
    garbage = 255 if id_dtype == torch.uint8 else -7
    ids = torch.where(active, ids, garbage).to(id_dtype)
    mask = maskf.to(mask_dtype)
    kw = dict(
        token_ids=ids, mask=mask, old_logp=-torch.rand(b, t, generator=g) * 3,
        advantages=torch.randn(b, generator=g)[:, None].expand(b, t).contiguous(),
        ref_logp=-torch.rand(b, t, generator=g) * 3, temperature=0.9,
    )  # fmt: skip
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=0.05, kl_estimator="k3")

    def run(**extra):
        hb, w = base.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        hidden = hb[:, 1:-1] if layout == "sliced" else hb[:, :t].contiguous()
        # 8-row chunks: the default 4096 padded rows take minutes interpreted
        with rk.use_options(linear_chunk_bytes=8 * vocab * 4, linear_grad_bytes=8 * vocab * 4):
            out = rk.fused_policy_loss(cfg, hidden=hidden, weight=w, **{**kw, **extra})
            return out, torch.autograd.grad(out.loss, (hb, w))

    with rk.use_backend("triton"):
        out, grads = run()
    assert out.route.key == ("hidden", "token", "triton", "host"), str(out.route)
    with rk.use_backend("reference"):
        want, want_grads = run()
    torch.testing.assert_close(out.loss, want.loss, atol=2e-6, rtol=1e-5)
    for got, exp in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, exp, atol=2e-6, rtol=1e-4)
    for name, value in want.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, atol=1e-5, rtol=1e-4)
    bad = ids.clone()
    bad[0, 0] = vocab + 3 if id_dtype != torch.uint8 else 200
    first = int(bad[0, 0])
    if id_dtype != torch.uint8:
        bad[1, 3] = -2 if bool(active[1, 3]) else bad[1, 3]
    with rk.use_backend("triton"):
        with pytest.raises(ValueError, match=rf"token_ids \(at active mask positions\) has \d id\(s\) "
                           rf"outside \[0, {vocab}\) \(first: {first}\)"):  # fmt: skip
            run(token_ids=bad)
        if layout == "sliced" and id_dtype == torch.int64:  # once: the NaN of an unchecked bad id
            nan_out, _ = run(token_ids=bad, validate=False)
            assert bool(torch.isnan(nan_out.loss))
