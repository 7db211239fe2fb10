"""The demo's policy: a tiny Qwen3-architecture causal LM with random init, no download.

``transformers.Qwen3ForCausalLM`` built from a ``Qwen3Config`` over the task's own vocabulary; the
architecture (GQA attention with q/k RMSNorm, RoPE, SwiGLU MLP, RMSNorm) is the real Qwen3 one, only
the sizes are small. The weights come from the model's own initializer under a fixed seed, so two runs
with the same seed start from the same policy.
"""

from __future__ import annotations

import torch

from rlkernel.demo.task import BOS, EOS, PAD, VOCAB_SIZE


def build_policy(
    *,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    max_positions: int = 64,
    vocab_size: int = VOCAB_SIZE,
) -> torch.nn.Module:
    """A randomly initialized ``Qwen3ForCausalLM`` with ``dtype`` weights on ``device``, in train mode.

    The weights are drawn in float32 on the CPU (so a seed gives the same policy on every device)
    and then moved and cast.

    Raises:
        ImportError: transformers (the ``demo`` extra) is not installed.
    """
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "rlkernel demo needs transformers>=4.51 with Qwen3: pip install 'rlkernel[demo]'"
        ) from e

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.bos_token_id = BOS
    return model.to(device=device, dtype=dtype).train()
