"""The checks that ``test_vocab_parallel.py`` runs inside each gloo worker process.

Every rank runs :data:`CHECKS` in order and writes ``rank<r>.json`` (check name → ``"ok"`` or the
traceback) after each one. Inputs are generated from fixed seeds, identically on every rank (the
hidden states and ids of tensor parallelism are replicated), so every rank can also compute the
unsharded reference itself. On the first failure a worker writes its traceback and returns: its peers
then fail fast in their next collective (the connection closes) instead of waiting for a partner.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import rlkernel as rk
from _rank_checks import init_gloo_worker, run_checks
from rlkernel.distributed import global_normalizers, vocab_parallel_linear_token_logprobs
from rlkernel.reference import logprobs as ref

VOCAB = 37
HIDDEN = 16
SHARDS = {2: (20, 17), 3: (13, 11, 13)}  # uneven, in rank order; Σ = VOCAB
COLLECTIVE_TIMEOUT_S = 20
# (atol, rtol) of outputs vs the unsharded reference; gradients in the input dtype.
TOLERANCES = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (2e-6, 1e-5),
    torch.bfloat16: (1e-5, 1e-5),  # logp/entropy (fp32) vs the fp32 reference on the same bf16 values
}
GRAD_TOLERANCES = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@dataclass
class Ctx:
    rank: int
    world: int
    group: object  # the tensor-parallel group (here: WORLD)

    @property
    def sizes(self) -> tuple[int, ...]:
        return SHARDS[self.world]

    @property
    def rows(self) -> slice:
        start = sum(self.sizes[: self.rank])
        return slice(start, start + self.sizes[self.rank])


def case(seed=0, lead=(3, 5), dtype=torch.float32, bias=True, hidden=HIDDEN, vocab=VOCAB):
    """Replicated random inputs (same on every rank): hidden, full weight, full bias, ids, two
    upstream-gradient coefficient tensors. Ids include ignored positions and the shard edges."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 2 / hidden**0.5).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    ids = torch.randint(0, vocab, lead, generator=g)
    flat = ids.view(-1)
    flat[:4] = torch.tensor([0, 12, 13, vocab - 1])[: flat.numel()]  # ids at shard boundaries
    flat[5] = -100
    c1 = torch.randn(*lead, generator=g, dtype=torch.float64)
    c2 = torch.randn(*lead, generator=g, dtype=torch.float64)
    return h, w, b, ids, c1, c2


def _leaf(t, grad=True):
    return None if t is None else t.detach().clone().requires_grad_(grad)


def _objective(logp, ent, c1, c2):
    out = (logp.double() * c1).sum()
    return out if ent is None else out + (ent.double() * c2).sum()


def _close(got, want, tol, what):
    torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1], msg=lambda m: f"{what}: {m}")


def compare_to_reference(
    ctx, *, dtype, bias=True, temperature=0.7, entropy=True, chunk_rows=None, grad_h=True, grad_w=True,
    seed=0, lead=(3, 5),
):  # fmt: skip
    """The sharded call on this rank vs the unsharded reference computed locally."""
    h, w, b, ids, c1, c2 = case(seed, dtype=dtype, bias=bias, lead=lead)
    kw = dict(temperature=temperature, return_entropy=entropy)
    hs, ws = _leaf(h, grad_h), _leaf(w[ctx.rows], grad_w)
    bs = None if b is None else _leaf(b[ctx.rows], grad_w)
    out = vocab_parallel_linear_token_logprobs(
        hs, ws, ids, tp_group=ctx.group, bias=bs, chunk_rows=chunk_rows, **kw
    )
    logp, ent = out if entropy else (out, None)
    hr, wr, br = _leaf(h, grad_h), _leaf(w, grad_w), _leaf(b, grad_w)
    out_r = ref.linear_token_logprobs(hr, wr, ids, bias=br, **kw)
    logp_r, ent_r = out_r if entropy else (out_r, None)
    tol = TOLERANCES[dtype]
    _close(logp, logp_r, tol, "logp")
    if entropy:
        _close(ent, ent_r, tol, "entropy")
    assert logp.view(-1)[5] == 0, "ignored position must give logp = 0"
    _objective(logp, ent, c1, c2).backward()
    _objective(logp_r, ent_r, c1, c2).backward()
    gtol = GRAD_TOLERANCES[dtype]
    if grad_h:
        _close(hs.grad, hr.grad, gtol, "dhidden")
        assert bool((hs.grad.view(-1, HIDDEN)[5] == 0).all()), "ignored row must get no gradient"
    else:
        assert hs.grad is None
    if grad_w:
        _close(ws.grad, wr.grad[ctx.rows], gtol, "dweight shard")
        if bias:
            _close(bs.grad, br.grad[ctx.rows], gtol, "dbias shard")
    else:
        assert ws.grad is None
    return logp, ent, hs.grad


# ------------------------------------------------------------------------------- forward/backward
def check_fp64_exact(ctx):
    compare_to_reference(ctx, dtype=torch.float64, chunk_rows=4)


def check_fp32_bias_temperature_entropy(ctx):
    compare_to_reference(ctx, dtype=torch.float32, chunk_rows=4)


def check_bf16(ctx):
    compare_to_reference(ctx, dtype=torch.bfloat16, chunk_rows=6, seed=1)


def check_bf16_half_operand_gemms(ctx):
    """tp_gemm="half" (the CUDA default for bf16/fp16; emulated on the CPU): ∂z is rounded to bf16."""
    with rk.use_options(tp_gemm="half"):
        compare_to_reference(ctx, dtype=torch.bfloat16, chunk_rows=4, seed=1)


def check_bf16_half_gemms_kernel_elementwise(ctx):
    """tp_gemm="half" with the Triton log-prob kernels on the shard (tp_elementwise="auto", which the
    interpreter runs on the CPU): per-rank partials combined by MAX + SUM, the backward kernel
    writing ∂z in bf16. Against the reference, with and without entropy, frozen weight, and equal
    (within fp32 rounding) to the PyTorch elementwise path; the same bits on every rank."""
    from rlkernel._dispatch import interpreter_enabled
    from rlkernel.ops._vocab_parallel_function import use_kernels

    h = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    if not interpreter_enabled():  # CPU tensors without the interpreter (a GPU machine's gloo
        assert not use_kernels(h, True, "auto")  # workers): the PyTorch path; NCCL check = CUDA path
        return
    assert use_kernels(h, True, "auto"), "the kernel path must run on CPU tensors with TRITON_INTERPRET=1"
    with rk.use_options(tp_gemm="half", tp_elementwise="auto"):
        logp, ent, dh = compare_to_reference(ctx, dtype=torch.bfloat16, chunk_rows=4, seed=1)
        compare_to_reference(ctx, dtype=torch.bfloat16, chunk_rows=6, seed=2, entropy=False, grad_w=False)
    with rk.use_options(tp_gemm="half", tp_elementwise="torch"):
        logp_t, ent_t, dh_t = compare_to_reference(ctx, dtype=torch.bfloat16, chunk_rows=4, seed=1)
    torch.testing.assert_close(logp, logp_t, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(ent, ent_t, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(dh.float(), dh_t.float(), atol=2e-2, rtol=2e-2)
    for name, t in (("logp", logp), ("entropy", ent), ("dhidden", dh)):
        parts = [torch.empty_like(t) for _ in range(ctx.world)]
        dist.all_gather(parts, t.detach().contiguous(), group=ctx.group)
        assert all(torch.equal(p, parts[0]) for p in parts), f"{name} differs across ranks"


def _tp_grads(ctx, call, seed=23):
    """logp, entropy, dhidden and the dweight shard of ``call(h, w_r, ids, **kw)`` on bf16 inputs."""
    h, w, b, ids, c1, c2 = case(seed, dtype=torch.bfloat16)
    hs, ws = _leaf(h), _leaf(w[ctx.rows])
    logp, ent = call(hs, ws, ids, tp_group=ctx.group, bias=b[ctx.rows], temperature=0.7, return_entropy=True)
    _objective(logp, ent, c1, c2).backward()
    return logp.detach(), ent.detach(), hs.grad, ws.grad


def check_tp_gemm_option_takes_effect(ctx):
    """The options reach the vocab-parallel path, set in this (worker) process: the default is
    "auto" (fp32 GEMMs for CPU tensors, so the same bits as "fp32"); "half" rounds ∂z to bf16 for
    the backward GEMMs, so dhidden and dweight change bits (the forward's products are exact in
    fp32 either way); and linear_token_logprobs(tp_group=) gives the same bits as the direct call
    under the same option."""
    defaults = rk.current_options()
    assert (defaults.tp_gemm, defaults.tp_elementwise) == ("auto", "auto")
    direct = vocab_parallel_linear_token_logprobs
    auto = _tp_grads(ctx, direct)
    with rk.use_options(tp_gemm="fp32"):
        fp32 = _tp_grads(ctx, direct)
    with rk.use_options(tp_gemm="half", tp_elementwise="torch"):
        half = _tp_grads(ctx, direct)
        routed = _tp_grads(ctx, rk.linear_token_logprobs)
    assert all(torch.equal(a, f) for a, f in zip(auto, fp32, strict=True)), "auto must be fp32 on the CPU"
    assert not torch.equal(half[2], fp32[2]), "tp_gemm='half' must change dhidden's bits"
    assert not torch.equal(half[3], fp32[3]), "tp_gemm='half' must change dweight's bits"
    assert all(torch.equal(a, b) for a, b in zip(half, routed, strict=True)), "the tp_group route"


def check_no_bias_no_entropy_auto_chunks(ctx):
    compare_to_reference(ctx, dtype=torch.float32, bias=False, temperature=1.0, entropy=False, seed=2)


def check_frozen_weight(ctx):
    compare_to_reference(ctx, dtype=torch.float32, grad_w=False, seed=3)


def check_frozen_hidden(ctx):
    compare_to_reference(ctx, dtype=torch.float32, grad_h=False, seed=4)


def check_bitwise_equal_across_ranks(ctx):
    logp, ent, dh = compare_to_reference(ctx, dtype=torch.float32, chunk_rows=5, seed=5)
    for name, t in (("logp", logp), ("entropy", ent), ("dhidden", dh)):
        parts = [torch.empty_like(t) for _ in range(ctx.world)]
        dist.all_gather(parts, t.detach().contiguous(), group=ctx.group)
        assert all(torch.equal(p, parts[0]) for p in parts), f"{name} differs across ranks"


def check_through_linear_token_logprobs(ctx):
    """The public op with tp_group (the hook in rlkernel.ops.logprobs) gives the same numbers."""
    h, w, b, ids, *_ = case(6)
    kw = dict(bias=b[ctx.rows], temperature=0.9, return_entropy=True)
    got = rk.linear_token_logprobs(h, w[ctx.rows], ids, tp_group=ctx.group, **kw)
    want = vocab_parallel_linear_token_logprobs(h, w[ctx.rows], ids, tp_group=ctx.group, **kw)
    for g_, w_ in zip(got, want, strict=True):
        assert torch.equal(g_, w_)


def check_many_rows(ctx):
    """Many chunks: dhidden's per-chunk asynchronous all-reduces (at most two in flight) retire in
    row order and land in the right rows."""
    compare_to_reference(ctx, dtype=torch.float32, chunk_rows=3, seed=7, lead=(4, 6))


def check_bf16_kernel_epilogue_and_whole_batch(ctx):
    """The Triton chunk math without a bias: the epilogue GEMMs of kernels.linear_head on the shard
    (the interpreter runs them on the CPU), with the whole-batch dweight GEMM (few rows) and with
    the chunked fp32 accumulator (more rows than ``whole_batch_fits`` allows), with and without
    entropy, frozen weight; the same bits on every rank."""
    from rlkernel._dispatch import interpreter_enabled
    from rlkernel.ops._linear_engine import whole_batch_fits
    from rlkernel.ops._vocab_parallel_function import epilogue_runs

    if not interpreter_enabled():  # gloo workers of a GPU machine: the PyTorch path (see above)
        return
    _, w, *_ = case(3, dtype=torch.bfloat16, bias=False)
    assert epilogue_runs(w[ctx.rows].contiguous(), None) and not epilogue_runs(w[ctx.rows], w[:, 0])
    bf16, fp32 = torch.bfloat16, torch.float32
    assert whole_batch_fits(15, 4, HIDDEN, bf16, fp32) and not whole_batch_fits(64, 6, HIDDEN, bf16, fp32)
    with rk.use_options(tp_gemm="half", tp_elementwise="auto"):
        logp, ent, dh = compare_to_reference(ctx, dtype=torch.bfloat16, bias=False, chunk_rows=4, seed=3)
        compare_to_reference(ctx, dtype=torch.bfloat16, bias=False, chunk_rows=6, seed=4, lead=(8, 8))
        compare_to_reference(ctx, dtype=torch.bfloat16, bias=False, chunk_rows=4, seed=5, entropy=False)
        compare_to_reference(ctx, dtype=torch.bfloat16, bias=False, chunk_rows=5, seed=6, grad_w=False)
    for name, t in (("logp", logp), ("entropy", ent), ("dhidden", dh)):
        parts = [torch.empty_like(t) for _ in range(ctx.world)]
        dist.all_gather(parts, t.detach().contiguous(), group=ctx.group)
        assert all(torch.equal(p, parts[0]) for p in parts), f"{name} differs across ranks"


def check_empty_batch(ctx):
    h, w, *_ = case(22)
    hs, ws = _leaf(h[:0]), _leaf(w[ctx.rows])
    logp, ent = rk.linear_token_logprobs(
        hs, ws, torch.zeros(0, 5, dtype=torch.long), tp_group=ctx.group, return_entropy=True
    )
    assert logp.shape == ent.shape == (0, 5)
    (logp.sum() + ent.sum()).backward()
    assert hs.grad.shape == hs.shape and bool((ws.grad == 0).all())


# ------------------------------------------------------------------------------------------ fused
def _fused(ctx, preset):
    h, w, _, ids, *_ = case(8, lead=(4, 6))
    g = torch.Generator().manual_seed(9)
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[1] = False  # one sequence without any active token
    mask[0, 0] = True
    ids = torch.where(mask, ids.clamp_min(0), -1)  # garbage at masked positions
    old_logp = -torch.rand(4, 6, generator=g) * 3 - 0.1
    adv = torch.randn(4, generator=g)
    cfg = rk.PolicyLossConfig.preset(preset, entropy_coef=0.01)
    batch = dict(token_ids=ids, old_logp=old_logp, advantages=adv, mask=mask, temperature=0.8)
    hs, ws = _leaf(h), _leaf(w[ctx.rows])
    # validate=True (the default): the ids are checked against the global V, on every rank at once.
    out = rk.fused_policy_loss(cfg, hidden=hs, weight=ws, tp_group=ctx.group, **batch)
    hr, wr = _leaf(h), _leaf(w)
    out_r = rk.fused_policy_loss(cfg, hidden=hr, weight=wr, **batch)
    _close(out.loss, out_r.loss, (1e-6, 1e-5), f"{preset} loss")
    out.loss.backward()
    out_r.loss.backward()
    _close(hs.grad, hr.grad, (1e-6, 1e-5), f"{preset} dhidden")
    _close(ws.grad, wr.grad[ctx.rows], (1e-6, 1e-5), f"{preset} dweight shard")
    for k in out_r.metrics:
        _close(out.metrics[k], out_r.metrics[k], (1e-6, 1e-5), f"{preset} metric {k}")


def check_fused_dapo(ctx):
    _fused(ctx, "dapo")


def check_fused_gspo(ctx):
    _fused(ctx, "gspo")


# ----------------------------------------------------------------------------------------- errors
def expect_same_error(ctx, fn, exc_type, *needles):
    """``fn`` must raise ``exc_type`` on every rank, with the same message, containing ``needles``."""
    try:
        fn()
        mine = None
    except Exception as err:  # noqa: BLE001 - compared across ranks below
        mine = (type(err).__name__, str(err))
    seen = [None] * ctx.world
    dist.all_gather_object(seen, mine, group=ctx.group)
    assert all(s is not None for s in seen), f"not every rank raised: {seen}"
    assert all(s[0] == exc_type.__name__ for s in seen), f"expected {exc_type.__name__} everywhere: {seen}"
    assert len({s[1] for s in seen}) == 1, f"the ranks raised different messages: {seen}"
    for needle in needles:
        assert needle in seen[0][1], f"{needle!r} not in {seen[0][1]!r}"


def _call(ctx, h, w, ids, **kw):
    return lambda: rk.linear_token_logprobs(h, w, ids, tp_group=ctx.group, **kw)


def check_error_hidden_size(ctx):
    last = ctx.rank == ctx.world - 1
    h, w, b, ids, *_ = case(10, hidden=HIDDEN + 1 if last else HIDDEN)
    expect_same_error(
        ctx,
        _call(ctx, h, w[ctx.rows], ids),
        ValueError,
        "hidden size H differs",
        f"rank {ctx.world - 1}: {HIDDEN + 1}",
    )


def check_error_dtype(ctx):
    h, w, b, ids, *_ = case(11, dtype=torch.float64 if ctx.rank == ctx.world - 1 else torch.float32)
    expect_same_error(ctx, _call(ctx, h, w[ctx.rows], ids), ValueError, "dtype differs", "torch.float64")


def check_error_token_count(ctx):
    h, w, b, ids, *_ = case(12, lead=(14,) if ctx.rank == 1 else (15,))
    expect_same_error(ctx, _call(ctx, h, w[ctx.rows], ids), ValueError, "token count N", "rank 1: 14")


def check_error_id_out_of_global_range(ctx):
    h, w, b, ids, *_ = case(13)
    for bad in (VOCAB, -1):
        ids_bad = ids.clone()
        ids_bad[2, 3] = bad
        expect_same_error(
            ctx, _call(ctx, h, w[ctx.rows], ids_bad), ValueError, f"outside [0, {VOCAB})", f"first: {bad}"
        )
    # An id past this rank's shard but inside the global vocabulary is fine (ids are global).
    ids[0, 0] = VOCAB - 1
    rk.linear_token_logprobs(h, w[ctx.rows], ids, tp_group=ctx.group)


def check_error_fused_id_out_of_global_range(ctx):
    """fused_policy_loss with tp_group checks the active ids against the global V on every rank at
    once: an id past this rank's shard is fine, one outside [0, V) raises on every rank."""
    h, w, b, ids, *_ = case(24, lead=(2, 7))
    batch = dict(
        old_logp=torch.zeros(2, 7), advantages=torch.ones(2), mask=torch.ones(2, 7, dtype=torch.bool)
    )
    cfg = rk.PolicyLossConfig.preset("dapo")
    ids = ids.clamp_min(0)
    ids[0, 0] = VOCAB - 1  # outside every shard but the last, inside the global vocabulary
    rk.fused_policy_loss(cfg, hidden=h, weight=w[ctx.rows], tp_group=ctx.group, token_ids=ids, **batch)
    ids[1, 2] = VOCAB
    fn = lambda: rk.fused_policy_loss(  # noqa: E731
        cfg, hidden=h, weight=w[ctx.rows], tp_group=ctx.group, token_ids=ids, **batch
    )
    expect_same_error(ctx, fn, ValueError, f"outside [0, {VOCAB})")


def check_error_ids_differ(ctx):
    h, w, b, ids, *_ = case(14)
    if ctx.rank == 1:
        ids[1, 1] = (ids[1, 1] + 1) % VOCAB
    expect_same_error(ctx, _call(ctx, h, w[ctx.rows], ids), ValueError, "token_ids differ", "rank(s) [1]")


def check_error_requires_grad_differs(ctx):
    h, w, b, ids, *_ = case(15)
    h.requires_grad_(ctx.rank == 0)
    expect_same_error(ctx, _call(ctx, h, w[ctx.rows], ids), ValueError, "requires grad differs")


def check_error_local_check_on_one_rank(ctx):
    """A rank whose own inputs are inconsistent: every rank raises, naming it (direct call: the
    hook in linear_token_logprobs runs its local checks before any collective)."""
    h, w, b, ids, *_ = case(16)
    shard = w[ctx.rows]
    if ctx.rank == 1:
        shard = torch.randn(shard.shape[0], HIDDEN + 2)
    fn = lambda: vocab_parallel_linear_token_logprobs(h, shard, ids, tp_group=ctx.group)  # noqa: E731
    expect_same_error(
        ctx, fn, ValueError, "rank 1 rejected its inputs", "weight (this rank's vocabulary shard)"
    )


def check_error_empty_shard(ctx):
    h, w, b, ids, *_ = case(17)
    shard = w[:0] if ctx.rank == 0 else w[ctx.rows]
    fn = lambda: vocab_parallel_linear_token_logprobs(h, shard, ids, tp_group=ctx.group)  # noqa: E731
    expect_same_error(ctx, fn, ValueError, "rank 0 rejected its inputs", "at least one vocabulary row")


def check_error_type_on_every_rank(ctx):
    h, w, b, ids, *_ = case(18)
    fn = lambda: vocab_parallel_linear_token_logprobs(h, w[ctx.rows], ids.float(), tp_group=ctx.group)  # noqa: E731
    expect_same_error(ctx, fn, TypeError, "token_ids must be an integer tensor")


def check_error_not_a_group(ctx):
    h, w, b, ids, *_ = case(19)
    try:
        rk.linear_token_logprobs(h, w[ctx.rows], ids, tp_group="world")
    except TypeError as err:
        assert "ProcessGroup" in str(err)
    else:
        raise AssertionError("a string tp_group must raise TypeError")


def check_still_in_sync_after_errors(ctx):
    compare_to_reference(ctx, dtype=torch.float32, chunk_rows=2, seed=20)


def check_subgroup(ctx):
    """A tensor-parallel group that is not WORLD: shard order follows the group's ranks."""
    if ctx.world < 3:
        return
    members = [1, 2]
    sub = dist.new_group(members)  # every rank must call new_group
    if ctx.rank in members:
        compare_to_reference(
            Ctx(rank=members.index(ctx.rank), world=2, group=sub), dtype=torch.float64, seed=21
        )
    dist.barrier()


# ------------------------------------------------------------------------------------ normalizers
def _masks(rank, n_micro=3):
    g = torch.Generator().manual_seed(100 + rank)
    masks = [torch.rand(2 + i, 5, generator=g) > 0.5 for i in range(n_micro)]
    masks[0][0] = False  # a sequence without active tokens
    return masks


def _expected(world, count_empty=False):
    tokens = seqs = 0
    for r in range(world):
        for m in _masks(r):
            tokens += int(m.sum())
            seqs += m.shape[0] if count_empty else int(m.any(-1).sum())
    return float(tokens), float(seqs)


def check_global_normalizers_padded(ctx):
    for count_empty in (False, True):
        got = global_normalizers(_masks(ctx.rank), group=ctx.group, count_empty=count_empty)
        assert all(t.dtype == torch.float32 and t.dim() == 0 for t in got)
        assert (got[0].item(), got[1].item()) == _expected(ctx.world, count_empty), (got, count_empty)
    one = global_normalizers(_masks(ctx.rank)[1].float())  # group=None: the default group
    want = [0.0, 0.0]
    for r in range(ctx.world):
        m = _masks(r)[1]
        want[0] += int(m.sum())
        want[1] += int(m.any(-1).sum())
    assert [one[0].item(), one[1].item()] == want


def check_global_normalizers_packed(ctx):
    masks, cus = [], []
    for m in _masks(ctx.rank):
        lengths = torch.full((m.shape[0],), m.shape[1])
        masks.append(m.reshape(-1))
        cus.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    got = global_normalizers(masks, cu_seqlens=cus, group=ctx.group)
    assert (got[0].item(), got[1].item()) == _expected(ctx.world)


def check_global_normalizers_match_step_loss(ctx):
    """Micro-batch losses with the global normalizers sum (over micro-batches and ranks) to the
    loss of the whole step computed in one process."""
    cfg = rk.PolicyLossConfig.preset("gspo")
    data = []
    for r in range(ctx.world):
        g = torch.Generator().manual_seed(200 + r)
        for m in _masks(r):
            shape = m.shape
            data.append(
                (
                    r,
                    -torch.rand(shape, generator=g, dtype=torch.float64) - 0.1,
                    -torch.rand(shape, generator=g, dtype=torch.float64) - 0.1,
                    torch.randn(shape[0], generator=g, dtype=torch.float64),
                    m,
                )
            )
    mine = [d for d in data if d[0] == ctx.rank]
    gt, gs = global_normalizers([d[4] for d in mine], group=ctx.group)
    local = sum(
        rk.policy_loss(lp, old, a, m, cfg, global_tokens=gt, global_seqs=gs).loss for _, lp, old, a, m in mine
    )
    total = local.detach().clone()
    dist.all_reduce(total, group=ctx.group)
    width = max(d[4].shape[1] for d in data)
    pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
    whole = rk.policy_loss(
        torch.cat([pad(d[1], 0) for d in data]),
        torch.cat([pad(d[2], 0) for d in data]),
        torch.cat([d[3] for d in data]),
        torch.cat([pad(d[4], False) for d in data]),
        cfg,
    ).loss
    _close(total, whole, (1e-12, 1e-10), "sum of micro-batch losses")


def check_global_normalizers_errors(ctx):
    for bad, exc in (([], ValueError), (torch.ones(5, dtype=torch.bool), ValueError), ("x", TypeError)):
        try:
            global_normalizers(bad, group=ctx.group)
        except exc:
            pass
        else:
            raise AssertionError(f"{bad!r} must raise {exc.__name__}")
    try:
        global_normalizers(torch.ones(2, 3), group=object())
    except TypeError as err:
        assert "ProcessGroup" in str(err)
    else:
        raise AssertionError("a non-ProcessGroup group must raise TypeError")


CHECKS: dict[str, Callable[[Ctx], None]] = {
    name[len("check_") :]: fn for name, fn in list(globals().items()) if name.startswith("check_")
}


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Worker entry point (``torch.multiprocessing.start_processes``)."""
    init_gloo_worker(rank, world, init_file, COLLECTIVE_TIMEOUT_S)
    path = os.path.join(out_dir, f"rank{rank}.json")
    ctx = Ctx(rank=rank, world=world, group=dist.group.WORLD)
    if run_checks(CHECKS.items(), ctx, path):
        dist.destroy_process_group()
