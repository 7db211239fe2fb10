"""A repeat call of ``fused_policy_loss`` from logits takes what its first call's checks decided.

Why: a training loop makes the same call every step (the same config and options; inputs of the
same shapes, strides, dtypes and devices; only their values new), and the entry point's metadata
checks and route facts cost 0.15–0.2 ms of host time on the H200 hosts before the first kernel is
queued, while the GPU waits for it (``benchmarks/NOTES.md``, 2026-11-28).

What the checks and the route decide depends on the call's *signature* (:func:`signature`) and on
no tensor's values: the id check, the only one that reads values, runs in the kernels on every
call. So the first call of a signature is checked and routed in full and what that decided is kept
(:class:`Decided`); a later call with the same signature builds its :class:`LossBatch` from its own
tensors and that decision (:meth:`Decided.batch`) and runs the same route builder.

The signature holds everything the checks and the route read:

* every tensor argument's shape, strides, dtype, device, layout and ``requires_grad`` (None where
  absent);
  the logits' storage offset and, when they are a view, their base's metadata and storage offset
  (the window the kernels address, ``ops._views``);
* the config (by value), ``temperature``, ``validate`` and ``inplace_backward`` by type and value,
  the normalizers ``global_tokens`` / ``global_seqs`` by type (a number's value is checked on every
  call: gradient accumulation passes a new count each step);
* the options (``current_options()``), the backend the dispatcher was asked for and whether the
  CPU interpreter runs, and the grad mode.

Only plain calls are kept: the logits source; no ``hidden``/``weight``/``bias``, process group,
``cp_positions`` or ``cu_seqlens`` (read on the host); plain ``torch.Tensor`` inputs (a subclass
such as a DTensor or a FakeTensor has rules of its own); not inside ``torch.compile`` tracing.
Every other call is checked in full, as before; a call whose checks raise is never kept. The table
is bounded (``rlkernel._memo.MAX_ENTRIES``; past it, it starts over) and holds no tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from rlkernel import _validate as check
from rlkernel._dispatch import interpreter_enabled, requested_backend
from rlkernel._memo import MAX_ENTRIES, store
from rlkernel.ops.routes import Route
from rlkernel.rl.aggregate import Segments
from rlkernel.rl.batch import LossBatch
from rlkernel.rl.config import PolicyLossConfig

_Tensor = torch.Tensor
_NUMBERS = (int, float)


@dataclasses.dataclass(frozen=True)
class Decided:
    """What the full checks of one signature decided (no tensor: those come from each call).

    Attributes:
        route: the route the call took.
        vocab: V, the logits' last dim.
        segments: the batch's (padded) segments.
        advantages_per_seq: the advantages' layout (:func:`rlkernel.rl.batch.advantages_layout`).
    """

    route: Route
    vocab: int
    segments: Segments
    advantages_per_seq: bool

    def batch(self, cfg: PolicyLossConfig, args: dict) -> LossBatch:
        """The :class:`LossBatch` ``validate_batch`` returns for this call (``args``: the call's
        keyword arguments; padded, no context parallelism: the tensors as given)."""
        device = args["token_ids"].device
        return LossBatch(
            cfg=cfg,
            segments=self.segments,
            device=device,
            old_logp=args["old_logp"],
            advantages=args["advantages"],
            mask=args["mask"],
            ref_logp=args["ref_logp"],
            rollout_logp=args["rollout_logp"],
            global_tokens=_normalizer("global_tokens", args["global_tokens"], device),
            global_seqs=_normalizer("global_seqs", args["global_seqs"], device),
            cu_seqlens=None,
            rollout_weights=args["rollout_weights"],
            advantages_per_seq=self.advantages_per_seq,
        )


_DECIDED: dict[tuple, Decided] = {}


def lookup(sig: tuple | None) -> Decided | None:
    """The decision kept for ``sig`` (None: not kept, or no signature)."""
    return None if sig is None else _DECIDED.get(sig)


def forget() -> None:
    """Empty the table: the next call of every signature is checked in full again."""
    _DECIDED.clear()


def remember(sig: tuple | None, route: Route, vocab: int, batch: LossBatch) -> None:
    """Keep what the full checks of a call with signature ``sig`` decided (nothing when ``sig`` is
    None: a call :func:`signature` does not cover, e.g. packed or context-parallel)."""
    if sig is not None:
        store(_DECIDED, sig, Decided(route, vocab, batch.segments, batch.advantages_per_seq), MAX_ENTRIES)


def _normalizer(name: str, value: object, device: torch.device) -> object:
    """A call's normalizer as ``validate_batch`` keeps it: None or a tensor as given (its metadata
    is in the signature), a number checked now (``rlkernel._validate.normalizer``: its value is not)."""
    if value is None or type(value) is _Tensor:
        return value
    return check.normalizer(name, value, device)


def _meta(t: torch.Tensor | None) -> tuple | None:
    """What a check reads of a tensor (None: absent). Raises for a tensor without strides."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.layout, t.requires_grad


def _plain(t: object) -> bool:
    return t is None or type(t) is _Tensor


def _scalar(value: object) -> tuple | None:
    """A normalizer's part of the signature (None: absent; raises TypeError for another type)."""
    if value is None:
        return None
    if type(value) is _Tensor:
        return _meta(value)
    if type(value) in _NUMBERS:
        return type(value)  # (the value is checked on every call: Decided.batch)
    raise TypeError  # (not kept: the full checks name the problem)


def signature(cfg: object, opts: object, args: dict) -> tuple | None:
    """The signature of a plain logits call (see the module docstring), or None for a call that is
    always checked in full. ``args``: ``fused_policy_loss``'s keyword arguments, as given. Reads
    metadata only (no tensor value, no device work); never raises. (Written out rather than looped:
    it runs on every call.)"""
    logits, ids, adv, mask = args["logits"], args["token_ids"], args["advantages"], args["mask"]
    old, ref = args["old_logp"], args["ref_logp"]
    rollout, weights = args["rollout_logp"], args["rollout_weights"]
    temperature, validate, inplace = args["temperature"], args["validate"], args["inplace_backward"]
    if (
        torch.compiler.is_compiling()
        or type(logits) is not _Tensor or type(ids) is not _Tensor or type(adv) is not _Tensor
        or type(mask) is not _Tensor or type(cfg) is not PolicyLossConfig
        or not (_plain(old) and _plain(ref) and _plain(rollout) and _plain(weights))
        or type(temperature) not in _NUMBERS or type(validate) is not bool or type(inplace) is not bool
        or args["invariant"] is not False or args["logits_dtype"] is not None
        or args["hidden"] is not None or args["weight"] is not None or args["bias"] is not None
        or args["tp_group"] is not None or args["cp_group"] is not None or args["cp_positions"] is not None
        or args["cu_seqlens"] is not None
    ):  # fmt: skip
        return None
    base = logits._base
    try:
        return (
            cfg, opts, requested_backend(), interpreter_enabled(), torch.is_grad_enabled(),
            type(temperature), temperature, validate, inplace,
            _meta(logits), logits.storage_offset(),
            None if base is None else (_meta(base), base.storage_offset()),
            _meta(ids), _meta(adv), _meta(mask), _meta(old), _meta(ref), _meta(rollout), _meta(weights),
            _scalar(args["global_tokens"]), _scalar(args["global_seqs"]),
        )  # fmt: skip
    except (RuntimeError, TypeError, ValueError):  # no strides, a bad backend name, ...
        return None
