"""``RLKernelGRPOTrainer`` against TRL 1.16 on a CUDA device: the Triton kernels, Qwen3's vocabulary.

The CPU suite runs the same comparisons at vocabulary 300 in float32 (the Triton path in the
interpreter). Here the LM head has Qwen3's 151,936 rows, so the chunk engine runs several chunks
and the fused loss its real kernels; TRL's head is its Triton chunked kernel. float32 agreement is
to the GPUs' float32 rounding (reductions in another order: 1e-5 of the scale); with a bf16 model
under bf16 autocast (TRL's default ``bf16=True``) both read the same bf16 inputs and agree to bf16
rounding of the logits. Skipped without CUDA (``scripts/gpu_suite.sh`` runs it with ``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch

from .trl_helpers import (
    dataset,
    grpo_args,
    length_reward,
    load_model,
    loss_and_grads,
    make_batch,
    require_trl,
    save_tiny_model,
    tokenizer,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
QWEN3_VOCAB = 151936
SETTINGS = {
    "dapo (fused path)": dict(),
    "grpo + KL": dict(loss_type="grpo", beta=0.05, use_bias_correction_kl=False),
    "GSPO": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05),
    "cispo + entropy bonus": dict(loss_type="cispo", epsilon_high=1.2, entropy_coef=0.05),
    "grpo + bias-corrected KL (TRL default)": dict(loss_type="grpo", beta=0.05),
    "vespo + bias-corrected KL": dict(loss_type="vespo", beta=0.05),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_trl()
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3_gpu")), vocab=QWEN3_VOCAB)


def build(model_dir, tmp_path, dtype=torch.float32, **overrides):
    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    model = load_model(model_dir).to(device="cuda", dtype=dtype)
    args = grpo_args(str(tmp_path), use_cpu=False, bf16=dtype == torch.bfloat16, **overrides)
    trainer = RLKernelGRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset(),
        processing_class=tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def compare(trainer, batch):
    from trl import GRPOTrainer

    ref_loss, ref_grads = loss_and_grads(GRPOTrainer._compute_loss, trainer, batch)
    loss, grads = loss_and_grads(type(trainer)._compute_loss, trainer, batch)
    return (loss, grads), (ref_loss, ref_grads)


@pytest.mark.parametrize("policy", ["off-policy", "on-policy"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_float32_matches_trl_on_the_gpu(model_dir, tmp_path, setting, policy):
    trainer = build(model_dir, tmp_path, **SETTINGS[setting])
    batch = make_batch(trainer, seed=1)
    if policy == "on-policy":
        del batch["old_per_token_logps"]
    (loss, grads), (ref_loss, ref_grads) = compare(trainer, batch)
    assert (loss - ref_loss).abs().item() <= 1e-5 * max(1.0, ref_loss.abs().item())
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-5 * max(1.0, grad.abs().max().item()), name


@pytest.mark.parametrize("setting", ["dapo (fused path)", "grpo + KL"])
def test_bf16_model_under_autocast_matches_trl(model_dir, tmp_path, setting):
    """bf16 weights, bf16 autocast: the two heads read the same bf16 hidden states and weight; the
    losses agree to bf16 rounding and the gradients point the same way."""
    trainer = build(model_dir, tmp_path, dtype=torch.bfloat16, **SETTINGS[setting])
    (loss, grads), (ref_loss, ref_grads) = compare(trainer, make_batch(trainer, seed=2))
    assert (loss - ref_loss).abs().item() <= 1e-2 * max(1.0, ref_loss.abs().item())
    ours = torch.cat([g.float().flatten() for g in grads.values()])
    theirs = torch.cat([ref_grads[n].float().flatten() for n in grads])
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item() > 0.999
