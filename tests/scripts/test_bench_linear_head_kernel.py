"""scripts/bench_linear_head_kernel.py --smoke: the kernel tables (with their checks against the
unfused path and the invariance check), the launch host times and the scale pass run in the CPU
interpreter."""

from __future__ import annotations

import re


def test_every_section(run_script):
    out = run_script("bench_linear_head_kernel", "--smoke", "--configs", "small", "--m", "16",
                     "--sections", "tables", "launch", "scale_cast", "--launch-calls", "1")  # fmt: skip
    assert "=== M = 16 (H = 64, V = 1000)" in out
    assert "small: invariance" in out and "inv ok" in out and "FAIL" not in out and "ERROR" not in out
    logp = [float(x) for x in re.findall(r"\|Δlogp\| ([\d.e+-]+)", out)]
    assert len(logp) == 6 and max(logp) < 1e-4  # 2 against float64, 4 against the unfused path
    grad = [float(x) for x in re.findall(r"\|Δ\|/max ([\d.e+-]+)", out)]
    assert len(grad) == 1 and grad[0] < 2**-7  # within a bf16 rounding
    launch = re.findall(r"^(\S.{47}) +([\d.]+) +([\d.]+)$", out[out.index("=== launch") :], re.MULTILINE)
    names = ["stats_partials", "combine_partials", "linear_head_grad_from_shifted", "linear_head_grad_into"]
    assert [name.split()[0] for name, _, _ in launch] == names
    assert all(float(fast) > 0 and float(slow) > 0 for _, fast, slow in launch)
    scale_cast = out[out.index("=== scale_cast") :]
    scale_rows = re.findall(r"^(fp32 -> bf16|bf16 in place)", scale_cast, re.MULTILINE)
    assert len(scale_rows) == 4
