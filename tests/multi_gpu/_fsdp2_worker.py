"""The torchrun entry of ``test_fsdp2.py``: an FSDP2 LM head on NCCL, 2 or 4 GPUs, against one GPU.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multi_gpu/_fsdp2_worker.py --out DIR
    (--nproc_per_node=4: FSDP2 over 4 ranks; add --smoke for gloo on the CPU at tiny sizes; the test
    runs these for you)

Every rank runs :data:`CHECKS` in order and writes ``DIR/rank<r>.json`` (check name → ``"ok"`` or
the traceback) after each one. On the first failure a rank writes its traceback and exits non-zero;
torchrun then stops the other rank (the collectives also time out after ``COLLECTIVE_TIMEOUT_S``).

Model: embedding [V, H] → tanh(linear [H, H]) → LM head [V, H] (the forward returns the hidden
states and the logits, as an HF model with ``output_hidden_states``), V = 151,936 (Qwen3),
H = 1024, 4 × 1024 tokens per rank. ``fully_shard`` on the mixing layer, the LM head (its own unit:
a ``Shard(0)`` DTensor outside its forward) and the root. Data parallel: each rank its own batch.

The reference is the unsharded model on one GPU (every rank computes it): the same
``fused_policy_loss`` on each rank's batch with the plain weight, gradients averaged over the ranks
(FSDP2's default mean). Compared (‖Δ‖/‖ref‖ of each parameter's gathered gradient, loss relative):
    fp32: gradients 1e-5, loss 1e-5 (the same kernels on the same values; only the order of the
        gradient mean differs).
    bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; reference: the unsharded
        model cast to bf16, its bf16 gradients averaged in fp32): gradients 1e-2 (DESIGN: bf16
        matmul-bearing ops), loss 1e-3; and the loss outside the forward (the fp32 DTensor head
        gathered in bf16 by rlkernel) against the loss inside it (FSDP2's own bf16 unsharded head):
        loss 1e-5, gradients 1e-4.
    ``invariant=True``: the log-probs with the DTensor head bitwise those with the plain head.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import rlkernel as rk
from _rank_checks import finish_torchrun_worker, init_torchrun_group, median_ms, rel, worker_args

COLLECTIVE_TIMEOUT_S = 120
FULL = dict(vocab=151936, hidden=1024, batch=4, seq=1024)
SMOKE = dict(vocab=101, hidden=32, batch=2, seq=8)
PRESETS = ("dapo", "gspo")  # the token-level fused linear path, and the composed path
FP32_RTOL = 1e-5
BF16_GRAD_RTOL, BF16_LOSS_RTOL = 1e-2, 1e-3
SAME_PATH_LOSS_RTOL, SAME_PATH_GRAD_RTOL = 1e-5, 1e-4  # bf16: outside vs inside the forward


@dataclass
class Ctx:
    rank: int
    world: int
    group: object
    mesh: object
    device: torch.device
    vocab: int
    hidden: int
    batch: int
    seq: int
    out: str = ""
    cache: dict = field(default_factory=dict)



class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        hidden = torch.tanh(self.mix(self.embed(ids)))
        return hidden, self.lm_head(hidden)


class LossInForward(torch.nn.Module):
    """The loss computed inside the root's forward (the LM head unsharded by FSDP2 there)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, call):
        hidden, _ = self.lm(ids.clamp_min(0))
        return call(hidden, self.lm.lm_head.weight)


def base_model(ctx: Ctx) -> TinyLM:
    """The fp32 model, identical on every rank (rank 0's parameters broadcast); a fresh copy."""
    if "model" not in ctx.cache:
        torch.manual_seed(1234)
        lm = TinyLM(ctx.vocab, ctx.hidden).to(ctx.device)
        with torch.no_grad():
            lm.lm_head.weight.mul_(2.0)  # logits of std ≈ 1 over the vocabulary
            for p in lm.parameters():
                dist.broadcast(p, src=0, group=ctx.group)
        ctx.cache["model"] = lm
    return copy.deepcopy(ctx.cache["model"])


def batch_of(ctx: Ctx, rank: int) -> dict:
    """Rank ``rank``'s RL batch (generated on the CPU from a seed: the same on every rank): ids
    (-1 where masked), mask (~20 % off, one sequence fully masked on rank 1), old log-probs,
    advantages."""
    g = torch.Generator().manual_seed(100 + rank)
    shape = (ctx.batch, ctx.seq)
    ids = torch.randint(0, ctx.vocab, shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    mask[0, 0] = True
    if rank == 1:
        mask[-1] = False
    out = dict(
        token_ids=torch.where(mask, ids, -1),
        mask=mask,
        old_logp=0.5 * torch.randn(shape, generator=g) - math.log(ctx.vocab),  # logp ≈ log(1/V) ± 1
        advantages=torch.randn(ctx.batch, generator=g),
    )
    return {k: v.to(ctx.device) for k, v in out.items()}


def loss_fn(preset: str, batch: dict, **kw) -> Callable:
    cfg = rk.PolicyLossConfig.preset(preset, entropy_coef=0.001)
    return lambda hidden, weight: rk.fused_policy_loss(cfg, hidden=hidden, weight=weight, **batch, **kw).loss


def reference(ctx: Ctx, preset: str, dtype: torch.dtype, **kw):
    """The unsharded single-GPU step in ``dtype``: (this rank's loss, {name: fp32 gradient mean
    over the ranks' batches})."""
    model = base_model(ctx).to(dtype)
    grads, mine = {}, None
    for r in range(ctx.world):
        batch = batch_of(ctx, r)
        hidden, _ = model(batch["token_ids"].clamp_min(0))
        loss = loss_fn(preset, batch, **kw)(hidden, model.lm_head.weight)
        names, params = zip(*model.named_parameters(), strict=True)
        for n, g in zip(names, torch.autograd.grad(loss, params), strict=True):
            grads[n] = grads.get(n, 0) + g.float() / ctx.world
        if r == ctx.rank:
            mine = loss.detach()
    return mine, grads


def sharded(ctx: Ctx, *, mp: MixedPrecisionPolicy | None = None, lm_head_unit: bool = True):
    """A fresh FSDP2-wrapped copy of the model (lm_head its own unit, or in the root group)."""
    lm = base_model(ctx)
    kw = dict(mesh=ctx.mesh) if mp is None else dict(mesh=ctx.mesh, mp_policy=mp)
    fully_shard(lm.mix, **kw)
    if lm_head_unit:
        fully_shard(lm.lm_head, **kw)
    return lm, kw


def gathered_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), f"{name}.grad is a {type(p.grad).__name__}"
        assert tuple(p.grad.placements) == tuple(p.placements), f"{name}.grad {p.grad.placements}"
        out[name.removeprefix("lm.")] = p.grad.full_tensor()
    return out


def compare(got_loss, got: dict, want_loss, want: dict, loss_rtol: float, grad_rtol: float) -> None:
    d_loss = abs(got_loss.item() - want_loss.item()) / max(abs(want_loss.item()), 1e-12)
    assert d_loss <= loss_rtol, f"loss {got_loss.item():.7f} vs {want_loss.item():.7f} (rel {d_loss:.1e})"
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    for name in want:
        r = rel(got[name], want[name])
        assert r <= grad_rtol, f"{name}.grad rel {r:.1e} > {grad_rtol:.0e}"


def outside_forward(ctx: Ctx, preset: str, *, mp: MixedPrecisionPolicy | None = None):
    """``hidden, _ = model(ids)``, then the loss with ``model.lm_head.weight`` (a Shard(0) DTensor):
    (loss, gathered fp32 gradients)."""
    lm, kw = sharded(ctx, mp=mp)
    fully_shard(lm, **kw)
    batch = batch_of(ctx, ctx.rank)
    hidden, _ = lm(batch["token_ids"].clamp_min(0))
    weight = lm.lm_head.weight
    assert isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),), type(weight)
    loss = loss_fn(preset, batch)(hidden, weight)
    loss.backward()
    return loss.detach(), gathered_grads(lm)


# ------------------------------------------------------------------------------------------ checks
def fp32_vs_single_gpu(ctx: Ctx, preset: str) -> None:
    loss, grads = outside_forward(ctx, preset)
    want_loss, want = reference(ctx, preset, torch.float32)
    compare(loss, grads, want_loss, want, FP32_RTOL, FP32_RTOL)


def bf16_vs_single_gpu(ctx: Ctx, preset: str) -> None:
    """FSDP2 mixed precision: fp32 shards, bf16 compute; the DTensor head (fp32) is gathered in
    bf16 by rlkernel, its gradient reduced in fp32 (as FSDP2's reduce_dtype=fp32)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    loss, grads = outside_forward(ctx, preset, mp=mp)
    want_loss, want = reference(ctx, preset, torch.bfloat16)
    compare(loss, grads, want_loss, want, BF16_LOSS_RTOL, BF16_GRAD_RTOL)
    lm, kw = sharded(ctx, mp=mp, lm_head_unit=False)
    inside = LossInForward(lm)
    fully_shard(inside, **kw)
    batch = batch_of(ctx, ctx.rank)
    loss_in = inside(batch["token_ids"], loss_fn(preset, batch))
    loss_in.backward()
    compare(loss, grads, loss_in.detach(), gathered_grads(inside), SAME_PATH_LOSS_RTOL, SAME_PATH_GRAD_RTOL)


def invariant_bitwise(ctx: Ctx, dtype: torch.dtype) -> None:
    """``invariant=True``: logp with the DTensor head (gathered; bf16: cast from the fp32 shards)
    bitwise equal to logp with the plain unsharded head in ``dtype``, on the same hidden states."""
    lm = base_model(ctx)
    batch = batch_of(ctx, ctx.rank)
    ids = batch["token_ids"].clamp_min(0)
    with torch.no_grad():
        hidden = lm(ids)[0].to(dtype)
        full = lm.lm_head.weight.detach()
        dw = distribute_tensor(full, ctx.mesh, [Shard(0)])
        got = rk.linear_token_logprobs(hidden, dw, ids, invariant=True)
        want = rk.linear_token_logprobs(hidden, full.to(dtype), ids, invariant=True)
    assert torch.equal(got, want), f"max |Δ| {(got - want).abs().max().item():.1e}"


def check_error_path(ctx: Ctx) -> None:
    """A DTensor weight with tp_group: the same ValueError on every rank, raised before any
    collective, and a good call afterwards works."""
    lm = base_model(ctx)
    batch = batch_of(ctx, ctx.rank)
    ids = batch["token_ids"].clamp_min(0)
    with torch.no_grad():
        hidden = lm(ids)[0]
    dw = distribute_tensor(lm.lm_head.weight.detach(), ctx.mesh, [Shard(0)])
    try:
        rk.linear_token_logprobs(hidden, dw, ids, tp_group=ctx.group)
        mine = None
    except Exception as exc:  # noqa: BLE001 - compared across ranks below
        mine = (type(exc).__name__, str(exc))
    seen = [None] * ctx.world
    dist.all_gather_object(seen, mine, group=ctx.group)
    assert all(s is not None and s[0] == "ValueError" for s in seen), seen
    assert len({s[1] for s in seen}) == 1 and "not supported with tp_group" in seen[0][1], seen
    logp = rk.linear_token_logprobs(hidden, dw, ids)
    assert bool(torch.isfinite(logp).all()), "a good call after the error failed"


def check_timing_dtensor_vs_plain(ctx: Ctx) -> None:
    """What the gather costs: ``fused_policy_loss`` (dapo) fwd+bwd with the bf16 DTensor head
    (all-gather + reduce-scatter of [V, H]) vs the plain full head. Written to
    ``fsdp2_timings.json`` by rank 0; no threshold (the collectives' time depends on the link)."""
    lm = base_model(ctx).to(torch.bfloat16)
    batch = batch_of(ctx, ctx.rank)
    with torch.no_grad():
        hidden = lm(batch["token_ids"].clamp_min(0))[0]
    full = lm.lm_head.weight.detach()
    dw = distribute_tensor(full.float(), ctx.mesh, [Shard(0)]).requires_grad_()
    plain = full.clone().requires_grad_()
    call = loss_fn("dapo", batch, validate=False)

    def step(weight):
        h = hidden.detach().requires_grad_()
        call(h, weight).backward()

    reps = 3 if ctx.device.type == "cpu" else 10
    dtensor_ms = median_ms(lambda: step(dw), reps)
    dist.barrier(group=ctx.group)
    plain_ms = median_ms(lambda: step(plain), reps)
    dist.barrier(group=ctx.group)
    if ctx.rank == 0:
        info = dict(
            world=ctx.world, tokens=ctx.batch * ctx.seq, hidden=ctx.hidden, vocab=ctx.vocab,
            dtensor_head_fwd_bwd_ms=dtensor_ms, plain_head_fwd_bwd_ms=plain_ms,
            head_mb_bf16=ctx.vocab * ctx.hidden * 2 / 2**20,
            device=torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
            torch=torch.__version__, date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )  # fmt: skip
        print(f"timing: {json.dumps(info)}", flush=True)
        if ctx.out:
            with open(os.path.join(ctx.out, "fsdp2_timings.json"), "w") as f:
                json.dump(info, f, indent=1)


def checks() -> dict[str, Callable[[Ctx], None]]:
    """Every check, in run order, by the name the test reports."""
    out: dict[str, Callable[[Ctx], None]] = {}
    for preset in PRESETS:
        out[f"fp32_{preset}_vs_single_gpu"] = lambda ctx, p=preset: fp32_vs_single_gpu(ctx, p)
        out[f"bf16_{preset}_vs_single_gpu"] = lambda ctx, p=preset: bf16_vs_single_gpu(ctx, p)
    out["invariant_bitwise_fp32"] = lambda ctx: invariant_bitwise(ctx, torch.float32)
    out["invariant_bitwise_bf16"] = lambda ctx: invariant_bitwise(ctx, torch.bfloat16)
    out["error_path_every_rank_raises"] = check_error_path
    out["timing_dtensor_vs_plain"] = check_timing_dtensor_vs_plain
    return out


CHECK_NAMES = tuple(checks())


def main() -> int:
    args = worker_args(__doc__)
    device = init_torchrun_group(args.smoke, COLLECTIVE_TIMEOUT_S)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    size = SMOKE if args.smoke else FULL
    ctx = Ctx(rank=rank, world=world, group=dist.group.WORLD, mesh=mesh, device=device, out=args.out, **size)
    return finish_torchrun_worker(checks().items(), ctx, args.out, rank, device)


if __name__ == "__main__":
    sys.exit(main())
