"""scripts/gpu_decode_gemm_sweep.py --smoke: the class check and the timing table run in the CPU
interpreter for two candidates (both in the table's bitwise class there too)."""

from __future__ import annotations

import re

CANDIDATES = ["m16n16k64s8w1", "m16n16k128s4w2"]


def test_class_check_and_table(run_script):
    out = run_script("gpu_decode_gemm_sweep", "--smoke", "--candidates", *CANDIDATES)
    verdicts = {name: verdict for verdict, name in re.findall(r"^CLASS (IN|OUT) +(\S+)", out, re.MULTILINE)}
    assert verdicts == dict.fromkeys(CANDIDATES, "IN")
    assert "2/2 in class" in out
    table = out[out.index("=== decode GEMM table") :]
    rows = re.findall(r"^(q/o|k/v|down) +(\d+) ", table, re.MULTILINE)
    assert sorted(rows) == sorted((s, m) for s in ("q/o", "k/v", "down") for m in ("1", "8"))
