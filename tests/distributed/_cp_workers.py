"""The checks that ``test_context_parallel.py`` runs inside each gloo worker process.

Every rank generates the same unsplit batch from a seed (float64: log-probs, old/ref/rollout
log-probs, entropies, masks with a fully masked sequence, per-sequence and per-token advantages),
computes the unsplit ``policy_loss`` itself, then its own context-parallel slice of it, and checks:
the rank losses all-reduced equal the unsplit loss, its gradient equals its slice of the unsplit
gradient, and its metrics equal the unsplit metrics. Layouts (every one for padded ``[S, T]`` and
packed input): contiguous slices, uneven ones (a rank with an empty slice included), Megatron's
load-balanced split (``context_parallel_split``) and a random partition of every sequence (different
positions per row). Bad layouts must raise the same error on every rank.

At world size 4 (``MESH_CHECKS`` only): a 2 (context) × 2 (data) mesh with ``global_normalizers``,
and a 2 (context) × 2 (tensor) mesh through the vocab-parallel LM head.

Each rank writes ``rank<r>.json`` (check name → ``"ok"`` or the traceback); see ``_workers.py`` for
the harness.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import rlkernel as rk
from _rank_checks import init_gloo_worker, run_checks
from rlkernel.distributed import context_parallel_split, global_normalizers
from rlkernel.reference import logprobs as ref
from rlkernel.rl.aggregate import AGGREGATIONS
from rlkernel.rl.config import LOSS_TYPES, ROLLOUT_CORRECTIONS, ROLLOUT_REJECTIONS

from ._workers import expect_same_error

COLLECTIVE_TIMEOUT_S = 20
S, T = 5, 11  # sequences, padded width (packed: lengths in [0, T])
VOCAB, HIDDEN = 19, 8
F64 = (1e-12, 1e-9)  # (atol, rtol): float64 CP vs unsplit (only the order of the sums differs)
F32 = (2e-6, 2e-5)  # float32 logits/hidden (Triton interpreter) vs the float64 unsplit loss


@dataclass
class Ctx:
    rank: int
    world: int
    group: object  # the context-parallel group (WORLD; the mesh checks make their own)
    solo: object = None  # this rank alone: a data-parallel / tensor-parallel group of one
    cache: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------ the batch
@dataclass
class Unsplit:
    """The unsplit batch in padded form ``[S, L]`` (packed: row i holds sequence i's first
    ``lengths[i]`` tokens)."""

    packed: bool
    lengths: list[int]
    tensors: dict  # name -> [S, L] float64 (or bool mask)
    adv_seq: torch.Tensor

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """The unsplit call's form of an ``[S, L, ...]`` tensor: itself, or the packed stream
        (differentiable: the gradient lands in ``x``'s padded form)."""
        return self.stream(x) if self.packed else x

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        """The sequences of an ``[S, L, ...]`` tensor concatenated (packed), whatever the layout."""
        return torch.cat([x[i, :n] for i, n in enumerate(self.lengths)])

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0] + list(torch.tensor(self.lengths).cumsum(0).tolist()))


def unsplit(seed: int, packed: bool) -> Unsplit:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (S,), generator=g).tolist() if packed else [T] * S
    if packed:
        lengths[1], lengths[3] = 0, T  # an empty sequence, a full one
    logp = -torch.rand(S, T, generator=g, dtype=torch.float64) * 2 - 0.05
    noise = lambda: 0.3 * torch.randn(S, T, generator=g, dtype=torch.float64)  # noqa: E731
    old = logp + noise()
    mask = torch.rand(S, T, generator=g) > 0.3
    mask[2] = False  # a sequence without active tokens
    tensors = dict(
        logp=logp,
        old_logp=old,
        ref_logp=logp + noise(),
        rollout_logp=old + noise(),
        entropy=torch.rand(S, T, generator=g, dtype=torch.float64) * 3,
        rollout_weights=torch.rand(S, T, generator=g, dtype=torch.float64) * 1.5 + 0.25,
        adv_tok=torch.randn(S, T, generator=g, dtype=torch.float64),
        mask=mask,
    )
    adv_seq = torch.randn(S, generator=g, dtype=torch.float64)
    return Unsplit(packed, lengths, tensors, adv_seq)


# ------------------------------------------------------------------------------------ layouts
@dataclass
class Layout:
    """Every rank's positions of every sequence (computed alike on every rank)."""

    name: str
    positions: list[list[torch.Tensor]]  # [rank][sequence] -> int64 positions, in local order
    contiguous: bool  # rank order, each slice in order: no cp_positions needed


def _widths(total: int, world: int, uneven: bool) -> list[int]:
    if not uneven:
        return [total // world + (r < total % world) for r in range(world)]
    cuts = {2: [0.65], 3: [0.45, 0.45]}[world]  # world 3: an empty middle slice
    bounds = [0] + [round(c * total) for c in cuts] + [total]
    return [bounds[r + 1] - bounds[r] for r in range(world)]


def layouts(world: int, data: Unsplit, seed: int) -> list[Layout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for uneven in (False, True):
        pos = [[] for _ in range(world)]
        for n in data.lengths:
            if data.packed and uneven:  # random cut points per sequence, empty pieces allowed
                cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
                bounds = [0] + cuts + [n]
            else:
                w = _widths(n, world, uneven)
                bounds = [sum(w[:r]) for r in range(world + 1)]
            for r in range(world):
                pos[r].append(torch.arange(bounds[r], bounds[r + 1]))
        out.append(Layout("uneven" if uneven else "contiguous", pos, contiguous=True))
    balanced = [[] for _ in range(world)]
    for n in data.lengths:
        for r in range(world):
            balanced[r].append(context_parallel_split(n, cp_size=world, cp_rank=r).positions)
    out.append(Layout("load_balanced", balanced, contiguous=False))
    shuffled = [[] for _ in range(world)]
    widths = _widths(T, world, True)
    for n in data.lengths:
        perm = torch.randperm(n, generator=g)
        if data.packed:
            cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
            bounds = [0] + cuts + [n]
        else:
            bounds = [sum(widths[:r]) for r in range(world + 1)]
        for r in range(world):
            shuffled[r].append(perm[bounds[r] : bounds[r + 1]])
    out.append(Layout("random", shuffled, contiguous=False))
    return out


def local(data: Unsplit, layout: Layout, rank: int, x: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s slice of an ``[S, L, ...]`` tensor: ``[S, T_r, ...]`` or packed."""
    pieces = [x[i, p] for i, p in enumerate(layout.positions[rank])]
    return torch.cat(pieces) if data.packed else torch.stack(pieces)


def local_positions(data: Unsplit, layout: Layout, rank: int) -> torch.Tensor:
    pieces = layout.positions[rank]
    return torch.cat(pieces) if data.packed else torch.stack(pieces)


def local_cu(layout: Layout, rank: int) -> torch.Tensor:
    sizes = torch.tensor([p.numel() for p in layout.positions[rank]])
    return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _close(got, want, tol, what):
    torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1], msg=lambda m: f"{what}: {m}")


def _close_metrics(got: dict, want: dict, tol, what: str) -> None:
    assert list(got) == list(want), f"{what}: metric names {list(got)} vs {list(want)}"
    for name in want:
        _close(got[name].double(), want[name].double(), tol, f"{what}: metric {name}")


def _all_reduced(x: torch.Tensor, group) -> torch.Tensor:
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x


# --------------------------------------------------------------------------- policy_loss vs unsplit
@dataclass(frozen=True)
class Case:
    name: str
    cfg: rk.PolicyLossConfig
    per_token_adv: bool = False
    on_policy: bool = False
    normalizers: str | None = None  # None | "float" | "tensor"
    rollout_weights: bool = False


def _cases() -> list[Case]:
    cases = []
    for k, loss_type in enumerate(LOSS_TYPES):
        for j, agg in enumerate(AGGREGATIONS):
            extra = {}
            if loss_type == "dro":
                extra["dro_beta"] = 0.1
            if loss_type in ("clip_cov", "kl_cov"):
                extra.update(clip_cov_lb=-0.3, clip_cov_ub=0.3, clip_cov_ratio=0.2, kl_cov_ratio=0.2)
            if loss_type == "gmpo":
                extra.update(clip_low=0.2, clip_high=0.2)
            if loss_type in ("gspo", "gspo_token"):
                extra.update(clip_low=0.05, clip_high=0.08)
            cfg = rk.PolicyLossConfig(
                loss_type=loss_type, aggregation=agg, kl_coef=0.05, entropy_coef=0.01, **extra
            )
            norm = (None, "float", "tensor")[(k + j) % 3]
            cases.append(Case(f"{loss_type}/{agg}", cfg, per_token_adv=(k + j) % 2 == 1, normalizers=norm))
    P = rk.PolicyLossConfig  # noqa: N806
    more = [
        Case("ppo dual_clip", P(dual_clip=3.0, kl_coef=0.1, kl_estimator="k1+")),
        Case("ppo delta", P(delta=1.5, kl_coef=0.1, kl_estimator="k3+", aggregation="seq-mean-token-mean")),
        Case("norm_length", P(aggregation="seq-mean-token-sum-norm", norm_length=13, kl_coef=0.1,
                              kl_estimator="k2")),
        Case("kl abs", P(kl_coef=0.1, kl_estimator="abs", aggregation="seq-mean-token-sum")),
        Case("kl k3_unclamped", P(kl_coef=0.1, kl_estimator="k3_unclamped"), per_token_adv=True),
        Case("on-policy gspo", P.preset("gspo", kl_coef=0.1), on_policy=True),
        Case("on-policy ppo", P.preset("grpo"), on_policy=True, per_token_adv=True),
        Case("given rollout_weights ppo", P.preset("dapo"), rollout_weights=True),
        Case("given rollout_weights gmpo", P.preset("gmpo"), rollout_weights=True, per_token_adv=True),
        Case("kl_ratio_weighted gspo", P.preset("gspo", kl_coef=0.2, kl_ratio_weighted=True)),
        Case("kl_ratio_weighted gspo_token", P(loss_type="gspo_token", clip_low=0.05, clip_high=0.08,
                                               kl_coef=0.2, kl_ratio_weighted=True), per_token_adv=True),
        Case("kl_ratio_weighted ppo", P(kl_coef=0.2, kl_ratio_weighted=True)),
        Case("seq_ratio product gspo", P.preset("gspo", seq_ratio="product", clip_low=0.5, clip_high=0.5)),
        Case("seq_ratio geo_mean vespo", P(loss_type="vespo", seq_ratio="geo_mean"), per_token_adv=True),
        Case("off_policy_mask ppo", P(off_policy_mask_threshold=0.02), per_token_adv=True),
        Case("off_policy_mask gspo", P.preset("gspo", off_policy_mask_threshold=0.02)),
        Case("top_entropy ppo", P(top_entropy_quantile=0.4, entropy_coef=0.02)),
        Case("top_entropy gspo", P.preset("gspo", top_entropy_quantile=0.0)),
        Case("top_entropy gmpo", P.preset("gmpo", top_entropy_quantile=0.7), normalizers="tensor"),
    ]  # fmt: skip
    for i, mode in enumerate(ROLLOUT_CORRECTIONS):
        for normalize in (False, True):
            cfg = P(rollout_correction=mode, rollout_clip_min=0.5, rollout_clip_max=1.6,
                    rollout_batch_normalize=normalize, aggregation=AGGREGATIONS[i])  # fmt: skip
            more.append(Case(f"ppo {mode} normalize={normalize}", cfg, per_token_adv=normalize))
    more += [
        Case("gspo seq_tis", P.preset("gspo", rollout_correction="seq_tis", rollout_clip_max=1.5)),
        Case("gmpo token_tis folded", P.preset("gmpo", rollout_correction="token_tis", rollout_clip_max=1.3)),
        Case("vespo token_mis", P(loss_type="vespo", rollout_correction="token_mis", rollout_clip_max=2.0)),
        Case("vespo seq_tis", P(loss_type="vespo", rollout_correction="seq_tis", rollout_clip_max=2.0)),
        Case("vespo seq_mis normalized", P(loss_type="vespo", rollout_correction="seq_mis",
                                           rollout_clip_min=0.3, rollout_clip_max=3.0,
                                           rollout_batch_normalize=True)),
    ]  # fmt: skip
    for i, criterion in enumerate(ROLLOUT_REJECTIONS):
        bounds = dict(rollout_rs_min=0.8, rollout_rs_max=1.25) if criterion.endswith("k1") else dict(
            rollout_rs_max=0.05 if criterion.startswith("token") or "mean" in criterion else 0.4
        )
        loss_type = ("ppo", "gspo", "gmpo")[i % 3]
        cfg = P(loss_type=loss_type, rollout_rs=criterion, aggregation=AGGREGATIONS[i % 4], **bounds)
        more.append(Case(f"{loss_type} rollout_rs={criterion}", cfg, per_token_adv=i % 2 == 0))
    return cases + more


CASES = _cases()


def policy_inputs(data: Unsplit, case: Case, select: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """``policy_loss`` arguments (all but ``logp``, ``cfg`` and the layout) through ``select``."""
    t = data.tensors
    kw = dict(
        old_logp=None if case.on_policy else select(t["old_logp"]),
        advantages=select(t["adv_tok"]) if case.per_token_adv else data.adv_seq,
        mask=select(t["mask"]),
        ref_logp=select(t["ref_logp"]),
        rollout_logp=select(t["rollout_logp"]),
    )
    if case.rollout_weights:
        kw["rollout_weights"] = select(t["rollout_weights"])
    return kw


def _normalizers(data: Unsplit, case: Case) -> dict:
    if case.normalizers is None:
        return {}
    mask = data.tensors["mask"]
    tokens, seqs = float(mask.sum()) + 3.0, float(mask.any(-1).sum()) + 1.0  # the step: more than this batch
    if case.normalizers == "tensor":
        return dict(global_tokens=torch.tensor(tokens), global_seqs=torch.tensor(seqs))
    return dict(global_tokens=tokens, global_seqs=seqs)


def unsplit_loss(data: Unsplit, case: Case, logp_full: torch.Tensor, *, seed: int):
    """The unsplit call (``logp_full``: the unsplit call's form, a leaf)."""
    kw = policy_inputs(data, case, data.flat)
    if data.packed:
        kw["cu_seqlens"] = data.cu_seqlens
    torch.manual_seed(seed)  # clip_cov's draw
    return rk.policy_loss(logp_full, cfg=case.cfg, entropy=data.flat(data.tensors["entropy"]),
                          **kw, **_normalizers(data, case))  # fmt: skip


def layout_args(ctx: Ctx, data: Unsplit, layout: Layout) -> dict:
    kw = dict(cp_group=ctx.group)
    if data.packed:
        kw["cu_seqlens"] = local_cu(layout, ctx.rank)
    if not layout.contiguous:
        kw["cp_positions"] = local_positions(data, layout, ctx.rank)
    return kw


def compare_policy_loss(ctx: Ctx, case: Case, data: Unsplit, layout: Layout, seed: int) -> None:
    what = f"{case.name} [{'packed' if data.packed else 'padded'} {layout.name}]"
    full = _leaf(data.tensors["logp"])
    want = unsplit_loss(data, case, data.flat(full), seed=seed)
    want.loss.backward()
    select = lambda x: local(data, layout, ctx.rank, x)  # noqa: E731
    mine = _leaf(select(data.tensors["logp"]))
    kw = policy_inputs(data, case, select)
    torch.manual_seed(seed)
    out = rk.policy_loss(mine, cfg=case.cfg, entropy=select(data.tensors["entropy"]), **kw,
                         **_normalizers(data, case), **layout_args(ctx, data, layout))  # fmt: skip
    out.loss.backward()
    _close(_all_reduced(out.loss, ctx.group), want.loss.detach(), F64, f"{what}: Σ rank losses")
    _close(mine.grad, select(full.grad), F64, f"{what}: gradient slice")
    _close_metrics(out.metrics, want.metrics, F64, what)


def check_every_loss_type_and_aggregation(ctx: Ctx) -> None:
    """Every loss type × aggregation (KL, entropy bonus, per-sequence and per-token advantages,
    local and global normalizers), on two layouts each, padded and packed in turn."""
    run_cases(ctx, CASES[: len(LOSS_TYPES) * len(AGGREGATIONS)], seed=1)


def check_corrections_masks_and_options(ctx: Ctx) -> None:
    """Rollout corrections (every mode, batch-normalized), rejection (every criterion), the
    off-policy mask, the top-entropy quantile, ratio-weighted KL, on-policy calls, given rollout
    weights, sequence-ratio conventions, KL estimators: two layouts each."""
    run_cases(ctx, CASES[len(LOSS_TYPES) * len(AGGREGATIONS) :], seed=2)


def run_cases(ctx: Ctx, cases: list[Case], seed: int) -> None:
    batches = [unsplit(seed, packed=False), unsplit(seed + 100, packed=True)]
    all_layouts = [(d, lay) for d in batches for lay in layouts(ctx.world, d, seed)]
    for k, case in enumerate(cases):
        for j in (k, k + 3):  # two layouts per case, padded and packed alike
            data, layout = all_layouts[j % len(all_layouts)]
            compare_policy_loss(ctx, case, data, layout, seed=1000 + k)


def check_every_layout_with_grpo_and_gspo(ctx: Ctx) -> None:
    """Every layout (padded and packed: contiguous even, uneven, load-balanced, random), each also
    with explicit cp_positions where it is contiguous (the same thing said twice)."""
    for packed in (False, True):
        data = unsplit(3 + packed, packed)
        for layout in layouts(ctx.world, data, 3):
            variants = [layout]
            if layout.contiguous:
                explicit = Layout(layout.name + " with cp_positions", layout.positions, contiguous=False)
                variants.append(explicit)
            for lay in variants:
                for name in ("grpo", "gspo"):
                    case = Case(name, rk.PolicyLossConfig.preset(name, kl_coef=0.05), per_token_adv=packed)
                    compare_policy_loss(ctx, case, data, lay, seed=7)


def check_differentiable_all_reduce(ctx: Ctx) -> None:
    """ops.context_parallel.all_reduce_sum: the forward sums over the ranks, the backward sums the
    ranks' upstream gradients (the gradient of Σ_r L_r)."""
    from rlkernel.ops.context_parallel import all_reduce_sum

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(ctx.world)]
    cs = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(ctx.world)]
    x = _leaf(xs[ctx.rank])
    total = all_reduce_sum(x, ctx.group)
    _close(total, sum(xs), F64, "forward")
    (total.sin() * cs[ctx.rank]).sum().backward()
    _close(x.grad, sum(cs) * sum(xs).cos(), F64, "backward: Σ of every rank's upstream gradient")
    assert not all_reduce_sum(xs[ctx.rank], ctx.group).requires_grad


# ------------------------------------------------------------------------------- fused_policy_loss
FUSED = ("dapo", "grpo", "gspo", "gmpo", "cispo", "dr_grpo")


def _fused_inputs(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(S, T, VOCAB, generator=g, dtype=torch.float64) * 2).to(dtype)
    hidden = torch.randn(S, T, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN**0.5 * 2).to(dtype)
    ids = torch.randint(0, VOCAB, (S, T), generator=g)
    return logits, hidden, weight, ids


def compare_fused(ctx, cfg_name, data, layout, *, source, dtype, tol, tp_group=None, seed=0, **cfg_kw):
    """``fused_policy_loss`` on this rank's slice (logits or hidden states) vs the unsplit
    ``policy_loss`` of the reference log-probs in float64: Σ rank losses, the gradient slice of
    the logits / hidden states, dweight summed over the ranks, metrics."""
    what = f"fused {source} {cfg_name} {dtype} [{'packed' if data.packed else 'padded'} {layout.name}]"
    cfg = rk.PolicyLossConfig.preset(cfg_name, **cfg_kw)
    case = Case(cfg_name, cfg, per_token_adv=data.packed)
    logits, hidden, weight, ids = _fused_inputs(seed, dtype)
    ids = torch.where(data.tensors["mask"], ids, -1)  # garbage at masked positions
    want_entropy = cfg.entropy_coef != 0
    x_full = _leaf((logits if source == "logits" else hidden).double())
    w_full = _leaf(weight.double())
    ids_ok = data.flat(ids.clamp_min(0))
    if source == "logits":
        out_r = ref.token_logprobs(data.flat(x_full), ids_ok, return_entropy=True)
    else:
        out_r = ref.linear_token_logprobs(data.flat(x_full), w_full, ids_ok, return_entropy=True)
    logp_r, ent_r = out_r
    kw = policy_inputs(data, case, data.flat)
    if data.packed:
        kw["cu_seqlens"] = data.cu_seqlens
    want = rk.policy_loss(logp_r, cfg=cfg, entropy=ent_r if want_entropy else None, **kw)
    want.loss.backward()
    select = lambda x: local(data, layout, ctx.rank, x)  # noqa: E731
    x = _leaf(select(logits if source == "logits" else hidden))
    w = _leaf(weight if tp_group is None else weight[_tp_rows(tp_group)])
    src = dict(logits=x) if source == "logits" else dict(hidden=x, weight=w, tp_group=tp_group)
    out = rk.fused_policy_loss(cfg, token_ids=select(ids), **src, **policy_inputs(data, case, select),
                               **layout_args(ctx, data, layout))  # fmt: skip
    out.loss.backward()
    _close(_all_reduced(out.loss, ctx.group).double(), want.loss.detach(), tol, f"{what}: Σ rank losses")
    _close(x.grad.double(), select(x_full.grad), tol, f"{what}: d{source} slice")
    if source == "hidden":
        dw_full = w_full.grad if tp_group is None else w_full.grad[_tp_rows(tp_group)]
        _close(_all_reduced(w.grad, ctx.group).double(), dw_full, tol, f"{what}: Σ rank dweight")
    _close_metrics(out.metrics, want.metrics, tol, what)


def _tp_rows(tp_group) -> slice:
    """Rank r of the tensor-parallel group holds an uneven contiguous range of the vocabulary."""
    world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    sizes = [VOCAB] if world == 1 else [VOCAB // 2 + 3, VOCAB - VOCAB // 2 - 3]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _fused_layouts(ctx: Ctx, seed: int):
    padded, packed = unsplit(seed, packed=False), unsplit(seed + 1, packed=True)
    return [(padded, lay) for lay in layouts(ctx.world, padded, seed)] + [
        (packed, lay) for lay in layouts(ctx.world, packed, seed)
    ]


def check_fused_reference_backend(ctx: Ctx) -> None:
    """The composed path of ``fused_policy_loss`` (reference backend, float64) from logits and from
    hidden states, with and without a (one-rank) tensor-parallel group."""
    all_layouts = _fused_layouts(ctx, 11)
    with rk.use_backend("reference"):
        for k, name in enumerate(FUSED):
            data, layout = all_layouts[k % len(all_layouts)]
            compare_fused(ctx, name, data, layout, source="logits", dtype=torch.float64, tol=F64, seed=k,
                          entropy_coef=0.01)  # fmt: skip
            data, layout = all_layouts[(k + 5) % len(all_layouts)]
            tp = ctx.solo if k % 2 else None
            compare_fused(ctx, name, data, layout, source="hidden", dtype=torch.float64, tol=F64, seed=k,
                          tp_group=tp)  # fmt: skip


def check_fused_triton_logits(ctx: Ctx) -> None:
    """The fused logits paths in the Triton interpreter (float32): the token-level plan (two-pass
    gradient-in-forward and three-pass), and the autograd coefficients of gspo / gmpo (the
    closed-form sequence kernel is not taken under cp_group)."""
    all_layouts = _fused_layouts(ctx, 13)
    with rk.use_backend("triton"):
        for k, name in enumerate(FUSED):
            data, layout = all_layouts[(3 * k) % len(all_layouts)]
            compare_fused(ctx, name, data, layout, source="logits", dtype=torch.float32, tol=F32, seed=k,
                          entropy_coef=0.01)  # fmt: skip
        data, layout = all_layouts[1]
        with rk.use_options(grad_in_forward_max_vocab=0):
            compare_fused(ctx, "dapo", data, layout, source="logits", dtype=torch.float32, tol=F32, seed=9,
                          rollout_correction="seq_tis", rollout_clip_max=1.5)  # fmt: skip


def check_fused_triton_hidden(ctx: Ctx) -> None:
    """The fused linear path (chunk engine with the token-level plan, smallest chunks) in the
    Triton interpreter (float32), and the composed hidden path of a sequence-level loss."""
    all_layouts = _fused_layouts(ctx, 17)
    with rk.use_backend("triton"), rk.use_options(linear_chunk_bytes=1, linear_grad_bytes=1):
        for k, name in enumerate(("dapo", "grpo", "gspo")):
            data, layout = all_layouts[(2 * k + 1) % len(all_layouts)]
            compare_fused(ctx, name, data, layout, source="hidden", dtype=torch.float32, tol=F32, seed=k)


# ------------------------------------------------------------------------------- normalizers
def check_global_normalizers_count_split_sequences_once(ctx: Ctx) -> None:
    """``global_normalizers(cp_group=)``: tokens and sequences of the unsplit micro-batches (a
    sequence whose tokens sit on several ranks counts once), padded and packed, count_empty."""
    batches = [unsplit(21, False), unsplit(22, True)]
    masks, cus, want_tokens, want_seqs, rows = [], [], 0, 0, 0
    for data in batches:
        layout = layouts(ctx.world, data, 21)[3]  # the random partition
        m = local(data, layout, ctx.rank, data.tensors["mask"])
        masks.append(m)
        cus.append(local_cu(layout, ctx.rank) if data.packed else None)
        full = data.tensors["mask"] & (torch.arange(T)[None, :] < torch.tensor(data.lengths)[:, None])
        want_tokens += int(full.sum())
        want_seqs += int(full.any(-1).sum())
        rows += S
    for count_empty in (False, True):
        got = global_normalizers(
            masks, cu_seqlens=cus, group=ctx.solo, cp_group=ctx.group, count_empty=count_empty
        )
        want = (float(want_tokens), float(rows if count_empty else want_seqs))
        assert (got[0].item(), got[1].item()) == want, (got, want, count_empty)


def check_policy_loss_with_global_normalizers(ctx: Ctx) -> None:
    """Micro-batches of one step under cp_group with ``global_normalizers(cp_group=)``: the rank
    losses of every micro-batch add up to the loss of the whole step in one unsplit call."""
    datas = [unsplit(31 + k, packed=False) for k in range(2)]
    cfgs = [rk.PolicyLossConfig.preset(n) for n in ("dapo", "gspo", "dr_grpo")]
    lays = [layouts(ctx.world, d, 31)[2 + k] for k, d in enumerate(datas)]
    masks = [local(d, lay, ctx.rank, d.tensors["mask"]) for d, lay in zip(datas, lays, strict=True)]
    gt, gs = global_normalizers(masks, group=ctx.solo, cp_group=ctx.group)
    for cfg in cfgs:
        total = 0.0
        for data, layout in zip(datas, lays, strict=True):
            case = Case(cfg.loss_type, cfg)
            select = lambda x, d=data, lay=layout: local(d, lay, ctx.rank, x)  # noqa: E731
            out = rk.policy_loss(
                select(data.tensors["logp"]), cfg=cfg, **policy_inputs(data, case, select),
                global_tokens=gt, global_seqs=gs, **layout_args(ctx, data, layout),
            )  # fmt: skip
            total = total + out.loss
        whole = rk.policy_loss(
            torch.cat([d.tensors["logp"] for d in datas]), torch.cat([d.tensors["old_logp"] for d in datas]),
            torch.cat([d.adv_seq for d in datas]), torch.cat([d.tensors["mask"] for d in datas]), cfg,
        )  # fmt: skip
        _close(_all_reduced(total, ctx.group), whole.loss, F64, f"{cfg.loss_type}: Σ micro-batch rank losses")


def check_rejection_mask_for_normalizers(ctx: Ctx) -> None:
    """``rejection_mask(cp_group=)``: this rank's slice of the unsplit rejection mask (sequence
    criteria read the whole sequence), the counts ``global_normalizers`` needs for ``rollout_rs``."""
    from rlkernel.rl.rollout import rejection_mask

    for k, criterion in enumerate(("seq_mean_k3", "seq_max_k2", "seq_sum_k1", "token_k3")):
        data = unsplit(80 + k, packed=k % 2 == 1)
        layout = layouts(ctx.world, data, 80)[k]
        k1 = criterion.endswith("k1")
        bounds = dict(rollout_rs_min=0.5, rollout_rs_max=1.5) if k1 else dict(rollout_rs_max=0.03)
        cfg = rk.PolicyLossConfig(rollout_rs=criterion, kl_coef=0.1, **bounds)
        t = data.tensors
        cu = data.cu_seqlens if data.packed else None
        full = rejection_mask(
            cfg, data.flat(t["old_logp"]), data.flat(t["rollout_logp"]), data.flat(t["mask"]), cu_seqlens=cu
        )
        if data.packed:
            full = torch.zeros(S, T, dtype=torch.bool).masked_scatter(
                torch.arange(T)[None, :] < torch.tensor(data.lengths)[:, None], full
            )
        select = lambda x, d=data, lay=layout: local(d, lay, ctx.rank, x)  # noqa: E731
        kw = layout_args(ctx, data, layout)
        mine = rejection_mask(cfg, select(t["old_logp"]), select(t["rollout_logp"]), select(t["mask"]), **kw)
        assert torch.equal(mine, select(full)), f"{criterion}: the rank's slice of the rejection mask"
        assert 0 < int(full.sum()) < int(t["mask"].sum()), f"{criterion}: nothing (or everything) rejected"


# ------------------------------------------------------------------------------- bad layouts
def _good_call(ctx: Ctx, data: Unsplit, layout: Layout, cfg=None, **changes):
    cfg = cfg or rk.PolicyLossConfig.preset("gspo")
    case = Case("gspo", cfg)
    select = lambda x: local(data, layout, ctx.rank, x)  # noqa: E731
    kw = dict(policy_inputs(data, case, select), **layout_args(ctx, data, layout))
    kw.update(changes)
    logp = kw.pop("logp", select(data.tensors["logp"]))
    return rk.policy_loss(logp, cfg=kw.pop("cfg", cfg), **kw)


def check_bad_layouts_raise_on_every_rank(ctx: Ctx) -> None:
    padded, packed = unsplit(41, False), unsplit(42, True)
    lay_p, lay_k = layouts(ctx.world, padded, 41)[1], layouts(ctx.world, packed, 41)[3]
    first = ctx.rank == 0
    sel = lambda x: local(padded, lay_p, ctx.rank, x)  # noqa: E731
    fewer = {k: v[:-1] for k, v in _padded_kw(ctx, padded, lay_p).items()} if first else {}
    mine = local_positions(packed, lay_k, ctx.rank)
    cases = {
        "sequence count differs": (
            lambda: _good_call(ctx, padded, lay_p, **fewer),
            ValueError, "sequence count S differs across ranks"),
        "padded on one rank, packed on another": (
            lambda: _good_call(ctx, padded, lay_p) if first else _good_call(ctx, packed, lay_k),
            ValueError, "layout (padded [B, T] or packed with cu_seqlens) differs"),
        "a local error on one rank": (
            lambda: _good_call(ctx, padded, lay_p, mask=sel(padded.tensors["mask"])[:, :-1] if first else
                               sel(padded.tensors["mask"])),
            ValueError, "rank 0 rejected its inputs: mask must have"),
        "cfg differs": (
            lambda: _good_call(ctx, padded, lay_p, cfg=rk.PolicyLossConfig.preset(("dapo", "gspo")[first])),
            ValueError, "cfg (a checksum of repr(cfg)) differs"),
        "dtype differs": (
            lambda: _good_call(ctx, padded, lay_p, logp=sel(padded.tensors["logp"]).float() if first else
                               sel(padded.tensors["logp"])),
            ValueError, "log-prob source dtype differs"),
        "gradient on one rank only": (
            lambda: _good_call(ctx, padded, lay_p, logp=_leaf(sel(padded.tensors["logp"])) if first else
                               sel(padded.tensors["logp"])),
            ValueError, "whether a gradient is computed differs"),
        "global_tokens differs": (
            lambda: _good_call(ctx, padded, lay_p, global_tokens=10.0 + ctx.rank),
            ValueError, "global_tokens differs across ranks (rank 0: 10.0, rank 1: 11.0"),
        "cp_positions on one rank only": (
            lambda: _good_call(ctx, padded, lay_p, cp_positions=sel(_columns()) if first else None),
            ValueError, "cp_positions given differs"),
        "cp_positions not a partition": (
            lambda: _good_call(ctx, packed, lay_k, cp_positions=mine.clamp_max(2)),
            ValueError, "cp_positions do not partition sequence(s)"),
        "an input present on one rank only": (
            lambda: _good_call(ctx, padded, lay_p, ref_logp=(sel(padded.tensors["ref_logp"]), None)[first]),
            ValueError, "inputs given differs"),
        "not a process group": (
            lambda: _good_call(ctx, padded, lay_p, cp_group="world"),
            TypeError, "cp_group must be a torch.distributed ProcessGroup"),
    }  # fmt: skip
    for label, (fn, exc, needle) in cases.items():
        try:
            expect_same_error(ctx, fn, exc, needle)
        except AssertionError as err:
            raise AssertionError(f"{label}: {err}") from None
    # Still in step: a good call on both layouts (the collectives of every rank still pair up).
    compare_policy_loss(ctx, Case("gspo", rk.PolicyLossConfig.preset("gspo")), packed, lay_k, seed=3)
    compare_policy_loss(ctx, Case("grpo", rk.PolicyLossConfig.preset("grpo")), padded, lay_p, seed=3)


def _columns() -> torch.Tensor:
    """``[S, T]``: each padded position's column (its position in its row)."""
    return torch.arange(T).expand(S, T)


def _padded_kw(ctx, data, layout) -> dict:
    case = Case("gspo", rk.PolicyLossConfig.preset("gspo"))
    select = lambda x: local(data, layout, ctx.rank, x)  # noqa: E731
    kw = policy_inputs(data, case, select)
    kw["logp"] = select(data.tensors["logp"])
    return kw


def check_fused_bad_inputs_raise_on_every_rank(ctx: Ctx) -> None:
    """``fused_policy_loss``: an id outside [0, V) on one rank, logits whose shape does not match
    the ids on one rank: every rank raises the same error; then a good call."""
    data = unsplit(51, False)
    layout = layouts(ctx.world, data, 51)[2]
    logits, _, _, ids = _fused_inputs(51, torch.float64)
    select = lambda x: local(data, layout, ctx.rank, x)  # noqa: E731
    case = Case("dapo", rk.PolicyLossConfig.preset("dapo"))
    mine_ids = torch.where(select(data.tensors["mask"]), select(ids), -1)
    kw = dict(policy_inputs(data, case, select), **layout_args(ctx, data, layout))
    bad_ids = mine_ids.clone()
    if ctx.rank == ctx.world - 1:
        bad_ids[select(data.tensors["mask"])] = VOCAB + 4  # every active id out of range
    last = ctx.world - 1
    short = select(logits)[:, :-1] if ctx.rank == 0 else select(logits)
    with rk.use_backend("reference"):
        call = lambda x, ids: rk.fused_policy_loss(case.cfg, logits=x, token_ids=ids, **kw)  # noqa: E731
        expect_same_error(ctx, lambda: call(select(logits), bad_ids), ValueError,
                          f"on rank {last}, token_ids (at active mask positions) has")  # fmt: skip
        expect_same_error(ctx, lambda: call(short, mine_ids), ValueError, "rank 0 rejected its inputs: token")
        out = rk.fused_policy_loss(case.cfg, logits=select(logits), token_ids=mine_ids, **kw)
    assert torch.isfinite(out.loss)


def check_global_normalizers_bad_layout(ctx: Ctx) -> None:
    masks = [torch.ones(3 if ctx.rank == 0 else 4, 5, dtype=torch.bool)]
    expect_same_error(
        ctx, lambda: global_normalizers(masks, group=ctx.solo, cp_group=ctx.group),
        ValueError, "the ranks of cp_group hold different numbers of sequences",
    )  # fmt: skip
    got = global_normalizers([torch.ones(3, 5, dtype=torch.bool)], group=ctx.solo, cp_group=ctx.group)
    assert (got[0].item(), got[1].item()) == (15.0 * ctx.world, 3.0)


# ------------------------------------------------------------------------------- world 4: meshes
# Rank 2·a + b. Pairs {0, 1} {2, 3} and across {0, 2} {1, 3}: CP × DP is CP = pairs, DP = across;
# CP × TP is TP = pairs (the ranks of one TP group hold the same slice), CP = across.


def check_mesh_context_by_data_parallel(ctx: Ctx) -> None:
    """CP = 2 × DP = 2: each data-parallel rank its own batch, split over its CP group;
    ``global_normalizers(group=dp, cp_group=cp)``; the losses of all ranks add up to the whole
    step's, each gradient is its slice of the whole step's gradient."""
    cp, dp = ctx.cache["pairs"], ctx.cache["across"]
    cp_rank, dp_rank = ctx.rank % 2, ctx.rank // 2
    shards = [unsplit(60 + d, packed=d == 1) for d in range(2)]  # DP rank d's batch
    data = shards[dp_rank]
    layout = layouts(2, data, 60)[2 + dp_rank]
    sub = Ctx(rank=cp_rank, world=2, group=cp)
    select = lambda x: local(data, layout, cp_rank, x)  # noqa: E731
    cu = local_cu(layout, cp_rank) if data.packed else None
    gt, gs = global_normalizers(select(data.tensors["mask"]), cu_seqlens=cu, group=dp, cp_group=cp)
    for name in ("dapo", "gspo", "grpo"):
        cfg = rk.PolicyLossConfig.preset(name, kl_coef=0.05)
        case = Case(name, cfg, per_token_adv=True)
        mine = _leaf(select(data.tensors["logp"]))
        out = rk.policy_loss(mine, cfg=cfg, **policy_inputs(data, case, select), global_tokens=gt,
                             global_seqs=gs, **layout_args(sub, data, layout))  # fmt: skip
        out.loss.backward()
        # The whole step in one call: both DP shards' sequences in one packed batch.
        leaves = [_leaf(s.tensors["logp"]) for s in shards]
        cat = lambda key: torch.cat([s.stream(s.tensors[key]) for s in shards])  # noqa: E731
        lengths = shards[0].lengths + shards[1].lengths
        whole = rk.policy_loss(
            torch.cat([s.stream(leaf) for s, leaf in zip(shards, leaves, strict=True)]), cat("old_logp"),
            cat("adv_tok"), cat("mask"), cfg, ref_logp=cat("ref_logp"),
            cu_seqlens=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()),
        )  # fmt: skip
        whole.loss.backward()
        total = _all_reduced(out.loss, dist.group.WORLD)
        _close(total, whole.loss.detach(), F64, f"{name}: Σ of 4 rank losses")
        _close(mine.grad, select(leaves[dp_rank].grad), F64, f"{name}: gradient slice")


def check_mesh_context_by_tensor_parallel(ctx: Ctx) -> None:
    """CP = 2 × TP = 2: the vocab-parallel LM head (uneven shards) under cp_group; the loss of
    each CP slice is the same on its TP ranks, dhidden is the unsplit slice, Σ over CP of each
    shard's dweight is the unsplit dweight's rows."""
    tp, cp, cp_rank = ctx.cache["pairs"], ctx.cache["across"], ctx.rank // 2
    sub = Ctx(rank=cp_rank, world=2, group=cp)
    for k, name in enumerate(("dapo", "gspo")):
        data = unsplit(70 + k, packed=k == 1)
        layout = layouts(2, data, 70)[2 + k]
        with rk.use_backend("reference"):
            compare_fused(sub, name, data, layout, source="hidden", dtype=torch.float64, tol=F64, tp_group=tp,
                          seed=k, entropy_coef=0.01)  # fmt: skip


def _checks(prefix_mesh: bool) -> dict[str, Callable[[Ctx], None]]:
    return {
        name[len("check_") :]: fn
        for name, fn in list(globals().items())
        if name.startswith("check_") and name.startswith("check_mesh") == prefix_mesh
    }


# The Triton interpreter's checks test the routes, not the arithmetic of more ranks: on 2 only (CI time).
TWO_RANKS_ONLY = ("fused_triton_logits", "fused_triton_hidden")


def checks_for(world: int) -> dict[str, Callable[[Ctx], None]]:
    """The checks of a run on ``world`` ranks: the context-parallel ones on 2 and 3, the meshes on 4."""
    found = _checks(prefix_mesh=world == 4)
    return {k: v for k, v in found.items() if world == 2 or k not in TWO_RANKS_ONLY}


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Worker entry point (``torch.multiprocessing.start_processes``)."""
    init_gloo_worker(rank, world, init_file, COLLECTIVE_TIMEOUT_S)
    solos = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    ctx = Ctx(rank=rank, world=world, group=dist.group.WORLD, solo=solos[rank])
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        ctx.cache.update(pairs=pairs[rank // 2], across=across[rank % 2])
    path = os.path.join(out_dir, f"rank{rank}.json")
    if run_checks(checks_for(world).items(), ctx, path):
        dist.destroy_process_group()
