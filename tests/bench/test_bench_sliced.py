"""The ``logits`` suite's headline rows (the users' call pattern) on the CPU: the logits each
implementation gets really are a view ``out[:, P-1:-1]`` of a larger model output that requires grad,
the lengths are ragged and the mask is 0 beyond them, the calls use default arguments, the peers'
rows (TRL, Liger) run and agree with plain PyTorch where their packages import and are skipped with
the reason where they do not, and the back-to-back timing measures what it says.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

import rlkernel as rk
from rlkernel.bench import SUITES, cli, harness, report
from rlkernel.bench import _logits_baselines as baselines
from rlkernel.bench import logits as bl
from rlkernel.bench import readme as bench_readme
from rlkernel.bench.suite import optional_import

SUITE = SUITES["logits"]
CPU = torch.device("cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
SMOKE = harness.Options(device=CPU, smoke=True)
REPO = Path(__file__).resolve().parents[2]


def _workload(name: str, impls: tuple[str, ...]) -> harness.Workload:
    (w,) = SUITE.build(harness.Options(device=CPU, smoke=True, workloads=(name,), impls=impls))
    return w


def _run(tmp_path: Path, workloads: str, impls: str) -> dict[tuple[str, str], dict]:
    argv = ["logits", "--smoke", "--rounds", "1", "--loop", "1", "--no-plot", "--out", str(tmp_path)]
    assert cli.main([*argv, "--workload", workloads, "--impl", impls]) == 0
    with (tmp_path / "logits.csv").open(newline="") as f:
        return {(r["workload"], r["impl"]): r for r in csv.DictReader(f)}


# --------------------------------------------------------------------------------------------------
# The inputs: a view of a larger base, ragged lengths
# --------------------------------------------------------------------------------------------------


def test_ragged_lengths_are_uniform_in_a_quarter_to_one_and_fixed():
    lengths = bl.ragged_lengths(4096, 1024)
    assert lengths.dtype == torch.int64 and int(lengths.min()) >= 256 and int(lengths.max()) <= 1024
    assert int(lengths.min()) < 300 and int(lengths.max()) > 1000  # the whole range is drawn
    assert abs(lengths.double().mean().item() - (256 + 1024) / 2) < 15  # uniform: mean 640 ± ~4 σ
    assert torch.equal(lengths, bl.ragged_lengths(4096, 1024))  # one draw per (B, T), every run
    assert torch.equal(bl.ragged_lengths(8, 1024), lengths[:8])
    geo = bl.geometry(8192, smoke=False)
    assert (geo.b, geo.t, geo.p, geo.n) == (8, 1024, 128, 8192)
    # 5,964 active of 8,192: the number docs/guides/benchmarks.md quotes.
    assert bl.active_tokens(geo) == int(bl.ragged_lengths(8, 1024).sum()) == 5964


@pytest.mark.parametrize("kind_name", ["sliced_dapo_kl_fwd_bwd", "sliced_logprobs_entropy_fwd_bwd"])
def test_sliced_inputs_are_a_window_of_a_model_output(kind_name):
    kind = bl.KINDS[kind_name]
    geo = bl.geometry(64, smoke=True)
    inp = bl.make_sliced_inputs(kind, geo, 50, CPU, seed=5)
    b, t, p = geo.b, geo.t, geo.p
    base = inp["base"]
    assert base.shape == (b, p + t, 50) and base.dtype == torch.bfloat16 and base.abs().sum() > 0
    x = bl.window(base, p)
    assert x.shape == (b, t, 50) and x._base is base and not x.is_contiguous()
    assert x.data_ptr() == base[:, p - 1].data_ptr()
    torch.testing.assert_close(x, base[:, p - 1 : p - 1 + t], rtol=0, atol=0)
    lengths = bl.ragged_lengths(b, t)
    assert int(lengths.min()) >= math.ceil(t / 4) and int(lengths.max()) <= t
    for i, n in enumerate(lengths.tolist()):
        assert inp["mask"][i, :n].all() and not inp["mask"][i, n:].any()
    if kind.loss is None:
        ignored = inp["ids_ignore"] == bl.IGNORE_INDEX
        assert torch.equal(ignored, ~inp["mask"])
        assert torch.equal(inp["ids_ignore"][inp["mask"]], inp["ids"][inp["mask"]])
        assert ((inp["ids"] >= 0) & (inp["ids"] < 50)).all()  # valid ids for everyone else
        for g in inp["grad_out"]:
            assert g[~inp["mask"]].abs().sum() == 0 and g[inp["mask"]].abs().min() > 0
    else:
        true = bl.torch_token_logprobs(x, inp["ids"], bl.TEMPERATURE, False)
        assert (inp["old_logp"] - true).abs().max() < 1.0 and (inp["old_logp"] - true).abs().max() > 0


# --------------------------------------------------------------------------------------------------
# The calls: what rlkernel is given, and the gradient everyone returns
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind_name", "api"),
    [("sliced_dapo_kl_fwd_bwd", "fused_policy_loss"), ("sliced_logprobs_entropy_fwd_bwd", "token_logprobs")],
)
def test_rlkernel_gets_the_view_of_a_base_that_requires_grad(kind_name, api, monkeypatch):
    """A spy on the public function the bench calls: the logits are the view of the input set's
    model output (which requires grad), taken afresh in every call, with default arguments only."""
    seen = []
    real = getattr(rk, api)

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(rk, api, spy)  # seam: spy: records what the bench passes to the public API
    w = _workload(kind_name, ("rlkernel", "torch"))
    prepared = w.setup(CPU, w.impls, 1)
    out = prepared.calls["rlkernel"](0)
    ref = prepared.calls["torch"](0)
    prepared.calls["rlkernel"](0)
    assert len(seen) == 2
    (args0, kw0), (args1, kw1) = seen
    x0 = kw0["logits"] if api == "fused_policy_loss" else args0[0]
    x1 = kw1["logits"] if api == "fused_policy_loss" else args1[0]
    base = x0._base
    assert base is not None and base.requires_grad and base.is_leaf and x1._base is base
    assert x0 is not x1  # sliced in every call, as a trainer does every step
    assert not x0.is_contiguous() and x0.shape[1] == base.shape[1] - bl.SMOKE_PROMPT_LEN
    assert not {"validate", "inplace_backward"} & set(kw0)  # default arguments
    if api == "token_logprobs":
        assert (args0[1] == bl.IGNORE_INDEX).any()  # padding said with ignore_index
    # Everyone's gradient is the model output's: zero on the prompt rows, the last row, and (where
    # the upstream gradient or the mask is 0) the rows beyond each length.
    (g,), (g_ref,) = out.grads, ref.grads
    assert g.shape == base.shape == g_ref.shape
    p, lengths = bl.SMOKE_PROMPT_LEN, bl.ragged_lengths(base.shape[0], base.shape[1] - bl.SMOKE_PROMPT_LEN)
    assert g[:, : p - 1].abs().sum() == 0 and g[:, -1].abs().sum() == 0
    for i, n in enumerate(lengths.tolist()):
        assert g[i, p - 1 + n :].abs().sum() == 0 and g[i, p - 1 : p - 1 + n].abs().sum() > 0
    torch.testing.assert_close(g.float(), g_ref.float(), rtol=2e-2, atol=1e-3)
    for a, b in zip(out.values, ref.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_plain_sliced_loss_matches_fused_policy_loss_on_an_explicit_copy():
    """The baseline's slice is the window rlkernel sees: plain loss of ``out`` (sliced inside) ==
    fused_policy_loss of an explicit copy of rows P-1 .. P+T-2, values and gradients."""
    kind = bl.KINDS["sliced_dapo_kl_fwd_bwd"]
    geo = bl.geometry(64, smoke=True)
    inp = bl.make_sliced_inputs(kind, geo, 50, CPU, seed=7)
    cfg, spec = bl.resolve_loss("dapo")
    base = inp["base"].float().requires_grad_(True)
    args = (inp["ids"], inp["old_logp"], inp["ref_logp"], inp["advantages"], inp["mask"])
    plain = bl.torch_policy_loss_from_logits(base[:, geo.p - 1 : -1], *args, spec, bl.TEMPERATURE)
    copy = base.detach()[:, geo.p - 1 : geo.p - 1 + geo.t].clone().requires_grad_(True)
    fused = rk.fused_policy_loss(
        cfg, token_ids=inp["ids"], old_logp=inp["old_logp"], advantages=inp["advantages"], mask=inp["mask"],
        logits=copy, temperature=bl.TEMPERATURE, ref_logp=inp["ref_logp"],
    ).loss  # fmt: skip
    torch.testing.assert_close(plain, fused, rtol=1e-5, atol=1e-6)
    (g_plain,) = torch.autograd.grad(plain, base)
    (g_copy,) = torch.autograd.grad(fused, copy)
    torch.testing.assert_close(g_plain[:, geo.p - 1 : -1], g_copy)
    assert g_plain[:, : geo.p - 1].abs().sum() == 0 and g_plain[:, -1].abs().sum() == 0


# --------------------------------------------------------------------------------------------------
# The peers' rows
# --------------------------------------------------------------------------------------------------


def _importable(name: str) -> bool:
    return optional_import(name)[0] is not None


@pytest.mark.skipif(not INTERPRET, reason="TRL's Triton kernel runs on the CPU only in the interpreter")
@pytest.mark.skipif(not _importable("trl.kernels"), reason="trl.kernels not importable")
def test_trl_rows_run_and_agree(tmp_path):
    """TRL's kernel on the sliced view with its row mask, backward included, and on the contiguous
    log-prob rows (entropy dropped): same values and gradients as plain PyTorch."""
    got = _run(tmp_path, "sliced_logprobs_entropy_fwd_bwd,logprobs_fwd", "torch,trl")
    for name in ("sliced_logprobs_entropy_fwd_bwd", "logprobs_fwd"):
        r = got[name, "trl"]
        assert r["status"] == "ok" and float(r["median_ms"]) > 0 and float(r["b2b_ms"]) > 0, r
        assert float(r["max_abs_diff"]) <= 1e-5, r
        assert r["trl"]  # the version column
    assert float(got["sliced_logprobs_entropy_fwd_bwd", "trl"]["grad_rel_diff"]) <= 1e-2
    assert "row_mask=mask" in got["sliced_logprobs_entropy_fwd_bwd", "trl"]["notes"]
    assert "entropy output dropped" in got["logprobs_fwd", "trl"]["notes"]


@pytest.mark.skipif(not INTERPRET, reason="Liger's Triton kernels run on the CPU only in the interpreter")
@pytest.mark.skipif(not _importable("liger_kernel.ops.grpo_loss"), reason="liger-kernel not installed")
def test_liger_rows_on_the_whole_output_agree(tmp_path):
    """Liger given the whole model output with the prompt positions masked: the same loss and the
    same model-output gradient as plain PyTorch (DAPO token level, GSPO sequence level)."""
    got = _run(tmp_path, "sliced_dapo_kl_fwd_bwd,sliced_gspo_fwd_bwd", "torch,liger")
    for name in ("sliced_dapo_kl_fwd_bwd", "sliced_gspo_fwd_bwd"):
        r = got[name, "liger"]
        assert r["status"] == "ok", r
        assert float(r["max_abs_diff"]) <= 1e-5 and float(r["grad_rel_diff"]) <= 1e-2, r
        assert "prompt positions masked" in r["notes"]


def test_prompt_extended_prepends_masked_prompt_positions():
    x = torch.arange(6.0).reshape(2, 3)
    ext = bl.prompt_extended(x, 4, -1.0)
    assert ext.shape == (2, 6) and ext.is_contiguous()
    assert torch.equal(ext[:, :3], torch.full((2, 3), -1.0)) and torch.equal(ext[:, 3:], x)
    assert torch.equal(bl.prompt_extended(x, 1, 0.0), x)  # P = 1: nothing before the window


@pytest.fixture
def without_peers(monkeypatch):
    """A Python where ``import trl`` and ``import liger_kernel`` fail, as on a machine without them
    (the import cache of optional baselines is cleared before and after)."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("trl", "liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    optional_import.cache_clear()
    yield
    optional_import.cache_clear()


@pytest.mark.usefixtures("without_peers")
def test_missing_packages_give_skipped_rows_not_errors(tmp_path):
    got = _run(tmp_path, "sliced_logprobs_entropy_fwd,sliced_gspo_fwd_bwd", "torch,liger,trl")
    trl_row = got["sliced_logprobs_entropy_fwd", "trl"]
    liger_row = got["sliced_gspo_fwd_bwd", "liger"]
    if INTERPRET:
        assert trl_row["status"].startswith("skipped: trl.kernels not importable"), trl_row
        assert liger_row["status"].startswith("skipped: liger_kernel.ops.grpo_loss not importable"), liger_row
    else:
        assert trl_row["status"].startswith("skipped: TRL's Triton kernel needs a CUDA device"), trl_row
    for key in (("sliced_logprobs_entropy_fwd", "torch"), ("sliced_gspo_fwd_bwd", "torch")):
        assert got[key]["status"] == "ok"


def test_trl_lookup_reasons(monkeypatch):
    fn, why = baselines._trl(CPU, module="rlkernel")  # a module without the function
    assert fn is None
    assert why == "rlkernel exports no selective_log_softmax_and_entropy (transformers reports no triton)"
    fn, why = baselines._trl(CPU, module="no_such_module_for_the_bench")
    assert fn is None and why.startswith("no_such_module_for_the_bench not importable (ModuleNotFoundError")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fn, why = baselines._trl(CPU)
    assert fn is None and why == "TRL's Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 on CPU)"


def test_trl_kernels_imports_without_trainer_dependencies():
    """``trl.kernels`` (what the bench imports) pulls in none of TRL's trainer stack, so it works on
    a machine with only torch, triton, transformers and packaging (the GPU machine): checked in a
    fresh interpreter that records which top-level packages the import loaded."""
    pytest.importorskip("trl")
    import subprocess

    code = (
        "import sys, trl.kernels as k; "
        "print(','.join(sorted({m.split('.')[0] for m in sys.modules})), '|', ','.join(k.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, exported = out.stdout.strip().split(" | ")
    heavy = {"accelerate", "datasets", "peft", "rich", "deepspeed", "vllm", "pandas", "liger_kernel"}
    assert not heavy & set(loaded.split(",")), loaded
    assert "selective_log_softmax_and_entropy" in exported.split(",")


# --------------------------------------------------------------------------------------------------
# Back-to-back timing
# --------------------------------------------------------------------------------------------------


def test_time_back_to_back_times_loops_per_call():
    calls_made = {"a": 0, "b": 0}

    def make(name: str, seconds: float):
        def call(i: int) -> None:
            calls_made[name] += 1
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        return call

    out = harness.time_back_to_back({"a": make("a", 2e-3), "b": make("b", 0.0)}, CPU, loop=5, reps=3)
    assert calls_made == {"a": 15, "b": 15}
    assert len(out["a"]) == len(out["b"]) == 3
    assert all(2.0 <= x < 20.0 for x in out["a"])  # per call, not per loop (which is >= 10 ms)
    assert max(out["b"]) < min(out["a"])
    with pytest.raises(ValueError, match="loop must be >= 1"):
        harness.time_back_to_back({"a": make("a", 0.0)}, CPU, loop=0, reps=1)


@pytest.mark.parametrize("loop_calls", [3, 0])
def test_harness_back_to_back_columns(loop_calls, tmp_path):
    x = torch.randn(8, 8)

    def setup(device, impls, copies):
        return harness.Prepared({"a": lambda i: harness.CallResult((x.sum(),))})

    workload = harness.Workload("toy", "fwd", {"n": 8}, 512, None, 256, ("a",), "a", setup, back_to_back=True)
    suite = harness.Suite("toy", "a toy", ("a",), ("toy",), ("n",), "a", lambda opts: [workload])
    opts = harness.Options(device=CPU, smoke=True, warmup=0, rounds=1, reps=1, loop_calls=loop_calls,
                           loop_reps=2)  # fmt: skip
    rows, _ = harness.run_suite(suite, opts, log=lambda line: None)
    row = rows[0]
    if loop_calls:
        assert row["b2b_ms"] > 0 and row["b2b_calls"] == 3
    else:
        assert row["b2b_ms"] is None and row["b2b_calls"] is None
    assert row["host_ms"] > 0  # the host time of the isolated calls, back to back or not
    csv_path, _ = harness.write_results(suite, rows, {}, tmp_path)
    assert "b2b_ms,b2b_calls,host_ms" in csv_path.read_text().splitlines()[0]
    assert "b2b ms  host ms" in report.format_table(rows, suite.param_columns)


def test_bad_loop_is_rejected(capsys):
    assert cli.main(["logits", "--smoke", "--loop", "-1"]) == 2
    assert "--loop must be >= 0, got -1" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# The README
# --------------------------------------------------------------------------------------------------


def test_committed_readme_table_and_results_page_are_generated_from_the_committed_csvs(monkeypatch):
    """``rlkernel bench --readme`` on the committed results reproduces the committed README block and
    results page (a new CSV is committed with both regenerated). The README's table: at most 12 rows,
    the users' call pattern, every peer a column named with its version."""
    monkeypatch.chdir(REPO)  # the block names the results folder as given: relative, as the CLI's default
    text = Path("README.md").read_text()
    block = bench_readme.readme_block(Path("benchmarks/results"))
    assert bench_readme.replace_block(text, block) == text
    assert bench_readme.RESULTS_PAGE.read_text() == bench_readme.results_page(Path("benchmarks/results"))
    lines = block.splitlines()
    header = next(line for line in lines if line.startswith("| call (users' pattern) |"))
    for peer in ("Liger-Kernel 0.8.5", "TRL 1.16.0 (`trl.kernels`)", "torch 2.11.0+cu130", "torch.compile"):
        assert f"| {peer} |" in header
    rows = lines[lines.index(header) + 2 :]
    rows = rows[: next(i for i, line in enumerate(rows) if not line.startswith("| "))]
    assert 10 <= len(rows) <= 12
    assert all("from logits" not in r or "V = " in r for r in rows)  # the sliced workloads' sizes
    assert all(r.split(" | ")[2] not in ("—", "") for r in rows)  # every headline row has rlkernel's time


# --------------------------------------------------------------------------------------------------
# On the GPU (the gpu step of scripts/gpu_suite.sh)
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sliced_rows_run_and_agree(tmp_path):
    """The headline workloads at a small size on CUDA, with the peers where their wheels are
    installed (scripts/gpu_run.sh installs .whl/): every row measured (or skipped because a package
    does not import), each cross-checked against plain PyTorch, and every fwd+bwd row's peak memory
    holds at least the model output's gradient. torch.compile is left out (minutes of compiling)."""
    sliced = [k for k in bl.KINDS if k.startswith("sliced_")]
    argv = ["logits", "--n", "2048", "--v", "32768", "--rounds", "1", "--loop", "2", "--no-plot"]
    impls = "rlkernel,torch,liger,trl"
    assert cli.main([*argv, "--out", str(tmp_path), "--workload", ",".join(sliced), "--impl", impls]) == 0
    with (tmp_path / "logits.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["impl"] != "ceiling"]
    assert {r["workload"] for r in rows} == set(sliced)
    grad_gb = 2 * (1024 + bl.PROMPT_LEN) * 32768 * 2 / 1e9  # B = 2 sequences of T = 1024
    for r in rows:
        if r["status"].startswith("skipped"):
            assert r["impl"] in ("liger", "trl") and "not importable" in r["status"], r
            continue
        assert r["status"] == "ok", r
        assert float(r["median_ms"]) > 0 and float(r["b2b_ms"]) > 0 and r["gpu"] and r["date_utc"], r
        if r["impl"] != "torch":
            assert float(r["max_abs_diff"]) <= 1e-4, r
        if r["pass"] == "fwd+bwd":
            assert float(r["peak_extra_gb"]) >= 0.99 * grad_gb, r
            if r["impl"] != "torch":
                assert float(r["grad_rel_diff"]) <= 2e-2, r
