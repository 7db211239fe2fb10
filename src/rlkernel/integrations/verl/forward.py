"""An rlkernel backend for verl's ``use_fused_kernels`` path: log-probs and entropy from hidden states.

With ``actor_rollout_ref.model.use_fused_kernels=True`` verl's FSDP engine does not ask the model for
logits: ``verl.models.transformers.monkey_patch.apply_monkey_patch`` replaces the model's ``forward``
(in ``patch_forward_with_backends``) by one that runs the decoder and computes, from its last hidden
states and ``lm_head.weight``, the log-prob of each next token and the entropy of each position's
distribution at the sampling temperature, returned as ``CausalLMOutputForPPO(log_probs, entropy)``
(``verl/models/transformers/dense_common.py``). verl has a ``torch`` backend (chunked matmul +
softmax, ``FusedLinearForPPO``), a ``triton`` one and ``liger``.

:func:`forward_with_rlkernel_backend` is that forward with the per-token math done by
:func:`rlkernel.linear_token_logprobs` (the ``[tokens, vocab]`` logits never exist at once; Triton on
the GPU, the fp32 reference on the CPU):

    labels: shift_labels if given, else roll(labels, −1), else roll(input_ids, −1)   (verl's rule)
    log_probs[t] = log_softmax((h_t Wᵀ + b) / temperature)[labels[t]]          float32
    entropy[t]   = −Σ_v p_v log p_v of the same distribution                      float32

It is installed on one model by :func:`install_fused_forward`, or through verl's config: importing
``rlkernel.integrations.verl`` wraps verl's ``patch_forward_with_backends`` so that
``fused_kernel_options.impl_backend: rlkernel`` installs it (:func:`hook_patch_forward_with_backends`).

Caveats:
    * Text-only causal LMs (verl's ``dense_common`` path: Llama, Qwen2/3, Mistral, …). The model types
      verl routes through their own forward (Qwen2/2.5/3/3.5-VL, GLM-4V, Kimi-VL) raise ``ValueError``.
    * The entropy is float32; verl's ``torch`` backend returns it in the hidden states' dtype (bf16 in
      training). The logits are accumulated in float32 and never rounded to bf16; verl's ``torch``
      backend rounds ``h Wᵀ`` to the hidden dtype first, so bf16 runs differ by that rounding.
    * ``lm_head.bias`` is used when the head has one; verl's backends ignore it.
    * FSDP engine only (verl's Megatron engine has its own fused path).
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any

import torch

from rlkernel import linear_token_logprobs

FUSED_BACKEND = "rlkernel"
# Model types whose fused forward verl takes from a model-specific module, not dense_common.
UNSUPPORTED_MODEL_TYPES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "qwen3_5",
    "qwen3_5_moe",
    "kimi_vl",
)


def _dense_common() -> types.ModuleType:
    return importlib.import_module("verl.models.transformers.dense_common")


def _next_tokens(input_ids, labels, shift_labels) -> torch.Tensor:
    """The token each position predicts: verl's rule (dense_common.forward_with_torch_backend)."""
    if shift_labels is not None:
        return shift_labels
    if labels is not None:
        return torch.roll(labels, shifts=-1, dims=-1)
    if input_ids is not None:
        return torch.roll(input_ids, shifts=-1, dims=-1)
    raise ValueError(
        "forward_with_rlkernel_backend needs input_ids, labels or shift_labels (the next tokens)"
    )


def forward_with_rlkernel_backend(
    self: torch.nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Any = None,
    inputs_embeds: torch.FloatTensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_attentions: bool | None = None,
    output_hidden_states: bool | None = None,
    return_dict: bool | None = None,
    cache_position: torch.LongTensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    temperature: float = 1.0,
    shift_labels: torch.LongTensor | None = None,
    **loss_kwargs: Any,
) -> Any:
    """verl's fused-kernel forward of a causal LM (``forward_with_torch_backend``'s arguments),
    computed by :func:`rlkernel.linear_token_logprobs`.

    Args:
        self: a Hugging Face causal LM with ``.model`` (the decoder) and ``.lm_head``.
        input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
            output_attentions, output_hidden_states, cache_position: passed to ``self.model`` as
            verl's ``forward_base_model`` does (``[B, S]`` or verl's packed ``[1, nnz]``).
        labels: ``[..., S]`` ids; the next tokens are ``roll(labels, −1)`` (when no
            ``shift_labels``).
        shift_labels: ``[..., S]`` next-token ids, used as they are (verl's FSDP engine passes them
            with remove-padding).
        return_dict: ``False`` is refused (verl's backends return a dataclass only).
        temperature: float > 0, the sampling temperature the log-probs and entropy are taken at.
        logits_to_keep, **loss_kwargs: accepted and unused, as in verl.

    Returns:
        verl's ``CausalLMOutputForPPO`` with ``log_probs`` and ``entropy`` float32 ``[..., S]``
        (differentiable in the hidden states and the head), and the decoder's ``past_key_values``,
        ``hidden_states``, ``attentions``.

    Raises:
        ValueError: ``return_dict=False``; no ``input_ids``/``labels``/``shift_labels``; next-token
            ids out of the vocabulary; a temperature <= 0 (named by
            :func:`rlkernel.linear_token_logprobs`).
        TypeError: a temperature that is not a number (verl's fused path takes one temperature).
    """
    if return_dict is False:
        raise ValueError(
            "return_dict=False is not supported: forward_with_rlkernel_backend returns a dataclass"
        )
    targets = _next_tokens(input_ids, labels, shift_labels)
    dense = _dense_common()
    outputs = dense.forward_base_model(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        cache_position=cache_position,
    )
    head = self.lm_head
    log_probs, entropy = linear_token_logprobs(
        outputs[0],
        head.weight,
        targets,
        bias=getattr(head, "bias", None),
        temperature=temperature,
        return_entropy=True,
    )
    return dense.CausalLMOutputForPPO(
        log_probs=log_probs,
        entropy=entropy,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def install_fused_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model.forward`` :func:`forward_with_rlkernel_backend` (what verl's
    ``patch_forward_with_backends`` does for its backends).

    The forward is bound to this model only (verl assigns its backends to the model's class, which
    also changes every other instance of it — a reference model built without fused kernels, or
    the same architecture elsewhere in the process); FSDP wrapping calls it all the same. Also sets
    ``model._verl_fused_kernels_backend = "rlkernel"``, verl's record of the backend.

    Args:
        model: a Hugging Face causal LM with ``.model``, ``.lm_head.weight`` ``[V, H]`` and
            ``.config.model_type``.

    Returns:
        ``model`` (patched in place).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: no decoder / LM head, or a model type verl routes through its own forward
            (:data:`UNSUPPORTED_MODEL_TYPES`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (a Hugging Face causal LM), got {type(model).__name__}"
        )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported: verl computes its fused log-probs with a "
            "model-specific forward (vision inputs); the rlkernel backend covers text-only causal LMs "
            "(verl's dense_common path)"
        )
    decoder = getattr(model, "model", None)
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if not isinstance(decoder, torch.nn.Module) or not isinstance(weight, torch.Tensor):
        lacks = "no .model" if not isinstance(decoder, torch.nn.Module) else "no .lm_head.weight"
        raise ValueError(
            "model must be a causal LM with .model (the decoder) and .lm_head.weight [V, H]; "
            f"{type(model).__name__} has {lacks}"
        )
    if weight.dim() != 2:
        raise ValueError(f"model.lm_head.weight must be [V, H], got shape {tuple(weight.shape)}")
    model.forward = types.MethodType(forward_with_rlkernel_backend, model)
    model._verl_fused_kernels_backend = FUSED_BACKEND
    return model


def hook_patch_forward_with_backends(monkey_patch: types.ModuleType) -> None:
    """Wrap ``monkey_patch.patch_forward_with_backends`` (verl's backend switch, which
    ``apply_monkey_patch`` looks up in its module when it runs) so that
    ``fused_kernels_backend="rlkernel"`` calls :func:`install_fused_forward`; every other backend
    goes to verl's function unchanged. Idempotent."""
    original = monkey_patch.patch_forward_with_backends
    if getattr(original, "rlkernel_backend", False):
        return

    @functools.wraps(original)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if use_fused_kernels and fused_kernels_backend == FUSED_BACKEND:
            install_fused_forward(model)
            return None
        return original(
            model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend
        )

    patch_forward_with_backends.rlkernel_backend = True
    monkey_patch.patch_forward_with_backends = patch_forward_with_backends
