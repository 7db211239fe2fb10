"""The fast launcher (``rlkernel.kernels._launch``): same kernels, same bits, less host time.

CPU: the specialization classes, and that the interpreter (no compiled kernel) takes Triton's own
launch. GPU: every kernel that uses it gives bitwise the outputs of Triton's own launch, the second
call with one key is a fast launch, and operands that Triton specializes differently (a pointer off
16-byte alignment, a size of 1) get their own compiled kernel instead of a wrong one.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

import rlkernel as rk
from rlkernel.kernels import _launch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _arg_class(arg: object) -> object:
    """The fast launcher's class of one argument (``_launch._classes``); TypeError if it has none
    (the launcher then takes Triton's own launch)."""
    try:
        return _launch._classes((arg,))[0]
    except AttributeError:
        raise TypeError(f"no fast-launch class for an argument of type {type(arg).__name__}") from None


def test_arg_class_separates_what_triton_specializes_on():
    cls = _arg_class
    # ints: == 1, multiple of 16, int32 / int64 / uint64 range (small ones: by value, finer)
    assert cls(1) != cls(3)
    assert cls(16) != cls(17) != cls(1)
    assert cls(32) == cls(48) != cls(33)
    assert cls(33) == cls(1000001)
    assert cls(2**31 - 1) != cls(2**31)
    assert cls(2**63) != cls(2**62)
    assert len({cls(v) for v in (1, 16, 17, 32, 2**31 + 1, 2**31, 2**63 + 1, 2**64)}) == 8
    # tensors: dtype and the data pointer's address mod 16 (alignment, and finer)
    t = torch.zeros(64, dtype=torch.float32)
    assert cls(t) == cls(t[4:])  # 16 bytes further: still aligned
    assert cls(t) != cls(t[1:])  # 4 bytes further: not
    assert cls(t) != cls(t.to(torch.float16))
    # floats: by type only; anything else has no class (Triton's own launch runs)
    assert cls(0.5) == cls(2.0)
    for other in ("tf32", None, True):
        with pytest.raises(TypeError, match="no fast-launch class"):
            cls(other)


def test_tuple_arguments_are_classed_element_by_element():
    """A (named) tuple argument (the token-loss kernels' ``inputs`` and ``scalars``): Triton
    specializes each element, so its class is the tuple of theirs."""
    from rlkernel._token_loss_plan import TokenLossKernelScalars

    cls = _arg_class
    t = torch.zeros(64, dtype=torch.float32)
    assert cls((t, 3)) == (cls(t), cls(3))
    assert cls((t, 3)) != cls((t[1:], 3)) != cls((t, 16))
    scalars = TokenLossKernelScalars(*(float(i) for i in range(10)))
    assert cls(scalars) == tuple(cls(float(i)) for i in range(10))
    with pytest.raises(TypeError, match="no fast-launch class"):
        cls((t, None))


def test_descriptor_class_is_dtype_block_shape_and_layout_options():
    """A host TMA descriptor: Triton specializes on dtype and block shape (the map itself is encoded
    from base, shape and strides at every launch), so those and padding / rank separate classes,
    while another base, shape or stride does not."""
    tensor_descriptor = pytest.importorskip("triton.tools.tensor_descriptor")
    desc = tensor_descriptor.TensorDescriptor
    cls = _arg_class
    a = torch.randn(64, 128).bfloat16()
    b = torch.randn(256, 64).bfloat16()
    assert cls(desc.from_tensor(a, [16, 32])) == cls(desc.from_tensor(b, [16, 32]))  # other base/shape
    assert cls(desc.from_tensor(a, [16, 32])) == cls(desc.from_tensor(a[8:], [16, 32]))
    assert cls(desc.from_tensor(a, [16, 32])) != cls(desc.from_tensor(a, [32, 32]))
    assert cls(desc.from_tensor(a, [16, 32])) != cls(desc.from_tensor(a.half(), [16, 32]))
    assert cls(desc.from_tensor(a, [16, 32])) != cls(desc.from_tensor(a, [16, 32], padding="nan"))
    assert cls(desc.from_tensor(a[0], [32])) != cls(desc.from_tensor(a, [1, 32]))
    assert cls(desc.from_tensor(a, [16, 32])) != cls(a)


def _two_constexprs(x_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):  # never launched
    pass


def test_constexprs_out_of_signature_order_are_refused():
    """The fast path passes constexprs positionally; the first launch of a key checks their order
    (a compiled ``JITFunction``: the interpreter's functions never take the fast path)."""
    from triton.runtime.jit import JITFunction

    launcher = _launch.FastLauncher(JITFunction(_two_constexprs))
    launcher._check_order({"BLOCK": 32, "FLAG": True})
    with pytest.raises(ValueError, match="signature order"):
        launcher._check_order({"FLAG": True, "BLOCK": 32})
    with pytest.raises(ValueError, match="signature order"):
        launcher._check_order({"BLOCK": 32})


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors run kernels only in the interpreter")
def test_interpreter_takes_tritons_own_launch():
    """On CPU tensors nothing is cached: the kernel runs as before (here: a tiny matmul)."""
    from rlkernel.kernels import matmul as km

    a = torch.randn(5, 32)
    b = torch.randn(32, 16)
    hits, cached = km._launch_pointer.hits, len(km._launch_pointer._compiled)
    out = km.matmul(a, b)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)
    assert (km._launch_pointer.hits, len(km._launch_pointer._compiled)) == (hits, cached)


def test_hooks_installed_reads_the_hook_chains(monkeypatch):
    from triton import knobs

    assert not _launch._hooks_installed()
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a HookChain (Triton 3.5+)
        hook = lambda metadata: None  # noqa: E731
        chain.add(hook)
        try:
            assert _launch._hooks_installed()
        finally:
            chain.remove(hook)
    else:
        # seam: Triton's own hook
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
        assert _launch._hooks_installed()


def _both(fn):
    """(fast, Triton's own) outputs of ``fn()``; the fast one after a warm-up call made the key."""
    fn()
    fast = fn()
    with rk.use_options(fast_launch=False):
        slow = fn()
    return fast, slow


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 17, 64, 300])
def test_matmul_fast_launch_is_bitwise_tritons(m):
    from rlkernel.kernels import matmul as km

    g = torch.Generator(device="cuda").manual_seed(m)
    a = torch.randn(m, 512, device="cuda", generator=g).bfloat16()
    w = torch.randn(384, 512, device="cuda", generator=g).bfloat16()
    hits = km._launch_pointer.hits
    fast, slow = _both(lambda: km.matmul(a, w.t()))
    assert km._launch_pointer.hits > hits
    assert torch.equal(fast, slow)


@pytest.mark.gpu
@needs_cuda
def test_misaligned_operand_gets_its_own_kernel():
    """A view 2 bytes off alignment must not reuse the aligned operand's compiled kernel."""
    from rlkernel.kernels import matmul as km

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(256, 129, device="cuda", generator=g).bfloat16()
    base = torch.randn(4 * 129 + 1, device="cuda", generator=g).bfloat16()
    aligned = base[: 4 * 128].view(4, 128)
    shifted = base[1 : 1 + 4 * 128].view(4, 128)  # 2 bytes off
    wt = w[:, :128].t()
    for a in (aligned, shifted, aligned, shifted):
        fast, slow = _both(lambda a=a: km.matmul(a, wt))
        assert torch.equal(fast, slow)
        torch.testing.assert_close(fast.float(), a.float() @ wt.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_rms_norm_and_attention_fast_launch_are_bitwise_tritons():
    from rlkernel.kernels import attention as ka
    from rlkernel.kernels import rmsnorm as kr

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(33, 1024, device="cuda", generator=g).bfloat16()
    w = torch.randn(1024, device="cuda", generator=g).bfloat16()
    fast, slow = _both(lambda: kr.rms_norm_fwd(x, w, 1e-6))
    assert all(torch.equal(f, s) for f, s in zip(fast, slow, strict=True))

    q = torch.randn(4, 1, 8, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(4, 77, 2, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(4, 77, 2, 128, device="cuda", generator=g).bfloat16()
    key_start = torch.tensor([0, 3, 10, 76], device="cuda", dtype=torch.int32)
    fast, slow = _both(lambda: ka.attention_fwd(q, k, v, scale=0.09, key_start=key_start))
    assert all(torch.equal(f, s) for f, s in zip(fast, slow, strict=True))
    assert ka._launch_fwd.hits > 0 and kr._launch_fwd.hits > 0


@pytest.mark.gpu
@needs_cuda
def test_linear_head_gemms_fast_launch_with_descriptors_is_bitwise_tritons():
    """The LM-head GEMMs take TMA descriptor arguments (operands, TMA-stored outputs): the fast
    launch runs them (hits grow) with Triton's own bits, for a full and a ragged row count."""
    from rlkernel.kernels import linear_head as lh

    if not lh.can_run(torch.empty(8, 64, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("the LM-head kernel needs TMA (sm90+)")
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(1000, 256, device="cuda", generator=g).bfloat16()
    hits = lh._launch_stats.hits, lh._launch_grad.hits
    for m in (256, 77):
        h = torch.randn(m, 256, device="cuda", generator=g).bfloat16()
        ids = torch.randint(0, 1000, (m,), device="cuda", generator=g)
        ids[3] = -100
        out = torch.empty(m, 1000, device="cuda", dtype=torch.bfloat16)

        def shifted(h=h, ids=ids, out=out):
            stats = lh.linear_head_stats_shifted(h, w, ids, out, with_entropy=True)
            return (*stats, out.clone())

        fast, slow = _both(shifted)
        assert all(torch.equal(f, s) for f, s in zip(fast, slow, strict=True))
        logp, lse, entropy, _ = fast[:4]
        gl = torch.randn(m, device="cuda", generator=g)
        ge = torch.randn(m, device="cuda", generator=g)

        def grad(h=h, ids=ids, out=out, lse=lse, entropy=entropy, gl=gl, ge=ge):
            lh.linear_head_grad_into(h, w, ids, lse, entropy, gl, ge, out)
            return out.clone()

        fast, slow = _both(grad)
        assert torch.equal(fast, slow)
    assert lh._launch_stats.hits > hits[0] and lh._launch_grad.hits > hits[1]


@pytest.mark.gpu
@needs_cuda
def test_device_plan_rows_kernel_fast_launch_is_bitwise_tritons():
    """The device-built token-level loss (named-tuple arguments through the fast launcher): loss,
    log-probs and the backward's inputs bitwise those of Triton's own launch, 2 and 3 passes."""
    from rlkernel.kernels import token_loss_rows as kr

    g = torch.Generator(device="cuda").manual_seed(7)
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
    base = torch.randn(4, 70, 3000, device="cuda", generator=g).bfloat16().requires_grad_(True)
    kw = dict(
        token_ids=torch.randint(0, 3000, (4, 64), device="cuda", generator=g),
        old_logp=torch.randn(4, 64, device="cuda", generator=g) - 8,
        ref_logp=torch.randn(4, 64, device="cuda", generator=g) - 8,
        advantages=torch.randn(4, device="cuda", generator=g),
        mask=torch.rand(4, 64, device="cuda", generator=g) > 0.3,
    )
    for max_vocab in (0, 1 << 30):  # 3 passes, then 2
        def call(max_vocab=max_vocab):
            with rk.use_options(grad_in_forward_max_vocab=max_vocab):
                out = rk.fused_policy_loss(cfg, logits=base[:, 5:-1], **kw)
                (grad,) = torch.autograd.grad(out.loss, base)
            return out.loss, grad, out.route

        hits = kr._launch_rows.hits
        fast, slow = _both(call)
        assert kr._launch_rows.hits > hits and fast[2].plan == "device"
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
