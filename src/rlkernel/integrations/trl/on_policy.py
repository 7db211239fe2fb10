"""``RLKernelGRPOTrainer(..., true_on_policy=True)``: what it needs, what it refuses, and the pieces it adds.

True on-policy (docs/integrations/trl.md, "True on-policy"): the policy is patched with
:func:`rlkernel.invariant.patch_hf_model`, so that the logits TRL's ``model.generate`` samples from and
the logits the loss reads (``fused_policy_loss(hidden=..., invariant=True)``) are the same bits; the
sampler's log-probs (:class:`~rlkernel.integrations.trl.sampler.SamplerLogprobs`) then *are* the
trainer's, and serve as the old log-probs: no scoring forward over prompt + completion.

Three things must hold for the equality, and each is made to hold or refused here:

* **The same kernels.** The patched model's linears, RMSNorms and attention run the batch-invariant
  kernels in ``generate()`` and in the training forward alike. Refused: a model ``patch_hf_model``
  refuses (not Qwen3/Llama, quantized or adapter layers), PEFT, Liger / Hub kernels and
  ``torch_compile`` (they replace forwards after the patch or compile the training forward only),
  vLLM and transformers' continuous batching (another engine samples), a static cache (the
  invariant attention needs a growing cache), dropout (random in both passes).
* **The same inputs.** ``generate()`` gives a left-padded prompt's tokens the positions
  ``cumsum(mask) − 1``; TRL's training forward passes no ``position_ids``, so a left-padded row's
  tokens sit at positions shifted by its padding and RoPE rounds differently: measured on the CPU, a
  patched model's log-probs then differ by ~1e-3. True on-policy passes :func:`generation_positions`.
* **The same dtypes.** With ``bf16=True`` / ``fp16=True`` accelerate wraps the model's forward in
  autocast, so ``generate()`` and the loss forward both run under it: the patched linears (the
  sampler's LM head included) cast to the 16-bit dtype as ``F.linear`` does, while rlkernel's
  LM-head ops in the loss run in the weight's dtype whatever the autocast. Parameters in another
  dtype than the autocast's (float32 weights under bf16 AMP) would give the loss float32 logits
  and the sampler 16-bit ones: refused. ``cast_lm_head_to_fp32=True`` maps onto
  float32 *logits* on both sides (``patch_hf_model(lm_head_dtype=torch.float32)`` for the sampler,
  ``logits_dtype=torch.float32`` for the loss) from the LM-head weight in the model's dtype; TRL's
  flag would also store the policy's LM-head weight in float32 (:func:`config_for_trl`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# GRPOConfig fields true on-policy refuses when set (truthy), and why.
_REFUSED_FIELDS = {
    "use_vllm": "vLLM samples with its own kernels; only transformers' generate() runs the patched model",
    "use_transformers_continuous_batching": (
        "transformers' paged generate_batch runs its own attention (paged KV cache), not the invariant one"
    ),
    "use_liger_kernel": (
        "Liger replaces the model's layer forwards when training starts, after patch_hf_model, so the loss "
        "forward would no longer run the kernels generate() ran"
    ),
    "torch_compile": (
        "the Trainer compiles the training forward only; generate() runs the eager model, and inductor's "
        "fusions round differently"
    ),
    "fsdp": "sharded training is not supported by true on-policy yet (tested in one process)",
    "deepspeed": "sharded training is not supported by true on-policy yet (tested in one process)",
}


_MULTI_TURN = (
    "multi-turn and custom rollouts stitch completions from several generate() calls, or from none; the "
    "sampler's log-probs are kept for TRL's one generate() call per batch"
)


def _refuse(setting: str, why: str) -> ValueError:
    return ValueError(f"true_on_policy=True does not support {setting}: {why}")


def check_config(args: object) -> None:
    """Refuse the ``GRPOConfig`` settings true on-policy cannot keep exact (before TRL builds anything).

    Raises:
        ValueError: naming the field (see ``_REFUSED_FIELDS``, ``cache_implementation``, the
            ``use_kernels`` model-init option).
    """
    for name, why in _REFUSED_FIELDS.items():
        if getattr(args, name, None):
            raise _refuse(f"{name}={getattr(args, name)!r}", why)
    cache = getattr(args, "cache_implementation", None)
    if cache not in (None, "dynamic"):
        raise _refuse(
            f"cache_implementation={cache!r}",
            "the invariant attention reads a growing (dynamic) KV cache; leave it None",
        )
    init = getattr(args, "model_init_kwargs", None) or {}
    if init.get("use_kernels"):
        raise _refuse(
            "model_init_kwargs={'use_kernels': True}",
            "Hub kernels replace the layer forwards that patch_hf_model routes through the invariant kernels",
        )


# GRPOTrainer arguments true on-policy refuses when given, and why.
_REFUSED_ARGUMENTS = {
    "peft_config": "adapters are not reviewed for batch invariance yet",
    "quantization_config": "quantized linears have forwards of their own, which patch_hf_model cannot route",
    "tools": _MULTI_TURN,
    "rollout_func": _MULTI_TURN,
    "environment_factory": _MULTI_TURN,
}


def check_arguments(arguments: dict) -> None:
    """Refuse the ``GRPOTrainer`` constructor arguments true on-policy does not support (before TRL
    builds anything; ``arguments``: the bound arguments by name).

    Raises:
        ValueError: naming the argument (``_REFUSED_ARGUMENTS``).
    """
    for name, why in _REFUSED_ARGUMENTS.items():
        if arguments.get(name):
            raise _refuse(name, why)


def config_for_trl(args: object) -> object:
    """The config ``GRPOTrainer.__init__`` gets: ``args`` itself, or with ``cast_lm_head_to_fp32=True``
    a shallow copy with the flag off (TRL would cast the policy's LM-head weight to float32 and give
    it a float32 forward that ``patch_hf_model`` cannot route; the trainer restores the flag on its own
    copy and maps it onto float32 logits)."""
    if args is None or not getattr(args, "cast_lm_head_to_fp32", False):
        return args
    config = copy.copy(args)
    config.cast_lm_head_to_fp32 = False
    return config


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_trainer(trainer: object, model: nn.Module) -> None:
    """Refuse what the built trainer holds that would break the equality (``model``: the policy).

    Raises:
        ValueError: a PEFT model, FSDP / DeepSpeed from the accelerate config, dropout, a model whose
            dtype is not the mixed-precision dtype, a generation mode other than sampling or greedy
            search, ``use_cache=False`` or ``prefill_chunk_size`` in the generation config.
    """
    from accelerate.utils import is_peft_model

    if is_peft_model(trainer.model):
        raise _refuse("a PEFT model", _REFUSED_ARGUMENTS["peft_config"])
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        raise _refuse("FSDP or DeepSpeed (the accelerate config)", _REFUSED_FIELDS["fsdp"])
    precision = trainer.accelerator.mixed_precision
    precision = str(getattr(precision, "value", precision))  # accelerate's PrecisionType or a str
    if precision != "no":
        want = _AUTOCAST_DTYPES.get(precision)
        other = sorted(
            {str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != want}
        )
        if want is None or other:
            raise _refuse(
                f"mixed precision {precision!r} with parameters in {', '.join(other) or precision}",
                "generate() and the loss forward run under its autocast, where the patched linears (the "
                "sampler's LM head) compute in 16 bits but rlkernel's LM-head ops in the loss in the "
                "weight's dtype, so the two logits would differ; load the model in "
                f"{want or 'the autocast dtype'} (e.g. dtype=torch.bfloat16) or set bf16=False / fp16=False",
            )
    dropout = [name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        raise _refuse(
            f"dropout (p > 0 in {', '.join(dropout[:3])})",
            "dropout draws different masks in generate() and in the loss forward; set disable_dropout=True",
        )
    attention_dropout = getattr(model.config.get_text_config(), "attention_dropout", 0.0) or 0.0
    if attention_dropout > 0:
        raise _refuse(
            f"config.attention_dropout={attention_dropout}",
            "the invariant attention has no dropout (disable_dropout=True does not reset this field); set "
            "model.config.attention_dropout = 0.0",
        )
    generation = trainer.generation_config
    mode = str(getattr(generation.get_generation_mode(), "value", generation.get_generation_mode()))
    if mode not in ("sample", "greedy_search"):
        raise _refuse(
            f"the generation mode {mode!r} (generation_kwargs)",
            "only sampling and greedy search decode one token per row per forward in the batch's order",
        )
    if generation.use_cache is False:
        raise _refuse("generation_kwargs use_cache=False", "the invariant decode reads a KV cache")
    if getattr(generation, "prefill_chunk_size", None) is not None:
        raise _refuse(
            "generation_kwargs prefill_chunk_size", "chunked prefill is not covered by the tests yet"
        )


def patch_policy(model: nn.Module, fp32_logits: bool) -> None:
    """``patch_hf_model(model, lm_head_dtype=torch.float32 if fp32_logits else None)``; its
    TypeError / ValueError re-raised with what asked for it."""
    from rlkernel.invariant import patch_hf_model

    try:
        patch_hf_model(model, lm_head_dtype=torch.float32 if fp32_logits else None)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"true_on_policy=True patches the policy with patch_hf_model, which refused: {error}"
        ) from error


def generation_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` int64 position ids as ``generate()`` gives them: ``cumsum(mask) − 1`` over each row's
    real tokens (left padding at 0), so that the training forward of a left-padded prompt + completion
    puts every token where the sampler had it."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp(min=0)
