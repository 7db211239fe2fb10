"""Three training steps of ``RLKernelGRPOTrainer`` end where TRL 1.16's ``GRPOTrainer`` ends.

Each run starts from the same saved tiny model with the same seed: generation (sampling, EOS at
ragged lengths), the toy reward, group advantages, SGD steps. The two trainers sample the same
completions as long as their parameters agree, so after 3 steps every parameter agrees to 1e-6, and
so do the logged losses.
"""

from __future__ import annotations

import math

import pytest
import torch

from .trl_helpers import (
    VOCAB,
    dataset,
    grpo_args,
    length_reward,
    load_model,
    require_trl,
    save_tiny_model,
    tokenizer,
)

TOL = 1e-6
STEPS = 3

RUNS = {
    # TRL's defaults: dapo, on-policy (no old log-probs), one micro-batch per step.
    "defaults": dict(),
    # num_iterations = 2: old log-probs, rlkernel's fused_policy_loss; GSPO with a k3 KL.
    "GSPO + KL, 2 iterations": dict(
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=3e-3,
        num_iterations=2,
        beta=0.05,
        use_bias_correction_kl=False,
    ),  # fmt: skip
    # 2 micro-batches per step, a generation every 4 (old log-probs): the window normalizers.
    "dr_grpo, accumulation 2, steps_per_generation 4": dict(
        loss_type="dr_grpo", gradient_accumulation_steps=2, steps_per_generation=4
    ),
    # The adaptive entropy bonus (its coefficient moves every step) with cispo.
    "cispo + adaptive entropy": dict(
        loss_type="cispo",
        epsilon_high=1.2,
        use_adaptive_entropy=True,
        entropy_coef=0.05,
        entropy_target=10.0,
        entropy_coef_delta=0.02,
    ),  # fmt: skip
}
# With pretended vLLM completions (sampler log-probs made up, one unscored token per batch).
VLLM_RUNS = {
    "vLLM sequence_mask, grpo": dict(
        loss_type="grpo", vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_trl()
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")))


def pretend_vllm(trainer, seed: int = 0) -> None:
    """The trainer's completions as if vLLM had sampled them: the flags set after construction (vLLM
    cannot be installed on the CPU CI) and ``_generate`` (TRL's) wrapped to also return sampler
    log-probs, made up near the model's (log 1/V ± 0.5), one of each batch unscored (None, as vLLM
    reports a NaN). TRL's own code then computes the old log-probs and the importance ratio."""
    from rlkernel.integrations.trl import plan_from_trl

    trainer.args.use_vllm = trainer.use_vllm = True
    if hasattr(trainer, "rlkernel_plan"):
        trainer.rlkernel_plan = plan_from_trl(trainer.args)
    generate = trainer._generate
    g = torch.Generator().manual_seed(seed)

    def _generate(prompts):
        trainer.use_vllm = False  # TRL's transformers generation
        try:
            out = list(generate(prompts))
        finally:
            trainer.use_vllm = True
        logps = [(-math.log(VOCAB) + 0.5 * torch.randn(len(ids), generator=g)).tolist() for ids in out[1]]
        logps[0][0] = None
        out[4] = logps
        return tuple(out)

    trainer._generate = _generate  # seam: vLLM's sampler stands in for the transformers one


def train(cls, model_dir, output_dir, *, vllm: bool = False, **overrides):
    """``STEPS`` steps of ``cls``; its parameters and logged losses."""
    trainer = cls(
        model=load_model(model_dir), reward_funcs=length_reward,
        args=grpo_args(str(output_dir), max_steps=STEPS, **overrides), train_dataset=dataset(),
        processing_class=tokenizer(),
    )  # fmt: skip
    if vllm:
        pretend_vllm(trainer)
    trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # Logged at the steps that generated (every steps_per_generation · num_iterations micro-batches).
    lengths = [
        entry["completions/min_length"]
        for entry in trainer.state.log_history
        if "completions/min_length" in entry
    ]
    return params, losses, lengths


def assert_same_run(ours, theirs, initial) -> None:
    params, losses, lengths = ours
    ref_params, ref_losses, ref_lengths = theirs
    assert lengths == ref_lengths  # the same completions were sampled
    assert len(losses) == STEPS and losses == pytest.approx(ref_losses, abs=TOL)
    assert max((params[n] - ref_params[n]).abs().max().item() for n in params) <= TOL
    # Training moved the parameters (the comparison is not of two untouched models).
    assert max((ref_params[n] - initial[n]).abs().max().item() for n in params) > 100 * TOL


@pytest.fixture(scope="module")
def initial(model_dir):
    return {name: p.detach().clone() for name, p in load_model(model_dir).named_parameters()}


@pytest.mark.parametrize("run", [*RUNS, *VLLM_RUNS])
def test_three_steps_end_with_trl_parameters(model_dir, tmp_path, initial, run):
    from trl import GRPOTrainer

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    vllm = run in VLLM_RUNS
    overrides = VLLM_RUNS[run] if vllm else RUNS[run]
    ours = train(RLKernelGRPOTrainer, model_dir, tmp_path / "rlkernel", vllm=vllm, **overrides)
    theirs = train(GRPOTrainer, model_dir, tmp_path / "trl", vllm=vllm, **overrides)
    assert_same_run(ours, theirs, initial)
    assert min(ours[2]) < 8  # some completions ended before max_completion_length


def test_example_trains_like_trl(model_dir, capsys):
    """examples/trl_grpo.py (one step here): both runs print, and their parameters agree."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(steps=1) <= TOL
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["rlkernel", "trl"]
    # Issue 29: the runs printed "loss +0.00000" (correct, on-policy) and nothing that moves; now
    # reward, KL to the reference and gradient norm per step, and a line saying why the loss is 0.
    for line in lines[:2]:
        assert "reward" in line and "kl to ref" in line and "grad_norm" in line and "loss" not in line
        assert float(line.split("grad_norm")[1].split()[0]) > 0
    assert lines[2].startswith("(the loss is ~0 at every step")
    assert lines[3].startswith("max |parameter difference| after 1 steps")
