"""True on-policy GRPO with TRL: the sampler's log-probs are the trainer's, bit for bit (CPU, seconds).

    pip install torch==2.13.0 trl==1.16.0                  # the tested TRL (make setup-dev does this)
    PYTHONPATH=src python examples/trl_true_on_policy.py   # --steps N

One keyword on rlkernel's TRL trainer:

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    trainer = RLKernelGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                  train_dataset=dataset, processing_class=tokenizer, true_on_policy=True)

The policy (a Qwen3 or Llama) is patched with ``rlkernel.invariant.patch_hf_model``; TRL's
``model.generate`` samples; the sampler's per-token log-probs are kept and are, bit for bit, the
log-probs the loss computes from the same weights, so they serve as the old log-probs (no scoring
forward). The script trains the same tiny bf16 Qwen3 (built in-process, as in examples/trl_grpo.py)
twice from the same start, with ``true_on_policy=True`` and without, 2 micro-batches per step and a
generation every 4 (the second step of each generation trains on old log-probs), and prints TRL's
``sampling/*`` metrics of each step trained at the sampler's weights: measured by the stock trainer,
exactly 0 and 1 with true on-policy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import PROMPTS, o_reward, save_tiny_qwen3, tiny_tokenizer  # noqa: E402

DIFF, RATIO = "sampling/sampling_logp_difference", "sampling/importance_sampling_ratio"


def train(true_on_policy: bool, model_path: str, tokenizer, steps: int, output_dir: str) -> list[dict]:
    from datasets import Dataset
    from transformers import PrinterCallback, Qwen3ForCausalLM
    from trl import GRPOConfig

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    args = GRPOConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=2, steps_per_generation=4, max_completion_length=10,
        learning_rate=0.005, optim="sgd", bf16=True, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = RLKernelGRPOTrainer(
        model=Qwen3ForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16), reward_funcs=o_reward,
        args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
        true_on_policy=true_on_policy,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def main(steps: int = 4) -> dict[str, float]:
    """Train both ways; print each measured step; return the largest |Δlogp| of each run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU invariant path is small per-row GEMVs: threads only spin
    tokenizer = tiny_tokenizer()
    worst = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_qwen3(f"{tmp}/tiny-qwen3", tokenizer)
        for name, flag in (("stock", False), ("true on-policy", True)):
            history = train(flag, path, tokenizer, steps, f"{tmp}/{name}")
            worst[name] = 0.0
            for entry in history:
                if f"{DIFF}/max" not in entry:
                    continue  # a step trained on old log-probs: the weights moved since sampling
                worst[name] = max(worst[name], entry[f"{DIFF}/max"])
                print(
                    f"{name:15s} step {entry['step']}: |Δlogp| mean {entry[f'{DIFF}/mean']:.3g} "
                    f"max {entry[f'{DIFF}/max']:.3g}; ratio min {entry[f'{RATIO}/min']:.6g} "
                    f"max {entry[f'{RATIO}/max']:.6g}"
                )
    torch.set_num_threads(threads)
    return worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    main(parser.parse_args().steps)
