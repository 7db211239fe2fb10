"""Hugging Face transformers adapter: run a model's attention through ``rlkernel.invariant.attention``.

``register_hf_attention()`` registers :func:`hf_attention_forward` in ``transformers.AttentionInterface``
under ``"rlkernel_invariant"`` and, under the same name, transformers' own SDPA mask function in
``transformers.masking_utils.AttentionMaskInterface``. A model loaded with (or switched to)
``attn_implementation="rlkernel_invariant"`` then calls the adapter from every attention layer with
query ``[B, Hq, Tq, D]``, key/value ``[B, Hkv, Tk, D]`` (after the KV-cache update) and that mask: a
boolean ``[B, 1, Tq, Tk]`` tensor, or ``None`` when the batch has no padding. ``generate()`` with its
``DynamicCache`` and a training forward/backward run unchanged.

From the mask to the kernel's arguments (the kernel anchors each sequence's key blocks at its first
real key, which is what makes left-padded decode, right-padded prefill and packed rows agree):

* ``None``: no padding; every row starts at key 0.
* Decode (Tq = 1): ``key_start[b]`` = the first key the query may see. No host sync.
* Prefill (Tq > 1): each query row's first visible key ``f`` is read from the mask. If, in every batch
  row, all "real" query rows (those whose mask is causal: no visible key after their own position)
  share one ``f``, that is ``key_start[b]`` (left padding: f = pad count; right padding: f = 0).
  Otherwise the rows are packed sequences (transformers builds a block-diagonal mask from
  ``position_ids`` that restart): each change of ``f`` starts a new sequence and the batch runs
  through the packed (varlen) form. One host sync per layer call, prefill only.
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments (the flash-attention packing kwargs of
  transformers' ``DataCollatorWithFlattening``), when given with batch 1, are used directly.

Caveats:
    * Only causal self-attention with a contiguous run of valid keys per sequence (left/right padding,
      packing) is supported; any other mask structure is not read (e.g. padding *inside* a sequence).
    * The cache must be a growing cache (``DynamicCache``): key position Tk − Tq + i for query i.
      A ``StaticCache`` (keys padded to the maximum length) is not supported.
    * No dropout, no sliding window, no softcap, no ``output_attentions`` (raise ``ValueError``).
    * Tested against transformers 5.23 on CPU; written against the public interfaces that 5.17 also
      has (``AttentionInterface.register``, ``AttentionMaskInterface.register``, the ``"sdpa"`` mask).
"""

from __future__ import annotations

import math
import weakref

import torch

from rlkernel.invariant.attention import attention, attention_heads_first

ATTN_IMPLEMENTATION = "rlkernel_invariant"


# The mask is one tensor shared by every layer of a forward: derive the kernel arguments once.
_cache: list = [None, None]  # [weakref to the last mask, its derived arguments]


def _query_segments(mask: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """The first visible key of each query row, ``[B, Tq]`` int64; -1 for rows that are not real
    (no visible key, or a visible key after the row's own position: the "unmask fully masked rows"
    fix transformers applies to left-padding rows). One pass over the mask's B·Tq·Tk bytes."""
    visible = mask[:, 0]  # [B, Tq, Tk]; the mask is shared by all heads
    keys = torch.arange(tk, device=mask.device)
    qpos = tk - tq + torch.arange(tq, device=mask.device)
    first = visible.to(torch.uint8).argmax(-1)  # the first True (argmax returns the first maximum)
    real = visible.any(-1) & ~(visible & (keys[None, :] > qpos[:, None])).any(-1)
    return torch.where(real, first, torch.full_like(first, -1))


def _kernel_arguments(mask: torch.Tensor, tq: int, tk: int) -> tuple[str, torch.Tensor]:
    """``("key_start", [B] tensor)`` or ``("packed", cu_seqlens)`` for a boolean [B, 1, Tq, Tk] mask."""
    if _cache[0] is not None and _cache[0]() is mask:
        return _cache[1]
    first = _query_segments(mask, tq, tk)
    last = first[:, -1]
    if tq == 1:  # decode: no host sync
        result = ("key_start", torch.where(last < 0, tk, last))
    else:
        real_first = torch.where(first < 0, last[:, None], first)
        if bool((real_first == last[:, None]).all()):
            result = ("key_start", torch.where(last < 0, tk, last).contiguous())
        else:
            if tq != tk:
                raise ValueError("packed sequences (a block-diagonal mask) are supported in prefill only")
            result = ("packed", _packed_layout(first, tq))
    _cache[0], _cache[1] = weakref.ref(mask), result
    return result


def _packed_layout(first: torch.Tensor, tq: int) -> torch.Tensor:
    """cu_seqlens over the flattened ``[B·Tq]`` rows: a sequence starts at each batch row's start and
    wherever a real row's first visible key differs from the previous real row's."""
    b = first.shape[0]
    starts = []
    for row, f in enumerate(first.tolist()):
        starts.append(row * tq)
        prev = None
        for i, fi in enumerate(f):
            if fi < 0:
                continue
            if prev is not None and fi != prev and i > 0:
                starts.append(row * tq + i)
            prev = fi
    starts.append(b * tq)
    return torch.tensor(sorted(set(starts)), dtype=torch.int32, device=first.device)


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function backed by :func:`rlkernel.invariant.attention`.

    Args:
        module: the calling attention module (its ``is_causal`` must not be False).
        query: ``[B, Hq, Tq, D]``; key, value: ``[B, Hkv, Tk, D]`` including the cache, Tk ≥ Tq.
        attention_mask: ``None`` or the ``[B, 1, Tq, Tk]`` mask of transformers' SDPA mask function
            (bool, True = visible; an additive float mask, 0 = visible, is accepted too).
        scaling: softmax scale (default ``D ** -0.5``).
        dropout: must be 0.
        **kwargs: ``sliding_window``/``softcap`` must be None; ``cu_seq_lens_q``/``cu_seq_lens_k``
            select the packed form (batch 1); other keys are ignored.

    Returns:
        ``(attn_output [B, Tq, Hq, D] contiguous, None)``.
    """
    if dropout:
        raise ValueError(f"rlkernel attention does not support dropout, got dropout={dropout}")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"rlkernel attention does not support {name}, got {kwargs[name]!r}")
    if kwargs.get("output_attentions"):
        raise ValueError("rlkernel attention does not return attention weights (output_attentions=True)")
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise ValueError("rlkernel attention is causal only (module.is_causal is False)")
    b, _, tq, d = query.shape
    tk = key.shape[2]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)  # as attention()'s default

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and b == 1:
        q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))  # [T, H, D] views
        out = attention(q, k, v, scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        return out.unsqueeze(0), None
    if attention_mask is None:
        return attention_heads_first(query, key, value, scale=scale, key_start=None), None

    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (tq, tk) or mask.shape[0] not in (1, b):
        raise ValueError(
            f"attention_mask must be [B, 1, Tq, Tk] = [{b}, 1, {tq}, {tk}] (the SDPA mask), got "
            f"shape={tuple(attention_mask.shape)}"
        )
    if mask.shape[0] != b:  # a batch-1 mask broadcast over the batch
        mask = mask.expand(b, *mask.shape[1:])
    kind, arg = _kernel_arguments(mask, tq, tk)
    if kind == "key_start":
        return attention_heads_first(query, key, value, scale=scale, key_start=arg), None
    cu = arg
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, T, H, D] views
    flat = attention(
        q.reshape(b * tq, -1, d),
        k.reshape(b * tk, -1, d),
        v.reshape(b * tk, -1, d),
        scale=scale,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )
    return flat.reshape(b, tq, -1, d), None


def register_hf_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`hf_attention_forward` and its mask function with transformers under ``name``.

    Idempotent. Afterwards ``AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)``
    or ``model.set_attn_implementation(name)`` routes attention through rlkernel. Returns ``name``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
