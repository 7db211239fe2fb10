"""Benchmark suite ``multigpu``: the LM head over several GPUs (vocab-parallel and FSDP2), one torchrun
run per GPU count.

``rlkernel bench multigpu`` does not time anything itself: for each world size W (2, 4, 8 up to the
GPUs present; ``--gpus 2,4`` picks them) it starts

    python -m torch.distributed.run --standalone --nproc-per-node W \\
        -m rlkernel.bench._multigpu_worker --out DIR

with ``CUDA_VISIBLE_DEVICES`` the first W GPUs and a time limit (the whole process group is killed
at :data:`DEADLINE_S`), echoes rank 0's progress lines, and turns the records rank 0 writes
(``DIR/rank0.json``) into rows of ``multigpu.csv`` / ``.json`` (the columns of every suite, the
environment of rank 0 included, plus ``gpus`` and ``world_size``). ``--smoke`` runs the same
pipeline with gloo on the CPU at tiny sizes (2 ranks; bf16 as on the GPU).

Workloads (bf16; hidden, ids and the weight drawn on rank 0 and broadcast; weight ``randn·2/√H``,
ids uniform, fixed ``randn`` upstream gradients of logp and entropy; forward + backward to the
hidden states and the weight, ``torch.autograd.grad``; default arguments, temperature 0.9):

    tp_logprobs_entropy_fwd_bwd  N = 8192, H = 4096, V = 151,936. ``rlkernel``: the whole [V, H] head
                                 on one GPU (gpus = 1); ``rlkernel_tp``: ``linear_token_logprobs(...,
                                 tp_group=WORLD, return_entropy=True)``, rank r holding the contiguous
                                 rows of an even split (gpus = W); ``all_reduce_dhidden``: the
                                 [N, H] fp32 all-reduce of the TP backward, alone; ``ceiling``: the
                                 4 GEMMs (2·N·H·V each) at the GEMM rate measured on rank 0's GPU,
                                 spread over W GPUs. ``speedup_vs_baseline`` = 1 GPU / TP.
    fsdp2_head_fwd_bwd           (H, N) = (4096, 8192) and (1024, 4096), V = 151,936. ``rlkernel``:
                                 the plain full head on every rank (gpus = 1); ``rlkernel_dtensor``:
                                 the head as a ``Shard(0)`` DTensor over the W ranks, bf16 shards;
                                 ``rlkernel_dtensor_fp32``: fp32 shards (FSDP2's mixed precision),
                                 which the op casts to bf16 before the all-gather and whose gradient
                                 it reduce-scatters in fp32; ``all_gather_reduce_scatter``: one
                                 all-gather and one reduce-scatter of the bf16 [V, H] head, alone.
                                 The notes give DTensor ÷ plain; ``speedup_vs_baseline`` = plain ÷
                                 DTensor.

Timing (every rank runs every implementation; implementations interleaved in rotated rounds): a
first call (``first_call_s``), warm-up calls, one call for the peak memory and the cross-check, then
at least 10 isolated steps per implementation, each started by a barrier on a synchronized device
and bracketed by CUDA events. A step of a collective implementation lasts until its slowest rank is
done (per step, the maximum over the ranks); the single-GPU rows are rank 0's, measured while every
rank runs the same. Cross-check (rank 0): logp and entropy (``max_abs_diff``), dhidden and rank 0's
rows of dweight (``grad_rel_diff``) against the workload's ``rlkernel`` row.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlkernel.bench.suite import BenchError, Options, Suite, Workload, select
from rlkernel.bench.timing import quantile

WORKER = "rlkernel.bench._multigpu_worker"
# Lines of rank 0 that start with this are progress: echoed while the run goes on.
PROGRESS = "multigpu:"
# workload -> its implementations, in row order (the baseline first).
KINDS: dict[str, tuple[str, ...]] = {
    "tp_logprobs_entropy_fwd_bwd": ("rlkernel", "rlkernel_tp", "all_reduce_dhidden"),
    "fsdp2_head_fwd_bwd": (
        "rlkernel", "rlkernel_dtensor", "rlkernel_dtensor_fp32", "all_gather_reduce_scatter"
    ),
}  # fmt: skip
BASELINE = "rlkernel"
# The collectives timed alone: no speed-up over the baseline (a figure of their own).
ALONE = ("all_reduce_dhidden", "all_gather_reduce_scatter")
# Implementations whose step spans every rank (timed as the slowest rank's step).
COLLECTIVE = ("rlkernel_tp", "all_reduce_dhidden", "rlkernel_dtensor", "rlkernel_dtensor_fp32",
              "all_gather_reduce_scatter")  # fmt: skip
VOCAB, VOCAB_SMOKE = 151936, 101
TP_SIZE, TP_SIZE_SMOKE = (8192, 4096), (32, 16)  # (N, H)
FSDP2_SIZES, FSDP2_SIZES_SMOKE = ((8192, 4096), (4096, 1024)), ((32, 16), (16, 8))  # (N, H)
# Per world size: the whole torchrun (start, NCCL set-up, first-call compiles, the timing) is killed
# after this. Estimated (before any GPU run): about a minute per world size on H100s, most of it the
# processes' start and the first calls' compiles.
DEADLINE_S, DEADLINE_SMOKE_S = 240, 120
MIN_STEPS = 10  # isolated steps per implementation, at least


def world_sizes(requested: tuple[int, ...] | None, device_count: int, smoke: bool) -> tuple[int, ...]:
    """The GPU counts of a run: ``requested`` (``--gpus``) checked, else 2, 4, 8, … up to
    ``device_count`` (``--smoke``: 2 CPU ranks). Raises BenchError for a count below 2, or above the
    GPUs present."""
    if requested is not None:
        bad = [w for w in requested if w < 2]
        if bad:
            raise BenchError(f"--gpus: every count must be >= 2 (one torchrun run per count), got {bad[0]}")
        if not smoke and max(requested) > device_count:
            raise BenchError(f"--gpus {max(requested)}: this machine has {device_count} CUDA device(s)")
        return tuple(dict.fromkeys(requested))
    if smoke:
        return (2,)
    if device_count < 2:
        raise BenchError(
            f"the multigpu suite needs at least 2 CUDA GPUs, this machine has {device_count}: run "
            "'rlkernel bench multigpu --smoke' to check the pipeline on the CPU (gloo)"
        )
    out, w = [], 2
    while w <= device_count:
        out.append(w)
        w *= 2
    return tuple(out)


def visible_devices(world: int, current: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a run on the first ``world`` GPUs of those ``current`` (this
    process's ``CUDA_VISIBLE_DEVICES``; None or empty: all) makes visible."""
    ids = [x.strip() for x in current.split(",") if x.strip()] if current else [str(i) for i in range(world)]
    return ",".join(ids[:world])


def timing_counts(opts: Options) -> tuple[int, int, int]:
    """(warm-up calls, rounds, steps per round): the run's options, with at least :data:`MIN_STEPS`
    steps and 2 warm-up calls per implementation on the GPU (``--smoke``: as given)."""
    if opts.smoke:
        return opts.warmup, opts.rounds, opts.reps
    reps = max(opts.reps, -(-MIN_STEPS // opts.rounds))
    return max(opts.warmup, 2), opts.rounds, reps


def worker_command(world: int, out: Path, opts: Options, workloads: tuple[str, ...]) -> list[str]:
    """The torchrun command line of one run."""
    warmup, rounds, reps = timing_counts(opts)
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
        "-m", WORKER, "--out", str(out), "--workload", ",".join(workloads),
        "--warmup", str(warmup), "--rounds", str(rounds), "--reps", str(reps),
        *(["--smoke"] if opts.smoke else []),
    ]  # fmt: skip


def _worker_env(world: int, smoke: bool) -> dict[str, str]:
    import rlkernel

    # The workers import the rlkernel this process runs (a source checkout on PYTHONPATH included).
    root = str(Path(rlkernel.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    visible = visible_devices(world, os.environ.get("CUDA_VISIBLE_DEVICES"))
    env["CUDA_VISIBLE_DEVICES"] = "" if smoke else visible
    env.setdefault("OMP_NUM_THREADS", "1")  # (torchrun's default; set here, its banner is not printed)
    return env


def launch(
    cmd: list[str], env: dict[str, str], deadline_s: float, log: Callable[[str], None]
) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own, echo its progress lines, kill the whole session at the
    deadline (or when this process is terminated); returns (exit status or None if killed, the tail
    of its output)."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        start_new_session=True,
    )  # fmt: skip
    tail: deque[str] = deque(maxlen=60)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if line.startswith(PROGRESS):
                log("    " + line[len(PROGRESS) :].strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def terminated(signum, frame):  # a step limit's SIGTERM: the workers must not outlive us
        raise SystemExit(128 + signum)

    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if on_main else None
    rc: int | None = None
    try:
        rc = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        tail.append(f"(killed after {deadline_s} s)")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    return rc, "\n".join(tail)


# --------------------------------------------------------------------------------------------------
# Records -> rows
# --------------------------------------------------------------------------------------------------


def _key(rec: dict) -> tuple:
    return (rec["workload"], rec["world_size"], rec["n_tokens"], rec["hidden"], rec["vocab"])


def _ms_text(ms: float) -> str:
    return f"{ms:.3g} ms"


def make_rows(records: list[dict], env: dict[str, str], ceilings: dict[str, float]) -> list[dict[str, Any]]:
    """One row per record of a run (rank 0's), in its order: times from the step samples,
    ``speedup_vs_baseline`` against the ``rlkernel`` row of the same workload and size, the
    ``ceiling`` records' times from the GEMM rate measured in the run, the ratios in the notes."""
    gemm = ceilings.get("gemm_tflops", 0.0) * 1e12
    medians = {(_key(r), r["impl"]): statistics.median(r["samples"]) for r in records if r.get("samples")}
    rows = []
    for rec in records:
        key, impl, gpus = _key(rec), rec["impl"], rec["gpus"]
        xs = rec.get("samples") or []
        ms = statistics.median(xs) if xs else None
        flops = rec.get("flops")
        if impl == "ceiling" and flops and gemm:
            ms = flops / (gpus * gemm) * 1e3
        base = medians.get((key, BASELINE))
        tflops = flops / (ms / 1e3) / 1e12 if flops and ms else None
        notes = [rec.get("notes", "")]
        if base and ms and impl in ("rlkernel_dtensor", "rlkernel_dtensor_fp32"):
            notes.append(f"DTensor / plain = {ms / base:.2f}x")
        if base and impl == "rlkernel_tp":
            notes.append(f"perfect split (1 GPU / {gpus}) = {_ms_text(base / gpus)}")
        if ms and rec.get("bytes") and impl in ALONE:
            notes.append(f"{rec['bytes'] / 1e9 / (ms / 1e3):.0f} GB/s of tensor bytes per second")
        rows.append(
            {
                "suite": "multigpu",
                "workload": rec["workload"],
                "pass": rec.get("pass", "fwd+bwd"),
                "gpus": gpus,
                "world_size": rec["world_size"],
                "n_tokens": rec["n_tokens"],
                "hidden": rec["hidden"],
                "vocab": rec["vocab"],
                "impl": impl,
                "status": rec["status"],
                "median_ms": ms,
                "p20_ms": quantile(xs, 0.2) if xs else None,
                "p80_ms": quantile(xs, 0.8) if xs else None,
                "samples": len(xs) or None,
                "first_call_s": rec.get("first_call_s"),
                "peak_extra_gb": rec["peak_bytes"] / 1e9 if rec.get("peak_bytes") is not None else None,
                "bytes_gb": rec["bytes"] / 1e9 if rec.get("bytes") else None,
                "tflops": tflops,
                "frac_gemm": tflops * 1e12 / (gpus * gemm) if tflops and gemm else None,
                "speedup_vs_baseline": base / ms if base and ms and impl not in ALONE else None,
                "max_abs_diff": rec.get("max_abs_diff"),
                "grad_rel_diff": rec.get("grad_rel_diff"),
                "ceiling_copy_tbps": ceilings.get("copy_tbps"),
                "ceiling_gemm_tflops": ceilings.get("gemm_tflops"),
                **env,
                "notes": "; ".join(n for n in notes if n),
            }
        )
    return rows


def failed_rows(workload: str, world: int, sizes: list[tuple[int, int]], vocab: int, problem: str,
                env: dict[str, str]) -> list[dict[str, Any]]:  # fmt: skip
    """Rows for a workload a run did not record: every implementation, ``error: <problem>``."""
    status = "error: " + " ".join(problem.split())[:300]
    out = []
    for n, h in sizes:
        for impl in KINDS[workload]:
            gpus = 1 if impl == BASELINE else world
            out.append({"suite": "multigpu", "workload": workload, "pass": "fwd+bwd", "gpus": gpus,
                        "world_size": world, "n_tokens": n, "hidden": h, "vocab": vocab, "impl": impl,
                        "status": status, **env, "notes": ""})  # fmt: skip
    return out


def sizes_of(workload: str, smoke: bool) -> list[tuple[int, int]]:
    """The (N, H) sizes of a workload."""
    if workload == "tp_logprobs_entropy_fwd_bwd":
        return [TP_SIZE_SMOKE if smoke else TP_SIZE]
    return list(FSDP2_SIZES_SMOKE if smoke else FSDP2_SIZES)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def run(opts: Options, *, log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """One torchrun run per GPU count; returns (rows, meta) like :func:`rlkernel.bench.harness.run_suite`."""
    from rlkernel.bench import ceilings as ceil_mod

    for flag, value in (("--n", opts.n_tokens), ("--v", opts.vocab), ("--impl", opts.impls)):
        if value is not None:
            raise BenchError(f"{flag} does not apply to the multigpu suite (fixed sizes and implementations)")
    workloads = select(opts.workloads, tuple(KINDS), "workload", "multigpu")
    device_count = 0 if opts.smoke else torch.cuda.device_count()
    worlds = world_sizes(opts.gpus, device_count, opts.smoke)
    deadline = DEADLINE_SMOKE_S if opts.smoke else DEADLINE_S
    vocab = VOCAB_SMOKE if opts.smoke else VOCAB
    t_start = time.perf_counter()
    log(f"rlkernel bench multigpu: {', '.join(workloads)} on {' and '.join(map(str, worlds))} "
        f"{'CPU ranks (gloo, smoke)' if opts.smoke else 'GPUs'}; at most {deadline} s per run")  # fmt: skip
    rows: list[dict] = []
    runs: list[dict] = []
    env: dict[str, str] | None = None
    for world in worlds:
        visible = "" if opts.smoke else visible_devices(world, os.environ.get("CUDA_VISIBLE_DEVICES"))
        log(f"[{world} {'ranks' if opts.smoke else 'GPUs'}] torchrun --nproc-per-node {world}"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""))  # fmt: skip
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"rlkernel-multigpu-{world}-") as tmp:
            cmd = worker_command(world, Path(tmp), opts, workloads)
            rc, tail = launch(cmd, _worker_env(world, opts.smoke), deadline, log)
            got = _read(Path(tmp), world)
        run_env = got.get("env") or env or ceil_mod.collect_env(torch.device("cpu" if opts.smoke else "cuda"))
        env = env or got.get("env")
        records = got.get("records", [])
        rows += make_rows(records, run_env, got.get("ceilings", {}))
        problem = None
        if rc != 0:
            errors = "; ".join(f"rank {r}: {e}" for r, e in sorted(got.get("errors", {}).items()))
            problem = errors or ("killed at the time limit" if rc is None else f"torchrun exited with {rc}")
            done = {r["workload"] for r in records}
            for name in (w for w in workloads if w not in done):
                rows += failed_rows(name, world, sizes_of(name, opts.smoke), vocab, problem, run_env)
            indented = "\n".join("      " + x for x in tail.splitlines())
            log(f"    failed: {problem}\n    output tail:\n{indented}")
        wall = round(time.perf_counter() - t0, 1)
        runs.append({"world_size": world, "cuda_visible_devices": visible, "returncode": rc,
                     "problem": problem, "wall_s": wall, "ceilings": got.get("ceilings"),
                     "command": " ".join(cmd)})  # fmt: skip
        log(f"    {wall} s: " + _summary([r for r in rows if r["world_size"] == world]))
    meta = {
        "suite": "multigpu",
        "description": SUITE.description,
        "env": env or ceil_mod.collect_env(torch.device("cpu")),
        "runs": runs,
        "options": {"gpus": list(worlds), "workloads": list(workloads), "smoke": opts.smoke,
                    "warmup_rounds_reps": list(timing_counts(opts))},  # fmt: skip
        "command": " ".join(sys.argv),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    log(f"done in {meta['wall_s']} s")
    return rows, meta


def _read(out: Path, world: int) -> dict:
    """Rank 0's records, env and ceilings, and every rank's error (``{rank: message}``)."""
    got: dict = {"errors": {}}
    for rank in range(world):
        path = out / f"rank{rank}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if data.get("error"):
            got["errors"][rank] = data["error"]
        if rank == 0:
            got.update({k: data[k] for k in ("records", "env", "ceilings") if k in data})
    return got


def _summary(rows: list[dict]) -> str:
    """The run's ratios: the TP speed-up, DTensor ÷ plain per size; failed rows by status."""
    parts = []
    for r in rows:
        s = r.get("speedup_vs_baseline")
        if r["impl"] == "rlkernel_tp" and s:
            parts.append(f"TP speed-up {s:.2f}x")
        elif r["impl"].startswith("rlkernel_dtensor") and s:
            parts.append(f"{r['impl']} / plain at H={r['hidden']}: {1 / s:.2f}x")
        elif r["impl"] != "ceiling" and r.get("median_ms") is None:
            parts.append(f"{r['impl']} {str(r['status'])[:80]}")
    return ", ".join(parts) or "no rows"


def _no_workloads(opts: Options) -> list[Workload]:
    raise BenchError("the multigpu suite runs under torchrun (rlkernel.bench.multigpu.run), not here")


SUITE = Suite(
    name="multigpu",
    description=(
        "the LM head over several GPUs, one torchrun run per GPU count: vocab-parallel (tp_group) vs "
        "one GPU, and the FSDP2 DTensor head vs the plain head; log-probs + entropy fwd+bwd, bf16"
    ),
    impls=tuple(dict.fromkeys(i for impls in KINDS.values() for i in impls)),
    kinds=tuple(KINDS),
    param_columns=("gpus", "world_size", "n_tokens", "hidden", "vocab"),
    baseline=BASELINE,
    build=_no_workloads,
    runner=run,
    bytes_doc=(
        "compute-bound (tp rows): flops = 4 * 2*N*H*V (logits, their recomputation, dhidden, dweight); "
        "ceiling = flops / (gpus * GEMM rate of rank 0's GPU); collective rows: tensor bytes"
    ),
)
