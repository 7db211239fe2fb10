"""The ``linear`` suite's implementations besides rlkernel's, and its fp32 reference.

    torch          plain PyTorch: ``hidden @ W.T`` (bf16 logits, every row), ``log_softmax(z.float()
                   / T)``, gather, entropy from the same log-softmax, outputs masked; losses: the RL
                   algebra of :func:`rlkernel.bench._logits_baselines.plain_policy_loss`; autograd
    trl            TRL 1.16's fused LM head, ``trl.kernels.chunked_logprob.ChunkedLogProbFunction``, in
                   the call pattern of TRL's ``add_fused_lm_head`` (the head its GRPO trainer puts on
                   the model): ``hidden[mask]``, ``labels[mask]`` (only the scored rows, packed), the
                   Function with ``chunk_size = 32768`` and ``outputs=("log_probs", "entropy")``,
                   ``masked_scatter`` back. Losses: that head's log-probs, then the plain RL algebra
                   (how TRL's trainer computes its loss from the head's log-probs)
    liger          ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (loss_type "dapo", token
                   level, with the reference model's log-probs for its KL term), losses only
    cublas_gemms   the LM-head GEMMs the workload needs at least (:attr:`Kind.n_gemms`), cuBLAS, over
                   the scored rows only (packed: the floor has nothing to do for padding)
    reference      (untimed, no row) the fp32 oracle every row is cross-checked against:
                   :func:`rlkernel.reference.logprobs.linear_token_logprobs` (fp32 logits of the bf16
                   operands, chunked, fp32 backward; TF32 off), its losses the plain RL algebra

Only ``trl.kernels`` is imported from TRL. Its Function's backward imports
``trl.trainer.utils.maybe_gather_lm_head_ctx`` (DeepSpeed ZeRO-3's parameter gather, a
``nullcontext`` without ZeRO-3), and ``trl.trainer.utils`` imports TRL's whole trainer stack
(accelerate, datasets ...), which the GPU machine does not carry: unless that module is already
imported, the bench puts a stand-in holding that one helper as a ``nullcontext`` into
``sys.modules`` for the duration of each TRL call (:func:`_trl_gather_stand_in`) and removes it
after. The head's math, tiles and kernels are TRL's own.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlkernel.bench._linear_inputs import Kind, hidden
from rlkernel.bench._logits_baselines import TEMPERATURE, LossSpec, plain_policy_loss, torch_token_logprobs
from rlkernel.bench.suite import Call, CallResult, Skip, optional_import

TRL_MODULE = "trl.kernels.chunked_logprob"
TRL_CLASS = "ChunkedLogProbFunction"
# The vocabulary tile TRL 1.16's add_fused_lm_head passes (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE;
# not imported: that module needs TRL's trainer stack).
TRL_CHUNK_SIZE = 32768
TRL_OUTPUTS = ("log_probs", "entropy")  # what TRL's GRPO trainer asks of its head
TRL_PARAMS = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
              "final_logit_softcapping", "logit_scale", "outputs")  # fmt: skip
TRL_GATHER_MODULE = "trl.trainer.utils"
# Bytes of one fp32 logits chunk of the reference (larger chunks: faster fp32 GEMMs).
REFERENCE_CHUNK_BYTES = 1 << 30


def leaves(inp: dict, kind: Kind) -> tuple[torch.Tensor, ...]:
    """What gradients are taken against: the base hidden states (and the weight unless frozen)."""
    return (inp["base"],) if kind.frozen_weight else (inp["base"], inp["weight"])


def bind(kind: Kind, inputs: list[dict], fwd: Callable[[dict], Any]) -> Call:
    """A timed call: ``fwd(inp)`` (the primitive's ``(logp, entropy)`` ``[B, T]``, or the 0-dim
    loss), then the gradients of the leaves (the primitive's with the input set's upstream
    gradients)."""

    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        out = fwd(inp)
        outs = tuple(out) if not kind.loss else (out,)
        grads = torch.autograd.grad(outs, leaves(inp, kind), None if kind.loss else inp["grad_out"])
        return CallResult(tuple(o.detach() for o in outs), tuple(grads))

    return call


def loss_from_logp(logp: torch.Tensor, inp: dict, spec: LossSpec) -> torch.Tensor:
    """The plain RL algebra (the suite's DAPO-KL objective) on ``[B, T]`` log-probs."""
    return plain_policy_loss(logp, inp["old_logp"], inp["advantages"], inp["mask"], spec, inp["ref_logp"])


# --------------------------------------------------------------------------------------- plain torch
def torch_logprobs(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch over every row: bf16 logits, fp32 log-softmax, gather, entropy, masked."""
    logp, ent = torch_token_logprobs(hidden(inp) @ inp["weight"].t(), inp["ids"], TEMPERATURE, True)
    return logp * inp["mask"], ent * inp["mask"]


def torch_loss(spec: LossSpec) -> Callable[[dict], torch.Tensor]:
    def fwd(inp: dict) -> torch.Tensor:
        logp = torch_token_logprobs(hidden(inp) @ inp["weight"].t(), inp["ids"], TEMPERATURE, False)
        return loss_from_logp(logp, inp, spec)

    return fwd


# ----------------------------------------------------------------------------------------------- TRL
def trl_head(device: torch.device) -> tuple[Any, str]:
    """``(ChunkedLogProbFunction, "")``, or ``(None, why)`` (TRL absent, or a signature other than
    1.16's). It runs on any device: its kernels are Triton on CUDA, torch tiles elsewhere."""
    mod, why = optional_import(TRL_MODULE)
    if mod is None:
        return None, why
    fn = getattr(mod, TRL_CLASS, None)
    if fn is None:
        return None, f"{TRL_MODULE} has no {TRL_CLASS}"
    params = tuple(inspect.signature(fn.forward).parameters)[1:]  # drop ctx
    if params != TRL_PARAMS:
        return None, f"{TRL_CLASS}.forward takes {params}, not TRL 1.16's {TRL_PARAMS}"
    return fn, ""


@functools.cache
def real_trl_gather_importable() -> bool:
    """Whether TRL's own ``trl.trainer.utils`` imports here (it needs ``datasets``). Asked once per
    process: a failing import would otherwise be retried inside every timed TRL call."""
    try:
        importlib.import_module(TRL_GATHER_MODULE)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _trl_gather_stand_in() -> Iterator[None]:
    """``trl.trainer.utils`` with ``maybe_gather_lm_head_ctx`` as a ``nullcontext`` (what TRL's
    helper returns without DeepSpeed ZeRO-3) in ``sys.modules`` inside the block, unless the real
    module imports (TRL's trainer stack, ``datasets`` included, is installed); removed after (see
    the module docstring)."""
    if TRL_GATHER_MODULE not in sys.modules and real_trl_gather_importable():
        importlib.import_module(TRL_GATHER_MODULE)
    if TRL_GATHER_MODULE in sys.modules:
        yield
        return
    stand_in = types.ModuleType(TRL_GATHER_MODULE)
    stand_in.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()  # type: ignore[attr-defined]
    sys.modules[TRL_GATHER_MODULE] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(TRL_GATHER_MODULE) is stand_in:
            del sys.modules[TRL_GATHER_MODULE]


def trl_logprobs(fn: Any, inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's head in ``add_fused_lm_head``'s call pattern (the module docstring): ``(logp, entropy)``
    ``[B, T]``, 0 at padding."""
    mask = inp["mask"]
    out = fn.apply(hidden(inp)[mask], inp["weight"], None, inp["ids"][mask], TEMPERATURE, TRL_CHUNK_SIZE,
                   None, 1.0, TRL_OUTPUTS)  # fmt: skip
    return tuple(x.new_zeros(mask.shape).masked_scatter(mask, x) for x in out[:2])


def trl_call(fn: Any, kind: Kind, spec: LossSpec | None, inputs: list[dict]) -> Call:
    """TRL's head (losses: then the plain RL algebra), forward and backward inside the stand-in."""
    if kind.loss:

        def fwd(inp: dict) -> torch.Tensor:
            return loss_from_logp(trl_logprobs(fn, inp)[0], inp, spec)

    else:

        def fwd(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
            return trl_logprobs(fn, inp)

    inner = bind(kind, inputs, fwd)

    def call(i: int) -> CallResult:
        with _trl_gather_stand_in():
            return inner(i)

    return call


def trl_note(kind: Kind) -> str:
    stand_in = f"; {TRL_GATHER_MODULE} stood in (no ZeRO-3 gather)"
    stand_in = "" if real_trl_gather_importable() else stand_in
    loss = ", then the plain RL algebra" if kind.loss else ""
    return (
        f"{TRL_CLASS}.apply(hidden[mask], W, None, ids[mask], T, chunk_size={TRL_CHUNK_SIZE}, "
        f"outputs={TRL_OUTPUTS}), masked_scatter{loss}{stand_in}"
    )


# --------------------------------------------------------------------------------------------- Liger
def liger_call(kind: Kind, spec: LossSpec, inputs: list[dict]) -> Call | Skip:
    """``LigerFusedLinearGRPOLoss`` configured like ``spec`` (bound by parameter name; Skip if this
    version lacks one or Liger is absent)."""
    mod, why = optional_import("liger_kernel.chunked_loss")
    if mod is None:
        return Skip(why)
    cls = mod.LigerFusedLinearGRPOLoss
    init = {
        "beta": spec.kl_coef,
        "use_ref_model": True,
        "epsilon_low": spec.clip_low,
        "epsilon_high": spec.clip_high,
        "loss_type": "dapo",
        "temperature": TEMPERATURE,
        "importance_sampling_level": "token",
    }
    params = set(inspect.signature(cls.__init__).parameters)
    missing = sorted(k for k in ("beta", "epsilon_low", "epsilon_high", "loss_type", "temperature")
                     if k not in params)  # fmt: skip
    if missing:
        return Skip(f"this liger-kernel's LigerFusedLinearGRPOLoss has no parameter(s) {missing}")
    module = cls(**{k: v for k, v in init.items() if k in params})
    need = {"_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages"}
    have = set(inspect.signature(module.forward).parameters)
    if not need <= have:
        return Skip(f"LigerFusedLinearGRPOLoss.forward lacks {sorted(need - have)}")

    def fwd(inp: dict) -> torch.Tensor:
        out = module(
            _input=hidden(inp),
            lin_weight=inp["weight"],
            selected_token_ids=inp["ids"],
            attention_mask=inp["mask"].to(torch.int64),
            advantages=inp["adv_seq"],
            ref_per_token_logps=inp["ref_logp"],
            old_per_token_logps=inp["old_logp"],
        )
        return out[0] if isinstance(out, tuple) else out

    return bind(kind, inputs, fwd)


# ------------------------------------------------------------------------------------ the GEMM floor
def gemm_call(kind: Kind, inputs: list[dict], seed: int) -> Call:
    """The workload's :attr:`Kind.n_gemms` cuBLAS GEMMs over its scored rows: logits ``[A,H]·[H,V]``
    (twice for the primitive), dhidden ``[A,V]·[V,H]``, dweight ``[V,A]·[A,H]`` (not frozen). The
    packed ``[A, H]`` rows and a random bf16 ``[A, V]`` standing in for the gradient are made on the
    first call (after the other rows' cross-checks, which run first) and kept: like the inputs,
    they are not counted in this row's peak memory."""

    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        w = inp["weight"].detach()
        if "gemm_rows" not in inp:
            rows = hidden(inp).detach()[inp["mask"]]  # [A, H], contiguous
            gen = torch.Generator(device=rows.device).manual_seed(seed)
            inp["gemm_rows"] = rows
            inp["gemm_grad"] = torch.randn(rows.shape[0], w.shape[0], device=rows.device, generator=gen,
                                           dtype=rows.dtype)  # fmt: skip
        h, gz = inp["gemm_rows"], inp["gemm_grad"]
        for _ in range(2 if not kind.loss else 1):
            z = h @ w.t()
            del z
        dh = gz @ w
        dw = None if kind.frozen_weight else gz.t() @ h
        del dh, dw
        return CallResult(())

    return call


# --------------------------------------------------------------------------------- the fp32 reference
@contextlib.contextmanager
def _true_fp32() -> Iterator[None]:
    """fp32 GEMMs without TF32 inside the block (the flag restored after)."""
    flags = torch.backends.cuda.matmul
    saved = flags.allow_tf32
    flags.allow_tf32 = False
    try:
        yield
    finally:
        flags.allow_tf32 = saved


def reference_call(kind: Kind, spec: LossSpec | None, inputs: list[dict]) -> Call:
    """The untimed fp32 oracle (module docstring): the same values and gradients as every row."""
    from rlkernel.reference import logprobs as ref

    def fwd(inp: dict):
        v = inp["weight"].shape[0]
        out = ref.linear_token_logprobs(
            hidden(inp), inp["weight"], inp["ids_ignore"], temperature=TEMPERATURE,
            return_entropy=not kind.loss, chunk_rows=max(1, REFERENCE_CHUNK_BYTES // (4 * v)),
        )  # fmt: skip
        return loss_from_logp(out, inp, spec) if kind.loss else out

    inner = bind(kind, inputs, fwd)

    def call(i: int) -> CallResult:
        with _true_fp32():
            return inner(i)

    return call
