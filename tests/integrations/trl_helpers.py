"""Shared setup of the TRL integration tests: a tiny model and tokenizer made in-process, TRL's config.

Nothing is downloaded: a byte-level BPE tokenizer is trained by ``tokenizers`` on a few sentences
(vocabulary 300, a non-power-of-two V) and a random-init 2-layer Qwen3 (hidden 64) is saved to a
temporary directory, because with ``beta > 0`` TRL builds the reference model from the policy's
path. The tests compare rlkernel's trainer with TRL's own code (``GRPOTrainer._compute_loss``, a
``GRPOTrainer`` run) in float32: ``bf16=False`` (GRPOConfig's default ``bf16=True`` turns on CPU
autocast, under which TRL's LM-head GEMM rounds to bf16 while rlkernel's runs in the weight's dtype).

The tests skip when TRL 1.16 is not installed, except under ``CI``, where they fail (CI must never
pass without comparing against the real code), as ``tests/integrations/conftest.py`` does for
OpenRLHF.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
import os

import pytest
import torch

TRL_VERSION = "1.16.0"  # the version the Makefile installs and the integration is tested with
VOCAB = 300
PROMPTS = ["the quick", "hello", "one two", "brown fox", "lazy dog", "three four", "jumps over", "world"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world", "one two three four five"] * 10


def require_trl() -> None:
    """Skip (fail under CI) unless TRL 1.16.0 and its stack are installed."""
    reason = None
    if importlib.util.find_spec("trl") is None:
        reason = f"TRL is not installed (pip install trl=={TRL_VERSION})"
    elif importlib.metadata.version("trl") != TRL_VERSION:
        reason = (
            f"TRL {importlib.metadata.version('trl')} is installed; these tests compare with {TRL_VERSION}"
        )
    else:
        # The GPU machine gets TRL's wheel alone (for trl.kernels in the bench): its trainer needs
        # these too.
        missing = [name for name in ("accelerate", "datasets") if importlib.util.find_spec(name) is None]
        if missing:
            reason = f"TRL's trainer stack is incomplete: {', '.join(missing)} not installed"
    if reason is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; CI must run the TRL comparison (make setup-dev installs it)")
    pytest.skip(reason)


@functools.lru_cache(maxsize=1)
def tokenizer():
    """A byte-level BPE tokenizer trained here (no download); eos = pad = ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, bpe)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def save_tiny_model(path: str, *, seed: int = 0, eos_bias: float = 2.5, vocab: int | None = None) -> str:
    """A random-init 2-layer Qwen3 (hidden 64, untied LM head) and the tokenizer, saved to ``path``.

    ``eos_bias``: the LM-head row of the end-of-sequence token is set along the mean hidden state,
    so that sampled completions end at ragged lengths (a random model would almost never stop).
    ``vocab``: a larger LM head than the tokenizer's vocabulary (e.g. Qwen3's 151,936 on the GPU).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab or len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        ids = torch.randint(0, config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(seed))
        mean = model.model(input_ids=ids).last_hidden_state.reshape(-1, 64).mean(0)
        model.lm_head.weight[tok.eos_token_id] = eos_bias * mean / (mean @ mean)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def load_model(path: str):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path)


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS})


def length_reward(completions, **kwargs) -> list[float]:
    """A toy reward: completions of about 12 characters are best."""
    return [-abs(len(c) - 12) / 12 for c in completions]


def grpo_args(output_dir: str, **overrides):
    """A ``GRPOConfig`` for the tiny model: float32 (``bf16=False``), 4 completions of <= 8 tokens
    per prompt, SGD (Adam would magnify rounding-level gradient differences of ~0 gradients), no
    logging or saving."""
    from trl import GRPOConfig

    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        learning_rate=0.005, optim="sgd", bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, seed=0, disable_tqdm=True,
    )  # fmt: skip
    settings.update(overrides)
    return GRPOConfig(**settings)


def make_batch(trainer, *, seed: int = 0, tool_mask: bool = False, token_advantages: bool = False):
    """A micro-batch as TRL's ``_generate_and_score_completions`` returns it, on random data: left-padded
    prompts, ragged completions (a full row, an empty row), advantages of both signs, old log-probs
    off the current ones by ~0.3 (ratios on both sides of the clips), reference log-probs, the
    sampler's log-probs (with one NaN, a token vLLM could not score) and ``num_items_in_batch``.
    """
    g = torch.Generator().manual_seed(seed)
    device = trainer.model.device
    B, P, T = 4, 5, 7
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (B, P), generator=g)
    prompt_len = torch.tensor([5, 2, 3, 1])
    prompt_mask = (torch.arange(P)[None] >= (P - prompt_len)[:, None]).long()
    completion_ids = torch.randint(0, vocab, (B, T), generator=g)
    lengths = torch.tensor([T, 0, 3, 5])
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    batch = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=torch.randn(B, generator=g),
    )  # fmt: skip
    if tool_mask:  # tool-output tokens inside the completions are not trained on
        batch["tool_mask"] = torch.ones(B, T, dtype=torch.long)
        batch["tool_mask"][0, 2:4] = 0
        batch["tool_mask"][3, 1] = 0
    if token_advantages:
        batch["advantages"] = torch.randn(B, T, generator=g)
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention_mask, T)
    logp = logp.float().cpu()
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    sampling = old + 0.4 * torch.randn(B, T, generator=g)
    sampling[2, 1] = float("nan")
    batch.update(
        old_per_token_logps=old.to(device),
        ref_per_token_logps=(logp + 0.5 * torch.randn(B, T, generator=g)).to(device),
        sampling_per_token_logps=sampling.to(device),
        num_items_in_batch=torch.tensor(37, device=device),
    )
    return batch


def importance_sampling_ratio(batch: dict, args) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (``GRPOConfig.vllm_importance_sampling_*``), from its
    documented formula in float64: ρ = exp(old − sampling) per token ([B, T]) or exp(Σ_t) per
    sequence ([B, 1]), a NaN sampling log-prob counting as ρ = 1, then truncated into
    [clip_min, clip_max] or zeroed outside it."""
    mask = batch["completion_mask"] * batch.get("tool_mask", 1)
    diff = (
        (batch["old_per_token_logps"].double() - batch["sampling_per_token_logps"].double()) * mask
    ).nan_to_num(0.0)
    mode = args.vllm_importance_sampling_mode
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        ratio = torch.where((ratio < low) | (ratio > high), 0.0, ratio)
    return ratio.float()


def loss_and_grads(compute_loss, trainer, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``compute_loss(trainer, model, batch)`` and the gradient of every parameter."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = compute_loss(trainer, model, batch)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def max_grad_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)
