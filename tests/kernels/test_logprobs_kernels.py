"""Triton kernels of token_logprobs against the reference: values, gradients, layouts, invariance.

On a machine without a GPU every test here runs the kernels in the Triton interpreter on CPU
tensors at tiny sizes (see conftest.py); with a GPU the same tests run the compiled kernels, and the
``gpu``-marked ones add the real sizes (N > 65,535 rows, N·V > 2^31, V = 151,936).
"""

import warnings

import pytest
import torch

import rlkernel as rk
from rlkernel.reference import logprobs as ref

from .conftest import DEVICE, ON_GPU, requires_cuda

# (atol, rtol). "fwd": fp32 logp/entropy of the kernel vs the fp32 reference on the same input
# values (DESIGN: ≤ 1e-5 absolute for bf16 inputs). "grad": the kernel's gradient, rounded once to
# the logits' dtype, vs the fp32 gradient of the reference: one rounding, so half an ulp of the dtype
# (bf16 2^-9, fp16 2^-11 relative); the absolute floor covers fp16 subnormals and the entropy term
# p·(log p + H), which cancels to ~0 where log p ≈ −H so that only an absolute bound holds there.
TOLERANCES = {
    torch.float32: {"fwd": (1e-5, 1e-5), "grad": (1e-6, 1e-5)},
    torch.bfloat16: {"fwd": (1e-5, 1e-5), "grad": (1e-6, 2**-8)},
    torch.float16: {"fwd": (1e-5, 1e-5), "grad": (1e-7, 2**-10)},
}
DTYPES = list(TOLERANCES)


def grad_tol(dtype):
    # The Triton 3.9 interpreter converts fp32 -> bf16 by truncating the mantissa (its
    # ``_convert_float``), where the GPU rounds to nearest even: up to one full bf16 ulp (2^-7).
    if dtype == torch.bfloat16 and not ON_GPU:
        return (TOLERANCES[dtype]["grad"][0], 2**-7)
    return TOLERANCES[dtype]["grad"]


# The interpreter evaluates numpy ops that see −inf/NaN on masked lanes and ignored rows.
pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def kernels():
    # Imported inside tests so that conftest.py has set TRITON_INTERPRET before the kernels exist.
    from rlkernel.kernels import logprobs

    return logprobs


def make(lead=(5,), vocab=37, dtype=torch.float32, scale=3.0, seed=0, ignore=()):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g) * scale).to(dtype).to(DEVICE)
    ids = torch.randint(0, vocab, lead, generator=g).to(DEVICE)
    for index in ignore:
        ids[index] = -100
    return logits, ids


def reference(logits, ids, **kw):
    return ref.token_logprobs(logits, ids, return_entropy=True, **kw)


def assert_close(actual, expected, tol):
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def reference_grads(logits, ids, g_logp, g_ent, temperature=1.0):
    """fp32 autograd gradient of the reference on the same values."""
    x = logits.detach().float().requires_grad_(True)
    logp, ent = reference(x, ids, temperature=temperature)
    loss = 0.0
    if g_logp is not None:
        loss = loss + (logp * g_logp).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return x.grad


# ------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("vocab", [1, 3, 37, 300])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_forward_matches_reference(dtype, temperature, vocab, with_entropy):
    logits, ids = make(lead=(4,), vocab=vocab, dtype=dtype, seed=vocab, ignore=(1,))
    out = rk.token_logprobs(logits, ids, temperature=temperature, return_entropy=with_entropy)
    exp_logp, exp_ent = reference(logits, ids, temperature=temperature)
    logp, ent = out if with_entropy else (out, None)
    assert logp.dtype == torch.float32 and logp.shape == ids.shape
    assert_close(logp, exp_logp, TOLERANCES[dtype]["fwd"])
    assert logp[1] == 0
    if with_entropy:
        assert_close(ent, exp_ent, TOLERANCES[dtype]["fwd"])
        assert ent[1] == 0


def test_forward_error_at_most_twice_the_reference_error():
    # FlashAttention's rule: against a float64 oracle, the kernel may not be much worse than PyTorch.
    logits, ids = make(lead=(6,), vocab=300, dtype=torch.bfloat16, scale=5.0, seed=3)
    x64 = logits.double()
    oracle = torch.log_softmax(x64 / 0.7, -1)
    o_logp = oracle.gather(-1, ids[:, None]).squeeze(-1)
    o_ent = -(oracle.exp() * oracle).sum(-1)
    logp, ent = rk.token_logprobs(logits, ids, temperature=0.7, return_entropy=True)
    r_logp, r_ent = reference(logits, ids, temperature=0.7)
    for mine, theirs, exact in ((logp, r_logp, o_logp), (ent, r_ent, o_ent)):
        err = (mine.double() - exact).abs().max().item()
        ref_err = (theirs.double() - exact).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, (err, ref_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_vocab_larger_than_one_block(dtype, with_entropy):
    vocab = 9000  # not a power of two; 5 forward tiles of 2048
    assert kernels().fwd_config(vocab, dtype).block_v < vocab
    logits, ids = make(lead=(3,), vocab=vocab, dtype=dtype, seed=7, ignore=(2,))
    logits[0, 8500] = 25.0  # the row max sits in the last, partial tile
    out = rk.token_logprobs(logits, ids, temperature=0.9, return_entropy=with_entropy)
    exp_logp, exp_ent = reference(logits, ids, temperature=0.9)
    logp, ent = out if with_entropy else (out, None)
    assert_close(logp, exp_logp, TOLERANCES[dtype]["fwd"])
    if with_entropy:
        assert_close(ent, exp_ent, TOLERANCES[dtype]["fwd"])


@pytest.mark.parametrize("vocab", [37, 300])
def test_many_small_tiles_rescale_correctly(vocab):
    # A 16-wide tile makes every row a long stream of online-softmax rescalings, cheaply.
    k = kernels()
    logits, ids = make(lead=(4,), vocab=vocab, seed=11, ignore=(3,))
    logits[0, :20] = float("-inf")  # the first tile (and a half) of row 0 is all −inf
    logits[1] = torch.linspace(-20, 20, vocab, device=DEVICE)  # the max grows in every tile
    logits[2, -1] = 40.0  # one dominant value in the last, partial tile
    logp, ent, lse = k.token_logprobs_fwd(
        logits, ids, temperature=0.8, return_entropy=True, config=k.KernelConfig(16, 1, 2)
    )
    exp_logp, exp_ent = reference(logits, ids, temperature=0.8)
    assert_close(logp, exp_logp, (1e-5, 1e-5))
    assert_close(ent, exp_ent, (1e-5, 1e-5))
    active = ids != -100
    exp_lse = torch.logsumexp(logits.float() / 0.8, -1)
    assert_close(lse[active], exp_lse[active], (1e-5, 1e-6))


def test_strided_input_is_read_without_a_copy():
    k = kernels()
    logits, ids = make(lead=(3, 6), vocab=37, dtype=torch.bfloat16, seed=5, ignore=((1, 2),))
    sliced, sliced_ids = logits[:, :-1], ids[:, 1:]
    assert not sliced.is_contiguous()
    assert k.row_layout(sliced) == (5, 6 * 37, 37, 1)  # two strided row dims, no copy
    assert k.as_kernel_layout(sliced) is sliced
    logp, ent = rk.token_logprobs(sliced, sliced_ids, return_entropy=True)
    exp_logp, exp_ent = rk.token_logprobs(sliced.contiguous(), sliced_ids, return_entropy=True)
    assert torch.equal(logp, exp_logp) and torch.equal(ent, exp_ent)


def test_properties_normalization_shift_invariance_entropy_bounds():
    logits, _ = make(lead=(3,), vocab=11, seed=61)
    rows = logits[:, None, :].expand(3, 11, 11)  # each row once per id: a stride-0 dim, no copy
    ids = torch.arange(11, device=DEVICE).expand(3, 11)
    assert kernels().row_layout(rows) == (11, 11, 0, 1)
    logp_all = rk.token_logprobs(rows, ids)
    torch.testing.assert_close(logp_all.exp().sum(-1), torch.ones(3, device=DEVICE), atol=1e-6, rtol=0)
    assert_close(rk.token_logprobs(rows + 5.0, ids), logp_all, (1e-5, 0))
    _, ent = rk.token_logprobs(logits, ids[:, 0], return_entropy=True)
    assert bool((ent >= 0).all()) and bool((ent <= torch.log(torch.tensor(11.0)) + 1e-6).all())


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x[:, 1:, :-1],  # leading dims do not fold into two: one copy
        lambda x: x.reshape(-1, x.shape[-1]).t().contiguous().t(),  # column stride N: read in place
        lambda x: x[..., ::2],  # column stride 2
        lambda x: x.transpose(0, 1),  # permuted leading dims
    ],
)
def test_other_layouts(view):
    logits, ids = make(lead=(2, 3, 4), vocab=38, seed=2)
    x = view(logits)
    ids = torch.randint(0, x.shape[-1], x.shape[:-1], device=DEVICE)
    x = x.detach().requires_grad_(True)
    logp, ent = rk.token_logprobs(x, ids, return_entropy=True)
    exp_logp, exp_ent = reference(x.detach(), ids)
    assert_close(logp, exp_logp, TOLERANCES[torch.float32]["fwd"])
    assert_close(ent, exp_ent, TOLERANCES[torch.float32]["fwd"])
    (logp.sum() + ent.sum()).backward()
    expected = reference_grads(x, ids, torch.ones_like(logp), torch.ones_like(ent))
    assert x.grad.shape == x.shape
    assert_close(x.grad, expected, grad_tol(torch.float32))


def test_layout_helpers():
    k = kernels()
    x = torch.empty(2, 3, 4, 10)
    assert k.row_layout(x) == (24, 0, 10, 1)
    assert k.row_layout(x[:, 1:]) == (8, 120, 10, 1)
    assert k.row_layout(x[:, :, :-1]) == (3, 40, 10, 1)
    assert k.row_layout(x[:, 1:, :-1]) is None
    assert k.row_layout(x[:1, :1, :1]) == (1, 0, 0, 1)
    assert k.row_layout(torch.empty(2**20, 3000, device="meta").t()) is None  # int32 column offsets
    assert k.can_write_in_place(x[:, :-1]) and k.can_write_in_place(x.transpose(1, 2))
    assert not k.can_write_in_place(torch.empty(3, 1).expand(3, 5))


# ----------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_backward_matches_reference_autograd(dtype, which, temperature):
    logits, ids = make(lead=(5,), vocab=37, dtype=dtype, seed=13, ignore=(2,))
    logits[4, 3] = float("-inf")
    x = logits.clone().requires_grad_(True)
    logp, ent = rk.token_logprobs(x, ids, temperature=temperature, return_entropy=True)
    gen = torch.Generator().manual_seed(1)
    g_logp = torch.randn(5, generator=gen).to(DEVICE) if which != "entropy" else None
    g_ent = torch.randn(5, generator=gen).to(DEVICE) if which != "logp" else None
    loss = (logp * g_logp).sum() if g_logp is not None else (ent * g_ent).sum()
    if which == "both":
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    assert x.grad.dtype == dtype
    expected = reference_grads(logits, ids, g_logp, g_ent, temperature)
    assert_close(x.grad, expected, grad_tol(dtype))
    assert bool((x.grad[2] == 0).all()), "ignored row must get exact zeros"
    assert x.grad[4, 3] == 0 and torch.isfinite(x.grad).all(), "a −inf logit gets a zero gradient"


def test_backward_larger_than_one_tile():
    vocab = 5000  # 2 backward tiles in bf16 (4096 per tile), 3 in fp32 (2048 per tile)
    for dtype in (torch.float32, torch.bfloat16):
        logits, ids = make(lead=(2,), vocab=vocab, dtype=dtype, seed=17)
        x = logits.clone().requires_grad_(True)
        logp, ent = rk.token_logprobs(x, ids, return_entropy=True)
        (logp.sum() - 0.5 * ent.sum()).backward()
        expected = reference_grads(
            logits, ids, torch.ones(2, device=DEVICE), -0.5 * torch.ones(2, device=DEVICE)
        )
        assert_close(x.grad, expected, grad_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_inplace_backward_equals_out_of_place(dtype, strided):
    logits, ids = make(lead=(2, 5), vocab=37, dtype=dtype, seed=19, ignore=((0, 3),))

    def run(inplace):
        x = logits.clone().requires_grad_(True)
        inp, tok = (x[:, :-1], ids[:, 1:]) if strided else (x, ids)
        logp, ent = rk.token_logprobs(
            inp, tok, temperature=1.3, return_entropy=True, inplace_backward=inplace
        )
        (2 * logp.sum() + ent.sum()).backward()
        return x

    out_of_place, in_place = run(False), run(True)
    assert torch.equal(in_place.grad, out_of_place.grad)
    if not strided:  # a leaf: its gradient lives in its own storage, no new [N, V] tensor
        assert in_place.grad.data_ptr() == in_place.data_ptr()


def test_inplace_backward_bumps_the_version_counter():
    # A node that saved the same logits and runs after ours must fail loudly, not read the gradient.
    logits, ids = make(lead=(3,), vocab=11)
    x = logits.clone().requires_grad_(True)
    y = x * 1.0
    s = torch.sin(y)  # saves y; created first, so its backward runs after ours
    logp = rk.token_logprobs(y, ids, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + s.sum()).backward()
    # A backward that retains the graph writes out of place (the next one reads the logits), so a
    # second backward accumulates the same gradient again; only the last one writes in place.
    leaf = logits.clone().requires_grad_(True)
    logp = rk.token_logprobs(leaf * 1.0, ids, inplace_backward=True)
    logp.sum().backward(retain_graph=True)
    once = leaf.grad.clone()
    logp.sum().backward()
    torch.testing.assert_close(leaf.grad, 2 * once)


# -------------------------------------------------------------------- invariance & determinism
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_bitwise_batch_invariant(dtype):
    vocab = 300
    logits, ids = make(lead=(8,), vocab=vocab, dtype=dtype, seed=23, ignore=(5,))
    g_logp = torch.randn(8, device=DEVICE)
    g_ent = torch.randn(8, device=DEVICE)

    def run(x, tok, gl, ge):
        x = x.clone().requires_grad_(True)
        logp, ent = rk.token_logprobs(x, tok, temperature=0.7, return_entropy=True)
        ((logp * gl).sum() + (ent * ge).sum()).backward()
        return logp.detach(), ent.detach(), x.grad

    alone = [run(logits[i : i + 1], ids[i : i + 1], g_logp[i : i + 1], g_ent[i : i + 1]) for i in range(8)]
    for rows in (slice(0, 2), slice(1, 6), slice(0, 8)):
        batch = run(logits[rows], ids[rows], g_logp[rows], g_ent[rows])
        for j, i in enumerate(range(8)[rows]):
            for a, b in zip(alone[i], batch, strict=True):
                assert torch.equal(a[0], b[j]), (rows, i)
    # The same rows inside a padded [B, T, V] tensor read through logits[:, :-1]: same bits.
    padded = torch.zeros(2, 5, vocab, dtype=dtype, device=DEVICE)
    padded[:, :4] = logits.reshape(2, 4, vocab)
    padded_ids = torch.full((2, 5), -100, device=DEVICE)
    padded_ids[:, :4] = ids.reshape(2, 4)
    logp, ent = rk.token_logprobs(padded[:, :-1], padded_ids[:, :-1], temperature=0.7, return_entropy=True)
    for i in range(8):
        assert torch.equal(logp.reshape(-1)[i : i + 1], alone[i][0])
        assert torch.equal(ent.reshape(-1)[i : i + 1], alone[i][1])


def test_runs_are_bitwise_deterministic():
    logits, ids = make(lead=(6,), vocab=300, dtype=torch.bfloat16, seed=29, ignore=(0,))

    def run():
        x = logits.clone().requires_grad_(True)
        logp, ent = rk.token_logprobs(x, ids, return_entropy=True)
        (logp.sum() + ent.sum()).backward()
        return logp, ent, x.grad

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


def test_config_depends_only_on_vocab_and_dtype():
    k = kernels()
    for dtype in DTYPES:
        for vocab in (1, 37, 32768, 151936):
            cfg = k.fwd_config(vocab, dtype)
            assert cfg.block_v & (cfg.block_v - 1) == 0 and cfg.block_v <= k.FWD_BLOCK_V
            # the forward tile (which fixes the bits) is the same with and without entropy
            assert k.fwd_config(vocab, dtype, with_entropy=True).block_v == cfg.block_v
            assert k.bwd_config(vocab, dtype).block_v * dtype.itemsize <= k.BWD_TILE_BYTES
    assert k.fwd_config(151936, torch.bfloat16).block_v == 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logp_bits_do_not_depend_on_entropy_request(dtype):
    logits, ids = make(lead=(4,), vocab=5000, dtype=dtype, seed=11)
    alone = rk.token_logprobs(logits, ids, temperature=0.9)
    with_entropy, _ = rk.token_logprobs(logits, ids, temperature=0.9, return_entropy=True)
    assert torch.equal(alone, with_entropy)


# ---------------------------------------------------------------------------- special values
def test_neg_inf_logits_finite_and_nan_propagates():
    logits = torch.tensor(
        [[0.0, float("-inf"), 1.0], [2.0, float("nan"), 0.0], [1.0, 2.0, 3.0]], device=DEVICE
    )
    ids = torch.tensor([2, 0, 1], device=DEVICE)
    x = logits.clone().requires_grad_(True)
    logp, ent = rk.token_logprobs(x, ids, return_entropy=True)
    exp_logp, exp_ent = reference(logits, ids)
    assert torch.isfinite(logp[0]) and torch.isfinite(ent[0])
    assert torch.isnan(logp[1]) and torch.isnan(ent[1])
    assert_close(logp[[0, 2]], exp_logp[[0, 2]], (1e-6, 1e-6))
    assert_close(ent[[0, 2]], exp_ent[[0, 2]], (1e-6, 1e-6))
    (logp[[0, 2]].sum() + ent[[0, 2]].sum()).backward()
    assert x.grad[0, 1] == 0 and torch.isfinite(x.grad[[0, 2]]).all()


def test_large_logit_offsets_keep_entropy_accurate():
    logits, ids = make(lead=(4,), vocab=300, seed=31)
    logp, ent = rk.token_logprobs(logits + 1000.0, ids, return_entropy=True)
    exp_logp, exp_ent = reference(logits, ids)  # shift invariance: same distribution
    assert_close(logp, exp_logp, (1e-4, 0))  # the shifted fp32 inputs themselves carry ~6e-5 rounding
    assert_close(ent, exp_ent, (1e-4, 0))
    assert bool((ent >= 0).all())


def test_empty_input():
    logits = torch.randn(0, 7, device=DEVICE, requires_grad=True)
    logp, ent = rk.token_logprobs(
        logits, torch.zeros(0, dtype=torch.long, device=DEVICE), return_entropy=True
    )
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert logits.grad.shape == (0, 7)


def test_out_of_range_id_without_validation_gives_nan_not_a_bad_read():
    logits, ids = make(lead=(3,), vocab=11)
    ids[1] = 11
    logp = rk.token_logprobs(logits, ids, validate=False)
    assert torch.isnan(logp[1]) and torch.isfinite(logp[[0, 2]]).all()


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_id_dtypes_and_custom_ignore_index(id_dtype):
    logits, ids = make(lead=(4,), vocab=37, seed=37)
    ids[3] = 7
    logp = rk.token_logprobs(logits, ids.to(id_dtype), ignore_index=7)
    exp_logp, _ = reference(logits, ids, ignore_index=7)
    assert_close(logp, exp_logp, (1e-6, 1e-6))
    assert logp[3] == 0


def test_float64_falls_back_to_the_reference():
    logits, ids = make(lead=(3,), vocab=9)
    logp = rk.token_logprobs(logits.double(), ids)
    assert logp.dtype == torch.float64


# -------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(logits=torch.randn(3, 5).long()), TypeError, "logits"),
        (dict(token_ids=torch.zeros(3)), TypeError, "token_ids"),
        (dict(token_ids=torch.zeros(4, dtype=torch.long)), ValueError, "token_ids must have shape"),
        (dict(token_ids=torch.tensor([0, 5, 1])), ValueError, r"outside \[0, 5\)"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(logits=torch.randn(3, 0)), ValueError, "vocabulary"),
        (dict(logits=torch.randn(())), ValueError, "logits must have at least 1"),
    ],
)
def test_bad_input_still_raises_on_the_triton_path(kwargs, exc, match):
    args = dict(logits=torch.randn(3, 5), token_ids=torch.tensor([0, 4, 1]))
    temperature = kwargs.pop("temperature", 1.0)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        rk.token_logprobs(args["logits"].to(DEVICE), args["token_ids"].to(DEVICE), temperature=temperature)


# ------------------------------------------------------------------------ custom ops, compile
def test_custom_ops_pass_opcheck():
    from rlkernel.ops import _logprobs_function  # noqa: F401  (registers the ops)

    logits, ids = make(lead=(3,), vocab=37, seed=41, ignore=(1,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(torch.ops.rlkernel.token_logprobs_fwd, (logits, ids, 0.8, -100, True))
        logp, ent, lse = torch.ops.rlkernel.token_logprobs_fwd(logits, ids, 0.8, -100, True)
        g = torch.randn(3, device=DEVICE)
        bwd_args = (logits, ids, lse, ent, g, g, 0.8, -100)
        torch.library.opcheck(torch.ops.rlkernel.token_logprobs_bwd, bwd_args)
        torch.library.opcheck(torch.ops.rlkernel.token_logprobs_bwd_inplace, (logits.clone(),) + bwd_args[1:])


def test_torch_compile_fullgraph():
    # On CPU the interpreter runs inside a compiled graph only with backend="aot_eager" (Dynamo +
    # AOTAutograd + the fake kernels are what this checks); on a GPU, the full Inductor stack.
    backend = "inductor" if ON_GPU else "aot_eager"
    logits, ids = make(lead=(2, 5), vocab=37, dtype=torch.bfloat16, seed=43, ignore=((1, 1),))

    def loss_fn(x, tok, inplace):
        logp, ent = rk.token_logprobs(
            x[:, :-1],
            tok[:, 1:],
            temperature=0.7,
            return_entropy=True,
            validate=False,
            inplace_backward=inplace,
        )
        return (logp * 2).sum() + ent.mean()

    for inplace in (False, True):
        torch._dynamo.reset()
        eager_x = logits.clone().requires_grad_(True)
        eager = loss_fn(eager_x, ids, inplace)
        eager.backward()
        compiled_x = logits.clone().requires_grad_(True)
        compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)(compiled_x, ids, inplace)
        compiled.backward()
        # Inductor may sum the loss in another order; the kernels' gradients must agree bitwise.
        torch.testing.assert_close(eager.detach(), compiled.detach(), rtol=1e-6, atol=0)
        assert torch.equal(eager_x.grad, compiled_x.grad)


# ----------------------------------------------------------------------------- GPU, real sizes
def make_on_gpu(n, vocab, seed, scale=3.0):
    """Random bf16 logits generated on the GPU (no multi-GB host tensor) and ids."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(n, vocab, device=DEVICE, dtype=torch.bfloat16, generator=gen).mul_(scale)
    ids = torch.randint(0, vocab, (n,), device=DEVICE, generator=gen)
    return logits, ids


@pytest.mark.gpu
@requires_cuda
def test_gpu_bf16_qwen_vocab_matches_fp32_reference():
    logits, ids = make_on_gpu(512, 151936, seed=47, scale=4.0)
    ids[7] = -100
    logp, ent = rk.token_logprobs(logits, ids, return_entropy=True)
    exp_logp, exp_ent = reference(logits, ids)
    assert (logp - exp_logp).abs().max().item() <= 1e-5
    assert (ent - exp_ent).abs().max().item() <= 1e-4  # Σ over 151,936 terms of p·log p


@pytest.mark.gpu
@requires_cuda
def test_gpu_more_than_65535_rows_and_inplace():
    n, vocab = 70_000, 1000
    logits, ids = make_on_gpu(n, vocab, seed=53)
    ids[n - 1] = -100
    x = logits.clone().requires_grad_(True)
    logp = rk.token_logprobs(x, ids, inplace_backward=True)
    logp.sum().backward()
    tail = slice(n - 300, n)
    exp_logp, _ = reference(logits[tail], ids[tail])
    assert_close(logp[tail], exp_logp, TOLERANCES[torch.bfloat16]["fwd"])
    expected = reference_grads(logits[tail], ids[tail], torch.ones(300, device=DEVICE), None)
    assert_close(x.grad[tail], expected, grad_tol(torch.bfloat16))
    assert bool((x.grad[n - 1] == 0).all())


@pytest.mark.gpu
@requires_cuda
def test_gpu_more_than_2_pow_31_elements():
    vocab = 32768
    n = 2**31 // vocab + 1024  # 66,560 rows, 2.18e9 bf16 values (4.4 GB); the tail is past 2^31
    free, _ = torch.cuda.mem_get_info()
    if free < 2.5 * n * vocab * 2:
        pytest.skip("not enough free GPU memory")
    logits, ids = make_on_gpu(n, vocab, seed=59)
    tail = slice(n - 64, n)
    tail_logits = logits[tail].clone()  # the in-place backward overwrites the logits
    x = logits.requires_grad_(True)
    logp, ent = rk.token_logprobs(x, ids, return_entropy=True, inplace_backward=True)
    (logp.sum() + ent.sum()).backward()
    exp_logp, exp_ent = reference(tail_logits, ids[tail])
    assert_close(logp[tail], exp_logp, TOLERANCES[torch.bfloat16]["fwd"])
    assert_close(ent[tail], exp_ent, (1e-4, 1e-5))
    ones = torch.ones(64, device=DEVICE)
    expected = reference_grads(tail_logits, ids[tail], ones, ones)
    assert_close(x.grad[tail], expected, grad_tol(torch.bfloat16))
