"""The checks that ``test_trl_fsdp2.py`` runs inside each gloo worker process (2 CPU ranks).

A tiny Qwen3 (transformers' real model) wrapped with FSDP2's ``fully_shard`` in three layouts: the
LM head in a unit of its own (what size-based auto-wrap does; the head is then a ``Shard(0)``
``DTensor`` inside the model's forward, since its own forward never runs), the LM head in the root
unit (FSDP2's unsharded plain tensor inside the forward), and the head tied to the embedding. Both
routes of the TRL integration are driven through the model's forward, as TRL calls them:
``add_rlkernel_lm_head`` (``model(..., labels=, fused_lm_head=True)``) and the trainer's
``install_loss_head`` (``model(..., rlkernel_head=fn)``, ``fn`` built as ``RLKernelGRPOTrainer``'s
loss head builds its inputs: :func:`head_inputs`, then ``rk.fused_policy_loss``).

Data parallel, as FSDP2 is used: every rank gets *different* token batches (seeded by rank), so a
gradient that is not averaged over the ranks (``weight.full_tensor()``'s backward keeps this
rank's) fails. Each rank also runs the unsharded single-process reference itself: the same model
and patch on every rank's batch, the gradients averaged over the ranks (FSDP2's default mean).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import rlkernel as rk
from _rank_checks import run_checks

VOCAB = 37  # 19 / 18 rows per shard on 2 ranks: uneven, as torch.chunk (DTensor, FSDP2) splits it
B, S = 2, 7
COLLECTIVE_TIMEOUT_S = 20
GRAD_TOL = 1e-6  # fp32, relative to max(1, max |reference gradient|)


@dataclass
class Ctx:
    rank: int
    world: int
    mesh: object  # 1-D DeviceMesh over WORLD


def _model(tied: bool, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32, tie_word_embeddings=tied,
        attn_implementation="eager",
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # logits of std ≈ 2 (a random init gives nearly uniform ones)
        model.lm_head.weight.mul_(40)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _shard(ctx, model, layout: str):
    """``fully_shard`` the decoder layers, then the head (``layout == "head_unit"``), then the root."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    if layout == "head_unit":
        fully_shard(model.lm_head, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)


def _batch(rank: int, seed: int):
    """Rank ``rank``'s input ids ``[B, S]``, labels (some -100), entropy and loss coefficients."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    labels[1, 4] = -100
    return dict(
        ids=ids, labels=labels, c_entropy=torch.randn(B, S - 1, generator=g),
        advantages=torch.randn(B, generator=g), old=-torch.rand(B, S - 1, generator=g) * 3 - 0.1,
    )  # fmt: skip


def _fused_head_objective(model, batch):
    """TRL's fused-head call (``_get_per_token_logps_and_entropies``): loss + Σ c·entropy."""
    out = model(input_ids=batch["ids"], labels=batch["labels"], fused_lm_head=True)
    return out.loss + (out.entropy * batch["c_entropy"]).sum()


def _loss_head_objective(model, batch):
    """The trainer's route: the loss computed inside the forward from ``(hidden, weight, bias)``."""
    from rlkernel.integrations.trl.head import head_inputs, head_settings

    settings = head_settings(model, 0.8, False)
    mask = batch["labels"][:, 1:] != -100
    cfg = rk.PolicyLossConfig.preset("dapo")

    def loss(hidden, weight, bias):
        h, w, b = head_inputs(hidden[:, :-1], weight, bias, settings)
        return rk.fused_policy_loss(
            cfg, hidden=h, weight=w, bias=b, token_ids=batch["labels"][:, 1:].clamp_min(0), mask=mask,
            old_logp=batch["old"], advantages=batch["advantages"], temperature=settings.temperature,
        ).loss  # fmt: skip

    return model(input_ids=batch["ids"], rlkernel_head=loss).loss


def _patch(model, route: str):
    from rlkernel.integrations.trl.head import add_rlkernel_lm_head, head_settings, install_loss_head

    if route == "fused_lm_head":
        add_rlkernel_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
        return _fused_head_objective
    install_loss_head(model, head_settings(model, 0.8, False))
    return _loss_head_objective


def _check(ctx, route: str, layout: str, seed: int):
    """The FSDP2 model's every gradient (gathered) vs the unsharded rank-mean, ≤ 1e-6 (scaled)."""
    tied = layout == "tied"
    model = _model(tied, seed)
    reference = copy.deepcopy(model)
    _shard(ctx, model, layout)
    objective = _patch(model, route)
    seen = []  # the head's weight as the forward sees it, recorded after the backbone (inside the root's)
    model.model.register_forward_hook(lambda *_: seen.append(type(model.lm_head.weight)))
    objective(model, _batch(ctx.rank, seed)).backward()
    # The head in its own unit is still sharded inside the root's forward: the case full_tensor() breaks.
    want_type = DTensor if layout == "head_unit" else torch.nn.Parameter
    assert seen and all(issubclass(t, want_type) for t in seen), f"lm_head.weight in the forward: {seen}"

    ref_objective = _patch(reference, route)
    total = sum(ref_objective(reference, _batch(r, seed)) for r in range(ctx.world))
    (total / ctx.world).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.grad is not None, f"{name}: {type(p).__name__}, grad {p.grad}"
        got, ref = p.grad.full_tensor(), want[name]
        scale = max(1.0, ref.abs().max().item())
        diff = (got - ref).abs().max().item()
        assert diff <= GRAD_TOL * scale, f"{route}, {layout}: {name}.grad off the rank-mean by {diff:.2e}"


def check_fused_lm_head_head_unit(ctx):
    _check(ctx, "fused_lm_head", "head_unit", seed=1)


def check_fused_lm_head_root_unit(ctx):
    _check(ctx, "fused_lm_head", "root_unit", seed=2)


def check_fused_lm_head_tied(ctx):
    _check(ctx, "fused_lm_head", "tied", seed=3)


def check_loss_head_head_unit(ctx):
    _check(ctx, "loss_head", "head_unit", seed=4)


def check_loss_head_root_unit(ctx):
    _check(ctx, "loss_head", "root_unit", seed=5)


def check_loss_head_tied(ctx):
    _check(ctx, "loss_head", "tied", seed=6)


CHECKS: dict[str, Callable[[Ctx], None]] = {
    name[len("check_") :]: fn for name, fn in list(globals().items()) if name.startswith("check_")
}


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Worker entry point (``torch.multiprocessing.start_processes``)."""
    torch.set_num_threads(1)  # the workers share the CI machine's 2 cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    path = os.path.join(out_dir, f"rank{rank}.json")
    passed = False
    try:
        passed = run_checks(CHECKS.items(), Ctx(rank, world, init_device_mesh("cpu", (world,))), path)
    finally:
        if passed:
            dist.destroy_process_group()
