"""Benchmark suite ``logits``: log-probs, entropy and RL losses from bf16 logits.

The run leads with the users' call pattern (``sliced_*``): the logits are ``out[:, P-1:-1]`` of a
model output ``[B, P+T, V]`` that requires grad, response lengths are ragged (uniform in
``[T/4, T]``), every call uses default arguments. The contiguous workloads are the second view:
a fresh ``[N, V]`` / ``[B, T, V]`` leaf, as in the suite's first runs. Inputs and the byte model:
:mod:`rlkernel.bench._logits_inputs`. Defaults: N = 8192 scored tokens (B = 8 sequences of T = 1024,
P = 128 prompt positions), V ∈ {32768, 151936}; ``--n 4096,8192,16384`` gives the former grid.

Workloads:

    sliced_dapo_kl_fwd_bwd           DAPO loss + k3 KL term (kl_coef = 1e-3), forward + backward to
                                     the model output
    sliced_gspo_fwd_bwd              GSPO loss (sequence-level ratio), forward + backward
    sliced_logprobs_entropy_fwd_bwd  token log-probs + entropy, forward + backward (upstream
                                     gradients 0 beyond each length)
    sliced_logprobs_entropy_fwd      the same forward alone (no grad: old / reference log-probs)
    logprobs_fwd, logprobs_entropy_fwd, logprobs_fwd_bwd, logprobs_entropy_fwd_bwd,
    dapo_kl_fwd_bwd, gspo_fwd_bwd    the contiguous view of the same objectives

Timing: every workload is timed as isolated calls (``median_ms``) and back to back (``b2b_ms``:
20 calls, one sync, per-call wall time; see :mod:`rlkernel.bench.harness`).

Implementations (each timed on the same inputs in one process):

    rlkernel       ``rlkernel.token_logprobs`` / ``rlkernel.fused_policy_loss(PolicyLossConfig.preset(
                   ...))`` with default arguments (``validate=True``, ``inplace_backward=False``), the
                   sliced logits passed as the view (sliced inside the timed call, as a trainer does
                   every step). Sliced log-prob rows: ids equal to ``ignore_index`` beyond each
                   length (rlkernel's way to say padding).
    torch          plain PyTorch: ``log_softmax(logits.float() / T).gather(...)``, entropy from the same
                   log-softmax, the RL algebra written out (``plain_policy_loss``); sliced: the slice
                   and (log-prob rows) the masking of the outputs inside the same function
    torch.compile  that same plain function, ``torch.compile(dynamic=False)``, compiled on the first
                   (untimed) call of each workload, after ``torch._dynamo.reset()``; sliced: it takes
                   the model output and slices inside, so the compiler sees the slice's backward too
    liger          Liger-Kernel 0.8.5 where it has the op: ``GrpoLossFunction`` for DAPO
                   (``loss_type="dapo"``, token-level ratio) and GSPO (``loss_type="grpo"``,
                   ``importance_sampling_level="sequence"``); ``fused_selective_log_softmax`` (forward
                   only, no grad) for ``logprobs_fwd``. It takes contiguous causal-LM logits
                   ``[B, L+1, V]`` and drops the last position itself. Sliced: the whole model output
                   ``[B, P+T, V]`` (no copy; ``out[:, P-1:]`` is not contiguous), its ids / old / ref /
                   mask ``[B, P+T-1]`` with the P-1 prompt positions masked out (its kernels skip
                   masked rows and write them zero gradients). Contiguous: its own ``[B, T+1, V]``
                   copy whose first T positions are everyone else's logits. ``inplace=False`` (the
                   gradient is a new tensor, as for the others), advantages ``[B]``. Liger has no
                   dual clip (rlkernel's DAPO preset has c = 10) and no k3 clamps; neither binds on
                   these inputs (|log r| is ~0.1), which the cross-check columns confirm.
    trl            TRL 1.16's ``trl.kernels.selective_log_softmax_and_entropy`` on the log-prob
                   workloads (it always computes both; the log-prob-only rows drop the entropy, as
                   TRL's ``selective_log_softmax`` does). Sliced: the view and ``row_mask=mask``
                   (masked rows skipped). Skipped, with the reason, where ``trl.kernels`` does not
                   import.

Opt-in variants (``--impl``; not in the default run or the README table): rlkernel's own call with
one switch changed, timed next to the default ``rlkernel`` row to show what the switch costs.

    rlkernel_inplace     ``inplace_backward=True`` (fwd+bwd workloads): the gradient is written into
                         the logits' (sliced: the model output's) storage, so the peak-memory column
                         shows the saving. The inputs are overwritten by their gradient on every call
                         (same work), so the row has no cross-check; ``tests/gpu/test_logprobs.py``
                         checks it bitwise instead.
    rlkernel_novalidate  (losses) ``validate=False``: no id-range check (Liger checks none either).
    rlkernel_composed    (DAPO) ``rk.use_options(token_level_fusion=False)``: log-prob primitive +
                         ``policy_loss`` under autograd, ~100 small launches of loss algebra.
    rlkernel_2pass       (DAPO) ``grad_in_forward_max_vocab`` above V: the gradient written during the
    rlkernel_3pass       forward (2 passes over the logits), or 0: the 3-pass path. The default takes
                         the 2-pass path for V <= 65,536 only.

The loss objectives are rlkernel's presets (``dapo`` with ``kl_coef=1e-3, kl_estimator="k3"``, ``gspo``);
the plain baseline reads its clip bounds, KL coefficient, dual clip and aggregation from the same
config object (:func:`spec_from_config`), and the tests check it against ``rlkernel.policy_loss``.
Temperature 0.9 (not 1, so every implementation's temperature path is exercised and cross-checked).

Layout: the objectives and the implementations other than rlkernel's live in
:mod:`rlkernel.bench._logits_baselines`, the inputs and byte model in
:mod:`rlkernel.bench._logits_inputs` (both re-exported here), Liger's binding to the inputs in
:mod:`rlkernel.bench._logits_liger`; this module binds the other implementations to their inputs
and builds the workloads.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from rlkernel.bench._logits_baselines import (  # noqa: F401 - some only re-exported
    KL_COEF,
    LIGER_TENSOR_ARGS,
    LOSSES,
    TEMPERATURE,
    TRL_FUNCTION,
    TRL_MODULE,
    LossSpec,
    _liger,
    _liger_module,
    _trl,
    liger_grpo_args,
    liger_loss_kwargs,
    loss_config,
    plain_policy_loss,
    resolve_loss,
    spec_from_config,
    torch_policy_loss_from_logits,
    torch_token_logprobs,
)
from rlkernel.bench._logits_inputs import (  # noqa: F401 - some only re-exported (linear.py, tests)
    IGNORE_INDEX,
    KINDS,
    LOGP_NOISE,
    PROMPT_LEN,
    SEED,
    SEQ_LEN,
    SMOKE_PROMPT_LEN,
    SMOKE_SEQ_LEN,
    Geometry,
    Kind,
    _randn,
    _seq_len,
    _true_logp,
    active_tokens,
    bytes_moved,
    geometry,
    liger_logits,
    make_inputs,
    make_sliced_inputs,
    prompt_extended,
    ragged_lengths,
    window,
)
from rlkernel.bench._logits_liger import liger_logprob_call, liger_loss_call
from rlkernel.bench.suite import (
    Call,
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

VARIANTS = (
    "rlkernel_inplace",
    "rlkernel_novalidate",
    "rlkernel_composed",
    "rlkernel_2pass",
    "rlkernel_3pass",
)
IMPLS = ("rlkernel", "torch", "torch.compile", "liger", "trl", *VARIANTS)
# The variants' keyword arguments of the rlkernel call and their rk.use_options switches.
VARIANT_CALLS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "rlkernel_inplace": ({"inplace_backward": True}, {}),
    "rlkernel_novalidate": ({"validate": False}, {}),
    "rlkernel_composed": ({}, {"token_level_fusion": False}),
    "rlkernel_2pass": ({}, {"grad_in_forward_max_vocab": 1 << 62}),
    "rlkernel_3pass": ({}, {"grad_in_forward_max_vocab": 0}),
}

N_FULL, N_QUICK, N_SMOKE = (8192,), (8192,), (64,)
V_FULL, V_SMOKE = (32768, 151936), (100,)

INPLACE_NOTE = "inplace_backward=True on its own copy of the inputs, overwritten each call: not cross-checked"
_SLICE_INSIDE = {False: "", True: ", the slice inside"}


# --------------------------------------------------------------------------------------------------
# What each call reads from an input set
# --------------------------------------------------------------------------------------------------


def _target(inp: dict, own: bool = False) -> torch.Tensor:
    """The tensor the gradient is taken against: the model output (sliced) or the logits leaf;
    ``own``: the in-place variant's private copy."""
    key = "base" if "base" in inp else "logits"
    return inp["own_" + key if own else key]


def _logits(inp: dict, own: bool = False) -> torch.Tensor:
    """The logits as the caller passes them; sliced: the view, taken inside the timed call as a
    trainer takes it every step."""
    x = _target(inp, own)
    return window(x, inp["p"]) if "base" in inp else x


def _own_copies(inputs: list[dict]) -> None:
    """A private copy of each input set's logits (sliced: model output) for the in-place variant."""
    for inp in inputs:
        key = "base" if "base" in inp else "logits"
        inp["own_" + key] = inp[key].detach().clone().requires_grad_(True)


def _fwd_call(fn: Callable[[dict], Any], inputs: list[dict], ent: bool) -> Call:
    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        with torch.no_grad():
            out = fn(inp)
        return CallResult(tuple(out) if ent else (out,))

    return call


def _fwd_bwd_call(fn: Callable[[dict], Any], inputs: list[dict], ent: bool, *, own: bool = False) -> Call:
    """Forward + backward with the input set's upstream gradients; ``own``: the in-place variant
    (on its private copy; nothing to cross-check)."""

    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        out = fn(inp)
        outs = tuple(out) if ent else (out,)
        (grad,) = torch.autograd.grad(outs, (_target(inp, own),), inp["grad_out"])
        if own:
            return CallResult(())
        return CallResult(tuple(o.detach() for o in outs), (grad,))

    return call


# --------------------------------------------------------------------------------------------------
# Log-prob workloads
# --------------------------------------------------------------------------------------------------


def _plain_logprobs(kind: Kind, p: int | None) -> Callable:
    """The plain function: contiguous ``(logits, ids)``; sliced ``(out, ids, mask)`` with the slice
    and the masking of the outputs (what a trainer does before its loss) inside."""
    ent = kind.entropy
    if p is None:
        return functools.partial(torch_token_logprobs, temperature=TEMPERATURE, entropy=ent)

    def sliced(base: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
        out = torch_token_logprobs(window(base, p), ids, TEMPERATURE, ent)
        return tuple(o * mask for o in out) if ent else out * mask

    return sliced


def _logprob_calls(kind: Kind, inputs: list[dict], impls: tuple[str, ...], opts: Options, notes: dict):
    import rlkernel as rk

    ent, sliced, device = kind.entropy, kind.sliced, opts.device
    ids_key = "ids_ignore" if sliced else "ids"

    def rk_fn(own: bool = False, **kwargs):
        return lambda inp: rk.token_logprobs(
            _logits(inp, own), inp[ids_key], temperature=TEMPERATURE, return_entropy=ent, **kwargs
        )

    plain = _plain_logprobs(kind, inputs[0]["p"] if sliced else None)

    def args(inp: dict) -> tuple:
        return (inp["base"], inp["ids"], inp["mask"]) if sliced else (inp["logits"], inp["ids"])

    fns: dict[str, Callable] = {}
    calls: dict[str, Call | Skip] = {}
    if "rlkernel" in impls:
        fns["rlkernel"] = rk_fn()
        padding = f", ids = {IGNORE_INDEX} (ignore_index) beyond each length" if sliced else ""
        notes["rlkernel"] = "token_logprobs" + padding
    if "torch" in impls:
        fns["torch"] = lambda inp: plain(*args(inp))
    if "torch.compile" in impls:
        torch._dynamo.reset()
        compiled = torch.compile(plain, dynamic=False, backend=opts.compile_backend)
        fns["torch.compile"] = lambda inp: compiled(*args(inp))
        notes["torch.compile"] = f"backend={opts.compile_backend}, dynamic=False" + _SLICE_INSIDE[sliced]
    if "trl" in impls:
        trl_fn, why = _trl(device)
        if trl_fn is None:
            calls["trl"] = Skip(why)
        else:

            def trl_call(inp: dict):
                row_mask = inp.get("mask")  # sliced only: the contiguous log-prob rows have no padding
                logp, entropy = trl_fn(_logits(inp), inp["ids"], temperature=TEMPERATURE, row_mask=row_mask)
                return (logp, entropy) if ent else logp

            fns["trl"] = trl_call
            row_mask = ", row_mask=mask" if sliced else ""
            dropped = "" if ent else " (its entropy output dropped)"
            notes["trl"] = f"{TRL_MODULE}.{TRL_FUNCTION}{row_mask}{dropped}"
    for impl, fn in fns.items():
        calls[impl] = _fwd_call(fn, inputs, ent) if kind.pass_ == "fwd" else _fwd_bwd_call(fn, inputs, ent)
    if "rlkernel_inplace" in impls and kind.pass_ == "fwd+bwd":
        _own_copies(inputs)
        inplace = rk_fn(own=True, inplace_backward=True)
        calls["rlkernel_inplace"] = _fwd_bwd_call(inplace, inputs, ent, own=True)
        notes["rlkernel_inplace"] = INPLACE_NOTE
    if "liger" in impls:  # logprobs_fwd only (contiguous): Liger has no entropy and no log-prob backward
        calls["liger"] = liger_logprob_call(inputs, device, notes)
    return {i: calls[i] for i in impls if i in calls}


# --------------------------------------------------------------------------------------------------
# Loss workloads
# --------------------------------------------------------------------------------------------------


def _loss_calls(kind: Kind, inputs: list[dict], impls: tuple[str, ...], opts: Options, notes: dict):
    import rlkernel as rk

    cfg, spec = resolve_loss(kind.loss)
    use_ref, sliced = bool(spec.kl_coef), kind.sliced
    p = inputs[0]["p"] if sliced else None
    calls: dict[str, Call | Skip] = {}

    def bind(loss_fn: Callable[[dict], torch.Tensor], *, own: bool = False, target: str | None = None,
             grad_view: Callable | None = None) -> Call:  # fmt: skip
        def call(i: int) -> CallResult:
            inp = inputs[i % len(inputs)]
            loss = loss_fn(inp)
            (grad,) = torch.autograd.grad(loss, (inp[target] if target else _target(inp, own),))
            if own:
                return CallResult(())
            return CallResult((loss.detach(),), (grad_view(grad, inp) if grad_view else grad,))

        return call

    def rk_loss(own: bool = False, options: dict | None = None, **kwargs):
        def loss(inp: dict) -> torch.Tensor:
            scope = rk.use_options(**options) if options else contextlib.nullcontext()
            with scope:
                return rk.fused_policy_loss(
                    cfg,
                    token_ids=inp["ids"],
                    old_logp=inp["old_logp"],
                    advantages=inp["advantages"],
                    mask=inp["mask"],
                    logits=_logits(inp, own),
                    temperature=TEMPERATURE,
                    ref_logp=inp["ref_logp"] if use_ref else None,
                    **kwargs,
                ).loss

        return loss

    what = f"fused_policy_loss(PolicyLossConfig.preset({LOSSES[kind.loss][0]!r}, ...))"
    if "rlkernel" in impls:
        calls["rlkernel"] = bind(rk_loss())
        notes["rlkernel"] = what
    for impl in (i for i in VARIANTS if i in impls):
        kwargs, options = VARIANT_CALLS[impl]
        if impl == "rlkernel_inplace":
            _own_copies(inputs)
            calls[impl] = bind(rk_loss(True, options, **kwargs), own=True)
            notes[impl] = INPLACE_NOTE
        else:
            calls[impl] = bind(rk_loss(False, options, **kwargs))
            notes[impl] = f"{what}, " + ", ".join(
                [f"{k}={v!r}" for k, v in kwargs.items()] + [f"options {k}={v!r}" for k, v in options.items()]
            )

    def plain(x, ids, old, ref, adv, mask):
        logits = window(x, p) if sliced else x  # sliced: the model output, sliced inside
        return torch_policy_loss_from_logits(logits, ids, old, ref, adv, mask, spec, TEMPERATURE)

    def args(inp: dict) -> tuple:
        ref = inp["ref_logp"] if use_ref else None
        return (_target(inp), inp["ids"], inp["old_logp"], ref, inp["advantages"], inp["mask"])

    if "torch" in impls:
        calls["torch"] = bind(lambda inp: plain(*args(inp)))
    if "torch.compile" in impls:
        torch._dynamo.reset()
        compiled = torch.compile(plain, dynamic=False, backend=opts.compile_backend)
        calls["torch.compile"] = bind(lambda inp: compiled(*args(inp)))
        notes["torch.compile"] = f"backend={opts.compile_backend}, dynamic=False" + _SLICE_INSIDE[sliced]
    if "liger" in impls:
        calls["liger"] = liger_loss_call(kind, spec, inputs, opts.device, notes, bind)
    return {i: calls[i] for i in impls if i in calls}


# --------------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------------


def _sliced_note(kind: Kind, geo: Geometry) -> str:
    b, t, p = geo.b, geo.t, geo.p
    grad = " requiring grad" if kind.pass_ == "fwd+bwd" else ""
    return (
        f"logits = out[:, {p - 1}:-1] of out [{b}, {p + t}, V]{grad}; lengths U[{math.ceil(t / 4)}, {t}]: "
        f"{active_tokens(geo)} of {geo.n} tokens active"
    )


def _setup(kind: Kind, n: int, v: int, opts: Options):
    geo = geometry(n, opts.smoke)

    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        if kind.sliced:
            inputs = [make_sliced_inputs(kind, geo, v, device, seed=SEED + c) for c in range(copies)]
        else:
            inputs = [make_inputs(kind, n, v, device, seq_len=geo.t, seed=SEED + c) for c in range(copies)]
        if kind.pass_ == "fwd+bwd":
            for inp in inputs:
                _target(inp).requires_grad_(True)
        notes: dict[str, str] = {}
        build = _logprob_calls if kind.loss is None else _loss_calls
        calls = build(kind, inputs, impls, opts, notes)
        if "rlkernel" in calls:
            from rlkernel._dispatch import requested_backend

            notes["rlkernel"] += f", default arguments; backend={requested_backend()}"
        if kind.sliced:
            layout = _sliced_note(kind, geo)
            notes = {impl: "; ".join(x for x in (layout, notes.get(impl, "")) if x) for impl in calls}
        return Prepared(calls=calls, notes=notes)

    return setup


def _impls_for(kind: Kind, name: str) -> tuple[str, ...]:
    """The implementations that have the op, in display order (variants last)."""
    if kind.loss is None:
        liger = ("liger",) if name == "logprobs_fwd" else ()
        inplace = ("rlkernel_inplace",) if kind.pass_ == "fwd+bwd" else ()
        return ("rlkernel", "torch", "torch.compile", *liger, "trl", *inplace)
    if kind.loss == "gspo":  # not eligible for the token-level paths: no fusion switches
        return ("rlkernel", "torch", "torch.compile", "liger", "rlkernel_inplace", "rlkernel_novalidate")
    return tuple(i for i in IMPLS if i != "trl")


def build(opts: Options) -> list[Workload]:
    """The workloads selected by ``opts`` (kind × N × V), each with its implementations; the sliced
    kinds first."""
    kinds = select(opts.workloads, tuple(KINDS), "workload", "logits")
    impls = select_impls(opts.impls, IMPLS, VARIANTS, "logits")
    ns, vs = token_and_vocab_sizes(
        opts, full=N_FULL, quick=N_QUICK, smoke=N_SMOKE, vocab_full=V_FULL, vocab_smoke=V_SMOKE
    )
    out = []
    for name in kinds:
        kind = KINDS[name]
        chosen = tuple(i for i in _impls_for(kind, name) if i in impls)
        if not chosen:
            continue
        for n in ns:
            geo = geometry(n, opts.smoke)
            rows = geo.b * (geo.p + geo.t) if kind.sliced else n
            for v in vs:
                out.append(
                    Workload(
                        name=name,
                        pass_=kind.pass_,
                        params={"n_tokens": n, "vocab": v},
                        bytes_moved=bytes_moved(kind, n, v, geo),
                        flops=None,
                        input_bytes=rows * v * 2,
                        impls=chosen,
                        reference="torch" if "torch" in chosen else None,
                        setup=_setup(kind, n, v, opts),
                        back_to_back=True,
                    )
                )
    return out


SUITE = Suite(
    name="logits",
    description=(
        "log-probs, entropy, DAPO and GSPO losses from bf16 logits: sliced from a [B, P+T, V] model output "
        "with ragged lengths (headline), then contiguous"
    ),
    impls=IMPLS,
    kinds=tuple(KINDS),
    param_columns=("n_tokens", "vocab"),
    baseline="torch",
    build=build,
    variants=VARIANTS,
    bytes_doc=(
        "contiguous: fwd N*V*2 + N*(8+4k); fwd+bwd 3*N*V*2 (read logits in fwd, read logits + write bf16 "
        "grad in bwd) + per-token tensors twice. sliced (A active tokens of N, base [B, P+T, V]): fwd "
        "A*V*2 + N*(8+4k); fwd+bwd 2*A*V*2 + B*(P+T)*V*2 (write the base's whole gradient) + per-token "
        "tensors twice. ceiling = bytes / measured copy bandwidth"
    ),
)
