"""The checks that ``test_fsdp2_lm_head.py`` runs inside each gloo worker process (2 CPU ranks).

Data parallel, as FSDP2 is used: every rank gets *different* hidden states / token batches (seeded
by rank), so a gradient that is not reduced over the ranks (e.g. the plain ``full_tensor()``
backward, a local slice) fails the checks; with identical data every reduction would look right.
Each rank also computes the unsharded single-process reference itself: the same computation on the
full weight for every rank's data, the gradients averaged over the ranks (FSDP2's default mean).

Every rank runs :data:`CHECKS` in order and writes ``rank<r>.json`` (check name → ``"ok"`` or the
traceback) after each one; on the first failure it returns, and its peer fails fast in its next
collective (see ``_workers.py``, whose plumbing this follows).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import rlkernel as rk
from _rank_checks import init_gloo_worker, run_checks

from ._workers import COLLECTIVE_TIMEOUT_S, expect_same_error

VOCAB = 37  # 19 / 18 rows per shard on 2 ranks: uneven, as torch.chunk (DTensor, FSDP2) splits it
HIDDEN = 16
B, T = 3, 6
GRAD_ATOL = 1e-6  # fp32: FSDP2 vs the unsharded single-process run (issue 14)


@dataclass
class Ctx:
    rank: int
    world: int
    mesh: object  # 1-D DeviceMesh over WORLD
    group: object  # WORLD (for expect_same_error)


# --------------------------------------------------------------------------------------- helpers
def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _close(got, want, what, atol=GRAD_ATOL):
    d = _max_diff(got, want)
    assert got.shape == want.shape and d <= atol, f"{what}: max |Δ| {d:.2e} > {atol:.0e} ({got.shape})"


def _head(seed=0, bias=True, dtype=torch.float32):
    """The full LM head (same on every rank): weight [V, H] (logits of std ≈ 2), bias [V]."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 2 / HIDDEN**0.5).to(dtype)
    b = (torch.randn(VOCAB, generator=g) * 0.5).to(dtype) if bias else None
    return w, b


def _rank_data(rank, seed=0, dtype=torch.float32):
    """Rank ``rank``'s hidden [B, T, H], ids [B, T] (one ignored) and upstream coefficients."""
    g = torch.Generator().manual_seed(1000 * seed + 17 + rank)
    h = torch.randn(B, T, HIDDEN, generator=g).to(dtype)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    ids[0, 1] = -100
    return h, ids, torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g)


def _objective(logp, ent, c1, c2):
    return (logp.double() * c1).sum() + (ent.double() * c2.double()).sum()


def _mean_over_ranks(ctx, fn):
    """``(1/W) Σ_r fn(r)`` of a gradient tuple: the single-process image of FSDP2's mean."""
    parts = [fn(r) for r in range(ctx.world)]
    return [sum(p[i] for p in parts) / ctx.world for i in range(len(parts[0]))]


def _shard_rows(ctx, full):
    """This rank's rows of a dim-0 ``Shard`` (torch.chunk: the first ranks get the extra row)."""
    return full.chunk(ctx.world)[ctx.rank]


# -------------------------------------------------------------- DTensor weights, no FSDP2 wrapper
def _linear_vs_reference(ctx, placement, *, seed, with_bias=True, entropy=True):
    """``linear_token_logprobs(hidden, DTensor weight, ...)`` against the plain full weight:
    logp/entropy/dhidden on this rank's data; ``weight.grad``/``bias.grad`` DTensors with the
    weight's placement holding the rank-mean of the per-rank gradients."""
    w, b = _head(seed, bias=with_bias)
    kw = dict(temperature=0.8, return_entropy=entropy)

    def plain(rank):
        h, ids, c1, c2 = _rank_data(rank, seed)
        h, wr = h.requires_grad_(), w.clone().requires_grad_()
        br = None if b is None else b.clone().requires_grad_()
        out = rk.linear_token_logprobs(h, wr, ids, bias=br, **kw)
        logp, ent = out if entropy else (out, torch.zeros_like(out))
        leaves = [h, wr] + ([br] if br is not None else [])
        grads = torch.autograd.grad(_objective(logp, ent, c1, c2), leaves)
        return logp.detach(), ent.detach(), *grads

    h, ids, c1, c2 = _rank_data(ctx.rank, seed)
    h = h.requires_grad_()
    dw = distribute_tensor(w, ctx.mesh, [placement]).requires_grad_()
    db = None if b is None else distribute_tensor(b, ctx.mesh, [placement]).requires_grad_()
    out = rk.linear_token_logprobs(h, dw, ids, bias=db, **kw)
    logp, ent = out if entropy else (out, torch.zeros_like(out))
    _objective(logp, ent, c1, c2).backward()
    logp_r, ent_r, dh_r, *_ = plain(ctx.rank)
    _close(logp, logp_r, "logp")
    _close(ent, ent_r, "entropy")
    _close(h.grad, dh_r, "dhidden")
    mean = _mean_over_ranks(ctx, lambda r: plain(r)[3:])
    for name, param, want in (("weight", dw, mean[0]), ("bias", db, mean[-1])):
        if param is None:
            continue
        grad = param.grad
        assert isinstance(grad, DTensor), f"{name}.grad is a {type(grad).__name__}, not a DTensor"
        assert tuple(grad.placements) == (placement,), f"{name}.grad placements {grad.placements}"
        local_want = _shard_rows(ctx, want) if placement.is_shard() else want
        _close(grad.to_local(), local_want, f"{name}.grad local shard")
        _close(grad.full_tensor(), want, f"{name}.grad gathered")


def check_shard0_weight_and_bias(ctx):
    _linear_vs_reference(ctx, Shard(0), seed=1)


def check_shard0_weight_no_bias_no_entropy(ctx):
    _linear_vs_reference(ctx, Shard(0), seed=2, with_bias=False, entropy=False)


def check_replicate_weight_and_bias(ctx):
    _linear_vs_reference(ctx, Replicate(), seed=3)


def check_plain_full_tensor_would_be_wrong(ctx):
    """Why the gather is not ``weight.full_tensor()``: its backward keeps only this rank's
    gradient (a local slice), which with data-parallel inputs differs from the rank-mean."""
    w, _ = _head(4, bias=False)
    h, ids, c1, c2 = _rank_data(ctx.rank, 4)
    dw = distribute_tensor(w, ctx.mesh, [Shard(0)]).requires_grad_()
    logp, ent = rk.linear_token_logprobs(h, dw.full_tensor(), ids, return_entropy=True)
    _objective(logp, ent, c1, c2).backward()
    naive = dw.grad.full_tensor()
    dw.grad = None
    logp, ent = rk.linear_token_logprobs(h, dw, ids, return_entropy=True)
    _objective(logp, ent, c1, c2).backward()
    ours = dw.grad.full_tensor()
    assert _max_diff(naive, ours) > 1e-3, "the two reductions should differ with per-rank data"


def check_frozen_dtensor_weight(ctx):
    """A DTensor weight without requires_grad: logp and dhidden as with the plain weight."""
    w, b = _head(5)
    h, ids, c1, _ = _rank_data(ctx.rank, 5)
    hs, hr = h.clone().requires_grad_(), h.clone().requires_grad_()
    dw, db = distribute_tensor(w, ctx.mesh, [Shard(0)]), distribute_tensor(b, ctx.mesh, [Shard(0)])
    logp = rk.linear_token_logprobs(hs, dw, ids, bias=db)
    logp_r = rk.linear_token_logprobs(hr, w, ids, bias=b)
    _close(logp, logp_r, "logp")
    (logp.double() * c1).sum().backward()
    (logp_r.double() * c1).sum().backward()
    _close(hs.grad, hr.grad, "dhidden")
    assert dw.grad is None and db.grad is None


def check_replicated_dtensor_hidden(ctx):
    """A DTensor ``hidden`` replicated over the mesh (its local tensor is the value) with a
    Shard(0) weight: logp as with plain tensors; hidden.grad a Replicate DTensor."""
    w, _ = _head(6, bias=False)
    h, ids, c1, c2 = _rank_data(0, 6)  # the same on every rank: a replicated value
    dh = distribute_tensor(h, ctx.mesh, [Replicate()]).requires_grad_()
    dw = distribute_tensor(w, ctx.mesh, [Shard(0)]).requires_grad_()
    logp, ent = rk.linear_token_logprobs(dh, dw, ids, return_entropy=True)
    assert type(logp) is torch.Tensor
    _objective(logp, ent, c1, c2).backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp_r, ent_r = rk.linear_token_logprobs(hr, wr, ids, return_entropy=True)
    _objective(logp_r, ent_r, c1, c2).backward()
    _close(logp, logp_r, "logp")
    assert isinstance(dh.grad, DTensor) and tuple(dh.grad.placements) == (Replicate(),)
    _close(dh.grad.to_local(), hr.grad, "dhidden")
    _close(dw.grad.full_tensor(), wr.grad, "dweight (equal data on every rank: the mean is the grad)")


def check_mixed_precision_fp32_shards_bf16_hidden(ctx):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16): an fp32 DTensor weight with bf16 hidden is
    gathered in bf16, bitwise the plain call on ``weight.bfloat16()``; its gradient is reduced in
    fp32 into the fp32 shards: the rank-mean of the bf16 gradients, to fp32 rounding."""
    w, b = _head(7)

    def plain(rank):
        h, ids, c1, c2 = _rank_data(rank, 7, dtype=torch.bfloat16)
        h, wr = h.requires_grad_(), w.bfloat16().requires_grad_()
        br = b.bfloat16().requires_grad_()
        logp, ent = rk.linear_token_logprobs(h, wr, ids, bias=br, return_entropy=True)
        grads = torch.autograd.grad(_objective(logp, ent, c1, c2), [h, wr, br])
        return logp.detach(), *(g.float() for g in grads)

    h, ids, c1, c2 = _rank_data(ctx.rank, 7, dtype=torch.bfloat16)
    h = h.requires_grad_()
    dw = distribute_tensor(w, ctx.mesh, [Shard(0)]).requires_grad_()
    db = distribute_tensor(b, ctx.mesh, [Shard(0)]).requires_grad_()
    logp, ent = rk.linear_token_logprobs(h, dw, ids, bias=db, return_entropy=True)
    _objective(logp, ent, c1, c2).backward()
    logp_r, dh_r, *_ = plain(ctx.rank)
    assert torch.equal(logp, logp_r), "bf16 gather must give the plain bf16 call's bits"
    assert h.grad.dtype == torch.bfloat16 and torch.equal(h.grad.float(), dh_r)
    mean = _mean_over_ranks(ctx, lambda r: plain(r)[2:])
    for name, param, want in (("weight", dw, mean[0]), ("bias", db, mean[1])):
        assert param.grad.dtype == torch.float32, f"{name}.grad {param.grad.dtype}"
        _close(param.grad.full_tensor(), want, f"{name}.grad (fp32 reduce of bf16 grads)")


# ------------------------------------------------------------------------------- FSDP2 models
class TinyLM(torch.nn.Module):
    """embedding -> tanh(linear) -> LM head; the forward returns (hidden, logits) as an HF model
    with ``output_hidden_states`` does (the logits are computed and left unused by the loss)."""

    def __init__(self, bias=False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias)

    def forward(self, ids):
        hidden = torch.tanh(self.mix(self.embed(ids)))
        return hidden, self.lm_head(hidden)


class LossInForward(torch.nn.Module):
    """A wrapper whose forward computes the loss (the model's and the loss's parameters used inside
    one FSDP2 root forward)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, call):
        hidden, _ = self.lm(ids.clamp_min(0))
        return call(hidden, self.lm.lm_head)


def _policy_batch(rank, seed, rows=B):
    """Rank ``rank``'s RL batch of ``rows`` sequences: ids (garbage -1 where masked), mask (~25 %
    off, rank 1: its last sequence fully masked), old log-probs, advantages."""
    g = torch.Generator().manual_seed(500 * seed + rank)
    ids = torch.randint(0, VOCAB, (rows, T), generator=g)
    mask = torch.rand(rows, T, generator=g) > 0.25
    mask[0, 0] = True
    if rank == 1:
        mask[-1] = False
    ids = torch.where(mask, ids, -1)
    old = -torch.rand(rows, T, generator=g) * 3 - 0.1
    return dict(token_ids=ids, mask=mask, old_logp=old, advantages=torch.randn(rows, generator=g))


def _loss_call(preset, batch, entropy_coef=0.01, **kw):
    cfg = rk.PolicyLossConfig.preset(preset, entropy_coef=entropy_coef)
    return lambda hidden, head: rk.fused_policy_loss(
        cfg, hidden=hidden, weight=head.weight, bias=head.bias, **batch, **kw
    ).loss


def _reference_grads(ctx, model, preset, seed, rows=B, **kw):
    """The unsharded single-process step: mean over the ranks' batches of the loss, its gradients
    (by parameter name) and this rank's loss."""
    model.zero_grad(set_to_none=True)
    losses = []
    for r in range(ctx.world):
        batch = _policy_batch(r, seed, rows)
        hidden, _ = model(batch["token_ids"].clamp_min(0))
        losses.append(_loss_call(preset, batch, **kw)(hidden, model.lm_head))
    (sum(losses) / ctx.world).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, losses[ctx.rank].detach()


def _compare_grads(model, want, what):
    for name, p in model.named_parameters():
        name = name.removeprefix("lm.")
        assert isinstance(p, DTensor), f"{name}: FSDP2 must leave a DTensor parameter"
        assert p.grad is not None, f"{name}: no gradient"
        assert tuple(p.grad.placements) == tuple(p.placements), f"{name}.grad {p.grad.placements}"
        _close(p.grad.full_tensor(), want[name], f"{what}: {name}.grad")


def _sharded_lm(ctx, bias=False, lm_head_unit=True, seed=0, mp=None):
    """(fsdp model, unsharded copy): lm_head its own FSDP2 unit (resharded after its forward, so a
    DTensor outside it) or part of the root group."""
    torch.manual_seed(seed)
    lm = TinyLM(bias=bias)
    unsharded = copy.deepcopy(lm)
    kw = dict(mesh=ctx.mesh) if mp is None else dict(mesh=ctx.mesh, mp_policy=mp)
    fully_shard(lm.mix, **kw)
    if lm_head_unit:
        fully_shard(lm.lm_head, **kw)
    return lm, unsharded, kw


def _fsdp2_outside_forward(ctx, preset, seed, bias=False, rows=B, **kw):
    """``out = model(ids)``, then the loss on the hidden states with ``model.lm_head.weight``, a
    Shard(0) DTensor: loss, and every parameter's gradient (gathered), vs the unsharded run."""
    lm, unsharded, shard_kw = _sharded_lm(ctx, bias=bias, seed=seed)
    fully_shard(lm, **shard_kw)
    batch = _policy_batch(ctx.rank, seed, rows)
    hidden, _ = lm(batch["token_ids"].clamp_min(0))
    weight = lm.lm_head.weight
    assert isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),), type(weight)
    loss = _loss_call(preset, batch, **kw)(hidden, lm.lm_head)
    loss.backward()
    want, loss_r = _reference_grads(ctx, unsharded, preset, seed, rows, **kw)
    _close(loss, loss_r, f"{preset} loss")
    _compare_grads(lm, want, f"{preset} outside the forward")


def check_fsdp2_outside_forward_dapo(ctx):
    _fsdp2_outside_forward(ctx, "dapo", seed=1)


def check_fsdp2_outside_forward_gspo_with_bias(ctx):
    _fsdp2_outside_forward(ctx, "gspo", seed=2, bias=True)


def check_fsdp2_outside_forward_triton_fused_linear(ctx):
    """The Triton chunk engine (interpreter; the fused token-level linear path of dapo) on the
    gathered weight: its autograd Function's weight gradient flows back to the shards. Two
    sequences (12 rows: one 16-row chunk) and no entropy term: the interpreter is slow."""
    from rlkernel._dispatch import interpreter_enabled

    if not interpreter_enabled():  # a GPU machine's gloo workers: CPU tensors have no kernel path
        return
    with rk.use_backend("triton"), rk.use_options(linear_chunk_bytes=1, linear_grad_bytes=1):
        _fsdp2_outside_forward(ctx, "dapo", seed=3, rows=2, entropy_coef=0.0)


def check_fsdp2_tied_embeddings_root_resharded(ctx):
    """LM head tied to the embedding (small Qwen3 models), one FSDP2 group, the root resharded
    after the forward: the loss outside the forward gets the tied DTensor; its gradient (ours,
    from the loss) and FSDP2's (the embedding's, reduce-scattered in its post-backward) add up."""
    torch.manual_seed(8)
    lm = TinyLM()
    lm.lm_head.weight = lm.embed.weight
    unsharded = copy.deepcopy(lm)
    assert unsharded.lm_head.weight is unsharded.embed.weight
    fully_shard(lm.mix, mesh=ctx.mesh)
    fully_shard(lm, mesh=ctx.mesh, reshard_after_forward=True)
    batch = _policy_batch(ctx.rank, 8)
    hidden, _ = lm(batch["token_ids"].clamp_min(0))
    assert isinstance(lm.lm_head.weight, DTensor) and lm.lm_head.weight is lm.embed.weight
    loss = _loss_call("dapo", batch)(hidden, lm.lm_head)
    loss.backward()
    want, loss_r = _reference_grads(ctx, unsharded, "dapo", 8)
    _close(loss, loss_r, "loss")
    _compare_grads(lm, want, "tied")


def check_fsdp2_hsdp_2d_mesh(ctx):
    """HSDP: ``fully_shard`` on a 2-D (replicate, shard) mesh, parameters placed
    ``(Replicate(), Shard(0))``; both layouts of 2 ranks, (2, 1) and (1, 2). The gathered head's
    gradient is averaged over both mesh dimensions, as FSDP2's HSDP reduction."""
    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(9)
        lm = TinyLM(bias=True)
        unsharded = copy.deepcopy(lm)
        fully_shard(lm.lm_head, mesh=mesh)
        fully_shard(lm, mesh=mesh)
        batch = _policy_batch(ctx.rank, 9)
        hidden, _ = lm(batch["token_ids"].clamp_min(0))
        weight = lm.lm_head.weight
        assert tuple(weight.placements) == (Replicate(), Shard(0)), weight.placements
        loss = _loss_call("dapo", batch)(hidden, lm.lm_head)
        loss.backward()
        want, loss_r = _reference_grads(ctx, unsharded, "dapo", 9)
        _close(loss, loss_r, f"mesh {shape}: loss")
        _compare_grads(lm, want, f"mesh {shape}")


def _fsdp2_inside_forward(ctx, preset, seed, lm_head_unit):
    """The loss inside the root's forward (``LossInForward``). With lm_head in the root group its
    weight is FSDP2's unsharded plain tensor there (FSDP2 reduces its gradient); as its own unit
    it is the Shard(0) DTensor (gathered here)."""
    lm, unsharded, shard_kw = _sharded_lm(ctx, seed=seed, lm_head_unit=lm_head_unit)
    wrapper = LossInForward(lm)
    fully_shard(wrapper, **shard_kw)
    batch = _policy_batch(ctx.rank, seed)
    seen = []

    def call(hidden, head):
        seen.append(type(head.weight))
        return _loss_call(preset, batch)(hidden, head)

    loss = wrapper(batch["token_ids"], call)
    loss.backward()
    expected = DTensor if lm_head_unit else torch.nn.Parameter
    assert seen and issubclass(seen[0], expected), f"lm_head.weight inside the forward: {seen}"
    want, loss_r = _reference_grads(ctx, unsharded, preset, seed)
    _close(loss, loss_r, f"{preset} loss")
    _compare_grads(wrapper, want, f"{preset} inside the forward")


def check_fsdp2_inside_forward_root_group(ctx):
    _fsdp2_inside_forward(ctx, "dapo", seed=4, lm_head_unit=False)


def check_fsdp2_inside_forward_lm_head_unit(ctx):
    _fsdp2_inside_forward(ctx, "gspo", seed=5, lm_head_unit=True)


def check_fsdp2_invariant(ctx):
    """``invariant=True`` with the FSDP2 DTensor head: the log-probs are bitwise those of the
    plain full weight on the same hidden states (the gather moves the weight's bits unchanged and
    the invariant GEMM is row by row); the loss likewise, and the gradients vs the unsharded run."""
    lm, unsharded, shard_kw = _sharded_lm(ctx, seed=6)
    fully_shard(lm, **shard_kw)
    batch = _policy_batch(ctx.rank, 6)
    hidden, _ = lm(batch["token_ids"].clamp_min(0))
    ids = batch["token_ids"].clamp_min(0)
    full = unsharded.lm_head.weight.detach().clone()
    with torch.no_grad():
        logp = rk.linear_token_logprobs(hidden, lm.lm_head.weight, ids, invariant=True)
        logp_plain = rk.linear_token_logprobs(hidden, full, ids, invariant=True)
    assert torch.equal(logp, logp_plain), f"invariant logp differs: {_max_diff(logp, logp_plain):.1e}"
    loss = _loss_call("dapo", batch, invariant=True)(hidden, lm.lm_head)
    with torch.no_grad():
        cfg = rk.PolicyLossConfig.preset("dapo", entropy_coef=0.01)
        loss_plain = rk.fused_policy_loss(cfg, hidden=hidden, weight=full, invariant=True, **batch).loss
    assert torch.equal(loss.detach(), loss_plain), "invariant loss differs from the plain weight's"
    loss.backward()
    want, loss_r = _reference_grads(ctx, unsharded, "dapo", 6, invariant=True)
    _close(loss, loss_r, "loss vs the unsharded run")
    _compare_grads(lm, want, "invariant")


def check_fsdp2_mixed_precision_outside_equals_inside(ctx):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the loss outside the forward
    (fp32 DTensor head, gathered in bf16) equals the loss inside the forward (FSDP2's own bf16
    unsharded head) bitwise, and every gradient to fp32 rounding of the same bf16 products."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batch = _policy_batch(ctx.rank, 7)
    outside, _, kw = _sharded_lm(ctx, seed=7, mp=mp)
    fully_shard(outside, **kw)
    hidden, _ = outside(batch["token_ids"].clamp_min(0))
    head = outside.lm_head
    assert hidden.dtype == torch.bfloat16 and head.weight.dtype == torch.float32, (hidden.dtype, head.weight)
    loss_out = _loss_call("dapo", batch)(hidden, head)
    loss_out.backward()
    lm, _, kw = _sharded_lm(ctx, seed=7, mp=mp, lm_head_unit=False)
    inside = LossInForward(lm)
    fully_shard(inside, **kw)
    loss_in = inside(batch["token_ids"], _loss_call("dapo", batch))
    loss_in.backward()
    assert torch.equal(loss_out.detach(), loss_in.detach()), f"{loss_out.item()} vs {loss_in.item()}"
    grads_in = {n.removeprefix("lm."): p.grad.full_tensor() for n, p in inside.named_parameters()}
    for name, p in outside.named_parameters():
        assert p.grad.dtype == torch.float32
        _close(p.grad.full_tensor(), grads_in[name], f"{name}.grad", atol=1e-6)


# ----------------------------------------------------------------------------------------- errors
def check_error_tp_group_with_dtensor_every_rank(ctx):
    w, _ = _head(8, bias=False)
    h, ids, *_ = _rank_data(ctx.rank, 8)
    dw = distribute_tensor(w, ctx.mesh, [Shard(0)])
    fn = lambda: rk.linear_token_logprobs(h, dw, ids, tp_group=dist.group.WORLD)  # noqa: E731
    expect_same_error(ctx, fn, ValueError, "weight is a DTensor", "not supported with tp_group")


def check_still_in_sync_after_errors(ctx):
    _linear_vs_reference(ctx, Shard(0), seed=9)


CHECKS: dict[str, Callable[[Ctx], None]] = {
    name[len("check_") :]: fn for name, fn in list(globals().items()) if name.startswith("check_")
}


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Worker entry point (``torch.multiprocessing.start_processes``)."""
    init_gloo_worker(rank, world, init_file, COLLECTIVE_TIMEOUT_S)
    path = os.path.join(out_dir, f"rank{rank}.json")
    passed = False
    try:
        ctx = Ctx(rank=rank, world=world, mesh=init_device_mesh("cpu", (world,)), group=dist.group.WORLD)
        passed = run_checks(CHECKS.items(), ctx, path)
    finally:
        if passed:
            dist.destroy_process_group()
