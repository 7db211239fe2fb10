"""The multi-process test harness shared by ``tests/distributed`` (gloo workers spawned by
``torch.multiprocessing``) and ``tests/multi_gpu`` (workers under ``torchrun``): each rank runs named
checks in order and records ``{check: "ok" | traceback}`` in ``rank<r>.json``; the parent test runs
the group once (module-scoped, with a deadline, never hanging) and reports each check on every rank.

Importable as ``_rank_checks``: pytest puts ``tests/`` on ``sys.path`` (``tests`` has no
``__init__.py``), spawned workers inherit it, and :func:`run_torchrun` passes it to torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------- worker side
def run_checks(
    checks: Iterable[tuple[str, Callable[[Any], None]]],
    ctx: Any,
    path: str,
    after_each: Callable[[], None] | None = None,
) -> bool:
    """Run ``checks`` (name, fn) on ``ctx`` in order, rewriting ``path`` with the results after each;
    stop at the first failure (its traceback is the record). Returns whether every check passed."""
    results: dict[str, str] = {}
    for name, fn in checks:
        try:
            fn(ctx)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test, then this rank stops
            results[name] = traceback.format_exc()
        finally:
            with open(path, "w") as f:
                json.dump(results, f)
        if results[name] != "ok":
            return False
        if after_each is not None:
            after_each()
    return True


def start_method(preload: list[str]) -> str:
    """How ``run_spawned`` starts its workers: ``"forkserver"`` where there is one, its server
    importing ``preload`` once (harmless if another module's server already runs: the workers then
    import those modules each), else ``"spawn"``."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(preload)
    return "forkserver"


def init_torchrun_group(smoke: bool, timeout_s: float):
    """The process group of a torchrun worker: gloo on the CPU (``smoke``: one thread) or NCCL on
    ``LOCAL_RANK``'s GPU (the bench's multigpu worker's start). Returns the rank's device."""
    from rlkernel.bench._multigpu_worker import init_torchrun_group as init

    return init(smoke, timeout_s)


def worker_args(doc: str) -> argparse.Namespace:
    """A torchrun worker's command line: ``--out DIR`` (for ``rank<r>.json``) and ``--smoke``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    parser.add_argument("--smoke", action="store_true", help="gloo on the CPU, tiny sizes")
    return parser.parse_args()


def finish_torchrun_worker(checks, ctx: Any, out: str, rank: int, device) -> int:
    """Run ``checks`` on a torchrun worker (``rank<r>.json`` in ``out``; CUDA memory freed between
    checks); 1 on a failure (torchrun then stops the other ranks), else a clean shutdown and 0."""
    import torch
    import torch.distributed as dist

    after_each = torch.cuda.empty_cache if device.type == "cuda" else None
    if not run_checks(checks, ctx, os.path.join(out, f"rank{rank}.json"), after_each):
        return 1
    dist.barrier()
    dist.destroy_process_group()
    return 0


def init_gloo_worker(rank: int, world: int, init_file: str, timeout_s: float) -> None:
    """The process group of a spawned gloo worker (one thread: the workers share the CI machine's
    2 cores), rendezvous through ``init_file``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (of detached tensors)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def median_ms(fn: Callable[[], None], reps: int) -> float:
    """Median wall time of ``fn`` in ms (synchronized; on a GPU the queue is drained before each
    call), after one warm-up call (compiles, allocator)."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


# ------------------------------------------------------------------------------------- parent side
def read_results(out: Path, world: int) -> dict[int, dict[str, str]]:
    """Each rank's recorded results (empty for a rank that wrote none)."""
    results = {}
    for rank in range(world):
        path = out / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
    return results


def run_spawned(fn: Callable, world: int, out: Path, deadline_s: float, start_method: str):
    """``fn(rank, world, init_file, out_dir)`` on ``world`` processes; ``(results, problem)``, the
    problem None unless a worker failed outside its checks or the deadline passed (then every
    worker still alive is terminated)."""
    import torch.multiprocessing as tmp

    procs = tmp.start_processes(
        fn, args=(world, str(out / "rendezvous"), str(out)), nprocs=world, join=False,
        start_method=start_method,
    )  # fmt: skip
    problem = None
    deadline = time.monotonic() + deadline_s
    try:
        while not procs.join(timeout=1.0):
            if time.monotonic() > deadline:
                problem = f"the workers did not finish within {deadline_s} s"
                break
    except Exception as err:  # ProcessRaisedException / ProcessExitedException: the worker's traceback
        problem = f"a worker failed outside the checks:\n{err}"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return read_results(out, world), problem


def run_torchrun(worker: Path, out: Path, world: int, deadline_s: float, smoke: bool):
    """``torchrun --standalone --nproc_per_node=world worker --out out [--smoke]`` in a session of its
    own, killed (the whole group) at the deadline; ``(results, problem)``, the problem None unless
    torchrun failed or timed out (then with its output's tail)."""
    src = TESTS_DIR.parent / "src"
    path = [str(src), str(TESTS_DIR), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
        str(worker), "--out", str(out), *(["--smoke"] if smoke else []),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    problem = None
    try:
        log, _ = proc.communicate(timeout=deadline_s)
        if proc.returncode != 0:
            problem = f"torchrun exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        problem = f"the run did not finish within {deadline_s} s (killed)"
    tail = log.decode(errors="replace")[-4000:]
    return read_results(out, world), (f"{problem}; output tail:\n{tail}" if problem else None)


def runs_by_world(tmp_path_factory, name: str, launch: Callable[[int, Path], tuple], *, cuda: bool):
    """``run(world)`` for a module fixture: ``launch(world, out_dir)`` (a ``(results, problem)``
    pair) once per world size, kept for the module; with ``cuda``, a world size larger than the
    CUDA device count skips."""
    done: dict[int, tuple] = {}

    def run(world: int) -> tuple:
        import pytest
        import torch

        if cuda and torch.cuda.device_count() < world:
            pytest.skip(f"needs {world} CUDA devices (a CPU-only machine runs the checks tiny on gloo)")
        if world not in done:
            done[world] = launch(world, tmp_path_factory.mktemp(f"{name}_{world}"))
        return done[world]

    return run


def fail_unless_ok(results: dict[int, dict[str, str]], problem: str | None, check: str, where: str) -> None:
    """``pytest.fail`` with every rank's traceback (or why it did not run) unless ``check`` passed on
    every rank. ``where`` ends the message's first line (e.g. "on 2 ranks")."""
    import pytest

    failures = []
    for rank in sorted(results):
        status = results[rank].get(check)
        if status is None:
            failed = [f"{c} (rank {r})" for r in sorted(results) for c, s in results[r].items() if s != "ok"]
            failures.append(f"rank {rank}: not run (earlier failure: {failed or problem})")
        elif status != "ok":
            failures.append(f"rank {rank}:\n{status}")
    if failures:
        pytest.fail(f"{check} {where}:\n" + "\n".join(failures), pytrace=False)
