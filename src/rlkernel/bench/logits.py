"""Benchmark suite ``logits``: log-probs, entropy and RL losses from bf16 logits ``[N, V]``.

Workloads (N tokens, V vocabulary; defaults N ∈ {4096, 8192, 16384}, V ∈ {32768, 151936}):

    logprobs_fwd               token_logprobs forward                           (no grad)
    logprobs_entropy_fwd       token_logprobs + entropy forward                 (no grad)
    logprobs_fwd_bwd           token_logprobs forward + backward to the logits
    logprobs_entropy_fwd_bwd   token_logprobs + entropy forward + backward
    dapo_kl_fwd_bwd            DAPO loss with a k3 KL term (kl_coef = 1e-3), forward + backward
    gspo_fwd_bwd               GSPO loss (sequence-level ratio), forward + backward

Implementations (each timed on the same inputs in one process):

    rlkernel       ``rlkernel.token_logprobs`` / ``rlkernel.fused_policy_loss(PolicyLossConfig.preset(...))``.
                   The loss rows call ``fused_policy_loss(..., validate=False)``: Liger (and the plain
                   baselines) check no token id either, and the default id check costs one host sync
                   per call, which stops the CPU from queuing the next call (measured on an H100:
                   2.82 ms/call without, 4.21 ms/call with it, back to back, before the token-level
                   fusion). The opt-in ``rlkernel_validate`` row times the default. DAPO takes the fused
                   token-level path (one launch of loss algebra each way); GSPO the composed one.
    torch          plain PyTorch: ``log_softmax(logits.float() / T).gather(...)``, entropy from the same
                   log-softmax, the RL algebra written out (``plain_policy_loss``)
    torch.compile  the same plain function, ``torch.compile(dynamic=False)``, compiled on the first
                   (untimed) call of each workload, after ``torch._dynamo.reset()``
    liger          Liger-Kernel where it has the op: ``GrpoLossFunction`` for DAPO (``loss_type="dapo"``,
                   token-level ratio) and GSPO (``loss_type="grpo"``, ``importance_sampling_level=
                   "sequence"``); ``fused_selective_log_softmax`` (forward only, no grad) for
                   ``logprobs_fwd``. Liger takes causal-LM logits ``[B, T+1, V]`` and drops the last
                   position itself, so it gets its own contiguous ``[B, T+1, V]`` copy whose first T
                   positions equal everyone else's logits; ``inplace=False`` (the gradient is a new
                   tensor, as for the others) and advantages ``[B]``. Liger has no dual clip (rlkernel's
                   DAPO preset has c = 10) and no k3 clamps; neither binds on these inputs (|log r| is
                   ~0.1), which the cross-check columns confirm.

Opt-in variants (``--impl``; not in the default run or the README table): rlkernel's own call with
one switch changed, timed next to the default ``rlkernel`` row to show what the switch costs.

    rlkernel_inplace   ``inplace_backward=True`` (fwd+bwd workloads): the gradient is written into
                       the logits' storage, so the peak-memory column shows the saving. The inputs are
                       overwritten by their gradient on every call (same work), so the row has no
                       cross-check; ``tests/gpu/test_logprobs.py`` checks it bitwise instead.
    rlkernel_validate  (losses) ``validate=True``, the default id check: one host sync per call.
    rlkernel_composed  (DAPO) ``rk.use_options(token_level_fusion=False)``: log-prob primitive +
                       ``policy_loss`` under autograd, ~100 small launches of loss algebra.
    rlkernel_2pass     (DAPO) ``grad_in_forward_max_vocab`` above V: the gradient written during the
    rlkernel_3pass     forward (2 passes over the logits), or 0: the 3-pass path. The default takes the
                       2-pass path for V <= 65,536 only.

The loss objectives are rlkernel's presets (``dapo`` with ``kl_coef=1e-3, kl_estimator="k3"``, ``gspo``);
the plain baseline reads its clip bounds, KL coefficient, dual clip and aggregation from the same
config object (:func:`spec_from_config`), and the tests check it against ``rlkernel.policy_loss``.

Layout: the objectives (temperature, loss presets) and the implementations other than rlkernel's
(the plain-PyTorch baseline, the Liger-Kernel adapters) live in :mod:`rlkernel.bench._logits_baselines`
and are importable from here too; this module holds the workloads, the inputs, the byte model and
the binding of each implementation to its inputs.

Inputs: bf16 logits ``2·randn`` (never zeros), uniform random token ids; the losses see ``[B, T]``
sequences of T = 1024 tokens (B = N / 1024) with ~10 % right padding in the mask (lengths uniform
in [0.8 T, T]), per-sequence advantages ``randn`` broadcast to tokens, and old/ref log-probs equal
to the true log-probs plus 0.1·randn (a few % of the tokens clip at DAPO's 0.2/0.28). Temperature
0.9 (not 1, so every implementation's temperature path is exercised and cross-checked).

Bytes the math must move (E = 2 bytes per bf16 logit; the per-token terms are < 0.02 % of the total):

    fwd        N·V·E                 read the logits once
               + N·(8 + 4·k)         ids in, k = 1 (logp) or 2 (+ entropy) fp32 outputs out
    fwd+bwd    3·N·V·E               read the logits in forward; read them again and write the
                                     bf16 gradient in backward
               + 2·N·(8 + 4·k)       (log-probs: ids and outputs / upstream gradients)
               + 2·N·(8+4+4+4+1)     (DAPO: ids, old_logp, ref_logp, advantages, mask, read twice)
               + 2·N·(8+4+4+1)       (GSPO: the same without ref_logp)

The ``ceiling`` row is that many bytes at the device-to-device copy bandwidth measured in the same
run. A kernel that computes the gradient during the forward pass (possible when the upstream
gradient of a scalar loss is known) needs only 2 passes, so a fraction of the copy ceiling above
1.0 would be legitimate for the loss workloads; the 3-pass model is the one an autograd op with a
separate backward cannot beat.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.bench._logits_baselines import (  # noqa: F401 - some only re-exported
    KL_COEF,
    LIGER_TENSOR_ARGS,
    LOSSES,
    TEMPERATURE,
    LossSpec,
    _liger,
    _liger_module,
    liger_grpo_args,
    liger_loss_kwargs,
    loss_config,
    plain_policy_loss,
    resolve_loss,
    spec_from_config,
    torch_policy_loss_from_logits,
    torch_token_logprobs,
)
from rlkernel.bench.suite import (
    CallResult,
    Options,
    Prepared,
    Skip,
    Suite,
    Workload,
    select,
    select_impls,
    token_and_vocab_sizes,
)

VARIANTS = ("rlkernel_inplace", "rlkernel_validate", "rlkernel_composed", "rlkernel_2pass", "rlkernel_3pass")
IMPLS = ("rlkernel", "torch", "torch.compile", "liger", *VARIANTS)
# The variants' keyword arguments of the rlkernel call and their rk.use_options switches.
VARIANT_CALLS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "rlkernel_inplace": ({"inplace_backward": True}, {}),
    "rlkernel_validate": ({"validate": True}, {}),
    "rlkernel_composed": ({}, {"token_level_fusion": False}),
    "rlkernel_2pass": ({}, {"grad_in_forward_max_vocab": 1 << 62}),
    "rlkernel_3pass": ({}, {"grad_in_forward_max_vocab": 0}),
}
SEQ_LEN = 1024
SMOKE_SEQ_LEN = 16
LOGP_NOISE = 0.1
SEED = 1234

N_FULL, N_QUICK, N_SMOKE = (4096, 8192, 16384), (8192,), (64,)
V_FULL, V_SMOKE = (32768, 151936), (100,)


@dataclass(frozen=True)
class Kind:
    pass_: str
    entropy: bool = False
    loss: str | None = None  # a key of LOSSES


KINDS: dict[str, Kind] = {
    "logprobs_fwd": Kind("fwd"),
    "logprobs_entropy_fwd": Kind("fwd", entropy=True),
    "logprobs_fwd_bwd": Kind("fwd+bwd"),
    "logprobs_entropy_fwd_bwd": Kind("fwd+bwd", entropy=True),
    "dapo_kl_fwd_bwd": Kind("fwd+bwd", loss="dapo"),
    "gspo_fwd_bwd": Kind("fwd+bwd", loss="gspo"),
}


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def _seq_len(n: int, smoke: bool) -> int:
    t = SMOKE_SEQ_LEN if smoke else SEQ_LEN
    return t if n % t == 0 else n


def _randn(shape, device, gen, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    # Drawn in the target dtype: no fp32 temporary of the size of the logits.
    return torch.randn(shape, device=device, generator=gen, dtype=dtype).mul_(scale)


@torch.no_grad()
def _true_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    flat, fids = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)
    out = torch.empty(fids.shape, device=logits.device, dtype=torch.float32)
    for s in range(0, flat.shape[0], 1024):
        out[s : s + 1024] = torch_token_logprobs(flat[s : s + 1024], fids[s : s + 1024], TEMPERATURE, False)
    return out.reshape(ids.shape)


def make_inputs(kind: Kind, n: int, v: int, device: torch.device, *, seq_len: int, seed: int) -> dict:
    """One set of inputs; loss workloads are ``[B, T]`` with B·T = n, log-prob workloads flat ``[n]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b = n // seq_len
    lead = (n,) if kind.loss is None else (b, seq_len)
    x = _randn((*lead, v), device, gen, torch.bfloat16, scale=2.0)
    ids = torch.randint(0, v, lead, device=device, generator=gen)
    inp: dict[str, Any] = {"logits": x, "ids": ids, "b": b, "t": seq_len}
    if kind.loss is None:
        if kind.pass_ == "fwd+bwd":
            inp["grad_out"] = tuple(_randn((n,), device, gen) for _ in range(1 + kind.entropy))
        return inp
    lengths = torch.randint(int(math.ceil(0.8 * seq_len)), seq_len + 1, (b,), device=device, generator=gen)
    inp["mask"] = torch.arange(seq_len, device=device)[None, :] < lengths[:, None]
    true = _true_logp(x, ids)
    inp["old_logp"] = true + _randn(lead, device, gen, scale=LOGP_NOISE)
    inp["ref_logp"] = true + _randn(lead, device, gen, scale=LOGP_NOISE)
    inp["adv_seq"] = _randn((b,), device, gen)
    inp["advantages"] = inp["adv_seq"][:, None].expand(b, seq_len).contiguous()
    return inp


def _liger_logits(x: torch.Tensor, b: int, t: int, gen_seed: int) -> torch.Tensor:
    """``[B, T+1, V]`` contiguous, first T positions = ``x`` (viewed as ``[B, T, V]``), last random."""
    v = x.shape[-1]
    ext = torch.empty(b, t + 1, v, device=x.device, dtype=x.dtype)
    ext[:, :t].copy_(x.reshape(b, t, v))
    gen = torch.Generator(device=x.device).manual_seed(gen_seed)
    ext[:, t].copy_(_randn((b, v), x.device, gen, x.dtype, scale=2.0))
    return ext


def bytes_moved(kind: Kind, n: int, v: int) -> int:
    """The minimal traffic of one call, as documented in the module docstring."""
    logits = n * v * 2
    if kind.loss is None:
        per_tok = 8 + 4 * (1 + kind.entropy)
        return logits + n * per_tok if kind.pass_ == "fwd" else 3 * logits + 2 * n * per_tok
    per_tok = 8 + 4 + 4 + 1 + (4 if LOSSES[kind.loss][1].get("kl_coef") else 0)
    return 3 * logits + 2 * n * per_tok


# --------------------------------------------------------------------------------------------------
# Binding implementations to inputs
# --------------------------------------------------------------------------------------------------


def _logprob_calls(kind: Kind, inputs: list[dict], impls: tuple[str, ...], opts: Options, notes: dict):
    import rlkernel as rk

    ent, device = kind.entropy, opts.device
    fns: dict[str, Callable | Skip] = {}
    if "rlkernel" in impls:
        fns["rlkernel"] = lambda x, ids: rk.token_logprobs(
            x, ids, temperature=TEMPERATURE, return_entropy=ent
        )
    plain = functools.partial(torch_token_logprobs, temperature=TEMPERATURE, entropy=ent)
    if "torch" in impls:
        fns["torch"] = plain
    if "torch.compile" in impls:
        torch._dynamo.reset()
        fns["torch.compile"] = torch.compile(plain, dynamic=False, backend=opts.compile_backend)
        notes["torch.compile"] = f"backend={opts.compile_backend}, dynamic=False"
    calls: dict[str, Any] = {}
    for impl, fn in fns.items():
        if kind.pass_ == "fwd":
            calls[impl] = _fwd_call(fn, inputs, ent)
        else:
            calls[impl] = _fwd_bwd_call(fn, inputs, ent)
    if "rlkernel_inplace" in impls:
        _own_logits(inputs)
        calls["rlkernel_inplace"] = _inplace_call(
            lambda x, ids: rk.token_logprobs(
                x, ids, temperature=TEMPERATURE, return_entropy=ent, inplace_backward=True
            ),
            inputs,
            ent,
        )
        notes["rlkernel_inplace"] = INPLACE_NOTE
    if "liger" in impls:
        mod, why = _liger(device)
        if mod is None:
            calls["liger"] = Skip(why)
        else:
            for inp in inputs:
                inp["liger_logits"] = _liger_logits(inp["logits"], inp["b"], inp["t"], SEED + 7)
                inp["liger_ids"] = inp["ids"].reshape(inp["b"], inp["t"])

            def liger_fwd(i: int) -> CallResult:
                inp = inputs[i % len(inputs)]
                out = mod.fused_selective_log_softmax(inp["liger_logits"], inp["liger_ids"], TEMPERATURE)
                return CallResult((out.reshape(-1),))

            calls["liger"] = liger_fwd
            notes["liger"] = "fused_selective_log_softmax on [B, T+1, V] (forward only, no grad)"
    return calls


def _fwd_call(fn: Callable, inputs: list[dict], ent: bool) -> Callable[[int], CallResult]:
    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        with torch.no_grad():
            out = fn(inp["logits"], inp["ids"])
        return CallResult(tuple(out) if ent else (out,))

    return call


def _fwd_bwd_call(fn: Callable, inputs: list[dict], ent: bool) -> Callable[[int], CallResult]:
    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        out = fn(inp["logits"], inp["ids"])
        outs = tuple(out) if ent else (out,)
        (grad,) = torch.autograd.grad(outs, (inp["logits"],), inp["grad_out"])
        return CallResult(tuple(o.detach() for o in outs), (grad,))

    return call


INPLACE_NOTE = "inplace_backward=True on its own copy of the logits, overwritten each call: not cross-checked"


def _own_logits(inputs: list[dict]) -> None:
    """A private copy of each input set's logits for the in-place variant (it overwrites them)."""
    for inp in inputs:
        inp["logits_inplace"] = inp["logits"].detach().clone().requires_grad_(True)


def _inplace_call(fn: Callable, inputs: list[dict], ent: bool) -> Callable[[int], CallResult]:
    """fwd+bwd with ``inplace_backward=True`` on the private logits; nothing to cross-check."""

    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        out = fn(inp["logits_inplace"], inp["ids"])
        outs = tuple(out) if ent else (out,)
        torch.autograd.grad(outs, (inp["logits_inplace"],), inp["grad_out"])
        return CallResult(())

    return call


def _loss_calls(kind: Kind, inputs: list[dict], impls: tuple[str, ...], opts: Options, notes: dict):
    cfg, spec = resolve_loss(kind.loss)
    use_ref = bool(spec.kl_coef)
    calls: dict[str, Any] = {}

    def bind(loss_fn: Callable, logits_key: str = "logits", grad_view: Callable | None = None, check=True):
        def call(i: int) -> CallResult:
            inp = inputs[i % len(inputs)]
            loss = loss_fn(inp)
            (grad,) = torch.autograd.grad(loss, (inp[logits_key],))
            if not check:
                return CallResult(())
            return CallResult((loss.detach(),), (grad_view(grad, inp) if grad_view else grad,))

        return call

    import rlkernel as rk

    def rk_loss(logits_key: str = "logits", options: dict | None = None, **kwargs):
        def loss(inp):
            with rk.use_options(**(options or {})):
                return rk.fused_policy_loss(
                    cfg,
                    token_ids=inp["ids"],
                    old_logp=inp["old_logp"],
                    advantages=inp["advantages"],
                    mask=inp["mask"],
                    logits=inp[logits_key],
                    temperature=TEMPERATURE,
                    ref_logp=inp["ref_logp"] if use_ref else None,
                    **{"validate": False, **kwargs},  # as Liger: no id check (see the module docstring)
                ).loss

        return loss

    what = f"fused_policy_loss(PolicyLossConfig.preset({LOSSES[kind.loss][0]!r}, ...))"
    if "rlkernel" in impls:
        calls["rlkernel"] = bind(rk_loss())
        notes["rlkernel"] = what
    for impl in (i for i in VARIANTS if i in impls):
        kwargs, options = VARIANT_CALLS[impl]
        if impl == "rlkernel_inplace":
            _own_logits(inputs)
            calls[impl] = bind(rk_loss("logits_inplace", options, **kwargs), "logits_inplace", check=False)
            notes[impl] = INPLACE_NOTE
        else:
            calls[impl] = bind(rk_loss("logits", options, **kwargs))
            notes[impl] = f"{what}, " + ", ".join(
                [f"{k}={v!r}" for k, v in kwargs.items()] + [f"options {k}={v!r}" for k, v in options.items()]
            )

    def plain(x, ids, old, ref, adv, mask):
        return torch_policy_loss_from_logits(x, ids, old, ref, adv, mask, spec, TEMPERATURE)

    def args(inp):
        return (
            inp["ids"],
            inp["old_logp"],
            inp["ref_logp"] if use_ref else None,
            inp["advantages"],
            inp["mask"],
        )

    if "torch" in impls:
        calls["torch"] = bind(lambda inp: plain(inp["logits"], *args(inp)))
    if "torch.compile" in impls:
        torch._dynamo.reset()
        compiled = torch.compile(plain, dynamic=False, backend=opts.compile_backend)
        calls["torch.compile"] = bind(lambda inp: compiled(inp["logits"], *args(inp)))
        notes["torch.compile"] = f"backend={opts.compile_backend}, dynamic=False"
    if "liger" in impls:
        mod, why = _liger(opts.device)
        try:
            liger_kwargs = liger_loss_kwargs(spec)
            if mod is not None:  # fail here, not in every call, if this Liger lacks a parameter
                liger_grpo_args(mod.GrpoLossFunction, **dict.fromkeys(LIGER_TENSOR_ARGS), **liger_kwargs)
        except ValueError as exc:
            mod, why = None, str(exc)
        if mod is None:
            calls["liger"] = Skip(why)
        else:
            for inp in inputs:
                ext = _liger_logits(inp["logits"].detach(), inp["b"], inp["t"], SEED + 7).requires_grad_(True)
                inp["liger_logits"] = ext
                inp["liger_args"] = liger_grpo_args(
                    mod.GrpoLossFunction,
                    logits=ext,
                    old_logp=inp["old_logp"],
                    ref_logp=inp["ref_logp"] if use_ref else None,
                    completion_ids=inp["ids"],
                    advantages=inp["adv_seq"],
                    completion_mask=inp["mask"].to(torch.int32),
                    **liger_kwargs,
                )

            def liger_loss(inp):
                return mod.GrpoLossFunction.apply(*inp["liger_args"])[0]  # (loss, kl_mean, clip_ratio)

            calls["liger"] = bind(liger_loss, "liger_logits", lambda g, inp: g[:, : inp["t"]])
            kw = liger_kwargs
            notes["liger"] = (
                f"GrpoLossFunction loss_type={kw['loss_type']} importance_sampling_level="
                f"{kw['importance_sampling_level']} beta={kw['beta']:g} on [B, T+1, V], inplace=False"
                + (f"; no dual clip (c={spec.dual_clip:g} binds only where r > c)" if spec.dual_clip else "")
            )
    return calls


def _setup(kind: Kind, n: int, v: int, opts: Options):
    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        seq_len = _seq_len(n, opts.smoke)
        inputs = [make_inputs(kind, n, v, device, seq_len=seq_len, seed=SEED + c) for c in range(copies)]
        if kind.pass_ == "fwd+bwd":
            for inp in inputs:
                inp["logits"].requires_grad_(True)
        notes: dict[str, str] = {}
        build = _logprob_calls if kind.loss is None else _loss_calls
        calls = build(kind, inputs, impls, opts, notes)
        if "rlkernel" in calls:
            from rlkernel._dispatch import requested_backend

            what = notes.get("rlkernel", "token_logprobs")
            check = "validate=True (one host sync)" if kind.loss is None else "validate=False (as Liger)"
            notes["rlkernel"] = f"{what}; {check}; backend={requested_backend()}"
        return Prepared(calls=calls, notes=notes)

    return setup


def _impls_for(kind_name: str) -> tuple[str, ...]:
    if kind_name == "logprobs_fwd":
        return ("rlkernel", "torch", "torch.compile", "liger")
    if kind_name.startswith("logprobs"):
        return ("rlkernel", "torch", "torch.compile", "rlkernel_inplace")
    if kind_name == "gspo_fwd_bwd":  # not eligible for the token-level paths: no fusion switches
        return ("rlkernel", "torch", "torch.compile", "liger", "rlkernel_inplace", "rlkernel_validate")
    return IMPLS


def build(opts: Options) -> list[Workload]:
    """The workloads selected by ``opts`` (kind × N × V), each with its implementations."""
    kinds = select(opts.workloads, tuple(KINDS), "workload", "logits")
    impls = select_impls(opts.impls, IMPLS, VARIANTS, "logits")
    ns, vs = token_and_vocab_sizes(
        opts, full=N_FULL, quick=N_QUICK, smoke=N_SMOKE, vocab_full=V_FULL, vocab_smoke=V_SMOKE
    )
    out = []
    for name in kinds:
        kind = KINDS[name]
        chosen = tuple(i for i in _impls_for(name) if i in impls)
        if not chosen:
            continue
        for n in ns:
            for v in vs:
                out.append(
                    Workload(
                        name=name,
                        pass_=kind.pass_,
                        params={"n_tokens": n, "vocab": v},
                        bytes_moved=bytes_moved(kind, n, v),
                        flops=None,
                        input_bytes=n * v * 2,
                        impls=chosen,
                        reference="torch" if "torch" in chosen else None,
                        setup=_setup(kind, n, v, opts),
                    )
                )
    return out


SUITE = Suite(
    name="logits",
    description="log-probs, entropy, DAPO and GSPO losses from bf16 logits [N, V]",
    impls=IMPLS,
    kinds=tuple(KINDS),
    param_columns=("n_tokens", "vocab"),
    baseline="torch",
    build=build,
    variants=VARIANTS,
    bytes_doc=(
        "fwd: N*V*2 + N*(8+4k); fwd+bwd: 3*N*V*2 (read logits in fwd, read logits + write bf16 grad in "
        "bwd) + per-token tensors twice; ceiling = bytes / measured copy bandwidth"
    ),
)
