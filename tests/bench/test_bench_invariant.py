"""The ``invariant`` benchmark suite end to end on CPU (``--smoke``): one row per workload and
implementation, every rlkernel row cross-checked against the standard path, the selection errors.
"""

from __future__ import annotations

import csv

import pytest
import torch

from rlkernel.bench import SUITES, BenchError, cli, harness
from rlkernel.bench import invariant as bi

SUITE = SUITES["invariant"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_invariant")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU invariant path: many tiny GEMVs (see tests/invariant/test_patch.py)
    try:
        rc = cli.main(["invariant", "--smoke", "--rounds", "1", "--no-plot", "--out", str(out)])
    finally:
        torch.set_num_threads(n)
    with (out / "invariant.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rc, rows


def test_smoke_rows(smoke):
    rc, rows = smoke
    assert rc == 0
    assert list(rows[0]) == list(harness.columns_for(SUITE))
    assert {r["workload"] for r in rows} == set(bi.KINDS)
    keys = [(r["workload"], r["shape"], r["tokens"], r["impl"]) for r in rows]
    assert len(keys) == len(set(keys))
    for r in rows:
        assert r["device"] == "cpu"
        if r["impl"] == "flash_attn":
            assert r["status"].startswith("skipped")
        elif r["impl"] in ("rlkernel", "torch"):
            assert r["status"] == "ok", r
            assert float(r["median_ms"]) > 0
    impls = {(r["workload"], r["impl"]) for r in rows}
    assert ("attn_decode", "flash_attn") in impls and ("model_train", "rlkernel") in impls


def test_smoke_cross_checks(smoke):
    _, rows = smoke
    for r in rows:
        if r["impl"] == "rlkernel":
            assert float(r["max_abs_diff"]) <= 1e-5, r  # fp32 on the CPU
            if r["pass"] == "fwd+bwd":
                assert float(r["grad_rel_diff"]) <= 1e-4, r


def test_roofline_columns(smoke):
    _, rows = smoke
    by = {(r["workload"], r["impl"]): r for r in rows}
    assert float(by[("gemm", "rlkernel")]["tflops"]) > 0
    assert float(by[("rmsnorm", "rlkernel")]["tbps"]) > 0
    assert by[("model_prefill", "rlkernel")]["tflops"] == ""


def test_full_workload_list():
    opts = harness.Options(device=torch.device("cpu"))
    ws = bi.build(opts)
    gemm = [w for w in ws if w.name == "gemm"]
    assert len(gemm) == len(bi.GEMM_SHAPES) * len(bi.GEMM_M)
    assert any(w.params == {"shape": "N=4096 K=4096 q/o_proj", "tokens": 8192} for w in gemm)
    assert {w.params["tokens"] for w in gemm} == {1, 8, 64, 256, 2048, 8192}
    assert [w.name for w in ws if w.name.startswith("model")] == [
        "model_prefill",
        "model_decode",
        "model_train",
    ]
    quick = bi.build(harness.Options(device=torch.device("cpu"), quick=True))
    assert len(quick) < len(ws)


def test_selection_errors():
    with pytest.raises(BenchError, match="unknown workload"):
        bi.build(harness.Options(device=torch.device("cpu"), workloads=("nope",)))
    with pytest.raises(BenchError, match="fixed shapes"):
        bi.build(harness.Options(device=torch.device("cpu"), n_tokens=(8,)))
    assert cli.main(["invariant", "--smoke", "--impl", "cublas"]) == 2
