"""TRL's fused LM head, computed by rlkernel: the model's forward patched to score tokens from hidden states.

TRL 1.16's trainers get per-token log-probs through one contract: ``trl.trainer.utils.add_fused_lm_head``
patches ``model.forward`` so that ``model(..., labels=labels, fused_lm_head=True)`` runs the backbone,
projects the positions whose next-token label is not -100 through the LM head in tiles and returns a
``FusedCausalLMOutput`` (``log_probs``, ``entropy``, ``loss``, ``label_mask``), never the
``[B, S, V]`` logits. GRPO's ``_get_per_token_logps_and_entropies`` calls it for the current, old and
reference log-probs (as do RLOO, DPO, KTO and SFT).

:func:`add_rlkernel_lm_head` takes the same arguments as ``add_fused_lm_head`` and patches the same
forward, with the tokens scored by :func:`rlkernel.linear_token_logprobs`; :func:`use_rlkernel_lm_head`
applies it to a ``GRPOTrainer``'s policy and reference models. Patching this documented forward
contract, rather than the trainer's private ``_get_per_token_logps_and_entropies`` (90 lines of
multimodal slicing that change between releases), is the route that depends least on TRL's internals:
the trainer keeps its own loss, chunking, multimodal inputs and PEFT handling.

:func:`install_loss_head` adds a second mode to a model's forward for :class:`RLKernelGRPOTrainer`:
``model(..., rlkernel_head=fn)`` runs the backbone and returns ``fn(hidden, weight, bias)`` computed
*inside* the forward, as TRL computes its fused head, so that the LM-head weight is gathered (FSDP2
``DTensor``) where the model's wrappers expect it and DDP / PEFT wrappers see an ordinary call.

Shared with TRL's head: the logit scale of the config (``logit_scale``, ``output_multiplier``,
``lm_head_multiplier``, ``logits_scaling``) folds into the temperature, z·s/τ = z/(τ/s); the hidden
states are moved to the LM head's device; ``cast_lm_head_to_fp32`` runs the head in float32.

Caveats:
    * Not supported (``ValueError`` when patching): ``final_logit_softcapping`` (Gemma 2/3; no
      softcap in rlkernel's log-prob ops), a logit scale <= 0, DeepSpeed ZeRO-3 (rlkernel's backward
      re-reads the LM-head weight after the gather context that ZeRO-3 needs has closed), a config
      that asks for MoE router logits (the load-balancing loss is not computed here).
    * Requested outputs other than ``log_probs`` and ``entropy`` (``log_sum_sq_probs``,
      ``mean_logits``, ``is_top1``) raise ``ValueError``.
    * The LM head runs in the weight's dtype (the hidden states are cast to it), independent of an
      enclosing autocast, as every rlkernel op (docs/guides/numerics.md).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlkernel import _validate as check
from rlkernel import linear_token_logprobs
from rlkernel.distributed import gather_lm_head
from rlkernel.integrations.trl.config import require_supported_trl

IGNORE_INDEX = -100  # TRL's label for positions that are not scored
OUTPUTS = ("log_probs", "entropy")
# FusedCausalLMOutput fields TRL can compute that rlkernel's ops do not.
_OTHER_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass(frozen=True)
class HeadSettings:
    """How a model's LM head is applied, read once from its config.

    Attributes:
        temperature: the sampling temperature divided by the config's logit scale (> 0).
        backbone_attr: the attribute holding the backbone (``base_model``; ``model`` for vision-language
            models before transformers 5, as TRL reads it).
        fp32: ``cast_lm_head_to_fp32``: hidden states and LM head in float32.
    """

    temperature: float
    backbone_attr: str
    fp32: bool


def _logit_scale(text_config: object) -> float:
    """The factor the model multiplies its logits by, from the config attributes TRL 1.16 reads."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return check.real(f"config.{name}", value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is None:
        return 1.0
    scaling = check.real("config.logits_scaling", scaling)
    if not (math.isfinite(scaling) and scaling > 0):  # Granite's 1 / 0 would raise ZeroDivisionError
        raise ValueError(f"config.logits_scaling must be a finite number > 0, got {scaling}")
    # HyperCLOVA X multiplies its logits by logits_scaling; Granite and MiniCPM3 divide by it.
    return scaling if getattr(text_config, "model_type", None) == "hyperclovax" else 1.0 / scaling


def _zero3_enabled() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # transformers without its deepspeed integration module
        return False
    return bool(is_deepspeed_zero3_enabled())


def head_settings(model: object, temperature: object, cast_lm_head_to_fp32: object) -> HeadSettings:
    """Check that rlkernel can score ``model``'s tokens as TRL's fused head does, and how.

    Raises:
        RuntimeError: the installed TRL is not a 1.16.x release.
        TypeError: ``model`` is not a transformers model with an LM head, a non-bool flag.
        ValueError: a softcapped or non-positively scaled LM head, MoE router logits requested by
            the config, DeepSpeed ZeRO-3, a temperature that is not a finite number > 0.
    """
    require_supported_trl()
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "get_output_embeddings", None)):
        raise TypeError(
            f"model must be a transformers PreTrainedModel with an LM head, got {type(model).__name__}"
        )
    check.boolean("cast_lm_head_to_fp32", cast_lm_head_to_fp32)
    temperature = check.positive_float("temperature", temperature)
    text_config = config.get_text_config()
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        raise ValueError(
            f"{type(model).__name__} softcaps its logits (final_logit_softcapping="
            f"{text_config.final_logit_softcapping}); rlkernel's log-prob ops have no softcap"
        )
    scale = _logit_scale(text_config)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the model's logit scale must be a finite number > 0, got {scale}")
    if getattr(text_config, "output_router_logits", False):
        raise ValueError(
            "the model's config sets output_router_logits=True (a Mixture-of-Experts load-balancing loss); "
            "rlkernel's LM head does not compute the router loss"
        )
    if _zero3_enabled():
        raise ValueError(
            "DeepSpeed ZeRO-3 is not supported: rlkernel's LM-head backward reads the weight after "
            "ZeRO-3's gather context has released it; use ZeRO-2, DDP or FSDP2"
        )
    import transformers

    backbone_attr = "base_model"
    if text_config is not config and int(transformers.__version__.split(".")[0]) < 5:
        backbone_attr = "model"  # vision-language models before transformers 5 (as TRL does)
    effective = check.fp32_float("temperature / logit scale", temperature / scale, positive=True)
    return HeadSettings(temperature=effective, backbone_attr=backbone_attr, fp32=cast_lm_head_to_fp32)


def lm_head_params(model: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight ``[V, H]`` and bias (or None), full tensors.

    An FSDP2 ``DTensor`` head (the LM head in a ``fully_shard`` unit of its own, as size-based
    auto-wrap makes it: its forward never runs, so here it is still sharded) is gathered by
    :func:`rlkernel.distributed.gather_lm_head`, whose backward averages the gradient over the mesh
    and reduce-scatters it to the shards, as FSDP2 does for every other parameter. TRL 1.16's head
    calls ``weight.full_tensor()`` here instead, whose backward keeps only this rank's gradient
    (docs/integrations/trl.md, "FSDP2"). A head in the root unit is FSDP2's unsharded plain tensor
    inside the forward and comes back as it is (FSDP2 reduces its gradient)."""
    head = model.get_output_embeddings()
    return gather_lm_head(head.weight, getattr(head, "bias", None))


def head_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, settings: HeadSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Hidden states, weight and bias in one dtype on the weight's device: float32 with
    ``cast_lm_head_to_fp32``, else the weight's dtype."""
    dtype = torch.float32 if settings.fp32 else weight.dtype
    hidden = hidden.to(device=weight.device, dtype=dtype)
    weight = weight.to(dtype)
    return hidden, weight, None if bias is None else bias.to(dtype)


def backbone_hidden(model: object, settings: HeadSettings, args: tuple, kwargs: dict) -> torch.Tensor:
    """The backbone's last hidden states ``[B, S, H]`` (no cache: a scoring pass)."""
    kwargs["use_cache"] = False
    return getattr(model, settings.backbone_attr)(*args, **kwargs).last_hidden_state


def _outputs(outputs: object) -> tuple[str, ...]:
    if isinstance(outputs, str) or not isinstance(outputs, Sequence):
        raise TypeError(f"outputs must be a tuple of output names, got {outputs!r}")
    other = [name for name in outputs if name not in OUTPUTS]
    if other:
        known = [name for name in other if name in _OTHER_OUTPUTS]
        raise ValueError(
            f"outputs {other} are not supported: rlkernel's head computes {OUTPUTS}"
            + (f" (TRL's {known} have no rlkernel op)" if known else "")
        )
    return tuple(outputs)


def add_rlkernel_lm_head(
    model: object,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: Sequence[str] = ("log_probs",),
) -> None:
    """TRL's ``add_fused_lm_head`` with the tokens scored by :func:`rlkernel.linear_token_logprobs`.

    After it, ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's ``FusedCausalLMOutput``:
    ``log_probs`` ``[B, S − 1]`` float32 (``[B, S]`` with ``shift_labels``), the log-prob of each
    next-token label under softmax(logits·s/τ), 0 where the label is -100; ``entropy`` (the same
    shape, when requested) of that distribution; ``loss`` = −Σ log_probs / (``num_items_in_batch``
    or the count of scored labels); ``label_mask``. Without ``fused_lm_head`` the forward is the
    one it replaces, so generation is unchanged. Apply it after the trainer is built (TRL's
    ``GRPOTrainer.__init__`` installs its own head), e.g. with :func:`use_rlkernel_lm_head`.

    Args:
        model: a transformers causal LM (for PEFT, its base model; PEFT's forward passes through).
        temperature: τ > 0, the sampling temperature.
        cast_lm_head_to_fp32: run the head in float32 (TRL's ``cast_lm_head_to_fp32``).
        outputs: per-token fields to compute, among ``("log_probs", "entropy")``.

    Raises:
        RuntimeError: the installed TRL is not a 1.16.x release.
        TypeError, ValueError: see :func:`head_settings`, and outputs rlkernel does not compute.
    """
    settings = head_settings(model, temperature, cast_lm_head_to_fp32)
    want_entropy = "entropy" in _outputs(outputs)
    from trl.trainer.utils import FusedCausalLMOutput

    original = model.forward

    @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
    def forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return original(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        if kwargs.get("output_router_logits"):
            raise ValueError("output_router_logits=True: rlkernel's LM head does not compute the router loss")
        hidden = backbone_hidden(self, settings, args, kwargs)
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        weight, bias = lm_head_params(self)
        labels = labels.to(weight.device)
        mask = labels != IGNORE_INDEX
        # Only the scored positions go through the head (prompt and padding cost nothing).
        h, weight, bias = head_inputs(hidden[mask.to(hidden.device)], weight, bias, settings)
        out = linear_token_logprobs(
            h, weight, labels[mask], bias=bias, temperature=settings.temperature, return_entropy=want_entropy
        )
        logp, entropy = out if want_entropy else (out, None)
        # masked_scatter keeps the outputs connected to the graph even when no label is scored.
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        entropy = None if entropy is None else entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, label_mask=mask
        )

    model.forward = types.MethodType(forward, model)


def use_rlkernel_lm_head(trainer: object) -> None:
    """Route a ``trl.GRPOTrainer``'s per-token log-probs and entropies (current, old and reference)
    through rlkernel, keeping TRL's loss: :func:`add_rlkernel_lm_head` on its policy (the PEFT base
    model for an adapter) and reference models, with the trainer's temperature and
    ``cast_lm_head_to_fp32``.

    Raises:
        TypeError: ``trainer`` is not a ``trl.GRPOTrainer``.
        ValueError: as :func:`add_rlkernel_lm_head`, and a trainer with a MoE load-balancing loss.
    """
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"trainer must be a trl.GRPOTrainer, got {type(trainer).__name__}")
    if trainer.aux_loss_enabled:
        raise ValueError("a Mixture-of-Experts load-balancing loss (router_aux_loss_coef) is not supported")
    cast = trainer.args.cast_lm_head_to_fp32
    add_rlkernel_lm_head(
        policy_model(trainer.model), temperature=trainer.temperature, cast_lm_head_to_fp32=cast,
        outputs=("log_probs", "entropy"),
    )  # fmt: skip
    if trainer.ref_model is not None:
        add_rlkernel_lm_head(trainer.ref_model, temperature=trainer.temperature, cast_lm_head_to_fp32=cast)


def policy_model(model: object) -> object:
    """The model whose forward TRL patches: the base model of a PEFT model, else the model."""
    from accelerate.utils import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


def install_loss_head(model: object, settings: HeadSettings) -> None:
    """Give ``model``'s forward a mode ``model(..., rlkernel_head=fn)`` that runs the backbone and
    returns ``FusedCausalLMOutput(loss=fn(hidden [B, S, H], weight [V, H], bias))``, computed inside
    the forward; any other call goes to the forward it wraps."""
    from trl.trainer.utils import FusedCausalLMOutput

    original = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, rlkernel_head: Callable | None = None, **kwargs):
        if rlkernel_head is None:
            return original(*args, **kwargs)
        kwargs.pop("labels", None)  # PEFT's forward passes labels=None on
        hidden = backbone_hidden(self, settings, args, kwargs)
        weight, bias = lm_head_params(self)
        return FusedCausalLMOutput(loss=rlkernel_head(hidden, weight, bias))

    model.forward = types.MethodType(forward, model)
