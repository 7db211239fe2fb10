"""scripts/count_host_work.py: its counter on a tiny step (the full cases take minutes interpreted):
Python calls, torch ops, new tensors and host reads are counted, marks taken at the first GEMM."""

from __future__ import annotations

import torch


def test_counts_a_small_step(load_script):
    script = load_script("count_host_work")
    a = torch.randn(3, 4)

    def step():
        b = (a * 2).sum(0)  # two ops, two new tensors
        c = a @ a.t()  # a view op, then the first GEMM
        return float(b[0]) + float(c[0, 0])  # two host reads

    rows, counter = script.merged(step)
    ret = rows["return"]
    assert ret["py calls"] >= 1 and ret["torch ops"] >= 5 and ret["syncs"] == 2 and ret["allocs"] >= 3
    assert rows["first GEMM"]["torch ops"] == 3  # mul, sum, t and "first launch" not in rows
    assert counter.ops["aten.mm.default"] == 1
