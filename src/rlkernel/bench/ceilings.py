"""The machine: hardware ceilings measured in the same run as the benchmarks they judge, and the
environment (GPU, versions, date, commit) that every result row records.

* **Copy bandwidth**: ``dst.copy_(src)`` of a 1 GiB bf16 tensor on the device; bytes = read + written
  (2 GiB per call); median of 20 calls after 10 warm-up calls. This is what a perfectly streaming kernel
  can reach on this GPU at this moment (≈ 3.0 TB/s on an H100 SXM), a tighter and more honest ceiling
  than the datasheet's HBM peak.
* **GEMM rate**: ``torch.mm`` of two 8192 × 8192 bf16 matrices (cuBLAS); 2·8192³ flops per call;
  median of 20 calls after 10 warm-up calls.

On CPU the same two measurements run on small fp32 tensors (``--smoke``: 8 MiB copy, 256³ matmul):
numbers that only keep the pipeline honest, never a roofline.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from rlkernel.bench.timing import time_interleaved


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float
    gemm_flops_per_s: float
    copy_desc: str
    gemm_desc: str

    def describe(self) -> str:
        return (
            f"copy {self.copy_bytes_per_s / 1e12:.3f} TB/s ({self.copy_desc}); "
            f"GEMM {self.gemm_flops_per_s / 1e12:.1f} TFLOP/s ({self.gemm_desc})"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "copy_tbps": self.copy_bytes_per_s / 1e12,
            "gemm_tflops": self.gemm_flops_per_s / 1e12,
            "copy": self.copy_desc,
            "gemm": self.gemm_desc,
        }


def _median_ms(fn, device: torch.device, *, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    samples = time_interleaved({"x": lambda _i: fn()}, device, rounds=1, reps=reps)["x"]
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, *, numel: int, dtype: torch.dtype, reps: int = 20) -> float:
    """Bytes per second of ``dst.copy_(src)`` (read + write) for ``numel`` elements."""
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, warmup=10, reps=reps)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def gemm_rate(device: torch.device, *, size: int, dtype: torch.dtype, reps: int = 20) -> float:
    """Flops per second of ``torch.mm`` on two ``size × size`` matrices."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    ms = _median_ms(lambda: torch.mm(a, b, out=out), device, warmup=10, reps=reps)
    return 2 * size**3 / (ms / 1e3)


def measure(device: torch.device, *, smoke: bool = False) -> Ceilings:
    """The two ceilings on ``device`` (small CPU stand-ins when ``device`` is a CPU)."""
    if device.type == "cuda":
        bw = copy_bandwidth(device, numel=2**29, dtype=torch.bfloat16)
        fl = gemm_rate(device, size=8192, dtype=torch.bfloat16)
        result = Ceilings(bw, fl, "copy_ of 1 GiB bf16, read+write", "torch.mm 8192^3 bf16")
        torch.cuda.empty_cache()
        return result
    numel, size, reps = (2**21, 256, 5) if smoke else (2**24, 1024, 20)
    bw = copy_bandwidth(device, numel=numel, dtype=torch.float32, reps=reps)
    fl = gemm_rate(device, size=size, dtype=torch.float32, reps=reps)
    mib = numel * 4 // 2**20
    return Ceilings(bw, fl, f"CPU copy_ of {mib} MiB fp32, read+write", f"CPU torch.mm {size}^3 fp32")


def _dist_version(*names: str) -> str:
    import importlib.metadata as md

    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return ""


def git_commit() -> str:
    """``RLKERNEL_GIT_COMMIT`` if set, else ``git rev-parse`` of this checkout (+ ``-dirty``)."""
    env = os.environ.get("RLKERNEL_GIT_COMMIT", "").strip()
    if env:
        return env
    here = str(Path(__file__).resolve().parent)
    try:
        sha = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def collect_env(device: torch.device) -> dict[str, str]:
    """The columns every row carries: device, GPU name, versions, date (UTC), git commit."""
    import rlkernel

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"cpu ({platform.machine()}, {os.cpu_count()} cores; smoke run, not a GPU measurement)"
    return {
        "device": device.type,
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "triton": _dist_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "liger": _dist_version("liger-kernel", "liger_kernel"),
        "trl": _dist_version("trl"),
        "rlkernel": rlkernel.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
    }


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 size (0 on CPU: CPU smoke runs never rotate inputs)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))
