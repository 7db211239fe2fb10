"""Route an HF ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` through the batch-invariant kernels, and back.

What :func:`patch_hf_model` changes, in place (and :func:`unpatch_hf_model` undoes):

    every nn.Linear (q/k/v/o, gate/up/down, lm_head)   -> rlkernel.invariant.matmul.linear
      (whose forward is nn.Linear.forward)               (lm_head_dtype=torch.float32: the lm_head
                                                          with out_dtype=torch.float32, fp32 logits)
    every Qwen3RMSNorm / LlamaRMSNorm (incl. q/k_norm) -> rlkernel.invariant.rmsnorm.rms_norm (same eps)
    attention                                           -> rlkernel.invariant.hf_attention, registered
                                                           in transformers' AttentionInterface (and its
                                                           mask function in AttentionMaskInterface)

How: each patched module's ``__class__`` is swapped for a subclass of its own class whose only
difference is ``forward`` (``InvariantLinear`` is a ``Linear``; ``isinstance`` checks keep working).
The module objects, their parameters and buffers are untouched, so ``state_dict``, optimizers built
before or after patching, ``requires_grad`` flags, hooks and LoRA wrappers (which call the base layer's
forward) keep working. Attention goes through the model's attention implementation name
(``model.set_attn_implementation``, or ``config._attn_implementation`` on transformers versions where
that method does not take a registered custom name), so ``generate()`` with its KV cache, padding masks
and packed ``position_ids`` reach the invariant attention through HF's own code path.

Left as HF has them, because they are batch invariant already (tests/invariant/test_patch.py checks
this with ``torch.equal`` rather than assuming it): the token embedding (a gather), RoPE (cos/sin of
``position × inv_freq`` and the rotate-half multiply-add: elementwise per token), SiLU(gate) * up and
the residual adds (elementwise). None of these reduce across tokens, so no batch shape can change the
order of any floating-point sum.

Caveats:
    * Only the two architectures above (and their base ``Qwen3Model`` / ``LlamaModel``). Other models
      raise TypeError: their modules (fused qkv, different norms, sliding windows, MoE routing) would
      need their own review before anything could be called invariant.
    * Only stock forwards are replaced: an ``nn.Linear`` or RMSNorm module whose forward is its own
      (a quantized, adapter or scaled subclass) or was replaced per instance (accelerate's
      offloading hooks with ``device_map``) makes :func:`patch_hf_model` raise, naming it
      (``allow_unpatched=True`` leaves such modules as they are, with a warning): replacing that
      forward would change what the model computes, and skipping it silently would break the
      invariance. Patch before dispatching such a model.
    * One level: a model containing a module patched by another ``patch_hf_model`` call (on its
      inner model, or on a model sharing the module) is refused, so that :func:`unpatch_hf_model`
      can always restore the original exactly; unpatching the outer model also undoes a patch of
      its inner model.
    * The invariant kernels fix one reduction order for every batch shape, which is not always the
      fastest order cuBLAS/FlashAttention would pick: see ``rlkernel bench invariant``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

# Imported once here, not inside the forwards: a decode step calls them ~10 times per layer.
from rlkernel import _validate as check
from rlkernel.invariant.matmul import linear as _linear
from rlkernel.invariant.rmsnorm import rms_norm as _rms_norm

SUPPORTED_MODELS = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3Model", "LlamaModel")
_NORM_CLASSES = ("Qwen3RMSNorm", "LlamaRMSNorm")
# Stored on the patched model: what unpatch needs to restore.
_STATE = "_rlkernel_invariant_state"
# Stored on each swapped class: the class it replaced.
_ORIGINAL = "_rlkernel_original_class"
_swapped_classes: dict[tuple[type, Any], type] = {}


def _invariant_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return _linear(input, self.weight, self.bias)


def _invariant_fp32_logits_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    # The LM head of patch_hf_model(..., lm_head_dtype=torch.float32): the GEMM's fp32 accumulator.
    return _linear(input, self.weight, self.bias, out_dtype=torch.float32)


def _invariant_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _rms_norm(hidden_states, self.weight, eps=self.variance_epsilon)


# The class-name prefix of each replacement forward.
_PREFIX = {_invariant_linear_forward: "Invariant", _invariant_fp32_logits_forward: "InvariantFp32Logits"}


def _swapped_class(cls: type, forward: Any) -> type:
    """A subclass of ``cls`` that differs only in ``forward`` (cached: one per original class and
    forward).

    It is also bound as a module attribute under its own name, so a pickled patched model (e.g.
    ``torch.save(model)``) finds it again."""
    key = (cls, forward)
    if key not in _swapped_classes:
        name = f"{_PREFIX.get(forward, 'Invariant')}{cls.__name__}"
        while name in globals():  # two original classes of one name from different modules
            name += "_"
        new = type(
            name, (cls,), {"forward": forward, _ORIGINAL: cls, "__module__": __name__, "__doc__": cls.__doc__}
        )
        globals()[name] = _swapped_classes[key] = new
    return _swapped_classes[key]


def _supported_classes() -> tuple[type, ...]:
    from transformers import LlamaForCausalLM, LlamaModel, Qwen3ForCausalLM, Qwen3Model

    return (Qwen3ForCausalLM, LlamaForCausalLM, Qwen3Model, LlamaModel)


def _check_model(model: Any, fn: str) -> None:
    if not isinstance(model, nn.Module) or not isinstance(model, _supported_classes()):
        raise TypeError(
            f"{fn}: model must be one of transformers' {', '.join(SUPPORTED_MODELS)} (or a subclass), "
            f"got {type(model).__module__}.{type(model).__qualname__}"
        )


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` is currently patched by :func:`patch_hf_model`."""
    return getattr(model, _STATE, None) is not None


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    """Point the model (and every config in it) at attention implementation ``name``.

    ``model.set_attn_implementation`` accepts a name registered in ``AttentionInterface`` on
    transformers 5.23 (tested); on versions where it is missing or refuses the name, the config
    attribute (which every version reads in its attention layers) is set directly.
    """
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
        except (ValueError, KeyError, AttributeError, TypeError):
            pass
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) != name:
            config._attn_implementation = name


def _norm_base(cls: type) -> type | None:
    """The Qwen3RMSNorm / LlamaRMSNorm class that ``cls`` is (or derives from), else None."""
    return next((c for c in cls.__mro__ if c.__name__ in _NORM_CLASSES), None)


def _plan(model: nn.Module) -> tuple[list[tuple[nn.Module, Any]], list[str]]:
    """What patching ``model`` would do: ``(module, forward)`` pairs to swap, and a description of
    each module that cannot be patched without changing what it computes. A module is patched only
    when its forward is the stock one (``nn.Linear.forward``, or the RMSNorm class's own), read from
    its class and not replaced on the instance: a subclass with its own forward (a quantized, adapter
    or scaled layer) or an instance forward (accelerate's hooks) would otherwise be silently
    replaced, or silently bypass the patch."""
    swaps, unsupported = [], []
    for path, module in model.named_modules():
        cls = type(module)
        if isinstance(module, nn.Linear):
            base, forward = nn.Linear, _invariant_linear_forward
        else:
            base, forward = _norm_base(cls), _invariant_rms_norm_forward
            if base is None:
                continue
        where = path or "the model itself"
        if "forward" in vars(module):
            unsupported.append(
                f"{where} ({cls.__qualname__}: its forward was replaced on the instance, e.g. by "
                "accelerate's hooks)"
            )
        elif cls.forward is not base.forward:
            unsupported.append(
                f"{where} ({cls.__module__}.{cls.__qualname__}: a subclass of {base.__name__} with its "
                "own forward)"
            )
        else:
            swaps.append((module, forward))
    return swaps, unsupported


def _patched_inside(model: nn.Module) -> list[str]:
    """Paths of the modules inside ``model`` patched by a ``patch_hf_model`` call on ``model`` itself
    or on one of its submodules ("" is the model)."""
    return [
        path or "the model itself"
        for path, module in model.named_modules()
        if getattr(type(module), _ORIGINAL, None) is not None or (path and is_patched(module))
    ]


def _lm_head_dtype(model: nn.Module, lm_head_dtype: object) -> torch.dtype | None:
    """The validated ``lm_head_dtype`` of :func:`patch_hf_model`: None (the LM head emits the
    weight's dtype, like every other linear) or ``torch.float32`` (fp32 logits, no 16-bit rounding);
    the weight's own dtype is the same as None."""
    if lm_head_dtype is None:
        return None
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"patch_hf_model: lm_head_dtype={lm_head_dtype!r} needs a model with an lm_head "
            f"(Qwen3ForCausalLM / LlamaForCausalLM), got {type(model).__qualname__}"
        )
    if lm_head_dtype is head.weight.dtype:
        return None
    if lm_head_dtype is not torch.float32 or head.weight.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            "patch_hf_model: lm_head_dtype must be None (logits in the weight's dtype), the weight's "
            f"dtype ({head.weight.dtype}) or torch.float32 (fp32 logits of a float16/bfloat16 model), "
            f"got {lm_head_dtype!r}"
        )
    return torch.float32


def patched_lm_head_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the logits of a model patched by :func:`patch_hf_model`: ``torch.float32``
    when it was patched with ``lm_head_dtype=torch.float32``, else the LM head weight's dtype;
    None for a model that is not patched or has no LM head. Pass it as ``logits_dtype`` of
    ``rlkernel.linear_token_logprobs(..., invariant=True)`` to reproduce its log-probs."""
    state = getattr(model, _STATE, None)
    head = getattr(model, "lm_head", None)
    if state is None or not isinstance(head, nn.Linear):
        return None
    return state.get("lm_head_dtype") or head.weight.dtype


def patch_hf_model(
    model: nn.Module, *, allow_unpatched: bool = False, lm_head_dtype: torch.dtype | None = None
) -> nn.Module:
    """Make an HF Qwen3/Llama model run its linears, RMSNorms and attention on the invariant kernels.

    After patching, every token's logits are bitwise independent of the batch it is computed in:
    batch size, left/right padding, packing (``position_ids`` restarting at 0, no attention mask) and
    KV-cache decode vs a full prefill. ``generate()``, a training forward and ``backward()`` all work
    as before; parameters are not copied or moved.

    Only modules whose forward is the stock one are patched: exactly ``nn.Linear.forward`` (plain
    ``nn.Linear`` or a subclass that does not override it) and the Qwen3/Llama RMSNorm's own forward,
    not replaced on the instance. Any other such module (a quantized, adapter or scaled ``nn.Linear``
    subclass with its own forward; accelerate's per-instance hooks) is an error unless
    ``allow_unpatched`` is set: replacing its forward would change what the model computes, and
    leaving it silently would break the invariance this function promises.

    Args:
        model: a ``transformers`` ``Qwen3ForCausalLM`` or ``LlamaForCausalLM`` (or the base
            ``Qwen3Model`` / ``LlamaModel``), on any device and dtype the invariant kernels take
            (CUDA: Triton kernels; CPU: the invariant reference path).
        allow_unpatched: leave the modules described above as they are (a ``UserWarning`` names
            them) and patch the rest. The model then computes what it computed before in those
            modules, and its logits are batch invariant only if they are.
        lm_head_dtype: None (default): the LM head emits logits in its weight's dtype (bf16 logits
            for a bf16 model, one rounding of the fp32 accumulator, as HF's ``nn.Linear`` does);
            ``torch.float32`` (float16/bfloat16 models): the LM head emits the fp32 accumulator
            itself (no 16-bit rounding: more accurate sampling and log-probs, twice the logits'
            memory). ``rlkernel.linear_token_logprobs(..., invariant=True, logits_dtype=...)``
            with the same dtype reproduces the log-probs of either bit for bit from the hidden states.

    Returns:
        ``model`` itself, patched in place. Patching a patched model again (with the same
        ``lm_head_dtype``) is a no-op.

    Raises:
        TypeError: ``model`` is not one of the supported architectures; ``allow_unpatched`` not a
            bool.
        ValueError: a linear or RMSNorm module has a forward of its own (see above; names each
            one), or a module inside ``model`` is already patched by a ``patch_hf_model`` call on a
            submodule (e.g. ``model.model``) or on a model sharing it: patch one level only, so that
            :func:`unpatch_hf_model` can restore it exactly. Nothing is changed when it raises.
            Also: ``lm_head_dtype`` not None / the weight's dtype / ``torch.float32`` (for a 16-bit
            model), given for a model without an LM head or whose LM head stays unpatched, or
            different from the one a patched model was patched with.
    """
    _check_model(model, "patch_hf_model")
    check.boolean("allow_unpatched", allow_unpatched)  # "False" would be truthy
    head_dtype = _lm_head_dtype(model, lm_head_dtype)
    if is_patched(model):
        had = getattr(model, _STATE).get("lm_head_dtype")
        if had is not head_dtype:
            raise ValueError(
                f"patch_hf_model: the model is already patched with lm_head_dtype={had}, asked for "
                f"{lm_head_dtype}; unpatch_hf_model it first"
            )
        return model
    nested = _patched_inside(model)
    if nested:
        raise ValueError(
            f"patch_hf_model: {', '.join(nested[:4])}{' …' if len(nested) > 4 else ''} "
            f"{'is' if len(nested) == 1 else 'are'} already patched, by patch_hf_model on a submodule "
            "or on a model that contains it; patch one level only (unpatch_hf_model that one first), "
            "so that unpatch_hf_model can restore the original model exactly"
        )
    swaps, unsupported = _plan(model)
    if head_dtype is not None:
        if not any(module is model.lm_head for module, _ in swaps):
            raise ValueError(
                "patch_hf_model: lm_head_dtype needs the lm_head patched, but it has a forward of its "
                "own (see allow_unpatched)"
            )
        swaps = [(m, _invariant_fp32_logits_forward if m is model.lm_head else f) for m, f in swaps]
    if unsupported:
        listed = "; ".join(unsupported)
        if not allow_unpatched:
            raise ValueError(
                f"patch_hf_model: cannot route {listed} through the invariant kernels: replacing its "
                "forward would change what the model computes, and leaving it as it is would break batch "
                "invariance. Replace or unwrap such modules first, or pass allow_unpatched=True to patch "
                "the rest and leave these as they are (the model is then not guaranteed batch invariant)"
            )
        warnings.warn(
            f"patch_hf_model(allow_unpatched=True): left unpatched: {listed}; the model's logits are "
            "batch invariant only if these modules are",
            UserWarning,
            stacklevel=2,
        )
    from rlkernel.invariant.hf_attention import register_hf_attention

    name = register_hf_attention()
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    # (config, its attention implementation before patching): a list of pairs, not a dict keyed by
    # id(), so that a deepcopy of the patched model carries a state that still matches its configs.
    state = {
        "attn": [(cfg, cfg._attn_implementation) for cfg in configs.values()],
        "lm_head_dtype": head_dtype,
    }
    for module, forward in swaps:
        module.__class__ = _swapped_class(type(module), forward)
    _set_attn_implementation(model, name)
    object.__setattr__(model, _STATE, state)  # a plain attribute: not a submodule, not in state_dict
    return model


def unpatch_hf_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_hf_model`: the original module classes and attention implementation return.

    The model then computes exactly what it computed before patching (bitwise). This also undoes a
    ``patch_hf_model`` applied to a submodule of ``model`` (e.g. ``model.model``), so unpatching the
    outer model restores the original whatever was patched inside it. Unpatching a model with
    nothing patched in it is a no-op.

    Raises:
        TypeError: ``model`` is not one of the supported architectures.
        ValueError: ``model`` is part of a model patched as a whole (its modules were swapped by
            ``patch_hf_model`` on an enclosing model): unpatch that model instead. Nothing changes.
    """
    _check_model(model, "unpatch_hf_model")
    if not is_patched(model):
        inner = [m for path, m in model.named_modules() if path and is_patched(m)]
        if not inner and _patched_inside(model):
            raise ValueError(
                "unpatch_hf_model: this model was not patched itself, but its modules were, by "
                "patch_hf_model on a model that contains it; unpatch that model instead"
            )
        for m in inner:
            _unpatch(m)
        return model
    _unpatch(model)
    return model


def _unpatch(model: nn.Module) -> None:
    state = getattr(model, _STATE)
    for module in model.modules():
        original = getattr(type(module), _ORIGINAL, None)
        if original is not None:
            module.__class__ = original
    for cfg, original in state["attn"]:
        cfg._attn_implementation = original
    setter = getattr(model, "set_attn_implementation", None)
    top = next((orig for cfg, orig in state["attn"] if cfg is getattr(model, "config", None)), None)
    if setter is not None and top is not None:
        try:
            setter(top)
        except (ValueError, KeyError, AttributeError, TypeError):
            pass
    object.__delattr__(model, _STATE)
