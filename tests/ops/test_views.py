"""Logits that are a window of the model output (``out[:, P - 1 : -1]`` and the like): the Triton
paths give the base's gradient directly (issue 12): the same bits as the gradient through a copy of
the view, exact zeros outside the window, no slice-backward node in the graph (so no second
base-sized buffer and no copy), also in place and on the gradient-in-forward path."""

from __future__ import annotations

import itertools

import pytest
import torch

import rlkernel as rk
from rlkernel.ops._views import window_of

B, P, T, V = 3, 4, 6, 37

WINDOWS = {
    "[:, :-1]": lambda x: x[:, :-1],
    "[:, P-1:-1]": lambda x: x[:, P - 1 : -1],
    "[1:, 2:]": lambda x: x[1:, 2:],
    "packed [0, 3:9]": lambda x: x[0, 3:9],
}


def _base(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(B, P + T, V, generator=g)).to(dtype).requires_grad_(True)


def _ids(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, shape, generator=g)
    return ids


def test_window_of_finds_boxes_and_rejects_the_rest():
    base = _base()
    found = window_of(base[:, P - 1 : -1])
    assert found is not None and found[0] is base
    assert found[1].index[:2] == (slice(0, B), slice(P - 1, P + T - 1))
    assert window_of(base) is None  # not a view
    assert window_of(base[:, :, :5]) is None  # a partial vocabulary
    assert window_of(base[:, ::2]) is None  # a step
    assert window_of(base.transpose(0, 1)[1:]) is None  # other strides
    assert window_of(base.detach()[:, 1:]) is None  # no gradient wanted
    with torch.no_grad():
        assert window_of(base[:, 1:]) is None


# Views of small bases of 2, 3 and 4 dims; at some ranks a view slices the vocabulary or does not exist.
VIEWS = [
    lambda b: b[:, 3:-1], lambda b: b[:, :-1], lambda b: b[1:, 2:], lambda b: b[1], lambda b: b[1, 3:5],
    lambda b: b[0, 0], lambda b: b.view(-1, V)[5:9], lambda b: b[:, :], lambda b: b[0:2], lambda b: b[:, 3],
    lambda b: b[..., :5], lambda b: b[:, ::2], lambda b: b[:, 2:2], lambda b: b.view(-1)[V // 2 : V // 2 + V],
    lambda b: b.transpose(0, 1)[1:], lambda b: b[-1:, 1:2],
]  # fmt: skip


def _boxes(lead: tuple[int, ...]):
    """Every box index of a base with these leading dims: per dim an int or a step-1 slice."""
    per_dim = [[*range(n), *(slice(a, z) for a in range(n) for z in range(a + 1, n + 1))] for n in lead]
    return itertools.product(*per_dim)


@pytest.mark.parametrize("k", range(len(VIEWS)))
@pytest.mark.parametrize("lead", [(2, 10), (1, 10), (10,), (2, 3, 10)])
def test_window_of_finds_exactly_the_box_views(k, lead):
    """``window_of`` against brute force: it finds a window exactly when some box index of the base
    (an int or a step-1 slice per leading dim, the vocabulary whole) addresses the view (the same
    shape, strides and storage offset), the view keeps the base's strides (a dropped dim is a
    leading one) and it is neither empty nor the whole base; the window it finds addresses the
    view."""
    base = torch.randn(*lead, V).requires_grad_(True)
    try:
        view = VIEWS[k](base)
    except (IndexError, RuntimeError):  # this view does not exist at this base's rank
        return
    key = (view.shape, view.stride(), view.storage_offset())
    box = any(
        (w.shape, w.stride(), w.storage_offset()) == key
        for w in (base[(*idx, slice(None))] for idx in _boxes(lead))
    )
    same_strides = view.dim() >= 1 and view.stride() == base.stride()[base.dim() - view.dim() :]
    expected = box and same_strides and view.numel() > 0 and view.shape != base.shape
    found = window_of(view)
    assert (found is not None) == expected
    if found is not None:
        again = found[1].of(base)
        assert found[0] is base and (again.shape, again.stride(), again.storage_offset()) == key


@pytest.mark.parametrize("lead", [(2, 10), (1, 10), (2, 3, 10)])
def test_base_and_window_memo_follows_the_metadata(lead):
    """``_base_and_window`` memoizes the window on the view's and base's metadata: for every view
    (asked twice, on two bases, so the second answer comes from the memo) it gives what the direct
    computation gives, and the base of the call itself."""
    from rlkernel.kernels.logprobs import row_layout
    from rlkernel.ops._logprobs_function import _base_and_window

    for k in range(len(VIEWS)):
        for _ in range(2):
            base = torch.randn(*lead, V).requires_grad_(True)
            try:
                view = VIEWS[k](base)
            except (IndexError, RuntimeError):
                break
            direct = window_of(view)
            if direct is not None and row_layout(view) is None:
                direct = None
            got = _base_and_window(view)
            if direct is None:
                assert got[0] is view and got[1] is None, k
            else:
                assert got[0] is base and got[1] == direct[1], k
        with torch.no_grad():  # the grad mode is read on every call, not memoized
            assert _base_and_window(VIEWS[0](base))[1] is None


def _graph_has_slice(t: torch.Tensor) -> bool:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "Slice" in type(fn).__name__ or "AsStrided" in type(fn).__name__:
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


@pytest.mark.parametrize("name", list(WINDOWS))
@pytest.mark.parametrize("entropy", [False, True])
def test_token_logprobs_window_gives_the_base_gradient(name, entropy):
    if torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    cut = WINDOWS[name]
    with rk.use_backend("triton"):
        base = _base()
        view = cut(base)
        ids = _ids(view.shape[:-1])
        ids.view(-1)[::5] = -100
        out = rk.token_logprobs(view, ids, return_entropy=entropy, temperature=0.8)
        logp, ent = out if entropy else (out, None)
        loss = (logp * torch.linspace(-1, 1, logp.numel()).view(logp.shape)).sum()
        if entropy:
            loss = loss + 0.3 * ent.sum()
        assert not _graph_has_slice(loss)
        loss.backward()
        base2 = base.detach().clone().requires_grad_(True)
        out2 = rk.token_logprobs(cut(base2).contiguous(), ids, return_entropy=entropy, temperature=0.8)
        logp2, ent2 = out2 if entropy else (out2, None)
        loss2 = (logp2 * torch.linspace(-1, 1, logp2.numel()).view(logp2.shape)).sum()
        if entropy:
            loss2 = loss2 + 0.3 * ent2.sum()
        loss2.backward()
    assert torch.equal(logp, logp2)
    assert torch.equal(base.grad, base2.grad)
    outside = torch.ones_like(base.grad, dtype=torch.bool)
    cut(outside).fill_(False)
    assert bool((base.grad[outside] == 0).all()) and outside.any()


@pytest.mark.parametrize("name", list(WINDOWS))
@pytest.mark.parametrize("route", ["3pass", "2pass", "inplace"])
def test_fused_policy_loss_window_gives_the_base_gradient(name, route, set_options):
    if torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    cut = WINDOWS[name]
    set_options(grad_in_forward_max_vocab=1 << 20 if route == "2pass" else 0)
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=0.01, entropy_coef=0.01)
    g = torch.Generator().manual_seed(5)

    def run(base, contiguous):
        view = cut(base)
        lead = view.shape[:-1]
        ids = _ids(lead, seed=6)
        gen = torch.Generator().manual_seed(7)
        mask = torch.rand(lead, generator=gen) > 0.2
        kw = dict(
            token_ids=torch.where(mask, ids, -1),
            old_logp=-torch.rand(lead, generator=gen),
            ref_logp=-torch.rand(lead, generator=gen),
            advantages=torch.randn(lead[:-1] if len(lead) > 1 else lead, generator=gen),
            mask=mask,
        )
        if len(lead) == 1:  # packed: one sequence
            kw["cu_seqlens"] = torch.tensor([0, lead[0]])
            kw["advantages"] = torch.randn(1, generator=gen)
        x = view.contiguous() if contiguous else view
        out = rk.fused_policy_loss(cfg, logits=x, inplace_backward=route == "inplace", **kw)
        graph_slice = _graph_has_slice(out.loss)
        (2.0 * out.loss).backward()
        return out, graph_slice

    del g
    with rk.use_backend("triton"):
        base = _base(seed=8)
        base_ref = base.detach().clone().requires_grad_(True)
        out, has_slice = run(base, contiguous=False)
        out_ref, _ = run(base_ref, contiguous=True)
    assert not has_slice
    assert torch.equal(out.loss, out_ref.loss)
    assert torch.equal(base.grad, base_ref.grad)
    outside = torch.ones_like(base.grad, dtype=torch.bool)
    cut(outside).fill_(False)
    assert bool((base.grad[outside] == 0).all())


@pytest.mark.parametrize("name", list(WINDOWS) + ["[1, 2:5]", "[:, 1:2, :]"])
def test_zero_outside_zeroes_exactly_the_rows_outside_the_window(name):
    """Every row outside the window becomes 0, every row inside keeps its bits (a 4-dim base too:
    chunks are cut per leading index until contiguous)."""
    take = WINDOWS.get(name) or {"[1, 2:5]": lambda x: x[1, 2:5], "[:, 1:2, :]": lambda x: x[:, 1:2, :]}[name]
    base = _base(seed=3)
    if name == "[:, 1:2, :]":  # a 4-dim base [B, 3, P+T, V]: the window is a box of dims 0-1
        base = torch.randn(B, 3, P + T, V, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    _, window = window_of(take(base))
    t = base.detach().clone()
    inside = torch.zeros(t.shape, dtype=torch.bool)
    window.of(inside)[...] = True
    window.zero_outside(t)
    assert torch.equal(t[inside], base.detach()[inside])
    assert torch.count_nonzero(t[~inside]) == 0 and torch.count_nonzero(t[inside]) > 0


def test_contiguous_chunks_cover_a_strided_slice_in_order():
    from rlkernel.ops._views import MAX_CHUNKS, _contiguous_chunks

    x = torch.arange(5 * 7 * 3).reshape(5, 7, 3)
    chunks = _contiguous_chunks(x[:, 2:4])
    assert len(chunks) == 5 and all(c.is_contiguous() for c in chunks)
    assert torch.equal(torch.stack(chunks), x[:, 2:4])
    wide = torch.zeros(MAX_CHUNKS + 1, 4, 2)[:, :2]  # too many pieces: the strided view itself
    assert len(_contiguous_chunks(wide)) == 1
