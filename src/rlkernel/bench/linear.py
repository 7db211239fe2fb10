"""Benchmark suite ``linear``: LM head + log-probs / DAPO loss from bf16 hidden states.

The run leads with the users' call pattern (``ragged_*``): the hidden states are the window
``base[:, P-1:-1]`` of the model's last hidden states ``[B, P+T, H]``, response lengths uniform in
``[T/4, T]`` (padding at the end of each sequence). The ``lmhead_*`` workloads are the second view:
a contiguous ``[N, H]`` leaf, no padding (losses: ~10 %). Inputs: :mod:`rlkernel.bench._linear_inputs`.
Defaults: H = 4096, V = 151,936 (Qwen3), N = B·T ∈ {8192, 65536} (T = 1024), temperature 0.9.

Workloads (forward + backward to the hidden states and, unless frozen, the weight):

    ragged_logprobs_entropy_fwd_bwd  log-probs + entropy (random upstream gradients, 0 at padding);
    lmhead_logprobs_entropy_fwd_bwd  the primitive's floor is 4 GEMMs (its backward recomputes the
                                     logits: autograd hands over the upstream gradients only then)
    ragged_dapo_kl_fwd_bwd           DAPO loss with a k3 KL term (kl_coef = 1e-3): 3 GEMMs
    lmhead_dapo_kl_fwd_bwd
    ragged_dapo_kl_frozen_fwd_bwd    the same with the weight frozen (LoRA): 2 GEMMs
    lmhead_dapo_kl_frozen_fwd_bwd

Implementations (same inputs, one process; the baselines in :mod:`rlkernel.bench._linear_baselines`):

    rlkernel                 the public API with default arguments: ``rlkernel.linear_token_logprobs(
                             hidden, W, ids, return_entropy=True)`` (ids ``ignore_index`` at padding)
                             / ``rlkernel.fused_policy_loss(cfg, hidden=..., weight=..., mask=...)``;
                             padding rows are not projected (compaction)
    rlkernel_invariant       the same with ``invariant=True``: each row's log-prob bitwise that of a
                             patched model's LM head (bf16 logits from the batch-invariant GEMM)
    rlkernel_invariant_fp32  ``invariant=True, logits_dtype=torch.float32`` (a patched LM head with
                             ``lm_head_dtype=torch.float32``)
    torch                    plain PyTorch over every row (bf16 logits, fp32 log-softmax); OOM at
                             large N (recorded as ``oom``)
    trl                      TRL 1.16's fused LM head ``trl.kernels`` ``ChunkedLogProbFunction``, as
                             its ``add_fused_lm_head`` calls it (scored rows only); losses: its
                             log-probs, then the plain RL algebra, as TRL's trainer does
    liger                    ``LigerFusedLinearGRPOLoss`` (losses; only N <= 16,384: ~0.5 s per 8k
                             tokens on an H100)
    cublas_gemms             the workload's GEMMs (4, 3 or 2) with cuBLAS over the scored rows: the
                             speed target is a ratio to this row

Opt-in variants (``--impl``; not in the default run or the README table):

    rlkernel_engine        (losses) the fused engine ``rlkernel.ops._linear_function.
                           fused_linear_token_loss`` driven directly by the token-loss plan's
                           per-chunk coefficients (what ``fused_policy_loss`` runs, minus its checks)
    rlkernel_logits_input  ``linear_logits_dtype="input"``: chunk logits in bf16 (less traffic; logp
                           off by up to ~|z|·2⁻⁹)
    rlkernel_dw_weight     ``linear_dweight_accum="weight"``: dweight accumulated in bf16 across
                           gradient groups (half the V·H accumulator; not for the frozen workloads)

Cross-check: every row against an untimed fp32 reference (``rlkernel.reference.logprobs.
linear_token_logprobs``: fp32 logits of the same bf16 operands, fp32 backward, TF32 off; losses
the plain RL algebra on its log-probs). ``max_abs_diff`` is max |Δ| over logp and entropy (losses:
|Δloss|), ``grad_rel_diff`` max |Δg| / max |g| over the hidden and weight gradients. Rows with bf16
logits (torch, Liger, ``rlkernel_invariant``) carry their rounding (|Δz| up to ~|z|·2⁻⁹).

FLOPs: ``n_gemms·2·A·H·V`` with A the scored rows (``scored_tokens``; N for the dense log-prob
kinds): ``frac_gemm`` is the fraction of the square-GEMM rate of :mod:`rlkernel.bench.ceilings`,
the ``ceiling`` row the time of those FLOPs at that rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlkernel.bench import _linear_baselines as base
from rlkernel.bench import logits as bl
from rlkernel.bench._linear_inputs import KINDS, Kind, geometry, hidden, make_inputs, scored_rows
from rlkernel.bench.suite import (
    Options,
    Prepared,
    Skip,
    Suite,
    Workload,
    select,
    select_impls,
    token_and_vocab_sizes,
)

# rlkernel's rows: (keyword arguments of the public call, rk.use_options switches).
RK_CALLS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "rlkernel": ({}, {}),
    "rlkernel_invariant": ({"invariant": True}, {}),
    "rlkernel_invariant_fp32": ({"invariant": True, "logits_dtype": torch.float32}, {}),
    "rlkernel_logits_input": ({}, {"linear_logits_dtype": "input"}),
    "rlkernel_dw_weight": ({}, {"linear_dweight_accum": "weight"}),
}
VARIANTS = ("rlkernel_engine", "rlkernel_logits_input", "rlkernel_dw_weight")
IMPLS = ("rlkernel", "rlkernel_invariant", "rlkernel_invariant_fp32", "torch", "trl", "liger", "cublas_gemms",
         *VARIANTS)  # fmt: skip
REFERENCE = "fp32_reference"  # untimed: no row (see the module docstring)
TEMPERATURE = bl.TEMPERATURE
HIDDEN = 4096
N_FULL, N_QUICK, N_SMOKE = (8192, 65536), (8192,), (64,)
V_FULL, V_SMOKE, H_SMOKE = (151936,), (100,), 16
LIGER_MAX_N = 16384
SMOKE_CHUNK_ROWS, SMOKE_GRAD_ROWS = 32, 64
SEED = 4321


def _rk_fwd(kind: Kind, cfg: Any, kwargs: dict[str, Any], options: dict[str, Any]) -> Callable[[dict], Any]:
    """rlkernel's public call with ``kwargs``, under ``rk.use_options(**options)``."""
    import rlkernel as rk

    def fwd(inp: dict):
        with rk.use_options(**options):
            if not kind.loss:
                return rk.linear_token_logprobs(
                    hidden(inp), inp["weight"], inp["ids_ignore"], temperature=TEMPERATURE,
                    return_entropy=True, **kwargs,
                )  # fmt: skip
            return rk.fused_policy_loss(
                cfg, token_ids=inp["ids"], old_logp=inp["old_logp"], advantages=inp["advantages"],
                mask=inp["mask"], hidden=hidden(inp), weight=inp["weight"], temperature=TEMPERATURE,
                ref_logp=inp["ref_logp"], **kwargs,
            ).loss  # fmt: skip

    return fwd


def _rk_note(kind: Kind, kwargs: dict[str, Any], options: dict[str, Any]) -> str:
    from rlkernel._dispatch import requested_backend

    if kind.loss:
        call = "fused_policy_loss(PolicyLossConfig.preset('dapo', kl k3 1e-3), hidden=..., mask=...)"
    else:
        call = "linear_token_logprobs(return_entropy=True), ids = -100 (ignore_index) at padding"
    args = [f"{k}={v!r}" for k, v in kwargs.items()] + [f"options {k}={v!r}" for k, v in options.items()]
    return "; ".join([call, *args, f"default arguments; backend={requested_backend()}"])


def _engine_call(kind: Kind, cfg: Any, inputs: list[dict], smoke: bool):
    """The fused engine on the token-loss plan's per-chunk coefficients, as ``fused_policy_loss``
    drives it (the plan built once per input set, outside the timed call)."""
    from rlkernel.ops._linear_function import fused_linear_token_loss
    from rlkernel.rl import token_loss as tl

    for inp in inputs:
        plan = tl.build_plan(
            cfg, token_ids=inp["ids"], old_logp=inp["old_logp"], advantages=inp["advantages"],
            mask=inp["mask"], ref_logp=inp["ref_logp"],
        )  # fmt: skip
        inp["coef_fn"], inp["engine_ids"] = tl.as_coef_fn(plan), plan.ids
    sizes = {"chunk_rows": SMOKE_CHUNK_ROWS, "grad_rows": SMOKE_GRAD_ROWS} if smoke else {}

    def fwd(inp: dict) -> torch.Tensor:
        loss, _ = fused_linear_token_loss(
            hidden(inp), inp["weight"], None, inp["engine_ids"], coef_fn=inp["coef_fn"],
            temperature=TEMPERATURE, **sizes,
        )  # fmt: skip
        return loss

    note = "fused_linear_token_loss, coef_fn: rlkernel.rl.token_loss plan" + (
        f"; smoke chunks {sizes}" if sizes else "; default chunk rule"
    )
    return base.bind(kind, inputs, fwd), note


def _layout_note(kind: Kind, inp: dict, scored: int) -> str:
    b, t, p, h = inp["b"], inp["t"], inp["p"], inp["weight"].shape[1]
    n = b * t
    if kind.ragged:
        return (f"hidden = base[:, {p - 1}:-1] of base [{b}, {p + t}, {h}] requiring grad; lengths "
                f"U[{-(-t // 4)}, {t}]: {scored} of {n} tokens scored")  # fmt: skip
    return f"hidden [{n}, {h}] contiguous; {scored} of {n} tokens scored"


def _setup(kind: Kind, n: int, v: int, opts: Options):
    h = H_SMOKE if opts.smoke else HIDDEN
    geo = geometry(n, opts.smoke)

    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        from rlkernel._dispatch import interpreter_enabled

        inputs = [make_inputs(kind, geo, h, v, device, seed=SEED + c) for c in range(copies)]
        for inp in inputs:
            for t in base.leaves(inp, kind):
                t.requires_grad_(True)
        cfg, spec = bl.resolve_loss("dapo") if kind.loss else (None, None)
        calls: dict[str, Any] = {}
        notes: dict[str, str] = {}
        for impl in (i for i in RK_CALLS if i in impls):
            kwargs, options = RK_CALLS[impl]
            calls[impl] = base.bind(kind, inputs, _rk_fwd(kind, cfg, kwargs, options))
            notes[impl] = _rk_note(kind, kwargs, options)
        if "rlkernel_engine" in impls:
            if device.type != "cuda" and not interpreter_enabled():
                calls["rlkernel_engine"] = Skip("Triton kernels need CUDA (or TRITON_INTERPRET=1 on CPU)")
            else:
                engine = _engine_call(kind, cfg, inputs, opts.smoke)
                calls["rlkernel_engine"], notes["rlkernel_engine"] = engine
        if "torch" in impls:
            plain = base.torch_loss(spec) if kind.loss else base.torch_logprobs
            calls["torch"] = base.bind(kind, inputs, plain)
            notes["torch"] = "hidden @ W.T (bf16 logits, every row), log_softmax(z.float()/T), gather"
        if "trl" in impls:
            fn, why = base.trl_head(device)
            calls["trl"] = base.trl_call(fn, kind, spec, inputs) if fn is not None else Skip(why)
            if fn is not None:
                notes["trl"] = base.trl_note(kind)
        if "liger" in impls:
            if device.type != "cuda":
                calls["liger"] = Skip("Liger's chunked losses are benchmarked on CUDA only")
            elif n > LIGER_MAX_N:
                calls["liger"] = Skip(f"too slow (~0.5 s per 8k tokens); run only for N <= {LIGER_MAX_N}")
            else:
                calls["liger"] = base.liger_call(kind, spec, inputs)
                notes["liger"] = "LigerFusedLinearGRPOLoss(loss_type='dapo', token level, use_ref_model)"
        if "cublas_gemms" in impls:
            calls["cublas_gemms"] = base.gemm_call(kind, inputs, SEED + 99)
            notes["cublas_gemms"] = f"{kind.n_gemms} cuBLAS bf16 GEMMs of the workload's shapes, scored rows"
        calls[REFERENCE] = base.reference_call(kind, spec, inputs)
        layout = _layout_note(kind, inputs[0], scored_rows(kind, geo))
        notes = {i: "; ".join(x for x in (layout, notes.get(i, "")) if x) for i in calls if i != REFERENCE}
        return Prepared(calls=calls, notes=notes)

    return setup


def _impls_for(kind: Kind) -> tuple[str, ...]:
    """The implementations that have the op, in display order (variants last)."""
    drop = {"liger", "rlkernel_engine"} if not kind.loss else set()
    if kind.frozen_weight:
        drop.add("rlkernel_dw_weight")
    return tuple(i for i in IMPLS if i not in drop)


def build(opts: Options) -> list[Workload]:
    """The workloads selected by ``opts`` (kind × N), each with its implementations; ragged first."""
    kinds = select(opts.workloads, tuple(KINDS), "workload", "linear")
    impls = select_impls(opts.impls, IMPLS, VARIANTS, "linear")
    ns, vs = token_and_vocab_sizes(
        opts, full=N_FULL, quick=N_QUICK, smoke=N_SMOKE, vocab_full=V_FULL, vocab_smoke=V_SMOKE
    )
    h = H_SMOKE if opts.smoke else HIDDEN
    out = []
    for name in kinds:
        kind = KINDS[name]
        chosen = tuple(i for i in _impls_for(kind) if i in impls)
        if not chosen:
            continue
        for n in ns:
            geo = geometry(n, opts.smoke)
            scored = scored_rows(kind, geo)
            rows = geo.b * (geo.p + geo.t) if kind.ragged else n
            for v in vs:
                out.append(
                    Workload(
                        name=name,
                        pass_="fwd+bwd",
                        params={"n_tokens": n, "scored_tokens": scored, "hidden": h, "vocab": v},
                        bytes_moved=None,
                        flops=kind.n_gemms * 2 * scored * h * v,
                        input_bytes=(rows + v) * h * 2,
                        impls=chosen,
                        reference=REFERENCE,
                        setup=_setup(kind, n, v, opts),
                    )
                )
    return out


SUITE = Suite(
    name="linear",
    description=(
        "LM head + log-probs+entropy / DAPO-KL loss from bf16 hidden states and weight [V, H]: ragged "
        "responses sliced from [B, P+T, H] (headline), then dense; cross-checked against an fp32 reference"
    ),
    impls=IMPLS,
    kinds=tuple(KINDS),
    param_columns=("n_tokens", "scored_tokens", "hidden", "vocab"),
    baseline="torch",
    build=build,
    variants=VARIANTS,
    bytes_doc=(
        "compute-bound: flops = n_gemms * 2*A*H*V over the A scored tokens (4 GEMMs for log-probs: logits, "
        "their recomputation, dhidden, dweight; 3 for the loss; 2 frozen); ceiling = flops / measured "
        "square-GEMM rate; cublas_gemms = those GEMMs at the workload's shapes"
    ),
)
