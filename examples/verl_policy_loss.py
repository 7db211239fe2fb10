"""rlkernel's ``rk_<mode>`` losses and fused forward next to verl's own, on the CPU (seconds).

    make verl-example                         # from a fresh clone: .venv with torch, transformers and
                                              # verl 0.9.1 (no ray), then this script
or, in an environment with rlkernel installed:

    pip install --no-deps "verl==0.9.1" && pip install omegaconf codetiming
    python examples/verl_policy_loss.py

No ray, tensordict or wandb is needed: verl's losses and fused forward use only torch, transformers,
omegaconf and codetiming, and :func:`rlkernel.integrations.verl_without_ray.import_verl` imports
them with stand-ins for the three packages verl's ``__init__`` imports and this never calls (where
they are installed, e.g. after ``pip install "rlkernel[verl]"``, nothing is stood in for). CI runs
this command (tests/integrations/test_verl_forward.py).

Importing ``rlkernel.integrations.verl`` registers the ``rk_*`` losses in verl's registry; in training,
verl's workers import it through ``actor_rollout_ref.model.external_lib`` (examples/
verl_config_snippet.yaml). For each registered mode and each ``loss_agg_mode``, this script runs
``rk_<mode>`` and verl's ``<mode>`` the way verl's actor calls them — one micro-batch of a
data-parallel rank, with the mini-batch's ``global_batch_info`` and random ``rollout_is_weights``,
torch's generator seeded alike before both (clip_cov draws its cut tokens from it) — and prints
the loss, |Δloss| and max |Δ∂loss/∂log_prob|. Then it runs a tiny random Llama's fused forward both
ways (verl's ``torch`` backend and ``impl_backend: rlkernel``) and prints the largest differences of
the log-probs, the entropy and the LM-head gradient.
"""

from __future__ import annotations

import copy

import torch
import transformers

from rlkernel.integrations.verl_without_ray import import_verl

# rlkernel.integrations.verl registers rk_* in verl's policy-loss registry when imported.
dense_common, core_algos, verl_config, rk_verl = import_verl(
    "verl.models.transformers.dense_common",
    "verl.trainer.ppo.core_algos",
    "verl.workers.config",
    "rlkernel.integrations.verl",
)
ActorConfig, PolicyLossConfig = verl_config.ActorConfig, verl_config.PolicyLossConfig

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


def batch(seed: int = 0, B: int = 8, T: int = 32):
    """One micro-batch as verl's actor passes it: ragged response masks, per-token advantages."""
    g = torch.Generator().manual_seed(seed)
    log_prob = -3 * torch.rand(B, T, generator=g)
    old_log_prob = log_prob + 0.3 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return old_log_prob, log_prob, advantages, torch.arange(T)[None, :] < lengths[:, None]


def actor_config() -> ActorConfig:
    """DAPO-style clip-higher and dual clip; the normalizers of a mini-batch of 2 ranks × 2
    micro-batches of 8 sequences (verl's FSDP engine fills global_batch_info the same way)."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=8,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=10.0,
        # dro's β; clip_cov / kl_cov windows and ratios that select tokens here (verl's defaults,
        # 2e-4 of the tokens in a covariance window [1, 5], select almost none on a small batch)
        policy_loss=PolicyLossConfig(
            dro_beta=0.1, clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=0.8, kl_cov_ratio=0.1
        ),
        global_batch_info=dict(dp_size=2, batch_num_tokens=560, global_batch_size=32, loss_scale_factor=64),
    )


def losses() -> None:
    old_log_prob, log_prob, advantages, mask = batch()
    weights = 0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(2))  # rollout IS
    config = actor_config()
    for name in rk_verl.RK_LOSSES:
        for agg in AGGS:
            results = []
            for mode in (name, name.removeprefix("rk_")):
                x = log_prob.clone().requires_grad_(True)
                torch.manual_seed(0)  # the same clip_cov draw in both
                loss, metrics = core_algos.get_policy_loss_fn(mode)(
                    old_log_prob=old_log_prob,
                    log_prob=x,
                    advantages=advantages,
                    response_mask=mask,
                    loss_agg_mode=agg,
                    config=config,
                    rollout_is_weights=weights,
                )
                loss.backward()
                results.append((loss.detach(), x.grad, metrics))
            (loss, grad, metrics), (ref, ref_grad, ref_metrics) = results
            dloss, dgrad = (loss - ref).abs().item(), (grad - ref_grad).abs().max().item()
            print(
                f"{name:12s} {agg:24s} loss {loss.item():+.7f}  verl {ref.item():+.7f}  "
                f"|Δloss| {dloss:.1e}  max|Δgrad| {dgrad:.1e}  metrics equal {metrics == ref_metrics}"
            )


def fused_forward() -> None:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(config)
    theirs = copy.deepcopy(ours)
    rk_verl.install_fused_forward(ours)  # what fused_kernel_options.impl_backend=rlkernel does
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    out = ours(input_ids=ids, return_dict=True, temperature=0.7)
    ref = dense_common.forward_with_torch_backend(theirs, input_ids=ids, return_dict=True, temperature=0.7)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    (ref.log_probs.sum() + ref.entropy.sum()).backward()
    dlogp = (out.log_probs - ref.log_probs).abs().max()
    dentropy = (out.entropy - ref.entropy).abs().max()
    dhead = (ours.lm_head.weight.grad - theirs.lm_head.weight.grad).abs().max()
    print(
        f"fused forward (tiny Llama, T=0.7): max|Δlog_probs| {dlogp:.1e}  max|Δentropy| {dentropy:.1e}  "
        f"max|Δ∂/∂lm_head| {dhead:.1e}"
    )


def main() -> None:
    losses()
    fused_forward()


if __name__ == "__main__":
    main()
