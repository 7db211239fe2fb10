"""How much host work one public call does, countable without a GPU: the call runs on tiny CPU
tensors with Triton's interpreter, and between the call's start and its first kernel launch (the
first GEMM for the hidden cases), and over the whole call (forward + backward), this counts

    py calls     Python function calls (``sys.setprofile``; the interpreted kernels' own are not counted)
    c calls      calls of C functions and methods (``len``, ``isinstance``, tensor methods, ...)
    torch ops    ATen ops dispatched (``TorchDispatchMode``; views and metadata ops included)
    allocs       ops whose output has a storage none of their inputs had (a new tensor)
    syncs        reads of a tensor value by the host (``aten::_local_scalar_dense``/``is_nonzero``:
                 ``.item()``, ``bool(t)``; and ``.tolist()`` calls; a device -> host copy on a GPU)
    launches     Triton kernel launches

The counts stand for host time on a GPU machine (a torch op, a launch: several us each there; a
Python call under 1 us). The routes are a CUDA call's, with these differences on the CPU: an id
check reads its result at once (the device-plan route: one ``tolist`` here, pinned memory on CUDA;
before the fused hidden check, torch ops before the engine instead of a deferred launch after it),
and the hidden cases run the cuBLAS-chunk back end (CUDA's default on an H100: the epilogue kernel),
in one 64-row chunk. The cases are ``scripts/profile_call.py``'s (its ``--smoke`` sizes, default
arguments, temperature 0.9):

    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/count_host_work.py            # dapo hidden_dapo
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/count_host_work.py --cases gspo --ops
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernels are decorated: before the import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import rlkernel as rk  # noqa: E402

_spec = importlib.util.spec_from_file_location("profile_call", Path(__file__).with_name("profile_call.py"))
profile_call = importlib.util.module_from_spec(_spec)
sys.modules["profile_call"] = profile_call  # its dataclass looks its module up
_spec.loader.exec_module(profile_call)

GEMM_OPS = {"aten.mm.default", "aten.mm.out", "aten.addmm.default", "aten.addmm.out", "aten.bmm.default",
            "aten.matmul.default", "aten.baddbmm.default", "aten._addmm_activation.default"}  # fmt: skip
GEMM_CALLS = {"mm", "addmm", "matmul", "bmm", "baddbmm", "linear"}
GEMM_KERNEL_WORDS = ("linear_head", "matmul", "gemm")
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default"}
KEYS = ("py calls", "c calls", "torch ops", "allocs", "syncs", "launches")


def _is_launch(frame) -> str | None:
    """The kernel's name when ``frame`` is a Triton launch (interpreter or compiled), else None."""
    code = frame.f_code
    if code.co_name == "run" and code.co_filename.endswith(("runtime/interpreter.py", "runtime/jit.py")):
        fn = frame.f_locals.get("self")
        return getattr(getattr(fn, "fn", None), "__name__", None) or "kernel"
    return None


class Counter(TorchDispatchMode):
    """Counts the events of the module docstring; ``marks`` records the counts at the first launch
    and the first GEMM. ``calls``: count Python and C calls (``sys.setprofile``), else the torch ops
    (the dispatch mode's own Python calls would inflate the calls: two runs)."""

    def __init__(self, calls: bool) -> None:
        super().__init__()
        self.calls = calls
        self.n = collections.Counter()
        self.ops = collections.Counter()
        self.depth = 0  # > 0 inside a launch: the interpreter's work is not the host's
        self.marks: dict[str, dict] = {}
        self.kernels: list[str] = []

    def _mark(self, name: str) -> None:
        if name not in self.marks:
            self.marks[name] = dict(self.n)

    def profile(self, frame, event, arg):
        if self.depth:
            if event == "return" and frame is self.launch_frame:
                self.depth = 0
            return
        if event == "call":
            kernel = _is_launch(frame)
            if kernel is not None:
                self.kernels.append(kernel)
                self._mark("first launch")
                if any(w in kernel for w in GEMM_KERNEL_WORDS):
                    self._mark("first GEMM")
                self.n["launches"] += 1
                self.depth, self.launch_frame = 1, frame
                return
            if self.calls:
                self.n["py calls"] += 1
        elif event == "c_call":
            name = getattr(arg, "__name__", "")
            if name in GEMM_CALLS:  # (the calls' run sees no dispatched op)
                self._mark("first GEMM")
            if self.calls:
                self.n["c calls"] += 1
            elif name == "tolist":  # a host read that dispatches no scalar op
                self.n["syncs"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth:
            return func(*args, **kwargs)
        name = str(func)
        if name in GEMM_OPS:
            self._mark("first GEMM")
        self.n["torch ops"] += 1
        self.ops[name] += 1
        if name in SYNC_OPS:
            self.n["syncs"] += 1
        inputs = set()
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    inputs.add(t.untyped_storage().data_ptr())
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.n["allocs"] += 1
                self.ops["(alloc) " + name] += 1
        return out


def count(step, calls: bool) -> Counter:
    c = Counter(calls)
    with contextlib.nullcontext() if calls else c:
        sys.setprofile(c.profile)
        try:
            step()
        finally:
            sys.setprofile(None)
    return c


def merged(step) -> tuple[dict[str, dict], Counter]:
    """The counts at each mark and at the return, the calls' run and the ops' run merged."""
    a, b = count(step, calls=True), count(step, calls=False)
    rows = {}
    for m in ("first launch", "first GEMM"):
        if m in a.marks or m in b.marks:
            rows[m] = {**b.marks.get(m, {}), **a.marks.get(m, {})}
    rows["return"] = {**b.n, **a.n}
    return rows, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", default=["dapo", "hidden_dapo"],
                        choices=[*profile_call.LOGITS_CASES, *profile_call.HIDDEN_CASES])  # fmt: skip
    parser.add_argument("--forward-only", action="store_true", help="the forward without backward")
    parser.add_argument("--no-validate", action="store_true", help="validate=False")
    parser.add_argument("--ops", action="store_true", help="list the torch ops and the kernels")
    parser.add_argument("--option", type=profile_call.option_value, action="append", default=[],
                        metavar="NAME=VALUE", help="rk.use_options(NAME=VALUE) around the calls, e.g. "
                        "linear_head_gemm=triton (the H100's epilogue back end, interpreted)")  # fmt: skip
    args = parser.parse_args(argv)
    pargs = profile_call.parse_args(["--smoke"] + (["--forward-only"] if args.forward_only else [])
                                    + (["--no-validate"] if args.no_validate else []))  # fmt: skip
    pargs.n = pargs.tokens[0]
    device = torch.device("cpu")
    print(f"{'case':28s} {'until':12s}" + "".join(f"{k:>10s}" for k in KEYS))
    # The kernels' routes on CPU tensors (as "auto" on CUDA); the hidden cases in one 64-row chunk
    # and group (the default 4096 padded rows take minutes interpreted; the calls are the same).
    rows = profile_call.SMOKE_TOKENS * profile_call.SMOKE_VOCAB * 4
    options = {"linear_chunk_bytes": rows, "linear_grad_bytes": rows, **dict(args.option)}
    with rk.use_backend("triton"), rk.use_options(**options):
        for name in args.cases:
            report(name, args, pargs, device)
    return 0


def report(name: str, args, pargs, device: torch.device) -> None:
    """One case's rows (and with ``--ops`` its torch ops and kernels)."""
    if name in profile_call.HIDDEN_CASES:
        case = profile_call.hidden_case(name, pargs.n, pargs, device)
    else:
        case = profile_call.logits_case(name, pargs.vocab[0], pargs, device)
    case.step()  # memos and first-call caches warm, as in a training loop
    count(case.step, calls=False)  # (the first dispatch-mode run imports what the mode needs)
    rows, c = merged(case.step)
    for label, counts in rows.items():
        print(f"{name:28s} {label:12s}" + "".join(f"{counts.get(k, 0):10d}" for k in KEYS))
    if args.ops:
        for op, k in sorted(c.ops.items(), key=lambda kv: -kv[1]):
            print(f"    {k:4d}  {op}")
        print("    kernels: " + ", ".join(c.kernels))


if __name__ == "__main__":
    sys.exit(main())
