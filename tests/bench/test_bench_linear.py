"""The ``linear`` bench suite end to end on CPU (``--smoke``): rows, the ragged (users') layout,
the cross-checks against the fp32 reference, TRL's head, skips, the workload matrix."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

from rlkernel.bench import SUITES, BenchError, cli, harness
from rlkernel.bench import _linear_baselines as lbase
from rlkernel.bench import _linear_inputs as linp
from rlkernel.bench import linear as bli
from rlkernel.bench._logits_inputs import ragged_lengths

SUITE = SUITES["linear"]
SMOKE_KINDS = ("ragged_logprobs_entropy_fwd_bwd", "ragged_dapo_kl_fwd_bwd", "lmhead_logprobs_entropy_fwd_bwd")
# Rows whose logits are bf16 (TRL's CPU tiles are in the inputs' dtype too): |Δlogp| ~ |z|·2^-9
BF16_LOGITS = ("torch", "trl", "rlkernel_invariant")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU smoke run of the two headline kinds and a dense one through the CLI (the frozen
    kinds are the same code with one leaf less)."""
    out = tmp_path_factory.mktemp("bench_linear")
    argv = ["linear", "--smoke", "--rounds", "1", "--no-plot", "--out", str(out)]
    rc = cli.main([*argv, "--workload", ",".join(SMOKE_KINDS)])
    with (out / "linear.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rc, rows


def test_smoke_rows_and_columns(smoke):
    rc, rows = smoke
    assert rc == 0
    assert list(rows[0]) == list(harness.columns_for(SUITE))
    assert [r["workload"] for r in rows][0].startswith("ragged_")  # the headline rows lead
    primitive = ("rlkernel", "rlkernel_invariant", "rlkernel_invariant_fp32", "torch", "trl", "cublas_gemms")
    want = {(k, i) for k in SMOKE_KINDS if "logprobs" in k for i in (*primitive, "ceiling")}
    want |= {("ragged_dapo_kl_fwd_bwd", i) for i in (*primitive, "liger", "ceiling")}
    assert {(r["workload"], r["impl"]) for r in rows} == want  # no row for the untimed reference
    scored = int(ragged_lengths(4, 16).sum())
    assert 16 <= scored < 64
    for r in rows:
        assert r["n_tokens"] == "64" and r["hidden"] == "16" and r["vocab"] == "100"
        assert r["scored_tokens"] == str(scored if r["workload"].startswith("ragged") else 64)
        if r["impl"] == "liger":
            assert r["status"].startswith("skipped")
        elif r["impl"] == "ceiling":
            assert r["status"] == "model" and float(r["frac_gemm"]) == pytest.approx(1.0)
        else:
            assert r["status"] == "ok", r
            assert float(r["median_ms"]) > 0 and float(r["tflops"]) > 0
        if r["workload"].startswith("ragged") and r["impl"] != "ceiling":
            assert f"{scored} of 64 tokens scored" in r["notes"] and "base[:, 3:-1]" in r["notes"]


def test_smoke_cross_checks_against_the_fp32_reference(smoke):
    """Every measured row against the untimed fp32 reference: rlkernel's default and fp32-logit
    rows to fp32 rounding (on the CPU the public ops run the reference path: 0), the bf16-logit
    rows (plain torch, TRL's head, the invariant mode's bf16 LM head) to bf16 rounding of the
    logits, and not closer (the check can tell them apart)."""
    _, rows = smoke
    checked = set()
    for r in rows:
        if r["status"] != "ok" or r["impl"] == "cublas_gemms":
            continue
        logp, grad = float(r["max_abs_diff"]), float(r["grad_rel_diff"])
        if r["impl"] in BF16_LOGITS:
            assert 1e-4 < logp <= 0.1 and grad <= 0.05, r
        else:
            assert logp <= 1e-5 and grad <= 1e-5, r
        checked.add(r["impl"])
    assert checked == {"rlkernel", "rlkernel_invariant_fp32", *BF16_LOGITS}


def test_trl_head_is_used_as_trl_calls_it_and_leaves_no_stand_in():
    """TRL's ``ChunkedLogProbFunction`` (1.16's signature) runs forward + backward in the bench
    without TRL's trainer stack: ``trl.trainer.utils`` is stood in only during the call (its one
    helper a nullcontext) and gone after. Its log-probs and entropy match the fp32 reference's to
    bf16 rounding, and padding gets 0."""
    fn, why = lbase.trl_head(torch.device("cpu"))
    if fn is None:
        pytest.skip(why)
    kind = linp.KINDS["ragged_logprobs_entropy_fwd_bwd"]
    geo = linp.geometry(64, True)
    inputs = [linp.make_inputs(kind, geo, 16, 100, torch.device("cpu"), seed=3)]
    for t in lbase.leaves(inputs[0], kind):
        t.requires_grad_(True)
    had = lbase.TRL_GATHER_MODULE in sys.modules
    got = lbase.trl_call(fn, kind, None, inputs)(0)
    assert (lbase.TRL_GATHER_MODULE in sys.modules) == had
    want = lbase.reference_call(kind, None, inputs)(0)
    pad = ~inputs[0]["mask"]
    for a, e in zip(got.values, want.values, strict=True):
        assert 0 < (a - e).abs().max() <= 0.1 and bool((a[pad] == 0).all())
    for a, e in zip(got.grads, want.grads, strict=True):
        assert ((a - e).abs().max() / e.abs().max()).item() <= 0.05


def test_trl_stand_in_holds_only_the_gather_helper():
    """Inside the block ``trl.trainer.utils`` resolves to the stand-in, whose helper is a null
    context for any parameters; after the block ``sys.modules`` is as before."""
    if lbase.TRL_GATHER_MODULE in sys.modules:
        pytest.skip("trl.trainer.utils is imported in this process: no stand-in is made")
    with lbase._trl_gather_stand_in():
        mod = sys.modules[lbase.TRL_GATHER_MODULE]
        with mod.maybe_gather_lm_head_ctx(torch.ones(2), None):
            pass
        assert [n for n in vars(mod) if not n.startswith("__")] == ["maybe_gather_lm_head_ctx"]
    assert lbase.TRL_GATHER_MODULE not in sys.modules


def test_build_matrix_flops_and_reference():
    from rlkernel.bench.harness import Options

    ws = bli.build(Options(device=torch.device("cpu")))
    assert {w.params["n_tokens"] for w in ws} == set(bli.N_FULL)
    assert [w.name for w in ws][: len(bli.N_FULL)] == ["ragged_logprobs_entropy_fwd_bwd"] * len(bli.N_FULL)
    for w in ws:
        kind = linp.KINDS[w.name]
        p = w.params
        assert w.flops == kind.n_gemms * 2 * p["scored_tokens"] * p["hidden"] * p["vocab"]
        assert kind.n_gemms == (2 if "frozen" in w.name else 3 if "dapo" in w.name else 4)
        if w.name.startswith("ragged"):
            geo = linp.geometry(p["n_tokens"], False)
            assert p["scored_tokens"] == int(ragged_lengths(geo.b, geo.t).sum()) < 0.8 * p["n_tokens"]
        elif "logprobs" in w.name:
            assert p["scored_tokens"] == p["n_tokens"]
        assert w.reference == bli.REFERENCE and bli.REFERENCE not in w.impls
        assert "cublas_gemms" in w.impls and "rlkernel_invariant_fp32" in w.impls
        assert ("liger" in w.impls) == kind.loss and not set(bli.VARIANTS) & set(w.impls)
    with pytest.raises(BenchError, match="workload"):
        bli.build(Options(device=torch.device("cpu"), workloads=("nope",)))
    with pytest.raises(BenchError, match="implementation"):
        bli.build(Options(device=torch.device("cpu"), impls=("nope",)))
