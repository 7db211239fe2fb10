"""Benchmark suite ``linear``: LM head + log-probs / DAPO loss from bf16 hidden states.

Workloads (N tokens, H = 4096, V = 151,936, bf16; defaults N ∈ {8192, 32768, 65536}):

    lmhead_logprobs_fwd_bwd        linear_token_logprobs forward + backward (random upstream grads)
                                   to hidden and weight
    lmhead_dapo_kl_fwd_bwd         DAPO loss with a k3 KL term (kl_coef = 1e-3) from hidden states,
                                   forward + backward to hidden and weight
    lmhead_dapo_kl_frozen_fwd_bwd  the same with the weight frozen (gradient to hidden only)

Implementations (same inputs, one process):

    rlkernel         the public API: ``rlkernel.linear_token_logprobs`` / ``rlkernel.fused_policy_loss(
                     cfg, hidden=..., weight=...)`` (whatever path the public op takes in this build)
    rlkernel_engine  (loss workloads) the fused engine ``rlkernel.ops._linear_function.
                     fused_linear_token_loss`` (3 GEMMs) driven by the per-chunk coefficients of
                     ``rlkernel.rl.token_loss`` (the DAPO-KL plan; one launch per chunk)
    torch            plain PyTorch: ``hidden @ W.T`` (bf16 logits), ``log_softmax(z.float() / T)``,
                     gather, the RL algebra of ``rlkernel.bench.logits.plain_policy_loss``; autograd.
                     Runs out of memory at large N (recorded as ``oom``). It is the cross-check
                     reference: its logits are rounded to bf16 (|Δlogp| up to ~|z|·2⁻⁹), so the
                     max_abs_diff of rlkernel's fp32-logit rows is that rounding, not an error.
    liger            ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (loss_type "dapo", token
                     level), where importable; skipped at N ≥ 32768 (about 0.5 s per 8k tokens on an
                     H100: minutes per workload). Its KL needs ``ref_per_token_logps``.
    cublas_gemms     the GEMMs any implementation must run, cuBLAS, same shapes, timed in the same run:
                     logits ``[N,H]·[H,V]``, dhidden ``[N,V]·[V,H]``, dweight ``[V,N]·[N,H]`` (the last one
                     not for the frozen workload). The speed target is a ratio to this row.

Opt-in variants (``--impl``; not in the default run or the README table): the ``rlkernel`` call
with one option of ``rk.use_options`` changed, to show what it buys:

    rlkernel_logits_input  ``linear_logits_dtype="input"``: chunk logits in bf16, as the model's own
                           LM head gives (less memory and traffic; logp off by up to ~|z|·2⁻⁹)
    rlkernel_dw_weight     ``linear_dweight_accum="weight"``: dweight accumulated in bf16 across
                           gradient groups (half the V·H accumulator; not for the frozen workload)

FLOPs: 2·N·H·V per GEMM; 3 GEMMs (2 frozen) are the ``flops`` of a workload, so ``frac_gemm`` is
the fraction of the square-GEMM rate of :mod:`rlkernel.bench.ceilings`, and the ``ceiling`` row the
time of those FLOPs at that rate. ``cublas_gemms`` shows what the real shapes reach.

Inputs: hidden ``randn`` bf16, weight ``randn·2/√H`` (logits of std ≈ 2), uniform token ids;
``[B, T]`` sequences of T = 1024 with ~10 % right padding; old/ref log-probs = the true log-probs +
0.1·randn; temperature 0.9.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.bench import logits as bl
from rlkernel.bench.suite import (
    CallResult,
    Options,
    Prepared,
    Skip,
    Suite,
    Workload,
    optional_import,
    select,
    select_impls,
    token_and_vocab_sizes,
)

VARIANT_OPTIONS = {
    "rlkernel_logits_input": {"linear_logits_dtype": "input"},
    "rlkernel_dw_weight": {"linear_dweight_accum": "weight"},
}
VARIANTS = tuple(VARIANT_OPTIONS)
IMPLS = ("rlkernel", "rlkernel_engine", "torch", "liger", "cublas_gemms", *VARIANTS)
TEMPERATURE = bl.TEMPERATURE
HIDDEN = 4096
N_FULL, N_QUICK, N_SMOKE = (8192, 32768, 65536), (8192,), (64,)
V_FULL, V_SMOKE, H_SMOKE = (151936,), (100,), 16
LIGER_MAX_N = 16384
SMOKE_CHUNK_ROWS, SMOKE_GRAD_ROWS = 32, 64
SEED = 4321


@dataclass(frozen=True)
class Kind:
    loss: bool
    frozen_weight: bool = False


KINDS: dict[str, Kind] = {
    "lmhead_logprobs_fwd_bwd": Kind(loss=False),
    "lmhead_dapo_kl_fwd_bwd": Kind(loss=True),
    "lmhead_dapo_kl_frozen_fwd_bwd": Kind(loss=True, frozen_weight=True),
}


def n_gemms(kind: Kind) -> int:
    return 2 if kind.frozen_weight else 3


def make_inputs(kind: Kind, n: int, h: int, v: int, device: torch.device, *, smoke: bool, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    t = bl._seq_len(n, smoke)
    b = n // t
    hid = torch.randn(n, h, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=device, generator=gen, dtype=torch.bfloat16).mul_(2.0 / math.sqrt(h))
    ids = torch.randint(0, v, (n,), device=device, generator=gen)
    inp: dict[str, Any] = {"hidden": hid, "weight": w, "ids": ids, "b": b, "t": t}
    if not kind.loss:
        inp["grad_out"] = torch.randn(n, device=device, generator=gen)
        return inp
    lengths = torch.randint(int(math.ceil(0.8 * t)), t + 1, (b,), device=device, generator=gen)
    inp["mask"] = (torch.arange(t, device=device)[None, :] < lengths[:, None]).reshape(-1)
    true = _true_logp(hid, w, ids)
    inp["old_logp"] = true + bl._randn((n,), device, gen, scale=bl.LOGP_NOISE)
    inp["ref_logp"] = true + bl._randn((n,), device, gen, scale=bl.LOGP_NOISE)
    inp["adv_seq"] = bl._randn((b,), device, gen)
    inp["advantages"] = inp["adv_seq"][:, None].expand(b, t).reshape(-1).contiguous()
    inp["ids_masked"] = torch.where(inp["mask"], ids, torch.full_like(ids, -100))
    return inp


@torch.no_grad()
def _true_logp(hid, w, ids):
    out = torch.empty(ids.shape, device=ids.device, dtype=torch.float32)
    for s in range(0, ids.shape[0], 1024):
        z = hid[s : s + 1024] @ w.t()
        out[s : s + 1024] = bl.torch_token_logprobs(z, ids[s : s + 1024], TEMPERATURE, False)
    return out


def _leaves(inp: dict, kind: Kind) -> tuple[torch.Tensor, ...]:
    return (inp["hidden"],) if kind.frozen_weight else (inp["hidden"], inp["weight"])


# --------------------------------------------------------------------------------- implementations
def _torch_logp(hid, w, ids):
    return bl.torch_token_logprobs(hid @ w.t(), ids, TEMPERATURE, False)


def _bind(kind: Kind, inputs: list[dict], fwd: Callable[[dict], torch.Tensor]) -> Callable[[int], CallResult]:
    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        out = fwd(inp)
        leaves = _leaves(inp, kind)
        grads = torch.autograd.grad(out, leaves, None if kind.loss else inp["grad_out"])
        return CallResult((out.detach(),), tuple(grads))

    return call


def _liger_cls():
    mod, why = optional_import("liger_kernel.chunked_loss")
    return (mod.LigerFusedLinearGRPOLoss, "") if mod is not None else (None, why)


def _liger_call(cls, spec: bl.LossSpec, kind: Kind, inputs: list[dict]):
    """LigerFusedLinearGRPOLoss configured like ``spec`` (bound by parameter name; ValueError if
    this version lacks one)."""
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
    missing = sorted(
        k for k in ("beta", "epsilon_low", "epsilon_high", "loss_type", "temperature") if k not in params
    )
    if missing:
        raise ValueError(f"this liger-kernel's LigerFusedLinearGRPOLoss has no parameter(s) {missing}")
    module = cls(**{k: v for k, v in init.items() if k in params})
    fwd_params = set(inspect.signature(module.forward).parameters)
    need = {"_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages"}
    if not need <= fwd_params:
        raise ValueError(f"LigerFusedLinearGRPOLoss.forward lacks {sorted(need - fwd_params)}")

    def fwd(inp):
        b, t = inp["b"], inp["t"]
        out = module(
            _input=inp["hidden"].reshape(b, t, -1),
            lin_weight=inp["weight"],
            selected_token_ids=inp["ids"].reshape(b, t),
            attention_mask=inp["mask"].reshape(b, t).to(torch.int64),
            advantages=inp["adv_seq"],
            ref_per_token_logps=inp["ref_logp"].reshape(b, t),
            old_per_token_logps=inp["old_logp"].reshape(b, t),
        )
        return out[0] if isinstance(out, tuple) else out

    return _bind(kind, inputs, fwd)


def _gemm_call(kind: Kind, inputs: list[dict]) -> Callable[[int], CallResult]:
    """The GEMMs of the workload with cuBLAS: a random bf16 ``[N, V]`` stands in for the gradient.
    It is allocated on the first call (after the cross-checks of the others, which run first), and
    kept: like the inputs, it is not counted in this row's peak memory."""

    def call(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        h, w = inp["hidden"].detach(), inp["weight"].detach()
        if "gz" not in inp:
            gen = torch.Generator(device=h.device).manual_seed(SEED + 99)
            inp["gz"] = torch.randn(h.shape[0], w.shape[0], device=h.device, generator=gen, dtype=h.dtype)
        gz = inp["gz"]
        z = h @ w.t()
        del z
        dh = gz @ w
        dw = None if kind.frozen_weight else gz.t() @ h
        del dh, dw
        return CallResult(())

    return call


def _engine_coefs(cfg, inputs: list[dict]) -> str:
    """Per input set: ``coef_fn`` and ``engine_ids`` for the fused engine, from the token-loss plan
    of ``rlkernel.rl.token_loss`` (one launch per chunk), as ``fused_policy_loss`` drives it."""
    from rlkernel.rl import token_loss as tl

    for inp in inputs:
        shp = (inp["b"], inp["t"])
        plan = tl.build_plan(
            cfg,
            token_ids=inp["ids"].reshape(shp),
            old_logp=inp["old_logp"].reshape(shp),
            advantages=inp["advantages"].reshape(shp),
            mask=inp["mask"].reshape(shp),
            ref_logp=inp["ref_logp"].reshape(shp),
        )
        inp["coef_fn"], inp["engine_ids"] = tl.as_coef_fn(plan), plan.ids.reshape(-1)
    return "rlkernel.rl.token_loss plan"


def _setup(kind: Kind, n: int, v: int, opts: Options):
    h = H_SMOKE if opts.smoke else HIDDEN

    def setup(device: torch.device, impls: tuple[str, ...], copies: int) -> Prepared:
        import rlkernel as rk
        from rlkernel._dispatch import interpreter_enabled, requested_backend

        inputs = [make_inputs(kind, n, h, v, device, smoke=opts.smoke, seed=SEED + c) for c in range(copies)]
        for inp in inputs:
            for t in _leaves(inp, kind):
                t.requires_grad_(True)
        calls: dict[str, Any] = {}
        notes: dict[str, str] = {}
        cfg, spec = bl.resolve_loss("dapo") if kind.loss else (None, None)

        if {"rlkernel", *VARIANTS} & set(impls):
            if kind.loss:

                def rk_fwd(inp):
                    b, t = inp["b"], inp["t"]
                    return rk.fused_policy_loss(
                        cfg,
                        token_ids=inp["ids"].reshape(b, t),
                        old_logp=inp["old_logp"].reshape(b, t),
                        advantages=inp["advantages"].reshape(b, t),
                        mask=inp["mask"].reshape(b, t),
                        hidden=inp["hidden"].reshape(b, t, -1),
                        weight=inp["weight"],
                        temperature=TEMPERATURE,
                        ref_logp=inp["ref_logp"].reshape(b, t),
                    ).loss

                notes["rlkernel"] = (
                    "fused_policy_loss(PolicyLossConfig.preset('dapo', kl k3 1e-3), hidden=...)"
                )
            else:

                def rk_fwd(inp):
                    return rk.linear_token_logprobs(
                        inp["hidden"], inp["weight"], inp["ids"], temperature=TEMPERATURE
                    )

                notes["rlkernel"] = "linear_token_logprobs"
            notes["rlkernel"] += f"; validate=True; backend={requested_backend()}"
            for impl in (i for i in ("rlkernel", *VARIANTS) if i in impls):
                options = VARIANT_OPTIONS.get(impl, {})

                def fwd(inp, options=options):
                    with rk.use_options(**options):
                        return rk_fwd(inp)

                calls[impl] = _bind(kind, inputs, fwd)
                notes[impl] = notes["rlkernel"] + "".join(f"; {k}={v!r}" for k, v in options.items())
            if "rlkernel" not in impls:
                del notes["rlkernel"]
        if "rlkernel_engine" in impls:
            if not kind.loss:
                calls["rlkernel_engine"] = Skip("the engine is for losses; the primitive is the rlkernel row")
            elif device.type != "cuda" and not interpreter_enabled():
                calls["rlkernel_engine"] = Skip("Triton kernels need CUDA (or TRITON_INTERPRET=1 on CPU)")
            else:
                from rlkernel.ops._linear_function import fused_linear_token_loss

                sizes = {"chunk_rows": SMOKE_CHUNK_ROWS, "grad_rows": SMOKE_GRAD_ROWS} if opts.smoke else {}
                how = _engine_coefs(cfg, inputs)

                def eng_fwd(inp):
                    loss, _ = fused_linear_token_loss(
                        inp["hidden"],
                        inp["weight"],
                        None,
                        inp["engine_ids"],
                        coef_fn=inp["coef_fn"],
                        temperature=TEMPERATURE,
                        **sizes,
                    )
                    return loss

                calls["rlkernel_engine"] = _bind(kind, inputs, eng_fwd)
                notes["rlkernel_engine"] = f"fused_linear_token_loss, coef_fn: {how}" + (
                    f"; smoke chunks {sizes}" if sizes else "; default chunk rule"
                )
        if "torch" in impls:
            if kind.loss:

                def torch_fwd(inp):
                    b, t = inp["b"], inp["t"]
                    logp = _torch_logp(inp["hidden"], inp["weight"], inp["ids"]).reshape(b, t)
                    shp = (b, t)
                    return bl.plain_policy_loss(
                        logp,
                        inp["old_logp"].reshape(shp),
                        inp["advantages"].reshape(shp),
                        inp["mask"].reshape(shp),
                        spec,
                        inp["ref_logp"].reshape(shp),
                    )

            else:

                def torch_fwd(inp):
                    return _torch_logp(inp["hidden"], inp["weight"], inp["ids"])

            calls["torch"] = _bind(kind, inputs, torch_fwd)
            notes["torch"] = "hidden @ W.T (bf16 logits), log_softmax(z.float()/T), gather, autograd"
        if "liger" in impls:
            cls, why = _liger_cls()
            if not kind.loss:
                calls["liger"] = Skip("Liger has no fused-linear log-prob primitive")
            elif device.type != "cuda":
                calls["liger"] = Skip("Liger's chunked losses are benchmarked on CUDA only")
            elif cls is None:
                calls["liger"] = Skip(why)
            elif n > LIGER_MAX_N:
                calls["liger"] = Skip(f"too slow (~0.5 s per 8k tokens); run only for N <= {LIGER_MAX_N}")
            else:
                try:
                    calls["liger"] = _liger_call(cls, spec, kind, inputs)
                    notes["liger"] = "LigerFusedLinearGRPOLoss(loss_type='dapo', token level, use_ref_model)"
                except ValueError as exc:
                    calls["liger"] = Skip(str(exc))
        if "cublas_gemms" in impls:
            calls["cublas_gemms"] = _gemm_call(kind, inputs)
            notes["cublas_gemms"] = f"{n_gemms(kind)} cuBLAS bf16 GEMMs of the workload's shapes"
        return Prepared(calls=calls, notes=notes)

    return setup


def _impls_for(kind: Kind) -> tuple[str, ...]:
    if not kind.loss:
        return ("rlkernel", "torch", "cublas_gemms", *VARIANTS)
    if kind.frozen_weight:
        return tuple(i for i in IMPLS if i != "rlkernel_dw_weight")
    return IMPLS


def build(opts: Options) -> list[Workload]:
    """The workloads selected by ``opts`` (kind × N), each with its implementations."""
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
            for v in vs:
                out.append(
                    Workload(
                        name=name,
                        pass_="fwd+bwd",
                        params={"n_tokens": n, "hidden": h, "vocab": v},
                        bytes_moved=None,
                        flops=n_gemms(kind) * 2 * n * h * v,
                        input_bytes=(n + v) * h * 2,
                        impls=chosen,
                        reference="torch" if "torch" in chosen else None,
                        setup=_setup(kind, n, v, opts),
                    )
                )
    return out


SUITE = Suite(
    name="linear",
    description="LM head + log-probs / DAPO-KL loss from bf16 hidden states [N, H] and weight [V, H]",
    impls=IMPLS,
    kinds=tuple(KINDS),
    param_columns=("n_tokens", "hidden", "vocab"),
    baseline="torch",
    build=build,
    variants=VARIANTS,
    bytes_doc=(
        "compute-bound: flops = (3 or 2 frozen) * 2*N*H*V (logits, dhidden, dweight GEMMs); ceiling = "
        "flops / measured square-GEMM rate; cublas_gemms = those GEMMs at the workload's shapes"
    ),
)
