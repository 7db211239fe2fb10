"""The ``invariant`` benchmark suite end to end on CPU (``--smoke``): one row per workload and
implementation, every rlkernel row cross-checked against the standard path, the selection errors;
the long-context rows' inputs and how their packing reaches each model.
"""

from __future__ import annotations

import csv

import pytest
import torch

from rlkernel.bench import SUITES, BenchError, cli, harness
from rlkernel.bench import _invariant_long as bl
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
    assert [w.name for w in ws if w.name.startswith("model") and "long" not in w.name] == [
        "model_prefill",
        "model_decode",
        "model_train",
    ]
    prefill = {w.params["shape"] for w in ws if w.name == "attn_prefill_fwd_bwd"}
    assert {"B=1 T=8192 H=32/8 D=128", "B=1 T=32768 H=32/8 D=128", "B=4 T=8192 H=32/8 D=128"} <= prefill
    long = {(w.name, w.params["shape"]): w for w in ws if w.name in bl.LONG_KINDS}
    s = len(bl.packed_lengths(131072, bi.SEED))
    assert list(long) == [
        ("model_long_prefill", "qwen3-8b-slice B=1 T=8192"),
        ("model_long_prefill", "qwen3-8b-slice B=1 T=32768"),
        ("model_long_decode", "qwen3-8b-slice B=1 cache=8192"),
        ("model_long_decode", "qwen3-8b-slice B=1 cache=32768"),
        ("model_long_train", "qwen3-8b-slice B=1 T=8192"),
        ("model_long_train", "qwen3-8b-slice B=1 T=32768"),
        ("model_long_train", "qwen3-8b-slice B=1 T=131072"),
        ("model_long_train", f"qwen3-8b-slice packed S={s} T=131072"),
        # the anchor config: the same rows at 8k and 32k, no 128k step
        ("model_long_prefill", "anchor B=1 T=8192"),
        ("model_long_prefill", "anchor B=1 T=32768"),
        ("model_long_decode", "anchor B=1 cache=8192"),
        ("model_long_decode", "anchor B=1 cache=32768"),
        ("model_long_train", "anchor B=1 T=8192"),
        ("model_long_train", "anchor B=1 T=32768"),
    ]
    assert long[("model_long_train", "anchor B=1 T=32768")].capped(
        harness.Options(device=torch.device("cpu"))
    ) == (1, 3, 2)
    assert long[("model_long_decode", "qwen3-8b-slice B=1 cache=32768")].params["tokens"] == 1
    step = long[("model_long_train", "qwen3-8b-slice B=1 T=131072")]
    assert (step.pass_, step.params["tokens"]) == ("fwd+bwd", 131072)
    # The training steps that take seconds cap their calls; the rest run the run's own count.
    assert step.capped(harness.Options(device=torch.device("cpu"))) == (0, 3, 1)
    assert long[("model_long_train", "qwen3-8b-slice B=1 T=32768")].capped(
        harness.Options(device=torch.device("cpu"))
    ) == (1, 3, 2)
    assert long[("model_long_prefill", "qwen3-8b-slice B=1 T=32768")].max_rounds is None
    quick = bi.build(harness.Options(device=torch.device("cpu"), quick=True))
    assert len(quick) < len(ws) and not [w for w in quick if w.name in bl.LONG_KINDS]


def test_selection_errors():
    with pytest.raises(BenchError, match="unknown workload"):
        bi.build(harness.Options(device=torch.device("cpu"), workloads=("nope",)))
    with pytest.raises(BenchError, match="fixed shapes"):
        bi.build(harness.Options(device=torch.device("cpu"), n_tokens=(8,)))
    with pytest.raises(BenchError, match="model_long_train has no --quick sizes"):
        bi.build(harness.Options(device=torch.device("cpu"), quick=True, workloads=("model_long_train",)))
    assert cli.main(["invariant", "--smoke", "--impl", "cublas"]) == 2


def test_smoke_long_rows(smoke):
    """The long-context rows at the smoke sizes: both models on every row, cross-checked (packed
    included: the patched model's cu_seq_lens path against HF's own packed mask), the notes say how
    each model was called."""
    _, rows = smoke
    long = [r for r in rows if r["workload"] in bl.LONG_KINDS]
    s = len(bl.packed_lengths(bi.SMOKE_LONG_STEP_T, bi.SEED))
    shapes = {(r["workload"], r["shape"], r["tokens"]) for r in long if r["impl"] == "rlkernel"}
    assert shapes == {
        ("model_long_prefill", "tiny B=1 T=16", "16"),
        ("model_long_prefill", "tiny B=1 T=32", "32"),
        ("model_long_decode", "tiny B=1 cache=16", "1"),
        ("model_long_decode", "tiny B=1 cache=32", "1"),
        ("model_long_train", "tiny B=1 T=16", "16"),
        ("model_long_train", "tiny B=1 T=32", "32"),
        ("model_long_train", "tiny B=1 T=64", "64"),
        ("model_long_train", f"tiny packed S={s} T=64", "64"),
        ("model_long_prefill", "tiny-llama B=1 T=16", "16"),
        ("model_long_prefill", "tiny-llama B=1 T=32", "32"),
        ("model_long_decode", "tiny-llama B=1 cache=16", "1"),
        ("model_long_decode", "tiny-llama B=1 cache=32", "1"),
        ("model_long_train", "tiny-llama B=1 T=16", "16"),
        ("model_long_train", "tiny-llama B=1 T=32", "32"),
    }
    for r in long:
        if r["impl"] == "flash_attn":
            assert r["status"].startswith("skipped")
            continue
        assert r["status"] == "ok" and float(r["median_ms"]) > 0, r
        assert "not in peak" in r["notes"]
        if r["impl"] == "rlkernel":
            assert r["max_abs_diff"] != ""  # cross-checked against the unpatched model
            if r["workload"] == "model_long_train":
                assert float(r["grad_rel_diff"]) <= 1e-4, r
    by = {(r["shape"], r["impl"]): r["notes"] for r in long if r["workload"] == "model_long_train"}
    assert "cu_seq_lens_q/k" in by[(f"tiny packed S={s} T=64", "rlkernel")]
    assert "invariant=True" in by[("tiny B=1 T=64", "rlkernel")]
    assert "bool mask" in by[(f"tiny packed S={s} T=64", "torch")]
    assert "logits_to_keep=1" in next(r["notes"] for r in long if r["workload"] == "model_long_prefill")


def test_packed_lengths_fixed_ragged_and_exact():
    for n in (64, 1000, 131072):
        lengths = bl.packed_lengths(n, 7)
        assert sum(lengths) == n and len(lengths) > 1
        assert all(x >= n // 32 for x in lengths)
        assert all(x <= n // 4 for x in lengths[:-1])  # the last one takes what remains
        assert len(set(lengths)) > 1
        assert bl.packed_lengths(n, 7) == lengths
    assert bl.packed_lengths(131072, 7) != bl.packed_lengths(131072, 8)


def test_train_inputs_layout():
    """Targets are the next token within each sequence, the mask drops each prompt quarter and each
    last token, cu_seqlens/position_ids follow the lengths; one sequence gives [1, N] loss inputs."""
    cpu = torch.device("cpu")
    inp = bl.train_inputs([8, 5, 3], 100, cpu, seed=3)
    assert inp.packed and inp.ids.shape == (1, 16)
    assert inp.cu_seqlens.tolist() == [0, 8, 13, 16] and inp.cu_seqlens.dtype == torch.int32
    assert inp.position_ids.tolist() == [[*range(8), *range(5), *range(3)]]
    active = [2, 3, 4, 5, 6] + [9, 10, 11] + [13, 14]
    assert inp.mask.nonzero().flatten().tolist() == active
    ids = inp.ids[0]
    assert all(inp.targets[j] == ids[j + 1] for j in active)
    assert inp.advantages.shape == (3, 1)
    one = bl.train_inputs([8], 100, cpu, seed=3)
    assert not one.packed and one.targets.shape == one.mask.shape == (1, 8)
    assert one.mask[0].nonzero().flatten().tolist() == [2, 3, 4, 5, 6] and one.advantages.shape == (1,)


def test_packing_reaches_the_patched_attention():
    """The patched model's packed call (position_ids, cu_seq_lens_q/k and a prepared mask mapping)
    computes what HF's own packed path computes, and the cu_seq_lens are what separates the
    sequences: without them the same row attends across sequence boundaries. Tiny model, fp32, CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU invariant path: many tiny GEMVs
    try:
        cpu = torch.device("cpu")
        base, patched = bl.models("tiny", cpu, seed=0)
        assert next(base.parameters()) is next(patched.parameters())  # one set of weights
        packed = bl.train_inputs([7, 12, 5, 8], base.config.vocab_size, cpu, seed=1)
        ours = bl.train_call(patched, packed, patched=True)(0)
        hf = bl.train_call(base, packed, patched=False)(0)
        torch.testing.assert_close(ours.values, hf.values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.grads, hf.grads, rtol=1e-4, atol=1e-6)

        kw = bl.forward_kwargs(patched, packed, patched=True)
        assert set(kw) == {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "attention_mask"}
        assert list(kw["attention_mask"].values()) == [None]
        no_cu = {k: v for k, v in kw.items() if not k.startswith("cu_seq_lens")}
        with torch.no_grad():
            h = patched.model(input_ids=packed.ids, use_cache=False, **kw).last_hidden_state[0]
            row = patched.model(input_ids=packed.ids, use_cache=False, **no_cu).last_hidden_state[0]
        torch.testing.assert_close(h[:7], row[:7], rtol=1e-5, atol=1e-5)  # the first sequence: same keys
        assert (h[7:] - row[7:]).abs().max() > 1e-2  # the others saw the earlier sequences' keys
    finally:
        torch.set_num_threads(n)
