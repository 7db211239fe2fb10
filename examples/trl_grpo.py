"""GRPO with TRL, the loss computed by rlkernel from hidden states: a tiny Qwen3 on the CPU, under a minute.

    pip install torch==2.13.0 trl==1.16.0        # the tested TRL (make setup-dev does this)
    PYTHONPATH=src python examples/trl_grpo.py   # --steps N, --no-compare

The switch is one import; the trainer takes TRL's constructor arguments unchanged:

    from rlkernel.integrations.trl import RLKernelGRPOTrainer   # instead of: from trl import GRPOTrainer

Everything here is made in-process (nothing is downloaded): a byte-level BPE tokenizer trained on a
few sentences, a random-init 2-layer Qwen3 (hidden 64), a toy reward (completions with many "o"s).
The script trains with ``RLKernelGRPOTrainer``, then with TRL's own ``GRPOTrainer`` from the same
start, and prints per step what shows the policy moving: the reward, the KL to the reference model
(it grows from 0 as the policy leaves its start) and the gradient norm; then how far apart the two
runs' parameters end (float32: rounding). The logged loss itself is about 0 at every step, in both
trainers: TRL's default is on-policy (the ratio exp(logp − sg[logp]) is 1 in value), so the loss is
the token-weighted mean of −advantage (+ β·KL ≈ 0), and each prompt's group-normalized advantages
sum to 0 (exactly 0 when the completions are equally long); its gradient is not 0.
A few steps on this toy task move the policy (the KL) before the reward: read the reward over more
``--steps``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

PROMPTS = ["the quick", "hello", "one two", "brown fox", "lazy dog", "three four", "jumps over", "world"]


def tiny_tokenizer():
    """A byte-level BPE tokenizer of 300 tokens, trained here; eos = pad = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", "one two three four five"] * 10
    bpe = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, bpe)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def save_tiny_qwen3(path: str, tokenizer) -> str:
    """A random-init 2-layer Qwen3 saved to ``path`` (TRL loads a reference model from the path
    when ``beta > 0``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def o_reward(completions, **kwargs) -> list[float]:
    """The toy task: say "o" often."""
    return [c.count("o") / max(len(c), 1) for c in completions]


def train(trainer_cls, model_path: str, tokenizer, steps: int, output_dir: str):
    from datasets import Dataset
    from transformers import PrinterCallback, Qwen3ForCausalLM
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=10, learning_rate=0.005, optim="sgd", loss_type="dapo", beta=0.02,
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = trainer_cls(
        model=Qwen3ForCausalLM.from_pretrained(model_path), reward_funcs=o_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the summary below instead of a dict per step
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer.model, history


# What each run prints per step: (label, TRL's log key, format).
COLUMNS = (
    ("reward", "reward", "{:.3f}"), ("kl to ref", "kl", "{:.1e}"), ("grad_norm", "grad_norm", "{:.2f}")
)


def row(history: list[dict], key: str, fmt: str) -> str:
    """One logged value per step, formatted."""
    return " ".join(fmt.format(entry[key]) for entry in history)


def main(steps: int = 4, compare: bool = True) -> float | None:
    """Train, print the runs, and return max |Δparameter| between rlkernel's and TRL's (or None)."""
    from trl import GRPOTrainer

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    tokenizer = tiny_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_qwen3(f"{tmp}/tiny-qwen3", tokenizer)
        runs = {"rlkernel": train(RLKernelGRPOTrainer, path, tokenizer, steps, f"{tmp}/rlkernel")}
        if compare:
            runs["trl"] = train(GRPOTrainer, path, tokenizer, steps, f"{tmp}/trl")
    # (CPU times would say little: the first run also pays one-time imports.)
    for name, (_, history) in runs.items():
        print(f"{name:9s} " + "   ".join(f"{label} {row(history, key, fmt)}" for label, key, fmt in COLUMNS))
    print(
        "(the loss is ~0 at every step in both: on-policy, the ratio is 1 in value and each prompt's "
        "advantages sum to 0; its gradient is grad_norm)"
    )
    if not compare:
        return None
    ours, theirs = (dict(runs[name][0].named_parameters()) for name in ("rlkernel", "trl"))
    diff = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
    print(f"max |parameter difference| after {steps} steps: {diff:.1e}")
    return diff


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-compare", action="store_true", help="train with rlkernel only")
    options = parser.parse_args()
    main(options.steps, not options.no_compare)
