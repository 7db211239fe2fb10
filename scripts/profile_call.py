"""Where one public call's time goes: an isolated forward + backward in the bench's users' call
pattern, its host time, and how long the GPU waits before its first kernel. On a CUDA machine
(``--smoke``: tiny sizes on the CPU, checks the script only). With PYTHONPATH=src or the package
installed:

    python3 scripts/profile_call.py                  # DAPO+KL from sliced logits, V = 151,936 and 32,768
    python3 scripts/profile_call.py --cases hidden_dapo hidden_frozen hidden_logprobs --marks
    python3 scripts/profile_call.py --cases hidden_dapo --tokens 8192 65536 --accounting
    python3 scripts/profile_call.py --cases dapo gspo --no-validate --option token_level_fusion=false
    PYTHONPATH=old/src python3 scripts/profile_call.py --label base    # an A/B: once per source tree

Cases (the inputs of ``rlkernel.bench``'s headline rows; N = ``--tokens``, B = N / 1024 sequences):

    dapo, gspo       ``fused_policy_loss`` from logits ``out[:, 127:-1]`` of ``[B, 1152, V]`` bf16 that
                     requires grad (V: ``--vocab``), lengths uniform in [T/4, T]; DAPO + k3 KL
                     (kl_coef 1e-3) or GSPO. ``--contiguous``: a contiguous leaf copy of the window.
    logprobs         ``token_logprobs(return_entropy=True)`` of that window, ids -100 beyond each length
    hidden_dapo      ``fused_policy_loss(hidden=base[:, 127:-1], weight=W)``, H = 4096, V = 151,936
    hidden_frozen    the same with a frozen weight
    hidden_logprobs  ``linear_token_logprobs(return_entropy=True)`` of the same hidden states

Every call: default arguments and temperature 0.9, unless ``--no-validate``, ``--forward-only``
(no backward), ``--invariant`` / ``--logits-dtype fp32`` (hidden cases) or ``--option NAME=VALUE``
(``rk.use_options`` around the call). One line per case, then a table of all:

    isolated    ms of an isolated call (CUDA events, the queue drained before it: the bench's timing)
    b2b         ms per call of 20 calls back to back, one sync
    host        ms from the call's start to its return, the queue drained before: its host time
    cpu         the host's CPU ms over that interval (host - cpu: time the host was blocked, a sync)
    1st kernel  ms the GPU waits before the call's first kernel (one call under torch.profiler)
    1st GEMM    ms before its first GEMM (cuBLAS or rlkernel's LM-head GEMMs)
    busy, idle  GPU ms busy and idle between the profiled call's first and last kernel
    peak GB     peak memory above the inputs (CUDA)

``--kernels`` prints the timeline (each kernel's start and duration, the gaps, time by kernel class
and name, the host's blocking CUDA calls), ``--marks`` when the host entered and left each stage
and when the GPU had done the work queued by then (``--mark module:function`` adds one; the default
list names today's stages, a renamed one is reported as not found), ``--accounting`` (hidden cases)
the kernels next to the cuBLAS GEMM floor's (the ``linear`` suite's ``cublas_gemms`` on the same
inputs), ``--cprofile`` the host's functions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import rlkernel as rk
from rlkernel.bench import _linear_baselines as linear_baselines
from rlkernel.bench import _linear_inputs as linear_inputs
from rlkernel.bench import _logits_inputs as logits_inputs
from rlkernel.bench import profiling, timing
from rlkernel.bench._logits_baselines import TEMPERATURE, loss_config

LOGITS_CASES = {
    "dapo": "sliced_dapo_kl_fwd_bwd",
    "gspo": "sliced_gspo_fwd_bwd",
    "logprobs": "sliced_logprobs_entropy_fwd_bwd",
}
HIDDEN_CASES = {
    "hidden_dapo": "ragged_dapo_kl_fwd_bwd",
    "hidden_frozen": "ragged_dapo_kl_frozen_fwd_bwd",
    "hidden_logprobs": "ragged_logprobs_entropy_fwd_bwd",
}
HIDDEN, HIDDEN_VOCAB = 4096, 151936
SMOKE_TOKENS, SMOKE_VOCAB, SMOKE_HIDDEN = 64, 100, 32
# The stages of a call whose host entry / exit --marks records (module:function or module:Class.method).
MARKS = (
    "rlkernel.rl.fused:checked_call",  # the checks, or a repeat call's kept decision (rl.repeat_calls)
    "rlkernel.rl._fused_call:validate_batch",  # (a call checked in full: the first of its signature)
    "rlkernel.rl._fused_call:route_facts",
    "rlkernel.rl.token_loss:device_plan_from_batch",
    "rlkernel.ops.device_plan_loss:device_plan_forward",
    "rlkernel.rl.seq_token_loss:device_seq_plan",
    "rlkernel.ops.device_seq_plan:seq_plan_forward",
    "rlkernel.ops.id_checks:defer_written",
    "rlkernel.kernels.logprobs:token_logprobs_bwd_window_into",
    "rlkernel.rl.token_loss:masked_token_ids",
    "rlkernel.rl.token_loss:plan_from_batch",
    "rlkernel.ops.id_checks:check_token_ids",
    "rlkernel.ops._linear_function:active_rows",
    "rlkernel.ops._linear_rows:masked_active_rows",
    "rlkernel.ops._linear_function:make_engine",
    "rlkernel.ops._linear_engine_base:ChunkEngine.stage",
    "rlkernel.kernels.linear_head:stats_partials_unchecked",
    "rlkernel.kernels.linear_head:combine_partials_unchecked",
    "rlkernel.kernels.linear_head:linear_head_grad_into_unchecked",
    "rlkernel.ops._linear_function:whole_batch_grads",
)


@dataclass
class Case:
    label: str
    step: Callable[[], Any]
    floor: Callable[[], Any] | None  # the GEMM floor on the same inputs (hidden cases)


def option_value(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` -> (NAME, VALUE as bool, int or str); ``rk.use_options`` checks the rest."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value, 0)
    except ValueError:
        return name, value


def _call_kwargs(args) -> dict:
    kw: dict[str, Any] = {"temperature": TEMPERATURE}
    if args.no_validate:
        kw["validate"] = False
    return kw


def logits_case(name: str, v: int, args, device: torch.device) -> Case:
    kind = logits_inputs.KINDS[LOGITS_CASES[name]]
    geo = logits_inputs.geometry(args.n, args.smoke)
    inp = logits_inputs.make_sliced_inputs(kind, geo, v, device, seed=0)
    base = inp["base"].requires_grad_(True)
    if args.contiguous:
        leaf = logits_inputs.window(base.detach(), geo.p).contiguous().requires_grad_(True)
        logits, target = (lambda: leaf), leaf
    else:
        logits, target = (lambda: logits_inputs.window(base, geo.p)), base
    kw = _call_kwargs(args)
    if kind.loss is None:

        def step():
            lp, ent = rk.token_logprobs(logits(), inp["ids_ignore"], return_entropy=True, **kw)
            if args.forward_only:
                return lp, ent
            return torch.autograd.grad((lp, ent), (target,), inp["grad_out"])

    else:
        cfg = loss_config(kind.loss)
        ref = inp["ref_logp"] if cfg.kl_coef else None

        def step():
            out = rk.fused_policy_loss(
                cfg, logits=logits(), token_ids=inp["ids"], old_logp=inp["old_logp"],
                advantages=inp["advantages"], mask=inp["mask"], ref_logp=ref, **kw,
            )  # fmt: skip
            return out.loss if args.forward_only else torch.autograd.grad(out.loss, (target,))

    layout = "contiguous" if args.contiguous else "sliced"
    return Case(f"{name} {layout} V={v} N={geo.n}", step, None)


def hidden_case(name: str, n: int, args, device: torch.device) -> Case:
    kind = linear_inputs.KINDS[HIDDEN_CASES[name]]
    h, v = (SMOKE_HIDDEN, SMOKE_VOCAB) if args.smoke else (HIDDEN, HIDDEN_VOCAB)
    inp = linear_inputs.make_inputs(kind, linear_inputs.geometry(n, args.smoke), h, v, device, seed=0)
    leaves = (inp["base"],) if kind.frozen_weight else (inp["base"], inp["weight"])
    for t in leaves:
        t.requires_grad_(True)
    kw = _call_kwargs(args)
    if args.invariant:
        kw["invariant"] = True
    if args.logits_dtype == "fp32":
        kw["logits_dtype"] = torch.float32
    if not kind.loss:

        def step():
            lp, ent = rk.linear_token_logprobs(
                linear_inputs.hidden(inp), inp["weight"], inp["ids_ignore"], return_entropy=True, **kw
            )
            if args.forward_only:
                return lp, ent
            return torch.autograd.grad((lp, ent), leaves, inp["grad_out"])

    else:
        cfg = loss_config("dapo")

        def step():
            out = rk.fused_policy_loss(
                cfg, hidden=linear_inputs.hidden(inp), weight=inp["weight"], token_ids=inp["ids"],
                old_logp=inp["old_logp"], advantages=inp["advantages"], mask=inp["mask"],
                ref_logp=inp["ref_logp"], **kw,
            )  # fmt: skip
            return out.loss if args.forward_only else torch.autograd.grad(out.loss, leaves)

    floor = linear_baselines.gemm_call(kind, [inp], seed=0)
    return Case(f"{name} V={v} N={n}", step, lambda: floor(0))


def with_options(step: Callable[[], Any], options: dict) -> Callable[[], Any]:
    if not options:
        return step

    def call():
        with rk.use_options(**options):
            return step()

    return call


def peak_extra_gb(step: Callable[[], Any], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = step()
    torch.cuda.synchronize(device)
    del out
    return (torch.cuda.max_memory_allocated(device) - base) / 1e9


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.3f}"


def print_timeline(tl: profiling.Timeline, prefix: str) -> None:
    prev_end = 0.0
    for k in tl.kernels:
        at, idle = k.start_us / 1e3, k.start_us - prev_end
        print(f"{prefix}{at:8.3f} ms {k.dur_us:8.1f} us (idle before {idle:7.1f} us) {k.name[:80]}")
        prev_end = max(prev_end, k.start_us + k.dur_us)
    classes = "  ".join(f"{c} {ms:.3f}" for c, ms in sorted(tl.by_class().items()))
    print(f"{prefix}GPU ms by class: {classes}")
    for name, count, total in tl.by_name()[:14]:
        print(f"{prefix}{total:8.3f} ms {count:4d}x  {name[:90]}")
    for gap, before, after in tl.gaps()[:8]:
        print(f"{prefix}gap {gap / 1e3:.3f} ms between {before[:50]} and {after[:50]}")
    for name, (count, total) in sorted(tl.blocking.items(), key=lambda kv: -kv[1][1]):
        print(f"{prefix}host blocking: {name} {count}x {total:.3f} ms")


def print_accounting(case: Case, tl: profiling.Timeline, iso: float, device: torch.device, prefix: str):
    """The call's kernels by name next to its GEMM floor's, and where the isolated time goes."""
    floor_iso = statistics.median(timing.time_interleaved({"f": lambda i: case.floor()}, device, rounds=5,
                                                          reps=1)["f"])  # fmt: skip
    ftl = profiling.kernel_timeline(case.floor, device)
    print(f"{prefix}accounting: isolated {iso:.3f} ms vs the GEMM floor's {floor_iso:.3f} ms "
          f"(floor kernels {ftl.busy_us / 1e3:.3f} ms)")  # fmt: skip
    print(f"{prefix}  GPU idle before the first kernel {_ms(tl.first_start_us)} ms, between kernels "
          f"{_ms(tl.idle_between_us)} ms; kernels {_ms(tl.busy_us)} ms "
          f"({(tl.busy_us - ftl.busy_us) / 1e3:+.3f} over the floor's)")  # fmt: skip
    for label, table in (("floor", ftl.by_name()), ("call", tl.by_name())):
        for name, count, total in table[:14]:
            print(f"{prefix}  {label:5s} {total:8.3f} ms {count:4d}x  {name[:90]}")


def profile_case(case: Case, args, device: torch.device) -> dict:
    p = f"{args.label} " if args.label else ""
    step = with_options(case.step, args.options)
    for _ in range(args.warmup):
        step()
    timing.synchronize(device)
    iso = statistics.median(timing.time_interleaved({"c": lambda i: step()}, device, rounds=args.reps,
                                                    reps=1)["c"])  # fmt: skip
    b2b = statistics.median(timing.time_back_to_back({"c": lambda i: step()}, device, loop=args.loop,
                                                     reps=3)["c"])  # fmt: skip
    host = timing.host_times(step, device, reps=args.reps, warmup=0)
    tl = profiling.kernel_timeline(step, device)
    gemm = tl.first()
    row = {
        "case": case.label, "isolated": iso, "b2b": b2b, "host": host.host_ms, "cpu": host.cpu_ms,
        "first_kernel": tl.first_start_us, "first_gemm": gemm.start_us if gemm else None,
        "kernels": len(tl.kernels), "busy": tl.busy_us, "idle": tl.idle_between_us,
        "peak_gb": peak_extra_gb(step, device),
    }  # fmt: skip
    print(f"\n=== {p}{case.label}: isolated {iso:.3f} ms, back-to-back {b2b:.3f} ms, host "
          f"{host.host_ms:.3f} ms (CPU {host.cpu_ms:.3f}); GPU idle before the first kernel "
          f"{_ms(tl.first_start_us)} ms, before the first GEMM {_ms(row['first_gemm'])} ms; "
          f"{len(tl.kernels)} kernels, busy {_ms(tl.busy_us)} ms, idle between {_ms(tl.idle_between_us)} ms",
          flush=True)  # fmt: skip
    if args.kernels:
        print_timeline(tl, "    ")
    if args.marks:
        marks, missing = profiling.host_marks(step, [*MARKS, *args.mark], device, reps=args.reps)
        print("    ms from the call's start (median): host at the first entry, at its exit; GPU done with "
              "the work queued by then")  # fmt: skip
        for key, m in sorted(marks.items(), key=lambda kv: kv[1].exit_ms):
            gpu = "-" if m.gpu_done_ms is None else f"{m.gpu_done_ms:8.3f}"
            print(f"    {m.enter_ms:8.3f} {m.exit_ms:8.3f} {gpu:>8s}  {key}")
        for target in missing:
            print(f"    (not found: {target})")
    if args.accounting and case.floor is not None:
        print_accounting(case, tl, iso, device, "    ")
    if args.cprofile:
        print(profiling.cprofile_report(step, device, calls=args.reps))
    return row


def print_summary(rows: list[dict], label: str) -> None:
    def cell(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    print(f"\n{'case':40s} {'isolated':>8s} {'b2b':>7s} {'host':>7s} {'cpu':>7s} {'1st kernel':>10s} "
          f"{'1st GEMM':>8s} {'kernels':>7s} {'busy':>8s} {'idle':>7s} {'peak GB':>7s}")  # fmt: skip
    for r in rows:
        ms = {k: None if r[k] is None else r[k] / 1e3 for k in ("first_kernel", "first_gemm", "busy", "idle")}
        name = (label + " " if label else "") + r["case"]
        print(f"{name:40s} {r['isolated']:8.3f} {r['b2b']:7.3f} {r['host']:7.3f} {r['cpu']:7.3f} "
              f"{cell(ms['first_kernel']):>10s} {cell(ms['first_gemm']):>8s} {r['kernels']:7d} "
              f"{cell(ms['busy']):>8s} {cell(ms['idle']):>7s} {cell(r['peak_gb'], '.2f'):>7s}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", default=["dapo"], choices=[*LOGITS_CASES, *HIDDEN_CASES])
    parser.add_argument("--vocab", type=int, nargs="+", default=None,
                        help="V of the logits cases (default 151936 32768; the hidden cases: 151,936)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="N (default 8192)")
    parser.add_argument("--contiguous", action="store_true", help="logits cases: a contiguous leaf")
    parser.add_argument("--no-validate", action="store_true", help="validate=False")
    parser.add_argument("--forward-only", action="store_true", help="the training forward without backward")
    parser.add_argument("--invariant", action="store_true", help="hidden cases: invariant=True")
    parser.add_argument("--logits-dtype", choices=["default", "fp32"], default="default",
                        help="hidden cases with --invariant: logits_dtype=torch.float32")
    parser.add_argument("--option", type=option_value, action="append", default=[], metavar="NAME=VALUE",
                        help="rk.use_options(NAME=VALUE) around every call (repeatable)")
    parser.add_argument("--label", default="", help="a name for this source tree in every line (A/B)")
    parser.add_argument("--reps", type=int, default=None, help="isolated calls timed (default 20)")
    parser.add_argument("--loop", type=int, default=20, help="calls per back-to-back loop")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="the kernel timeline, by class and name")
    parser.add_argument("--marks", action="store_true", help="host entry / exit of each stage")
    parser.add_argument("--mark", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="another function for --marks (module:function or module:Class.method)")
    parser.add_argument("--accounting", action="store_true", help="hidden cases: next to the GEMM floor")
    parser.add_argument("--cprofile", action="store_true", help="cProfile of the isolated calls")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script only")
    args = parser.parse_args(argv)
    args.options = dict(args.option)
    try:  # an unknown option or a bad value fails now, naming it
        with rk.use_options(**args.options):
            pass
    except (TypeError, ValueError) as exc:
        parser.error(f"--option: {exc}")
    if args.smoke:
        args.vocab, args.tokens = [SMOKE_VOCAB], [SMOKE_TOKENS]
        args.reps = args.reps or 2
        args.loop, args.warmup = min(args.loop, 2), min(args.warmup, 1)
    args.vocab = args.vocab or [151936, 32768]
    args.tokens = args.tokens or [8192]
    args.reps = args.reps or 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("profile_call: needs a CUDA device (--smoke runs it tiny on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    name = "CPU (smoke: not a measurement)" if args.smoke else torch.cuda.get_device_name(device)
    print(f"# {name} | torch {torch.__version__} | options {args.options or 'default'}")
    rows = []
    for n in args.tokens:
        args.n = n
        for case_name in args.cases:
            if case_name in HIDDEN_CASES:
                cases = [lambda c=case_name, n=n: hidden_case(c, n, args, device)]
            else:
                cases = [lambda c=case_name, v=v: logits_case(c, v, args, device) for v in args.vocab]
            for make in cases:  # one case's inputs alive at a time
                rows.append(profile_case(make(), args, device))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print_summary(rows, args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
