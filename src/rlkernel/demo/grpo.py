"""The demo's GRPO loop: sample groups with ``generate``, score, compute advantages, update.

One step:

1. Draw ``batch_prompts`` prompts and repeat each ``group_size`` times.
2. Roll out with ``model.generate`` (KV cache, ``do_sample=True`` at ``temperature``, no top-k/top-p)
   and keep the raw logits of every sampled position (``output_logits``). The sampler's per-token
   log-probs are ``rlkernel.token_logprobs(rollout_logits, ids, temperature=temperature)``: the
   distribution the tokens were drawn from.
3. Score each completion with the task's reward; turn rewards into advantages with
   ``rlkernel.group_advantages`` (estimator ``grpo``, or ``dr_grpo`` for that preset).
4. One training-style forward of the whole padded batch (prompt + completion, a single prefill, no
   KV cache). Its log-probs under the pre-update weights are ``old_logp``; ``max |rollout_logp −
   old_logp|`` over completion tokens is the rollout/training mismatch that rlkernel's
   batch-invariant kernels exist to remove. With a KL preset the frozen reference policy gives
   ``ref_logp`` the same way.
5. ``ppo_epochs`` passes over ``minibatches`` shuffled minibatches, one AdamW step each. A minibatch
   is split into ``micro_batches`` for gradient accumulation, with the minibatch's totals as
   ``global_tokens`` / ``global_seqs`` so that the micro-batch losses add up to the minibatch loss.
   The loss is ``rlkernel.fused_policy_loss`` straight from the logits. The second minibatch is
   already slightly off-policy, which is what makes the clip fraction non-zero.

Everything lives on ``device``; on CUDA, rlkernel's dispatch picks its Triton kernels by itself.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import rlkernel
from rlkernel.demo.policy import build_policy
from rlkernel.demo.task import EOS, PAD, ReverseTask, decode

IGNORE = -100
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class DemoConfig:
    """Every knob of a demo run; the CLI's defaults are these."""

    steps: int = 400
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    preset: str = "grpo"
    estimator: str | None = None  # None: "dr_grpo" for the dr_grpo preset, else "grpo"
    task_length: int = 3
    group_size: int = 8
    batch_prompts: int = 16
    lr: float = 5e-4
    grad_clip: float = 1.0
    temperature: float = 1.0
    ppo_epochs: int = 1
    minibatches: int = 2
    micro_batches: int = 2
    hidden_size: int = 64
    num_layers: int = 2

    def resolved_estimator(self) -> str:
        if self.estimator is not None:
            return self.estimator
        return "dr_grpo" if self.preset == "dr_grpo" else "grpo"


@dataclass
class Rollout:
    """One step's samples. ``[B, T]`` tensors; T = the longest completion of the batch."""

    prompts: torch.Tensor  # [B, P] int64
    completions: torch.Tensor  # [B, T] int64, <pad> after <eos>
    mask: torch.Tensor  # [B, T] bool: sampled tokens up to and including the first <eos>
    logp: torch.Tensor  # [B, T] float32 sampler log-probs, 0 where masked
    entropy: torch.Tensor  # [B, T] float32 sampler entropy, 0 where masked


def completion_mask(completions: torch.Tensor) -> torch.Tensor:
    """True for every token up to and including the first ``<eos>`` (every token if there is none)."""
    is_eos = (completions == EOS).int()
    return (torch.cumsum(is_eos, dim=1) - is_eos) == 0


@torch.no_grad()
def rollout(
    model: torch.nn.Module, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float
) -> Rollout:
    """Sample one completion per prompt row with HF's KV-cached sampler; keep its log-probs."""
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=PAD,
            eos_token_id=EOS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    finally:
        model.train(was_training)
    completions = out.sequences[:, prompts.shape[1] :]
    logits = torch.stack(out.logits, dim=1)  # [B, T, V] raw logits, before the temperature
    mask = completion_mask(completions)
    ids = completions.masked_fill(~mask, IGNORE)
    logp, entropy = rlkernel.token_logprobs(logits, ids, temperature=temperature, return_entropy=True)
    return Rollout(prompts, completions, mask, logp, entropy * mask)


def completion_logits(
    model: torch.nn.Module, prompts: torch.Tensor, completions: torch.Tensor
) -> torch.Tensor:
    """Training-style prefill of prompt + completion: the ``[B, T, V]`` logits predicting the completion.

    No attention mask is needed: prompts all have the same length and the padding after ``<eos>``
    comes after every token that matters, which a causal model never looks at.
    """
    seqs = torch.cat([prompts, completions], dim=1)
    logits = model(input_ids=seqs, use_cache=False).logits
    return logits[:, prompts.shape[1] - 1 : -1]


@torch.no_grad()
def _frozen_logp(model: torch.nn.Module, ro: Rollout, temperature: float) -> torch.Tensor:
    ids = ro.completions.masked_fill(~ro.mask, IGNORE)
    return rlkernel.token_logprobs(
        completion_logits(model, ro.prompts, ro.completions), ids, temperature=temperature
    )


def _weighted(values: list[tuple[float, dict[str, torch.Tensor]]], key: str) -> float:
    """Token-weighted mean of a per-micro-batch metric (rlkernel's metrics are local to each call)."""
    got = [(w, float(m[key])) for w, m in values if key in m]
    total = sum(w for w, _ in got)
    if total == 0:
        return float("nan")
    return sum(w * v for w, v in got) / total


def train(cfg: DemoConfig, *, log: Callable[[dict], None] | None = None) -> tuple[list[dict], dict]:
    """Run the demo. Returns (one metrics dict per step, run info); ``log`` gets each step's dict."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # prompts and minibatch order, on the CPU
    task = ReverseTask(length=cfg.task_length)
    loss_cfg = rlkernel.PolicyLossConfig.preset(cfg.preset)
    estimator = cfg.resolved_estimator()

    model = build_policy(
        seed=cfg.seed,
        device=device,
        dtype=DTYPES[cfg.dtype],
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        max_positions=max(64, task.prompt_len + task.answer_len),
    )
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if loss_cfg.kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    kl_key = "kl_ref" if ref_model is not None else "approx_kl"

    history: list[dict] = []
    t0 = time.perf_counter()
    n_seqs = cfg.batch_prompts * cfg.group_size
    for step in range(1, cfg.steps + 1):
        prompts = task.sample_prompts(cfg.batch_prompts, gen).repeat_interleave(cfg.group_size, dim=0)
        ro = rollout(model, prompts.to(device), max_new_tokens=task.answer_len, temperature=cfg.temperature)
        rewards = task.reward(ro.prompts, ro.completions)
        adv = rlkernel.group_advantages(rewards, cfg.group_size, estimator=estimator)

        old_logp = _frozen_logp(model, ro, cfg.temperature)
        ref_logp = _frozen_logp(ref_model, ro, cfg.temperature) if ref_model is not None else None
        mismatch = float(((ro.logp - old_logp).abs() * ro.mask).max())

        losses: list[float] = []
        metrics: list[tuple[float, dict[str, torch.Tensor]]] = []
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(n_seqs, generator=gen).to(device)
            for mb in perm.chunk(cfg.minibatches):
                global_tokens = int(ro.mask[mb].sum())
                global_seqs = int(ro.mask[mb].any(dim=1).sum())
                opt.zero_grad(set_to_none=True)
                mb_loss = 0.0
                for mic in mb.chunk(cfg.micro_batches):
                    out = rlkernel.fused_policy_loss(
                        loss_cfg,
                        logits=completion_logits(model, ro.prompts[mic], ro.completions[mic]),
                        token_ids=ro.completions[mic],
                        old_logp=old_logp[mic],
                        advantages=adv[mic],
                        mask=ro.mask[mic],
                        temperature=cfg.temperature,
                        rollout_logp=ro.logp[mic],
                        ref_logp=None if ref_logp is None else ref_logp[mic],
                        global_tokens=global_tokens,
                        global_seqs=global_seqs,
                    )
                    out.loss.backward()
                    mb_loss += float(out.loss.detach())
                    metrics.append((float(ro.mask[mic].sum()), out.metrics))
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                losses.append(mb_loss)

        rec = {
            "step": step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "exact_match": float((rewards >= 1.0).float().mean()),
            "loss": sum(losses) / len(losses),
            "clip_frac": _weighted(metrics, "clip_frac"),
            "kl": _weighted(metrics, kl_key),
            "entropy_mean": float((ro.entropy.float() * ro.mask).sum() / ro.mask.sum().clamp(min=1)),
            "max_abs_logp_diff": mismatch,
            "completion_len": float(ro.mask.sum(dim=1).float().mean()),
            "elapsed_s": time.perf_counter() - t0,
        }
        history.append(rec)
        if log is not None:
            log(rec)

    first = slice(None, None, cfg.group_size)
    samples = [
        f"{decode(p)} -> {decode(c[m])}"
        for p, c, m in zip(
            ro.prompts[first][:4].cpu(),
            ro.completions[first][:4].cpu(),
            ro.mask[first][:4].cpu(),
            strict=True,
        )
    ]
    info = {
        "config": asdict(cfg),
        "estimator": estimator,
        "kl_metric": kl_key,
        "loss_config": asdict(loss_cfg),
        "task": f"reverse {cfg.task_length} digits; reward = fraction of the {task.answer_len} answer "
        "positions (digits, then <eos>) matched",
        "n_params": sum(p.numel() for p in model.parameters()),
        "final_samples": samples,
        "elapsed_s": time.perf_counter() - t0,
    }
    return history, info
