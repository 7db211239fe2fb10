"""The route of a ``fused_policy_loss`` call: one pure function of facts about the call.

:func:`choose_route` reads a :class:`RouteFacts` (no tensors: what the inputs, the objective and the
backend say, gathered once by :func:`route_facts`) and the options, and returns the
:class:`~rlkernel.ops.routes.Route` that ``rlkernel.rl.fused`` then runs through its table of
builders. The rules, in order:

1. ``token_level_fusion=False`` (option): the composed path (the primitive, then ``policy_loss``).
2. From logits, a token-level objective (``token_loss.is_eligible``) on the Triton kernels:
   inside ``torch.compile`` one registered custom op (3 passes, constants built by traced torch
   ops); otherwise the fused token-level kernels, with the gradient written during the forward
   (2 passes) when V <= ``grad_in_forward_max_vocab``, the logits need a gradient and the backward
   is not in place, else 3 passes; the per-token constants built on the device
   (:func:`device_plan_supported`) or, for what that does not cover, on the host.
3. From logits, any other objective on the Triton kernels, eagerly, with a gradient to compute and
   not float64: gspo / gspo_token / gmpo in closed form (``seq_token_loss.is_eligible``, not under
   ``cp_group``; the plan built on the device where :func:`device_plan_supported`, else on the
   host), the rest by autograd inside the forward. (Without a gradient the composed path is the
   same two launches.)
4. From hidden states, a token-level objective on the Triton kernels, eagerly, weight and hidden of
   one dtype, no ``tp_group``: the fused linear loss (3 GEMMs with a gradient).
5. Everything else: the composed path on the kernels the primitive picks.
"""

from __future__ import annotations

import dataclasses

import torch

from rlkernel import _dispatch
from rlkernel._memo import memoized
from rlkernel._options import Options
from rlkernel.ops.routes import Gemm, Kernels, Route, Source, linear_route
from rlkernel.rl import seq_token_loss, token_loss
from rlkernel.rl.batch import LossBatch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class RouteFacts:
    """What the route of a loss call depends on.

    Attributes:
        source: ``"logits"`` or ``"hidden"``.
        kernels: where the source's kernels run: ``"triton"`` (CUDA, or the forced interpreter) or
            ``"reference"`` (the dispatcher's choice for the source's device and dtype).
        compiling: inside ``torch.compile`` tracing.
        needs_grad: autograd will ask for a gradient of the source (or of the LM head).
        vocab: V (the full vocabulary; a vocab-parallel shard's size is not used).
        token_level: the objective has a token-level plan (``token_loss.is_eligible``).
        closed_form: the objective is gspo / gspo_token / gmpo in closed form
            (``seq_token_loss.is_eligible``).
        device_plan: a token-level or closed-form call whose per-token constants the kernels can
            build themselves (:func:`device_plan_supported`).
        inplace_backward: the logits' storage receives the gradient.
        vocab_parallel: a ``tp_group`` was given.
        dtypes_match: hidden and weight have one dtype (always True from logits).
        gemm: hidden states: the logits GEMM the engine would run (None from logits).
        weight_grad: hidden states: the LM head's weight needs a gradient.
    """

    source: Source
    kernels: Kernels
    compiling: bool
    needs_grad: bool
    vocab: int
    token_level: bool
    closed_form: bool
    device_plan: bool = False
    inplace_backward: bool = False
    vocab_parallel: bool = False
    dtypes_match: bool = True
    gemm: Gemm | None = None
    weight_grad: bool = False


_CHOSEN: dict[tuple[RouteFacts, Options], Route] = {}  # pure: memoized (a handful of distinct calls)


def choose_route(facts: RouteFacts, options: Options) -> Route:
    """The route of a call with these facts under these options (the rules of the module docstring).
    Pure: no tensor is read, nothing is launched (hence memoized: a training loop asks the same
    question every step)."""
    return memoized(_CHOSEN, (facts, options), lambda: _choose(facts, options))


def _choose(f: RouteFacts, options: Options) -> Route:
    if f.source == "logits":
        return _logits_route(f, options)
    if options.token_level_fusion and not f.vocab_parallel and f.token_level and f.kernels == "triton":
        if not f.compiling and f.dtypes_match:
            grouping = ("auto" if f.weight_grad else None) if f.needs_grad else None
            return Route(
                "hidden", "token", "triton", passes=3 if f.needs_grad else 1, plan="host", gemm=f.gemm,
                grouping=grouping,
            )  # fmt: skip
    primitive = linear_route(
        kernels=f.kernels,
        needs_grad=f.needs_grad,
        gemm=None if f.vocab_parallel else f.gemm,
        vocab_parallel=f.vocab_parallel,
        weight_grad=f.weight_grad,
    )
    return dataclasses.replace(primitive, objective="composed")


def _logits_route(f: RouteFacts, options: Options) -> Route:
    triton = f.kernels == "triton"
    if options.token_level_fusion and triton and f.token_level:
        if f.compiling:
            return Route("logits", "token", "compiled", passes=3, plan="host")
        two = f.vocab <= options.grad_in_forward_max_vocab and f.needs_grad and not f.inplace_backward
        passes = (2 if two else 3) if f.needs_grad else 1
        return Route("logits", "token", "triton", passes=passes, plan="device" if f.device_plan else "host")
    if options.token_level_fusion and triton and not f.compiling and f.needs_grad:
        if f.closed_form:
            return Route("logits", "sequence", "triton", passes=3, plan="device" if f.device_plan else "host")
        return Route("logits", "autograd", "triton", passes=3)
    kernels: Kernels = "compiled" if (triton and f.compiling) else f.kernels
    passes = None if kernels == "reference" else (3 if f.needs_grad else 1)
    return Route("logits", "composed", kernels, passes=passes)


def device_plan_supported(batch: LossBatch) -> bool:
    """Whether the token-level kernels can build this call's per-token constants themselves: a
    padded ``[B, T]`` batch (packed streams need ``cu_seqlens``' sequence index: host plan), not
    context-parallel (its counts span the group's ranks), no
    rollout correction, rejection or given rollout weights (their weights are host-plan algebra),
    and per-token tensors the kernels read flat (contiguous ``token_ids``, ``mask``, ``old_logp``,
    ``ref_logp``, per-token advantages)."""
    cfg = batch.cfg
    if batch.cu_seqlens is not None or len(batch.token_shape) != 2 or batch.cp is not None:
        return False  # (context parallelism: the counts span the ranks, the host plan reduces them)
    if cfg.rollout_correction is not None or cfg.rollout_rs is not None or batch.rollout_weights is not None:
        return False
    flat = [batch.mask, batch.advantages, batch.old_logp, batch.ref_logp if cfg.kl_coef > 0 else None]
    return all(t is None or t.is_contiguous() for t in flat)


def route_facts(
    batch: LossBatch,
    *,
    logits: torch.Tensor | None,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    vocab: int,
    inplace_backward: bool,
    vocab_parallel: bool,
    invariant: bool,
    options: Options,
) -> RouteFacts:
    """The :class:`RouteFacts` of a checked call (read once; nothing is launched)."""
    token_level, closed_form = _objective_kind(
        batch.cfg, batch.old_logp is None, batch.rollout_weights is not None
    )
    # Context parallelism: the closed form's kernel sums each sequence in one program (it cannot see
    # the other ranks' tokens): the autograd coefficients, whose algebra reduces over the group.
    closed_form = closed_form and batch.cp is None
    compiling = torch.compiler.is_compiling()
    grad_mode = torch.is_grad_enabled()
    if logits is not None:
        kernels = _dispatch.resolve_backend(logits.device, has_kernel=logits.dtype in KERNEL_DTYPES)
        return RouteFacts(
            source="logits",
            kernels=kernels,
            compiling=compiling,
            needs_grad=grad_mode and logits.requires_grad,
            vocab=vocab,
            token_level=token_level,
            closed_form=closed_form,
            device_plan=(token_level or closed_form)
            and device_plan_supported(batch)
            and token_ids.is_contiguous(),
            inplace_backward=inplace_backward,
        )
    kernels = _dispatch.resolve_backend(hidden.device, has_kernel=hidden.dtype in KERNEL_DTYPES)
    weight_grad = grad_mode and weight.requires_grad
    bias_grad = bias is not None and bias.requires_grad
    gemm = None
    if kernels == "triton" and not vocab_parallel:
        gemm = _linear_gemm(hidden, weight, bias, invariant, options)
    return RouteFacts(
        source="hidden",
        kernels=kernels,
        compiling=compiling,
        needs_grad=grad_mode and (hidden.requires_grad or weight_grad or bias_grad),
        vocab=vocab,
        token_level=token_level,
        closed_form=closed_form,
        vocab_parallel=vocab_parallel,
        dtypes_match=weight.dtype == hidden.dtype,
        gemm=gemm,
        weight_grad=weight_grad,
    )


_KINDS: dict[tuple, tuple[bool, bool]] = {}


def _objective_kind(cfg, on_policy: bool, has_rollout_weights: bool) -> tuple[bool, bool]:
    """``(token_level, closed_form)`` of an objective (memoized: a function of the frozen config)."""

    def make() -> tuple[bool, bool]:
        token_level = token_loss.is_eligible(cfg, on_policy=on_policy)
        closed_form = not token_level and seq_token_loss.is_eligible(
            cfg, on_policy=on_policy, has_rollout_weights=has_rollout_weights
        )
        return token_level, closed_form

    return memoized(_KINDS, (cfg, on_policy, has_rollout_weights), make)


def _linear_gemm(hidden, weight, bias, invariant: bool, options: Options) -> Gemm:
    """The logits GEMM the chunk engine runs for these inputs (its own rule)."""
    if invariant:
        return "invariant"
    from rlkernel.ops.logprobs import linear_gemm_kind

    return linear_gemm_kind(hidden, weight, bias, options)
