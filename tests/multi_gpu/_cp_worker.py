"""The torchrun entry of ``test_context_parallel.py``: context-parallel losses on NCCL at real size.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multi_gpu/_cp_worker.py --out DIR
    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/multi_gpu/_cp_worker.py --out DIR
    (add --smoke for gloo on the CPU at tiny sizes; the test runs these for you)

Every rank runs :data:`checks` in order and writes ``DIR/rank<r>.json`` (check name → ``"ok"`` or
the traceback) after each one; on the first failure a rank exits non-zero and torchrun stops the
others (the collectives also time out after ``COLLECTIVE_TIMEOUT_S``).

2 ranks (CP = 2): each rank holds a slice of every sequence. Hidden states ``[S, T, H]`` (S = 4,
T = 4096, H = 4096, bf16), the LM head V = 151,936, and the RL inputs are generated on rank 0 and
broadcast; every rank computes the unsplit loss on its own GPU with the same call (the default
backend: the fused linear path, or the composed path for the sequence-level objectives) and
compares its slice: the rank losses summed equal the unsplit loss, its ``dhidden`` is its slice of
the unsplit ``dhidden``, the ranks' ``dweight`` summed is the unsplit ``dweight``, and its metrics
are the unsplit ones. Layouts: padded contiguous uneven slices, packed (ragged lengths) in Megatron's
load-balanced layout (``context_parallel_split``). Every preset on the hidden path; the logits path
(S = 2, T = 2048) for a token-level, a sequence-level and a GRPO objective; rollout corrections,
rejection, the top-entropy quantile and the off-policy mask; a bad layout raising the same error on
every rank.

4 ranks: CP = 2 × DP = 2 (each data-parallel pair its own batch, ``global_normalizers(group=dp,
cp_group=cp)``; Σ of the four losses = the whole step's loss computed on one GPU), and CP = 2 × TP
= 2 (the vocab-parallel head: the ranks of a TP group hold the same slice).

Tolerances (the same kernels on both sides, different chunking and reduction order): loss 1e-4
relative; gradients 1e-2 relative (‖Δ‖/‖ref‖; DESIGN: bf16 matmul-bearing ops); metrics 2e-3
absolute or relative (a clip fraction may move by a token whose ratio sits on the boundary).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import rlkernel as rk
from _rank_checks import finish_torchrun_worker, init_torchrun_group, rel, worker_args
from rlkernel.distributed import context_parallel_split, global_normalizers
from rlkernel.rl.config import PRESETS

COLLECTIVE_TIMEOUT_S = 120
FULL = dict(seqs=4, width=4096, hidden=4096, vocab=151936, logits_seqs=2, logits_width=2048)
SMOKE = dict(seqs=3, width=12, hidden=32, vocab=101, logits_seqs=2, logits_width=10)
LOSS_RTOL, GRAD_RTOL, METRIC_TOL = 1e-4, 1e-2, 2e-3
TEMPERATURE = 0.9


@dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    seqs: int
    width: int
    hidden: int
    vocab: int
    logits_seqs: int
    logits_width: int
    out: str = ""
    cache: dict = field(default_factory=dict)



def close_metrics(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: metric names {list(got)} vs {list(want)}"
    for name in want:
        g, w = got[name].item(), want[name].item()
        assert abs(g - w) <= METRIC_TOL * max(1.0, abs(w)), f"{what}: metric {name} {g:.6g} vs {w:.6g}"


# ------------------------------------------------------------------------------------ the batch
@dataclass
class Batch:
    """An unsplit RL batch in padded form ``[S, T, ...]``; packed: row i's first ``lengths[i]``."""

    hidden: torch.Tensor  # [S, T, H] bf16 (or logits [S, T, V])
    ids: torch.Tensor  # [S, T], -1 at masked positions
    mask: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    rollout_logp: torch.Tensor
    adv: torch.Tensor  # [S, T] per token
    lengths: list[int]
    packed: bool

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[i, :n] for i, n in enumerate(self.lengths)]) if self.packed else x

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0] + torch.tensor(self.lengths).cumsum(0).tolist())


def make_batch(ctx: Ctx, group, seed: int, *, packed: bool, logits: bool = False) -> Batch:
    """Generated on the group's first rank and broadcast (bitwise the same on every rank of it)."""
    seqs, width = (ctx.logits_seqs, ctx.logits_width) if logits else (ctx.seqs, ctx.width)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    dev = ctx.device
    inner = ctx.vocab if logits else ctx.hidden
    scale = 2.0 if logits else 1.0
    x = (torch.randn(seqs, width, inner, device=dev, generator=gen) * scale).to(torch.bfloat16)
    ids = torch.randint(0, ctx.vocab, (seqs, width), device=dev, generator=gen)
    mask = torch.rand(seqs, width, device=dev, generator=gen) > 0.2
    mask[1, : width // 2] = False  # a sequence active in its second half only
    noise = lambda: 0.05 * torch.randn(seqs, width, device=dev, generator=gen)  # noqa: E731
    base = -torch.rand(seqs, width, device=dev, generator=gen) * 4 - 8.0  # logp ≈ log(1/V) ± 2
    adv = torch.randn(seqs, width, device=dev, generator=gen)
    tensors = [x, ids, mask, base + noise(), base + noise(), base + 2 * noise(), adv]
    src = dist.get_global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)
    if packed:
        host = torch.Generator().manual_seed(seed)
        lengths = torch.randint(width // 4, width + 1, (seqs,), generator=host).tolist()
    else:
        lengths = [width] * seqs
    x, ids, mask, old, ref, roll, adv = tensors
    return Batch(x, torch.where(mask, ids, -1), mask, old, ref, roll, adv, lengths, packed)


@dataclass
class Slice:
    """One rank's share: positions per sequence, and whether they are contiguous in rank order."""

    positions: list[torch.Tensor]
    contiguous: bool

    def take(self, b: Batch, x: torch.Tensor) -> torch.Tensor:
        pieces = [x[i, p.to(x.device)] for i, p in enumerate(self.positions)]
        return torch.cat(pieces) if b.packed else torch.stack(pieces)

    def kwargs(self, b: Batch, group) -> dict:
        kw = dict(cp_group=group)
        if b.packed:
            sizes = torch.tensor([p.numel() for p in self.positions])
            kw["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        if not self.contiguous:
            pos = torch.cat(self.positions) if b.packed else torch.stack(self.positions)
            kw["cp_positions"] = pos.to(b.ids.device)
        return kw


def contiguous_uneven(b: Batch, cp_rank: int) -> Slice:
    """Padded: the first 60 % of every row on CP rank 0, the rest on rank 1."""
    cut = (b.lengths[0] * 3) // 5
    return Slice([torch.arange(0, cut) if cp_rank == 0 else torch.arange(cut, n) for n in b.lengths], True)


def load_balanced(b: Batch, cp_rank: int) -> Slice:
    """Megatron's load-balanced layout (chunks r and 3 − r of four per sequence)."""
    return Slice([context_parallel_split(n, cp_size=2, cp_rank=cp_rank).positions for n in b.lengths], False)


# ----------------------------------------------------------------------------------- comparison
def rl_kwargs(b: Batch, take: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    return dict(
        token_ids=take(b.ids), old_logp=take(b.old_logp), advantages=take(b.adv), mask=take(b.mask),
        ref_logp=take(b.ref_logp), rollout_logp=take(b.rollout_logp),
    )  # fmt: skip


def unsplit(b: Batch, cfg, weight: torch.Tensor | None) -> tuple:
    """The unsplit call on this GPU: loss, dx (padded form), dweight, metrics."""
    x = b.hidden.clone().requires_grad_(True)
    kw = rl_kwargs(b, b.stream)
    if b.packed:
        kw["cu_seqlens"] = b.cu_seqlens
    if weight is None:
        out = rk.fused_policy_loss(cfg, logits=b.stream(x), temperature=TEMPERATURE, validate=False, **kw)
        dx, dw = torch.autograd.grad(out.loss, [x])[0], None
    else:
        w = weight.clone().requires_grad_(True)
        out = rk.fused_policy_loss(
            cfg, hidden=b.stream(x), weight=w, temperature=TEMPERATURE, validate=False, **kw
        )
        dx, dw = torch.autograd.grad(out.loss, [x, w])
    return out.loss.detach(), dx, dw, dict(out.metrics)


def compare_cp(b: Batch, part: Slice, cfg, weight, group, what: str, *, tp_group=None, rows=None) -> None:
    """This rank's slice under ``group`` (CP) vs the unsplit call: Σ losses, dx slice, Σ dweight."""
    loss_r, dx_r, dw_r, metrics_r = unsplit(b, cfg, weight)
    x = part.take(b, b.hidden).clone().requires_grad_(True)
    kw = dict(rl_kwargs(b, lambda t: part.take(b, t)), **part.kwargs(b, group))
    if weight is None:
        out = rk.fused_policy_loss(cfg, logits=x, temperature=TEMPERATURE, **kw)
        dx, dw = torch.autograd.grad(out.loss, [x])[0], None
    else:
        w = (weight if rows is None else weight[rows]).clone().requires_grad_(True)
        out = rk.fused_policy_loss(cfg, hidden=x, weight=w, tp_group=tp_group, temperature=TEMPERATURE, **kw)
        dx, dw = torch.autograd.grad(out.loss, [x, w])
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=group)
    d_loss = abs(total.item() - loss_r.item()) / max(abs(loss_r.item()), 1e-12)
    assert d_loss <= LOSS_RTOL, f"{what}: Σ rank losses {total.item():.7g} vs unsplit {loss_r.item():.7g}"
    r = rel(dx, part.take(b, dx_r))
    assert r <= GRAD_RTOL, f"{what}: d{'logits' if weight is None else 'hidden'} slice rel {r:.1e}"
    if dw is not None:
        dist.all_reduce(dw, group=group)
        want = dw_r if rows is None else dw_r[rows]
        assert rel(dw, want) <= GRAD_RTOL, f"{what}: Σ rank dweight rel {rel(dw, want):.1e}"
    close_metrics(out.metrics, metrics_r, what)


def weight_of(ctx: Ctx) -> torch.Tensor:
    if "weight" not in ctx.cache:
        gen = torch.Generator(device=ctx.device).manual_seed(99)
        w = torch.randn(ctx.vocab, ctx.hidden, device=ctx.device, generator=gen) * (2.5 / ctx.hidden**0.5)
        w = w.to(torch.bfloat16)
        dist.broadcast(w, src=0)
        ctx.cache["weight"] = w
    return ctx.cache["weight"]


# ------------------------------------------------------------------------------------ CP = 2 checks
def cp_hidden(ctx: Ctx, preset: str, packed: bool, **cfg_kw) -> None:
    group = dist.group.WORLD
    b = make_batch(ctx, group, 1 + packed, packed=packed)
    part = (load_balanced if packed else contiguous_uneven)(b, ctx.rank)
    cfg = rk.PolicyLossConfig.preset(preset, entropy_coef=0.001, **cfg_kw)
    compare_cp(b, part, cfg, weight_of(ctx), group, f"{preset} {cfg_kw} packed={packed}")


def cp_logits(ctx: Ctx, preset: str) -> None:
    group = dist.group.WORLD
    b = make_batch(ctx, group, 5, packed=True, logits=True)
    cfg = rk.PolicyLossConfig.preset(preset, entropy_coef=0.001)
    compare_cp(b, load_balanced(b, ctx.rank), cfg, None, group, f"logits {preset}")


def check_bad_layout_every_rank_raises(ctx: Ctx) -> None:
    """Different sequence counts, and a position map that is not a partition: every rank raises the
    same ValueError, fast; a good call afterwards works."""
    group = dist.group.WORLD
    b = make_batch(ctx, group, 7, packed=True)
    part = load_balanced(b, ctx.rank)
    cfg = rk.PolicyLossConfig.preset("gspo")
    good = dict(rl_kwargs(b, lambda t: part.take(b, t)), **part.kwargs(b, group))
    x = part.take(b, b.hidden)
    w = weight_of(ctx)
    fewer = dict(good)
    if ctx.rank == 0:
        fewer.update(cu_seqlens=good["cu_seqlens"][:-1], advantages=good["advantages"])
        n = int(fewer["cu_seqlens"][-1])
        for k in ("token_ids", "old_logp", "advantages", "mask", "ref_logp", "rollout_logp", "cp_positions"):
            fewer[k] = fewer[k][:n]
        fewer["x"] = x[:n]
    overlap = dict(good, cp_positions=good["cp_positions"].clamp_max(5))
    for label, kw, needle in (
        ("sequence count", fewer, "sequence count S differs"),
        ("positions", overlap, "cp_positions do not partition"),
    ):
        xx = kw.pop("x", x)
        t0 = time.perf_counter()
        try:
            rk.fused_policy_loss(cfg, hidden=xx, weight=w, **kw)
            mine = None
        except Exception as exc:  # noqa: BLE001 - compared across ranks below
            mine = (type(exc).__name__, str(exc))
        elapsed = time.perf_counter() - t0
        seen = [None] * ctx.world
        dist.all_gather_object(seen, mine, group=group)
        assert all(s is not None and s[0] == "ValueError" for s in seen), f"{label}: {seen}"
        assert len({s[1] for s in seen}) == 1 and needle in seen[0][1], f"{label}: {seen}"
        assert elapsed < COLLECTIVE_TIMEOUT_S / 2, f"{label}: the raise took {elapsed:.1f} s"
    out = rk.fused_policy_loss(cfg, hidden=x, weight=w, **good)
    assert torch.isfinite(out.loss), "a good call after the errors failed"


# ------------------------------------------------------------------------------- 4 ranks: meshes
def meshes(ctx: Ctx) -> tuple:
    """Rank 2·a + b: pairs {0, 1} {2, 3}, across {0, 2} {1, 3} (created once, by every rank)."""
    if "meshes" not in ctx.cache:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        ctx.cache["meshes"] = pairs[ctx.rank // 2], across[ctx.rank % 2]
    return ctx.cache["meshes"]


def mesh_cp_dp(ctx: Ctx, preset: str) -> None:
    """CP = pairs, DP = across: DP rank d's batch split over its CP pair; global normalizers over
    the step; Σ of the four rank losses = the whole step in one unsplit call on this GPU."""
    cp, dp = meshes(ctx)
    cp_rank, dp_rank = ctx.rank % 2, ctx.rank // 2
    shards = [make_batch(ctx, dist.group.WORLD, 20 + d, packed=True) for d in range(2)]
    b = shards[dp_rank]
    part = load_balanced(b, cp_rank)
    cfg = rk.PolicyLossConfig.preset(preset, entropy_coef=0.001)
    kw = dict(rl_kwargs(b, lambda t: part.take(b, t)), **part.kwargs(b, cp))
    gt, gs = global_normalizers(kw["mask"], cu_seqlens=kw["cu_seqlens"], group=dp, cp_group=cp)
    x = part.take(b, b.hidden).clone().requires_grad_(True)
    w = weight_of(ctx).clone().requires_grad_(True)
    out = rk.fused_policy_loss(cfg, hidden=x, weight=w, global_tokens=gt, global_seqs=gs,
                               temperature=TEMPERATURE, **kw)  # fmt: skip
    dx, dw = torch.autograd.grad(out.loss, [x, w])
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    dist.all_reduce(dw)
    whole = Batch(*(torch.cat([getattr(s, f) for s in shards]) for f in
                    ("hidden", "ids", "mask", "old_logp", "ref_logp", "rollout_logp", "adv")),
                  lengths=shards[0].lengths + shards[1].lengths, packed=True)  # fmt: skip
    loss_r, dx_r, dw_r, _ = unsplit(whole, cfg, weight_of(ctx))
    d_loss = abs(total.item() - loss_r.item()) / max(abs(loss_r.item()), 1e-12)
    assert d_loss <= LOSS_RTOL, f"Σ of 4 rank losses {total.item():.7g} vs the whole step {loss_r.item():.7g}"
    rows = slice(dp_rank * b.hidden.shape[0], (dp_rank + 1) * b.hidden.shape[0])
    r = rel(dx, part.take(b, dx_r[rows]))
    assert r <= GRAD_RTOL, f"dhidden rel {r:.1e}"
    assert rel(dw, dw_r) <= GRAD_RTOL, f"Σ dweight rel {rel(dw, dw_r):.1e}"


def mesh_cp_tp(ctx: Ctx, preset: str) -> None:
    """TP = pairs (uneven vocabulary shards), CP = across: the ranks of a TP pair hold the same
    slice; vs the unsplit, unsharded call."""
    tp, cp = meshes(ctx)
    tp_rank, cp_rank = ctx.rank % 2, ctx.rank // 2
    b = make_batch(ctx, dist.group.WORLD, 30, packed=False)
    part = contiguous_uneven(b, cp_rank)
    first = ctx.vocab // 2 + ctx.vocab // 20
    rows = slice(0, first) if tp_rank == 0 else slice(first, ctx.vocab)
    cfg = rk.PolicyLossConfig.preset(preset, entropy_coef=0.001)
    compare_cp(b, part, cfg, weight_of(ctx), cp, f"CP x TP {preset}", tp_group=tp, rows=rows)


# The CPU smoke run (gloo, tiny) keeps the plumbing tested; the gloo tests of tests/distributed
# check the arithmetic of every objective. Its subset: one preset per path, one extra, the errors.
SMOKE_CHECKS = (
    "hidden_dapo_padded_uneven", "hidden_gspo_packed_balanced", "hidden_grpo_packed_balanced",
    "hidden_gspo_top_entropy", "logits_gspo_packed_balanced", "bad_layout_every_rank_raises",
)  # fmt: skip


def checks(world: int, smoke: bool = False) -> dict[str, Callable[[Ctx], None]]:
    """Every check of a ``world``-rank run, in run order, by the name the test reports (``smoke``:
    :data:`SMOKE_CHECKS` on 2 ranks)."""
    if smoke and world == 2:
        return {name: fn for name, fn in checks(world).items() if name in SMOKE_CHECKS}
    out: dict[str, Callable[[Ctx], None]] = {}
    if world == 4:
        for preset in ("dapo", "grpo", "gspo"):
            out[f"mesh_cp2_dp2_{preset}"] = lambda ctx, p=preset: mesh_cp_dp(ctx, p)
        for preset in ("dapo", "gspo"):
            out[f"mesh_cp2_tp2_{preset}"] = lambda ctx, p=preset: mesh_cp_tp(ctx, p)
        return out
    for preset in PRESETS:
        for packed in (False, True):
            out[f"hidden_{preset}_{'packed_balanced' if packed else 'padded_uneven'}"] = (
                lambda ctx, p=preset, k=packed: cp_hidden(ctx, p, k)
            )
    extras = {
        "seq_tis": dict(rollout_correction="seq_tis", rollout_clip_max=2.0),
        "rollout_rs_seq_mean_k3": dict(rollout_rs="seq_mean_k3", rollout_rs_max=0.01),
        "top_entropy": dict(top_entropy_quantile=0.2),
        "off_policy_mask": dict(off_policy_mask_threshold=0.01),
    }
    for name, kw in extras.items():
        for preset in ("dapo", "gspo"):
            out[f"hidden_{preset}_{name}"] = lambda ctx, p=preset, k=kw: cp_hidden(ctx, p, True, **k)
    for preset in ("dapo", "grpo", "gspo"):
        out[f"logits_{preset}_packed_balanced"] = lambda ctx, p=preset: cp_logits(ctx, p)
    out["bad_layout_every_rank_raises"] = check_bad_layout_every_rank_raises
    return out


def main() -> int:
    args = worker_args(__doc__)
    device = init_torchrun_group(args.smoke, COLLECTIVE_TIMEOUT_S)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in (2, 4):
        raise SystemExit(f"run on 2 ranks (CP = 2) or 4 (the 2 x 2 meshes), not {world}")
    ctx = Ctx(rank=rank, world=world, device=device, out=args.out, **(SMOKE if args.smoke else FULL))
    return finish_torchrun_worker(checks(world, args.smoke).items(), ctx, args.out, rank, device)


if __name__ == "__main__":
    sys.exit(main())
