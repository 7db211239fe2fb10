"""Result rows of a benchmark run (one per workload × implementation, plus a ``ceiling`` row per
workload) and their CSV/JSON files; the columns are documented in ``docs/guides/benchmarks.md``."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

from rlkernel.bench.suite import Measurement, Suite, Workload
from rlkernel.bench.timing import (  # noqa: F401 - re-exported: suites, tests and scripts use them here
    QUEUE_AHEAD_BYTES,
    gpu_time_ms,
    input_copies,
    quantile,
    synchronize,
    time_interleaved,
)

COMMON_HEAD = ("suite", "workload", "pass")
# median/p20/p80 over the isolated calls; the per-call time back to back (median over the loops) and
# the calls per loop; the host time of an isolated call (median, its start to its return on the host);
# peak memory above the inputs; achieved rates and fractions of the ceilings of
# this run; speedup over the suite's baseline (plain torch, isolated calls); the cross-check against
# the reference implementation; then the environment.
COMMON_TAIL = tuple(
    """impl status median_ms p20_ms p80_ms samples b2b_ms b2b_calls host_ms first_call_s peak_extra_gb
    bytes_gb tbps tflops frac_copy_bw frac_gemm speedup_vs_baseline max_abs_diff grad_rel_diff
    ceiling_copy_tbps ceiling_gemm_tflops device gpu torch cuda triton liger trl rlkernel python
    date_utc commit notes""".split()
)


def columns_for(suite: Suite) -> tuple[str, ...]:
    return COMMON_HEAD + suite.param_columns + COMMON_TAIL


def make_rows(
    suite: Suite, workload: Workload, results: list[Measurement], ceilings: Any, env: dict[str, str]
) -> list[dict[str, Any]]:
    """One row per implementation plus the ``ceiling`` row (native Python types; None = empty)."""
    bw, gemm = ceilings.copy_bytes_per_s, ceilings.gemm_flops_per_s
    medians = {m.impl: statistics.median(m.samples) for m in results if m.samples}
    base_ms = medians.get(suite.baseline)
    common = {"suite": suite.name, "workload": workload.name, "pass": workload.pass_, **workload.params}
    tail = {"ceiling_copy_tbps": bw / 1e12, "ceiling_gemm_tflops": gemm / 1e12, **env}
    gb = workload.bytes_moved / 1e9 if workload.bytes_moved is not None else None
    rows = []
    for m in results:
        ms = medians.get(m.impl)
        sec = ms / 1e3 if ms else None
        tbps = workload.bytes_moved / sec / 1e12 if sec and workload.bytes_moved is not None else None
        tflops = workload.flops / sec / 1e12 if sec and workload.flops is not None else None
        rows.append(
            {
                **common,
                "impl": m.impl,
                "status": m.status,
                "median_ms": ms,
                "p20_ms": quantile(m.samples, 0.2) if m.samples else None,
                "p80_ms": quantile(m.samples, 0.8) if m.samples else None,
                "samples": len(m.samples) or None,
                "b2b_ms": statistics.median(m.b2b_samples) if m.b2b_samples else None,
                "b2b_calls": m.b2b_calls if m.b2b_samples else None,
                "host_ms": statistics.median(m.host_samples) if m.host_samples else None,
                "first_call_s": m.first_call_s,
                "peak_extra_gb": m.peak_bytes / 1e9 if m.peak_bytes is not None else None,
                "bytes_gb": gb,
                "tbps": tbps,
                "tflops": tflops,
                "frac_copy_bw": tbps * 1e12 / bw if tbps is not None else None,
                "frac_gemm": tflops * 1e12 / gemm if tflops is not None else None,
                "speedup_vs_baseline": base_ms / ms if base_ms and ms else None,
                "max_abs_diff": m.max_abs_diff,
                "grad_rel_diff": m.grad_rel_diff,
                **tail,
                "notes": m.note,
            }
        )
    # The roofline: the minimal traffic at the measured copy bandwidth, the math at the GEMM rate.
    t_bytes = workload.bytes_moved / bw if workload.bytes_moved is not None else 0.0
    t_flops = workload.flops / gemm if workload.flops is not None else 0.0
    t = max(t_bytes, t_flops)
    if t > 0:
        bound = "copy bandwidth" if t_bytes >= t_flops else "bf16 GEMM rate"
        rows.append(
            {
                **common,
                "impl": "ceiling",
                "status": "model",
                "median_ms": t * 1e3,
                "bytes_gb": gb,
                "tbps": workload.bytes_moved / t / 1e12 if workload.bytes_moved is not None else None,
                "tflops": workload.flops / t / 1e12 if workload.flops is not None else None,
                "frac_copy_bw": t_bytes / t if workload.bytes_moved is not None else None,
                "frac_gemm": t_flops / t if workload.flops is not None else None,
                "speedup_vs_baseline": base_ms / (t * 1e3) if base_ms else None,
                **tail,
                "notes": f"bound by the {bound} measured in this run",
            }
        )
    return rows


def _csv_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_results(suite: Suite, rows: list[dict], meta: dict, out_dir: Path) -> tuple[Path, Path]:
    """``<out>/<suite>.csv`` (one row per workload × impl) and ``<out>/<suite>.json`` (meta + rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cols = columns_for(suite)
    csv_path, json_path = out_dir / f"{suite.name}.csv", out_dir / f"{suite.name}.json"
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({c: _csv_cell(row.get(c)) for c in cols})
    with json_path.open("w") as f:
        json.dump({"meta": meta, "columns": list(cols), "rows": rows}, f, indent=1, default=str)
        f.write("\n")
    return csv_path, json_path
