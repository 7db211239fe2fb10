"""scripts/attention_tile_sweep.py --smoke: the forward candidates' bitwise comparison, the backward
tiles' determinism and agreement, and SDPA's rows run in the CPU interpreter at tiny sizes."""

from __future__ import annotations

import re


def test_sweep_table(run_script):
    out = run_script("attention_tile_sweep", "--smoke")
    table = out[out.index("=== attention tiles") :]
    assert re.search(r"^B=1 T=40 +sdpa fwd\+bwd ", table, re.MULTILINE)
    fwd = re.findall(r"^B=1 T=40 +fwd (\S+) w\d s\d .* bitwise=(\w+)", table, re.MULTILINE)
    assert [tile for tile, _ in fwd] == ["16/16", "32/16"] and {same for _, same in fwd} == {"True"}
    bwd = re.findall(r"^B=1 T=40 +bwd\[(\w+)\] .* det=(\w+) relerr=(\S+)", table, re.MULTILINE)
    assert [kind for kind, _, _ in bwd] == ["default", "dkdv", "dq"]
    assert all(det == "True" and float(err) < 1e-6 for _, det, err in bwd)


def test_other_key_blocks_are_compared_with_sdpa(run_script):
    """--block-n: forward candidates with another key block (another formula) run and agree with
    SDPA's output (no bitwise claim), the default's own row first."""
    out = run_script("attention_tile_sweep", "--smoke", "--kernels", "fwd", "--block-n", "32")
    table = out[out.index("=== attention tiles") :]
    rows = re.findall(r"^B=1 T=40 +fwd (\S+) w\d s\d \(formula\) .* vs_sdpa=(\S+)", table, re.MULTILINE)
    assert [tile for tile, _ in rows] == ["16/16", "16/32"]
    assert all(float(err) < 1e-4 for _, err in rows)
