"""The ``linear`` bench suite end to end on CPU (``--smoke``): rows, cross-checks, skips, errors."""

from __future__ import annotations

import csv
import os

import pytest

from rlkernel.bench import SUITES, BenchError, cli, harness
from rlkernel.bench import linear as bli

SUITE = SUITES["linear"]
# The engine's Triton kernels run on the CPU only in the interpreter (tests/conftest.py turns it on
# when there is no GPU); on a GPU machine the CPU smoke run skips that implementation.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU smoke run of two workloads through the CLI (the frozen one is the same code path)."""
    out = tmp_path_factory.mktemp("bench_linear")
    argv = ["linear", "--smoke", "--rounds", "1", "--no-plot", "--out", str(out)]
    rc = cli.main([*argv, "--workload", "lmhead_logprobs_fwd_bwd,lmhead_dapo_kl_fwd_bwd"])
    with (out / "linear.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rc, rows


def test_smoke_rows_and_columns(smoke):
    rc, rows = smoke
    assert rc == 0
    assert list(rows[0]) == list(harness.columns_for(SUITE))
    keys = {(r["workload"], r["impl"]) for r in rows}
    assert keys == {
        ("lmhead_logprobs_fwd_bwd", i) for i in ("rlkernel", "torch", "cublas_gemms", "ceiling")
    } | {("lmhead_dapo_kl_fwd_bwd", i) for i in (*bli.IMPLS, "ceiling") if i not in bli.VARIANTS}
    for r in rows:
        assert r["n_tokens"] == "64" and r["hidden"] == "16" and r["vocab"] == "100"
        if r["impl"] == "liger" or (r["impl"] == "rlkernel_engine" and not INTERPRET):
            assert r["status"].startswith("skipped")
        elif r["impl"] == "ceiling":
            assert r["status"] == "model" and float(r["frac_gemm"]) == pytest.approx(1.0)
        else:
            assert r["status"] == "ok", r
            assert float(r["median_ms"]) > 0 and float(r["tflops"]) > 0


def test_smoke_cross_checks(smoke):
    """rlkernel vs plain torch, whose logits are bf16-rounded (|Δlogp| ~ |z|·2^-9): loose bounds."""
    _, rows = smoke
    checked = 0
    for r in rows:
        if r["impl"] in ("rlkernel", "rlkernel_engine") and r["status"] == "ok":
            assert float(r["max_abs_diff"]) <= 0.1, r
            assert float(r["grad_rel_diff"]) <= 0.1, r
            checked += 1
    assert checked == (3 if INTERPRET else 2)


def test_build_matrix_and_flops():
    import torch

    from rlkernel.bench.harness import Options

    ws = bli.build(Options(device=torch.device("cpu")))
    assert {w.params["n_tokens"] for w in ws} == set(bli.N_FULL)
    for w in ws:
        g = 2 if "frozen" in w.name else 3
        assert w.flops == g * 2 * w.params["n_tokens"] * w.params["hidden"] * w.params["vocab"]
        assert w.reference == "torch" and "cublas_gemms" in w.impls
    with pytest.raises(BenchError, match="workload"):
        bli.build(Options(device=torch.device("cpu"), workloads=("nope",)))
    with pytest.raises(BenchError, match="implementation"):
        bli.build(Options(device=torch.device("cpu"), impls=("nope",)))
