"""The opt-in variant implementations of the bench suites (rlkernel with one switch changed:
``rk.use_options(...)`` or a keyword), end to end on CPU (``--smoke``): they run only when named
with ``--impl``, each gives a measured row on the workloads it applies to, and the rows that can
be cross-checked agree with the plain-PyTorch reference.
"""

from __future__ import annotations

import csv
import os

import pytest
import torch

from rlkernel.bench import SUITES, cli, harness
from rlkernel.bench import invariant as bi
from rlkernel.bench import linear as bli
from rlkernel.bench import logits as bl

# The engine variant's Triton kernels run on the CPU only in the interpreter (tests/conftest.py
# turns it on when there is no GPU); on a GPU machine the CPU smoke run skips it.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def run(tmp_path, suite: str, impls: tuple[str, ...], workloads: tuple[str, ...]) -> list[dict]:
    argv = [suite, "--smoke", "--rounds", "1", "--no-plot", "--out", str(tmp_path)]
    assert cli.main([*argv, "--impl", ",".join(impls), "--workload", ",".join(workloads)]) == 0
    with (tmp_path / f"{suite}.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("suite", ["logits", "linear", "invariant"])
def test_variants_are_opt_in(suite, capsys):
    """Without ``--impl`` no workload runs a variant; ``--list`` names them apart."""
    variants = SUITES[suite].variants
    assert variants and set(variants) <= set(SUITES[suite].impls)
    workloads = SUITES[suite].build(harness.Options(device=torch.device("cpu"), smoke=True))
    assert not {i for w in workloads for i in w.impls} & set(variants)
    assert cli.main(["--list"]) == 0
    assert f"opt-in variants: {', '.join(variants)}" in capsys.readouterr().out


def test_logits_variants(tmp_path):
    """Every logits variant where it applies: the in-place backward on the log-prob and loss
    workloads (no cross-check: it overwrites its inputs), the loss switches on DAPO, and the same on
    the sliced (users') layout, where the in-place backward writes into the model output's copy."""
    kinds = ("logprobs_fwd_bwd", "dapo_kl_fwd_bwd", "gspo_fwd_bwd", "sliced_dapo_kl_fwd_bwd",
             "sliced_logprobs_entropy_fwd_bwd")  # fmt: skip
    rows = run(tmp_path, "logits", ("torch", *bl.VARIANTS), kinds)
    got = {(r["workload"], r["impl"]): r for r in rows}
    expected = {(k, "rlkernel_inplace") for k in ("logprobs_fwd_bwd", "sliced_logprobs_entropy_fwd_bwd")}
    expected |= {(k, v) for k in ("dapo_kl_fwd_bwd", "sliced_dapo_kl_fwd_bwd") for v in bl.VARIANTS}
    expected |= {("gspo_fwd_bwd", v) for v in ("rlkernel_inplace", "rlkernel_novalidate")}
    assert {k for k in got if k[1] in bl.VARIANTS} == expected
    for key in expected:
        r = got[key]
        assert r["status"] == "ok" and float(r["median_ms"]) > 0 and float(r["b2b_ms"]) > 0, r
        if key[1] == "rlkernel_inplace":
            assert r["max_abs_diff"] == "" and "not cross-checked" in r["notes"]
        else:
            assert float(r["max_abs_diff"]) <= 1e-5 and float(r["grad_rel_diff"]) <= 1e-2, r
    assert "token_level_fusion=False" in got[("dapo_kl_fwd_bwd", "rlkernel_composed")]["notes"]
    assert "validate=False" in got[("sliced_dapo_kl_fwd_bwd", "rlkernel_novalidate")]["notes"]


def test_linear_variants(tmp_path):
    """The fused engine driven directly (losses only; the Triton interpreter on the CPU), the
    chunk-logits dtype and dweight accumulation options on the public call, each cross-checked
    against the fp32 reference (bf16 gradients); no bf16 dweight variant for the frozen weight."""
    kinds = ("ragged_logprobs_entropy_fwd_bwd", "lmhead_dapo_kl_frozen_fwd_bwd")
    rows = run(tmp_path, "linear", ("torch", *bli.VARIANTS), kinds)
    got = {(r["workload"], r["impl"]): r for r in rows}
    assert ("ragged_logprobs_entropy_fwd_bwd", "rlkernel_dw_weight") in got
    assert ("ragged_logprobs_entropy_fwd_bwd", "rlkernel_engine") not in got
    assert ("lmhead_dapo_kl_frozen_fwd_bwd", "rlkernel_logits_input") in got
    assert ("lmhead_dapo_kl_frozen_fwd_bwd", "rlkernel_dw_weight") not in got
    engine = got[("lmhead_dapo_kl_frozen_fwd_bwd", "rlkernel_engine")]
    assert engine["status"] == "ok" or not INTERPRET
    for (_, impl), r in got.items():
        if impl not in bli.VARIANTS or r["status"].startswith("skipped"):
            continue
        assert r["status"] == "ok", r
        assert float(r["max_abs_diff"]) <= 1e-4 and float(r["grad_rel_diff"]) <= 1e-2, r
        assert ("fused_linear_token_loss" if impl == "rlkernel_engine" else "linear_") in r["notes"]


def test_invariant_variants_and_training_workloads(tmp_path):
    """The single GEMM table and the cuBLAS backward GEMMs, next to the new fwd+bwd workloads."""
    kinds = ("gemm", "gemm_fwd_bwd")
    rows = run(tmp_path, "invariant", ("rlkernel", "torch", *bi.VARIANTS), kinds)
    got = {(r["workload"], r["impl"]) for r in rows}
    assert ("gemm", "rlkernel_single") in got and ("gemm_fwd_bwd", "rlkernel_cublas_bwd") in got
    assert ("gemm", "rlkernel_cublas_bwd") not in got and ("gemm_fwd_bwd", "rlkernel_single") not in got
    for r in rows:
        if r["impl"].startswith("rlkernel"):
            assert r["status"] == "ok", r
            assert float(r["max_abs_diff"]) <= 1e-5, r  # fp32 on the CPU
            if r["pass"] == "fwd+bwd":
                assert float(r["grad_rel_diff"]) <= 1e-4, r
                assert float(r["tflops"]) > 0


def test_invariant_attention_split_variants(tmp_path):
    """The attention split-size variants (half the default split, one split) on the attention
    workloads only, cross-checked against SDPA like the default row."""
    kinds = ("attn_decode", "attn_prefill_fwd_bwd", "rmsnorm")
    variants = tuple(bi.ATTN_SPLITS)
    rows = run(tmp_path, "invariant", ("rlkernel", "torch", *variants), kinds)
    got = {(r["workload"], r["impl"]) for r in rows}
    assert {(k, v) for k in kinds[:2] for v in variants} <= got
    assert not {("rmsnorm", v) for v in variants} & got
    for r in rows:
        if r["impl"] in variants:
            assert r["status"] == "ok", r
            assert f"attention_split_keys={bi.ATTN_SPLITS[r['impl']]}" in r["notes"], r
            assert float(r["max_abs_diff"]) <= 1e-5, r  # fp32 on the CPU
            if r["pass"] == "fwd+bwd":
                assert float(r["grad_rel_diff"]) <= 1e-4, r
