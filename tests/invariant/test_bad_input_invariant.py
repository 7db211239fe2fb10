"""Bad input to ``rlkernel.invariant``: a clear ``ValueError``/``TypeError`` naming the argument, never
uninitialised memory, an out-of-bounds read or a silently different answer; NaN/Inf propagate only to
the rows that see them (DESIGN.md, "Bad input").

Attention cases run on both backends (``reference`` and ``triton``, the latter in the CPU interpreter
without a GPU): both must reject the same inputs. Every input is random (no zeros), so that a kernel
reading memory it should not cannot pass by accident.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel.invariant as inv
from rlkernel.invariant import attention
from rlkernel.reference import attention as ref

COVERED = [
    inv.attention,
    inv.linear,
    inv.matmul,
    inv.patch_hf_model,
    inv.rms_norm,
    inv.unpatch_hf_model,
]

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def small_reference_blocks(monkeypatch):
    monkeypatch.setattr(ref, "BLOCK_N", 8)  # seam (test size): several key blocks in short test sequences


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", request.param)
    return request.param


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def packed_qkv(n_q=9, n_k=9, hq=2, hkv=1, d=16, seed=0):
    return randn(n_q, hq, d, seed=seed), randn(n_k, hkv, d, seed=seed + 1), randn(n_k, hkv, d, seed=seed + 2)


def cu(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ------------------------------------------------------------------ attention: packed size hints
@pytest.mark.parametrize("max_seqlen_q", [4, 1, 0, -1])
def test_attention_max_seqlen_q_below_the_longest_sequence_raises(backend, max_seqlen_q):
    q, k, v = packed_qkv()
    c = cu(0, 4, 9)  # the longest query sequence has 5 rows
    with pytest.raises(ValueError, match=r"max_seqlen_q must be >= the longest query sequence .*\(5\)"):
        attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=max_seqlen_q)


def test_attention_max_seqlen_q_valid_hints_give_the_same_bits(backend):
    q, k, v = packed_qkv(seed=3)
    c = cu(0, 4, 9)
    want = attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c)
    assert not want.isnan().any()
    for hint in (5, 6, 40):  # exact, and any larger bound
        assert torch.equal(attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=hint), want)


def test_attention_max_seqlen_q_wrong_type_or_form_raises(backend):
    q, k, v = packed_qkv()
    c = cu(0, 4, 9)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=5.0)
    with pytest.raises(ValueError, match="max_seqlen_q applies to the packed form only"):
        attention(q[None], k[None], v[None], max_seqlen_q=9)


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "match"),
    [
        ((-2, 4, 9), (0, 4, 9), "cu_seqlens_q must start at 0, got -2"),
        ((0, 4, 9), (0, -1, 9), "cu_seqlens_k must be non-decreasing"),
        ((0, 6, 4, 9), (0, 6, 7, 9), "cu_seqlens_q must be non-decreasing"),
        ((0, 4, 8), (0, 4, 9), "cu_seqlens_q must end at the packed length 9, got 8"),
        ((0, 4, 9), (0, 4, 12), "cu_seqlens_k must end at the packed length 9, got 12"),
        ((0, 4, 9), (0, 5, 9), "sequence 1 has 5 queries and 4 keys"),
        ((0, 9), (0, 4, 9), "same number of sequences"),
    ],
)
def test_attention_bad_cu_seqlens_raise(backend, cu_q, cu_k, match):
    q, k, v = packed_qkv()
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, cu_seqlens_q=cu(*cu_q), cu_seqlens_k=cu(*cu_k))


def test_attention_cu_seqlens_wrong_dtype_or_shape_raise(backend):
    q, k, v = packed_qkv()
    c = cu(0, 4, 9)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer tensor"):
        attention(q, k, v, cu_seqlens_q=c.float(), cu_seqlens_k=c)
    with pytest.raises(ValueError, match="cu_seqlens_k must be 1-D"):
        attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c[None])


# -------------------------------------------------------------------------- attention: key_start
@pytest.mark.parametrize("starts", [(-3, 0), (0, -1), (2, 6), (7, 1)])
def test_attention_key_start_out_of_range_raises(backend, starts):
    q, k, v = randn(2, 4, 2, 16), randn(2, 5, 1, 16, seed=1), randn(2, 5, 1, 16, seed=2)
    bad = torch.tensor(starts, device=DEVICE)
    i = next(j for j, s in enumerate(starts) if not 0 <= s <= 5)
    match = rf"key_start must be in \[0, Tk\] = \[0, 5\] .* got {starts[i]} at batch index {i}"
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, key_start=bad)


def test_attention_key_start_edges_are_valid(backend):
    q, k, v = randn(2, 4, 2, 16, seed=5), randn(2, 5, 1, 16, seed=6), randn(2, 5, 1, 16, seed=7)
    out = attention(q, k, v, key_start=torch.tensor([5, 0], device=DEVICE))  # Tk: all padding
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1], attention(q[1:], k[1:], v[1:])[0])


def test_attention_unvalidated_key_start_gives_nan_rows_not_out_of_bounds_reads(backend):
    """validate=False skips the host check; the kernel (and the reference) must still never read a
    key outside the sequence: the bad sequence's rows are NaN, the others unchanged."""
    q, k, v = randn(3, 4, 2, 16, seed=8), randn(3, 6, 1, 16, seed=9), randn(3, 6, 1, 16, seed=10)
    starts = torch.tensor([-3, 2, 9], device=DEVICE)
    out = attention(q, k, v, key_start=starts, validate=False)
    assert bool(out[0].isnan().all()) and bool(out[2].isnan().all())
    want = attention(q[1:2], k[1:2], v[1:2], key_start=starts[1:2])
    assert torch.equal(out[1], want[0])


# ------------------------------------------------------------- attention: NaN/Inf stay where seen
def right_padded(lens, total, fill, hq=2, hkv=1, d=16, seed=20):
    """q, k, v [B, total, H, D]: random real rows, then ``fill`` (a number, or "random") as padding."""
    out = []
    for j, h in enumerate((hq, hkv, hkv)):
        x = randn(len(lens), total, h, d, seed=seed + j)
        for b, n in enumerate(lens):
            if fill != "random":
                x[b, n:] = fill
        out.append(x)
    return out


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
def test_attention_non_finite_right_padding_does_not_reach_real_rows(backend, fill):
    """Padding after a sequence's end (future keys for every real row) may hold anything: a KV
    buffer's uninitialised tail, NaN activations. The real rows must be bitwise what they are with
    finite padding; the padding rows, which see it, are not finite (not hidden)."""
    lens, total = [5, 19, 12], 21
    q, k, v = right_padded(lens, total, "random")
    qn, kn, vn = right_padded(lens, total, fill)
    want = attention(q, k, v)
    got = attention(qn, kn, vn)
    for b, n in enumerate(lens):
        assert torch.equal(got[b, :n], want[b, :n])
        assert not bool(got[b, n:].isfinite().any())
    got_v = attention(q, k, vn)  # non-finite values only: the padding rows see them
    for b, n in enumerate(lens):
        assert torch.equal(got_v[b, :n], want[b, :n])
        assert not bool(got_v[b, n:].isfinite().any())


def test_attention_nan_in_a_later_sequence_of_a_pack_stays_there(backend):
    q, k, v = packed_qkv(n_q=14, n_k=14, seed=30)
    c = cu(0, 6, 14)
    want = attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c)
    k2, v2 = k.clone(), v.clone()
    k2[9], v2[11] = float("nan"), float("inf")
    got = attention(q, k2, v2, cu_seqlens_q=c, cu_seqlens_k=c)
    assert torch.equal(got[:9], want[:9])  # sequence 0, and sequence 1 before its first bad key
    assert bool(got[9:].isnan().all())  # the NaN key: every score of rows 9.. is NaN


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_attention_nan_reaches_exactly_the_rows_that_see_it(backend, where):
    """A NaN at position 9 of one sequence: rows before 9 exact, rows from 9 on NaN (a NaN score
    must not be taken for a row that sees no key and output 0), the other sequence untouched. A NaN
    query is its own row's alone."""
    q, k, v = randn(2, 20, 2, 16, seed=40), randn(2, 20, 1, 16, seed=41), randn(2, 20, 1, 16, seed=42)
    want = attention(q, k, v)
    x = {"q": q, "k": k, "v": v}
    x[where] = x[where].clone()
    x[where][0, 9, 0, 3] = float("nan")
    got = attention(x["q"], x["k"], x["v"])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0, :9], want[0, :9])
    if where == "q":
        assert bool(got[0, 9, 0].isnan().all())
        assert torch.equal(got[0, 9, 1], want[0, 9, 1]) and torch.equal(got[0, 10:], want[0, 10:])
    else:  # both q heads read kv head 0; a row that sees a NaN key or value is NaN as a whole
        assert bool(got[0, 9:].isnan().all())


def test_attention_left_padding_garbage_is_ignored_forward_and_backward(backend):
    """NaN in every padding position before key_start (queries, keys, values and the output
    gradient of the padding rows): the real rows' outputs and all gradients are those of random
    finite padding; padding rows output 0 and get zero gradients."""
    starts = torch.tensor([7, 0, 13], device=DEVICE)
    b, t = 3, 16
    base = [randn(b, t, 2, 16, seed=50), randn(b, t, 1, 16, seed=51), randn(b, t, 1, 16, seed=52)]
    g = randn(b, t, 2, 16, seed=53)
    bad = [x.clone() for x in base]
    g_bad = g.clone()
    for i, s in enumerate(starts.tolist()):
        for x in (*bad, g_bad):
            x[i, :s] = float("nan")

    def run(tensors, grad):
        leaves = [x.clone().requires_grad_(True) for x in tensors]
        out = attention(*leaves, key_start=starts)
        out.backward(grad)
        return out.detach(), [x.grad for x in leaves]

    out, grads = run(base, g)
    out_bad, grads_bad = run(bad, g_bad)
    for i, s in enumerate(starts.tolist()):
        assert torch.equal(out_bad[i, s:], out[i, s:])
        assert torch.equal(out_bad[i, :s], torch.zeros_like(out_bad[i, :s]))
        for a, w in zip(grads_bad, grads, strict=True):
            assert torch.equal(a[i, s:], w[i, s:])
            assert torch.equal(a[i, :s], torch.zeros_like(a[i, :s]))


def _grads(q, k, v, g, **kw):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    attention(*leaves, **kw).backward(g)
    return [x.grad for x in leaves]


def test_attention_backward_future_nan_key_does_not_reach_earlier_rows(backend):
    """NaN in the key and value at position 11 of a sequence: dq of rows 0..10, which do not see
    it, is exactly that of finite inputs; the rows that see it get NaN, not a hidden 0."""
    t = 20
    q, k, v = randn(1, t, 2, 16, seed=60), randn(1, t, 1, 16, seed=61), randn(1, t, 1, 16, seed=62)
    g = randn(1, t, 2, 16, seed=63)
    k2, v2 = k.clone(), v.clone()
    k2[0, 11, 0, 5], v2[0, 11, 0, 2] = float("nan"), float("nan")
    dq = _grads(q, k, v, g)[0]
    dq2 = _grads(q, k2, v2, g)[0]
    assert torch.equal(dq2[0, :11], dq[0, :11])
    assert bool(dq2[0, 11:].isnan().any(-1).all())


def test_attention_backward_nan_query_row_does_not_reach_later_keys(backend):
    """NaN in the query and the output gradient of row 5: no other row's dq changes, and keys 6..19
    (which row 5 does not see) get exactly the dk/dv of finite inputs."""
    t = 20
    q, k, v = randn(1, t, 2, 16, seed=70), randn(1, t, 1, 16, seed=71), randn(1, t, 1, 16, seed=72)
    g = randn(1, t, 2, 16, seed=73)
    q2, g2 = q.clone(), g.clone()
    q2[0, 5, 1, 7], g2[0, 5, 0, 4] = float("nan"), float("nan")
    dq, dk, dv = _grads(q, k, v, g)
    dq2, dk2, dv2 = _grads(q2, k, v, g2)
    others = [i for i in range(t) if i != 5]
    assert torch.equal(dq2[0, others], dq[0, others])
    assert torch.equal(dk2[0, 6:], dk[0, 6:]) and torch.equal(dv2[0, 6:], dv[0, 6:])
    assert bool(dk2[0, :6].isnan().any()) and bool(dv2[0, :6].isnan().any())


# ------------------------------------------------------------------------ patch_hf_model: modules
@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()  # as tests/invariant/test_patch.py: the CPU path is many tiny ops
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(arch: str, seed: int = 0):
    """A randomly initialised 1-layer Qwen3 or Llama model (CPU, fp32, SDPA)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (
        (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    )
    cfg = config_cls(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, attn_implementation="sdpa", tie_word_embeddings=False,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def token_ids(seed=1):
    return torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(seed))


class DoublingLinear(torch.nn.Linear):
    """An lm_head subclass with its own forward (stands for a quantized/adapter/scaled layer)."""

    def forward(self, x):
        return 2 * super().forward(x)


class TaggedLinear(torch.nn.Linear):
    """A subclass that keeps nn.Linear.forward: safe to patch."""


def logits(m, ids):
    with torch.no_grad():
        return m(input_ids=ids).logits


def assert_original(m, ids, want):
    from rlkernel.invariant.patch import is_patched

    assert not any(is_patched(x) for x in m.modules())
    assert not any(type(x).__name__.startswith("Invariant") for x in m.modules())
    assert all(
        getattr(x.config, "_attn_implementation", "sdpa") == "sdpa"
        for x in m.modules()
        if hasattr(x, "config")
    )
    assert torch.equal(logits(m, ids), want)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_patch_rejects_a_linear_subclass_with_its_own_forward(one_thread, arch):
    m = tiny_model(arch)
    m.lm_head.__class__ = DoublingLinear
    ids = token_ids()
    want = logits(m, ids)
    with pytest.raises(
        ValueError,
        match=r"cannot route lm_head \(.*DoublingLinear: a subclass of Linear with its own forward\)",
    ):
        inv.patch_hf_model(m)
    assert_original(m, ids, want)  # nothing changed
    assert type(m.lm_head) is DoublingLinear


def test_patch_allow_unpatched_leaves_them_with_a_warning(one_thread):
    m = tiny_model("qwen3")
    m.lm_head.__class__ = DoublingLinear
    ids = token_ids(2)
    want = logits(m, ids)
    with pytest.warns(UserWarning, match="left unpatched: lm_head"):
        inv.patch_hf_model(m, allow_unpatched=True)
    assert type(m.lm_head) is DoublingLinear  # its forward (the doubling) is kept
    assert type(m.model.layers[0].mlp.down_proj).__name__ == "InvariantLinear"
    torch.testing.assert_close(logits(m, ids), want, rtol=1e-4, atol=1e-5)  # not halved
    inv.unpatch_hf_model(m)
    assert_original(m, ids, want)


@pytest.mark.parametrize("flag", ["False", 0, None])
def test_patch_allow_unpatched_must_be_a_bool(one_thread, flag):
    """Issue 29: the string "False" was read as True (and patched around a module it must not)."""
    m = tiny_model("qwen3")
    m.lm_head.__class__ = DoublingLinear
    ids = token_ids(2)
    want = logits(m, ids)
    with pytest.raises(TypeError, match="allow_unpatched must be a bool"):
        inv.patch_hf_model(m, allow_unpatched=flag)
    assert_original(m, ids, want)


def test_patch_takes_a_linear_subclass_that_keeps_the_stock_forward(one_thread):
    m = tiny_model("llama")
    m.lm_head.__class__ = TaggedLinear
    ids = token_ids(3)
    want = logits(m, ids)
    inv.patch_hf_model(m)
    assert isinstance(m.lm_head, TaggedLinear) and type(m.lm_head).__name__ == "InvariantTaggedLinear"
    torch.testing.assert_close(logits(m, ids), want, rtol=1e-4, atol=1e-5)
    inv.unpatch_hf_model(m)
    assert type(m.lm_head) is TaggedLinear
    assert torch.equal(logits(m, ids), want)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_patch_rejects_an_rms_norm_subclass_with_its_own_forward(one_thread, arch):
    m = tiny_model(arch)
    base = type(m.model.norm)
    m.model.norm.__class__ = type(
        "ShiftedNorm", (base,), {"forward": lambda self, x: base.forward(self, x) + 1}
    )
    with pytest.raises(
        ValueError, match=r"cannot route model\.norm \(.*ShiftedNorm: a subclass of \w+RMSNorm"
    ):
        inv.patch_hf_model(m)


def test_patch_rejects_a_forward_replaced_on_the_instance(one_thread):
    """accelerate's hooks replace ``module.forward`` per instance: swapping the class would leave it
    bypassing the patch, silently."""
    m = tiny_model("qwen3")
    proj = m.model.layers[0].self_attn.o_proj
    proj.forward = torch.nn.Linear.forward.__get__(proj)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj .*replaced on the instance"):
        inv.patch_hf_model(m)


# ------------------------------------------------------------------------ patch_hf_model: nesting
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_nested_patch_is_rejected_and_unpatch_restores_bitwise(one_thread, arch):
    m = tiny_model(arch)
    ids = token_ids(4)
    want = logits(m, ids)
    # inner first, then the outer model: rejected, nothing changes; unpatching the outer model undoes
    # the inner patch too
    inv.patch_hf_model(m.model)
    inner = logits(m, ids)
    with pytest.raises(ValueError, match=r"model.* already patched, by patch_hf_model on a submodule"):
        inv.patch_hf_model(m)
    assert torch.equal(logits(m, ids), inner)
    inv.unpatch_hf_model(m)
    assert_original(m, ids, want)
    # outer first, then the inner model: rejected; unpatching the inner one is refused, the outer one
    # restores everything
    inv.patch_hf_model(m)
    outer = logits(m, ids)
    with pytest.raises(ValueError, match="already patched"):
        inv.patch_hf_model(m.model)
    with pytest.raises(ValueError, match="unpatch that model instead"):
        inv.unpatch_hf_model(m.model)
    assert torch.equal(logits(m, ids), outer)
    inv.unpatch_hf_model(m)
    assert_original(m, ids, want)
    # the same level twice, then unpatch twice; inner patch undone at its own level
    for target in (m, m.model):
        inv.patch_hf_model(target)
        inv.patch_hf_model(target)
        inv.unpatch_hf_model(target)
        inv.unpatch_hf_model(target)
        assert_original(m, ids, want)


def test_patch_rejects_a_module_shared_with_a_patched_model(one_thread):
    a, b = tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=2)
    b.lm_head = a.lm_head  # one module object in two models: unpatching one would unpatch the other
    ids = token_ids(5)
    want_b = logits(b, ids)
    inv.patch_hf_model(a)
    with pytest.raises(ValueError, match="lm_head is already patched"):
        inv.patch_hf_model(b)
    inv.unpatch_hf_model(a)
    assert_original(b, ids, want_b)


def test_patch_and_unpatch_reject_what_is_not_a_supported_model():
    with pytest.raises(TypeError, match="patch_hf_model: model must be one of"):
        inv.patch_hf_model(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="unpatch_hf_model: model must be one of"):
        inv.unpatch_hf_model("model")


# ---------------------------------------------------------------------- linear, matmul, rms_norm
def test_rms_norm_rejects_an_empty_hidden_dimension(backend):
    """(linear/matmul with K = 0 give F.linear's empty sum: tests/test_zero_size.py.)"""
    x = randn(3, 0)
    with pytest.raises(ValueError, match="x must have a hidden dimension >= 1"):
        inv.rms_norm(x, randn(0), eps=1e-6)


def test_linear_matmul_rms_norm_reject_mismatched_arguments(backend):
    x, w = randn(3, 8), randn(4, 8, seed=1)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = x.shape\[-1\] = 8"):
        inv.linear(x, w[:, :5])
    with pytest.raises(TypeError, match="b dtype torch.float64 must match a dtype torch.float32"):
        inv.matmul(x, w.t().double())
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        inv.rms_norm(x, randn(5), eps=1e-6)
    for eps in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            inv.rms_norm(x, randn(8), eps=eps)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_linear_matmul_rms_norm_propagate_non_finite_rows_only(backend, value):
    """A NaN/Inf in one row of x makes that row's output non-finite (not hidden) and leaves the other
    rows bitwise unchanged."""
    x, w, b, nw = randn(5, 16, seed=3), randn(8, 16, seed=4), randn(8, seed=5), randn(16, seed=6)
    bad = x.clone()
    bad[2, 3] = value
    for fn in (lambda t: inv.linear(t, w, b), lambda t: inv.matmul(t, w.t()), lambda t: inv.rms_norm(t, nw)):
        want, got = fn(x), fn(bad)
        assert not bool(got[2].isfinite().all())
        assert torch.equal(got[[0, 1, 3, 4]], want[[0, 1, 3, 4]])
