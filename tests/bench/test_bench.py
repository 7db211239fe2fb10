"""The benchmark harness end to end on CPU (``--smoke``), the README generator, the CLI's errors, and
the plain-PyTorch baselines against ``rlkernel.policy_loss`` (so every comparison is apples to apples).
"""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

import rlkernel as rk
from rlkernel.bench import SUITES, BenchError, cli, get_suite, harness, report
from rlkernel.bench import logits as bl
from rlkernel.bench import readme as bench_readme

SUITE = SUITES["logits"]
# The default implementations of each workload (the trl rows are tested in test_bench_sliced.py: its
# kernel takes seconds per call in the interpreter, so the shared smoke run leaves it out).
APPLICABLE = {
    "sliced_dapo_kl_fwd_bwd": ("rlkernel", "torch", "torch.compile", "liger"),
    "sliced_gspo_fwd_bwd": ("rlkernel", "torch", "torch.compile", "liger"),
    "sliced_logprobs_entropy_fwd_bwd": ("rlkernel", "torch", "torch.compile", "trl"),
    "sliced_logprobs_entropy_fwd": ("rlkernel", "torch", "torch.compile", "trl"),
    "logprobs_fwd": ("rlkernel", "torch", "torch.compile", "liger", "trl"),
    "logprobs_entropy_fwd": ("rlkernel", "torch", "torch.compile", "trl"),
    "logprobs_fwd_bwd": ("rlkernel", "torch", "torch.compile", "trl"),
    "logprobs_entropy_fwd_bwd": ("rlkernel", "torch", "torch.compile", "trl"),
    "dapo_kl_fwd_bwd": ("rlkernel", "torch", "torch.compile", "liger"),
    "gspo_fwd_bwd": ("rlkernel", "torch", "torch.compile", "liger"),
}
SMOKE_IMPLS = ("rlkernel", "torch", "torch.compile", "liger")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU smoke run of the whole logits suite (but TRL) through the CLI, shared by the tests
    below."""
    out = tmp_path_factory.mktemp("bench")
    rc = cli.main(["logits", "--smoke", "--rounds", "1", "--impl", ",".join(SMOKE_IMPLS), "--out", str(out)])
    with (out / "logits.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rc, out, rows


def test_smoke_writes_csv_json_png(smoke):
    rc, out, rows = smoke
    assert rc == 0
    with (out / "logits.csv").open(newline="") as f:
        assert next(csv.reader(f)) == list(harness.columns_for(SUITE))
    data = json.loads((out / "logits.json").read_text())
    assert data["columns"] == list(harness.columns_for(SUITE))
    assert len(data["rows"]) == len(rows)
    assert data["meta"]["env"]["device"] == "cpu"
    assert data["meta"]["ceilings"]["copy_tbps"] > 0 and data["meta"]["ceilings"]["gemm_tflops"] > 0
    assert (out / "logits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_one_row_per_workload_and_impl(smoke):
    _, _, rows = smoke
    keys = [(r["workload"], r["n_tokens"], r["vocab"], r["impl"]) for r in rows]
    assert len(keys) == len(set(keys))
    expected = {
        (w, "64", "100", i) for w, impls in APPLICABLE.items() for i in (*impls, "ceiling") if i != "trl"
    }
    assert set(keys) == expected
    # The headline (sliced) workloads come first, in the CSV as in the run.
    names = list(dict.fromkeys(r["workload"] for r in rows))
    assert names == list(APPLICABLE) and all(n.startswith("sliced_") for n in names[:4])
    for r in rows:
        assert r["device"] == "cpu" and "smoke" in r["gpu"]
        assert r["torch"] == torch.__version__ and r["date_utc"].endswith("Z") and r["commit"]
        assert r["peak_extra_gb"] == ""  # no memory numbers on CPU
        if r["impl"] == "ceiling":
            assert r["status"] == "model"
            ms = float(r["bytes_gb"]) * 1e9 / (float(r["ceiling_copy_tbps"]) * 1e12) * 1e3
            assert math.isclose(float(r["median_ms"]), ms, rel_tol=1e-4)
        elif r["impl"] == "liger":
            assert r["status"].startswith("skipped")  # no CUDA here
        else:
            assert r["status"] == "ok", r
            assert float(r["median_ms"]) > 0 and float(r["tbps"]) > 0 and int(r["samples"]) == 1
            assert 0 < float(r["frac_copy_bw"]) and float(r["first_call_s"]) > 0
            assert float(r["b2b_ms"]) > 0 and r["b2b_calls"] == "2"  # --smoke: loops of 2 calls
            if r["impl"] == "rlkernel":
                assert "default arguments" in r["notes"], r["notes"]


def test_smoke_cross_checks_against_plain_torch(smoke):
    _, _, rows = smoke
    for r in rows:
        if r["impl"] in ("rlkernel", "torch.compile"):
            assert float(r["max_abs_diff"]) <= 1e-5, r
            if r["pass"] == "fwd+bwd":
                assert float(r["grad_rel_diff"]) <= 1e-2, r


def test_readme_and_results_page_from_the_csvs(smoke, tmp_path):
    _, out, _ = smoke
    readme, page = tmp_path / "README.md", tmp_path / "results.md"
    head = "# title\n\nintro text\n\n"
    tail = "\n\n## after\n\nmore text\n"
    readme.write_text(f"{head}{bench_readme.BEGIN}\nold table\n{bench_readme.END}{tail}")
    argv = ["--readme", "--results", str(out), "--readme-path", str(readme), "--results-page", str(page)]
    assert cli.main(argv) == 0
    text = readme.read_text()
    assert text.startswith(head + bench_readme.BEGIN + "\n") and text.endswith(bench_readme.END + tail)
    block = text[text.index(bench_readme.BEGIN) : text.index(bench_readme.END)]
    assert "old table" not in block and "CPU smoke run" in block
    # The headline: the users' call pattern only, one row per headline workload of the run (its one
    # vocabulary is both the largest and the smallest: shown once), every peer a named column.
    header = next(line for line in block.splitlines() if line.startswith("| call (users' pattern) |"))
    peers = [f"Liger-Kernel {_env(out, 'liger')}", f"TRL {_env(out, 'trl')} (`trl.kernels`)",
             f"torch {torch.__version__}", "torch.compile"]  # fmt: skip
    assert header.split(" | ")[2:] == ["rlkernel", *peers, "floor", "rlkernel ÷ fastest peer |"]
    rows = [line.split(" | ") for line in block.splitlines() if "| N = 64, V = 100 |" in line]
    whats = ["DAPO + KL loss from logits, fwd+bwd", "GSPO loss from logits, fwd+bwd",
             "log-probs + entropy from logits, fwd+bwd", "log-probs + entropy from logits, fwd (old / ref)"]
    assert [r[0] for r in rows] == [f"| {w}" for w in whats]
    # isolated / back to back (host time of an isolated call), no memory on CPU
    cell = re.fullmatch(r"([\d.]+) / ([\d.]+) ms \(host ([\d.]+)\)", rows[0][2])
    assert cell is not None and all(float(x) > 0 for x in cell.groups()), rows[0][2]
    assert rows[0][3] == "skipped" and re.fullmatch(r"[\d.]+× / [\d.]+×", rows[0][-1].removesuffix(" |"))
    assert "[docs/guides/benchmark-results.md](docs/guides/benchmark-results.md)" in block
    # The page: every row, the run's order (the sliced workloads first)
    full = page.read_text()
    assert full.startswith("# Benchmark results\n") and "## `logits`" in full
    assert "| workload | n_tokens | vocab | rlkernel | torch | torch.compile | liger | ceiling |" in full
    lines = [line for line in full.splitlines() if line.startswith("| ") and "(fwd" in line]
    assert [line.split(" (")[0] for line in lines] == ["| " + w for w in APPLICABLE]
    assert "per call back to back (2 calls, one sync)" in full
    before = readme.read_text(), full
    assert bench_readme.update_docs(readme, out, page) == []  # idempotent
    assert (readme.read_text(), page.read_text()) == before


def _env(out, column: str) -> str:
    with (out / "logits.csv").open(newline="") as f:
        return next(csv.DictReader(f))[column] or "—"


def test_headline_picks_sizes_and_ratios():
    """The headline's size picks ("min" / "max" of the run) and the ratio to the fastest measured peer."""
    base = {"suite": "logits", "pass": "fwd+bwd", "n_tokens": "8192", "status": "ok", "b2b_ms": ""}

    def row(workload, vocab, impl, ms, status="ok"):
        return {**base, "workload": workload, "vocab": str(vocab), "impl": impl, "median_ms": str(ms),
                "status": status}  # fmt: skip

    rows = [row("sliced_dapo_kl_fwd_bwd", v, impl, ms) for v in (1000, 2000)
            for impl, ms in (("rlkernel", v / 1000), ("torch", 4 * v / 1000), ("liger", 2 * v / 1000))]
    rows.append(row("sliced_dapo_kl_fwd_bwd", 2000, "trl", "", status="skipped: no TRL"))
    rows = [{"suite": r["suite"], "workload": r["workload"], "pass": r["pass"], "n_tokens": r["n_tokens"],
             "vocab": r["vocab"], **r} for r in rows]  # fmt: skip
    table = bench_readme.headline_table({"logits": rows})
    lines = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [line[1] for line in lines] == ["N = 8,192, V = 2,000", "N = 8,192, V = 1,000"]  # max, then min
    assert [line[2] for line in lines] == ["2.00 ms", "1.00 ms"]
    assert lines[0][4] == "skipped" and lines[1][4] == "—"  # TRL: skipped at V = 2000, no row at 1000
    assert [line[-1] for line in lines] == ["0.50× |", "0.50× |"]  # over Liger's time, the fastest peer
    assert bench_readme.headline_table({"linear": rows}) == ""  # none of its workloads


def test_headline_row_from_a_newer_partial_run_when_committed():
    """A headline row naming a newer run of its suite takes its rows from it where that run holds
    the workload, else from the suite's own CSV."""
    h = bench_readme.Headline("logits", "sliced_dapo_kl_fwd_bwd", "x", {"vocab": "max"}, "logits_later")
    base = {"suite": "logits", "workload": "sliced_dapo_kl_fwd_bwd", "pass": "fwd+bwd", "n_tokens": "8192",
            "vocab": "1000", "status": "ok", "b2b_ms": ""}  # fmt: skip
    old = [{**base, "impl": "rlkernel", "median_ms": "2.0"}]
    new = [{**base, "impl": "rlkernel", "median_ms": "1.5"}]
    other = [{**base, "workload": "sliced_gspo_fwd_bwd", "impl": "rlkernel", "median_ms": "9.0"}]
    assert h.source({"logits": old, "logits_later": new}) == "logits_later"
    assert h.source({"logits": old}) == "logits"
    assert h.source({"logits": old, "logits_later": other}) == "logits"  # the later run lacks it
    plain = bench_readme.Headline("logits", "sliced_dapo_kl_fwd_bwd", "x")  # names no newer run
    assert plain.source({"logits_later": new}) == "logits"


def test_readme_without_markers_is_a_clear_error(smoke, tmp_path, capsys):
    _, out, _ = smoke
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    argv = ["--readme", "--results", str(out), "--readme-path", str(readme)]
    argv += ["--results-page", str(tmp_path / "page.md")]
    assert cli.main(argv) == 2
    assert "<!-- bench:begin -->" in capsys.readouterr().err
    assert readme.read_text() == "# no markers\n"


def test_results_page_beside_the_readme_by_default(smoke, tmp_path, capsys):
    _, out, _ = smoke
    readme = tmp_path / "README.md"
    readme.write_text(f"{bench_readme.BEGIN}\n{bench_readme.END}\n")
    argv = ["--readme", "--results", str(out), "--readme-path", str(readme)]
    assert cli.main(argv) == 2  # tmp_path/docs/guides does not exist
    assert "--results-page" in capsys.readouterr().err
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    assert cli.main(argv) == 0
    assert (tmp_path / bench_readme.RESULTS_PAGE).read_text().startswith("# Benchmark results")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nope", "--smoke"], "unknown suite 'nope'; available suites: invariant, linear, logits, multigpu"),
        (["logits", "--smoke", "--impl", "torch,foo"], "unknown implementation 'foo' for suite 'logits'"),
        (["logits", "--smoke", "--workload", "ppo"], "unknown workload 'ppo' for suite 'logits'"),
        ([], "name a suite"),
    ],
)
def test_bad_names_give_clear_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    if "unknown implementation" in message:
        assert "rlkernel, torch, torch.compile, liger" in err


def test_bad_sizes_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        cli.main(["logits", "--smoke", "--n", "0"])
    assert "sizes must be positive" in capsys.readouterr().err


def test_get_suite_and_select_raise_bench_error():
    assert get_suite("logits") is SUITE
    with pytest.raises(BenchError, match="available suites"):
        get_suite("linear_typo")
    with pytest.raises(BenchError, match="choose from"):
        SUITE.build(harness.Options(device=torch.device("cpu"), smoke=True, impls=("tritonx",)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_cuda_the_full_run_points_to_smoke(capsys):
    assert cli.main(["logits"]) == 2
    assert "--smoke" in capsys.readouterr().err


def test_list(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "logits" in out and "dapo_kl_fwd_bwd" in out and "torch.compile" in out


def test_workload_matrix_and_bytes_model():
    opts = harness.Options(device=torch.device("cuda"))
    full = SUITE.build(opts)
    assert len(full) == 10 * 2  # every kind at N = 8192, V in {32768, 151936}: the sliced ones first
    assert [w.name for w in full[::2]] == list(APPLICABLE)
    assert {(w.params["n_tokens"], w.params["vocab"]) for w in full} == {(8192, 32768), (8192, 151936)}
    assert all(w.back_to_back and w.reference == "torch" for w in full)
    grid = SUITE.build(harness.Options(device=torch.device("cuda"), n_tokens=(4096, 8192, 16384)))
    assert len(grid) == 10 * 3 * 2  # the former grid, on request
    quick = SUITE.build(harness.Options(device=torch.device("cuda"), quick=True))
    assert {w.params["n_tokens"] for w in quick} == {8192}
    n, v = 8192, 151936
    by = {(w.name, w.params["n_tokens"], w.params["vocab"]): w for w in full}
    assert by["logprobs_fwd", n, v].bytes_moved == n * v * 2 + n * 12
    assert by["logprobs_entropy_fwd_bwd", n, v].bytes_moved == 3 * n * v * 2 + 2 * n * 16
    assert by["dapo_kl_fwd_bwd", n, v].bytes_moved == 3 * n * v * 2 + 2 * n * 21
    assert by["gspo_fwd_bwd", n, v].bytes_moved == 3 * n * v * 2 + 2 * n * 17
    # Sliced: B = 8 sequences of T = 1024 after P = 128 prompt positions; A active tokens (the
    # ragged lengths); read the active rows (twice with a backward), write the whole base gradient.
    lengths = bl.ragged_lengths(8, 1024)
    active = int(lengths.sum())
    assert 8 * 256 <= active <= n and active < n  # padding is part of the workload
    base = 8 * (128 + 1024) * v * 2
    assert by["sliced_dapo_kl_fwd_bwd", n, v].bytes_moved == 2 * active * v * 2 + base + 2 * n * 21
    assert by["sliced_gspo_fwd_bwd", n, v].bytes_moved == 2 * active * v * 2 + base + 2 * n * 17
    assert by["sliced_logprobs_entropy_fwd_bwd", n, v].bytes_moved == 2 * active * v * 2 + base + 2 * n * 16
    assert by["sliced_logprobs_entropy_fwd", n, v].bytes_moved == active * v * 2 + n * 16
    assert by["sliced_dapo_kl_fwd_bwd", n, v].input_bytes == base
    assert by["logprobs_fwd_bwd", n, v].impls == ("rlkernel", "torch", "torch.compile", "trl")
    assert by["sliced_logprobs_entropy_fwd", n, v].impls == ("rlkernel", "torch", "torch.compile", "trl")
    assert by["sliced_dapo_kl_fwd_bwd", n, v].impls == ("rlkernel", "torch", "torch.compile", "liger")
    only = SUITE.build(harness.Options(device=torch.device("cuda"), impls=("liger",)))
    assert {w.name for w in only} == {
        "sliced_dapo_kl_fwd_bwd", "sliced_gspo_fwd_bwd", "logprobs_fwd", "dapo_kl_fwd_bwd", "gspo_fwd_bwd"
    }  # fmt: skip
    only = SUITE.build(harness.Options(device=torch.device("cuda"), impls=("trl",)))
    assert {w.name for w in only} == {k for k, impls in APPLICABLE.items() if "trl" in impls}


def test_harness_helpers():
    assert harness.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert harness.quantile([1.0, 2.0], 0.2) == pytest.approx(1.2)
    assert harness.input_copies(10 * 2**30, 50 * 2**20) == 1  # larger than L2: reuse
    assert harness.input_copies(10 * 2**20, 50 * 2**20) == 16  # fits: rotate through 4x L2
    assert harness.input_copies(10, 0) == 1  # CPU


def _policy_inputs(seed: int, b: int = 6, t: int = 20, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=dtype) * 5
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)
    old[0, :3] = logp[0, :3] - 3.0  # r = e^3 ≈ 20 > dual clip 10 with A < 0: the dual clip binds
    ref = logp + 0.5 * torch.randn(b, t, generator=g, dtype=dtype)
    adv = torch.randn(b, generator=g, dtype=dtype)
    adv[0] = -1.0
    lengths = torch.tensor([t, t - 3, 1, t - 7, 0, t][:b])
    mask = torch.arange(t)[None, :] < lengths[:, None]  # includes an empty sequence
    return logp.requires_grad_(True), old, ref, adv[:, None].expand(b, t).contiguous(), mask


@pytest.mark.parametrize("name", ["dapo", "gspo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_baseline_matches_rlkernel_policy_loss(name, seed):
    cfg = bl.loss_config(name)
    spec = bl.spec_from_config(cfg)
    assert spec.loss_type == {"dapo": "ppo", "gspo": "gspo"}[name]
    if name == "dapo":
        assert spec.kl_coef == bl.KL_COEF
    logp, old, ref, adv, mask = _policy_inputs(seed)
    ours = bl.plain_policy_loss(logp, old, adv, mask, spec, ref)
    theirs = rk.policy_loss(logp, old, adv, mask, cfg, ref_logp=ref if spec.kl_coef else None).loss
    (g_ours,) = torch.autograd.grad(ours, logp)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_theirs.to(g_ours.dtype), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind_name", ["dapo_kl_fwd_bwd", "gspo_fwd_bwd"])
def test_plain_loss_from_logits_matches_fused_policy_loss(kind_name):
    kind = bl.KINDS[kind_name]
    cfg, spec = bl.resolve_loss(kind.loss)
    inp = bl.make_inputs(kind, 64, 50, torch.device("cpu"), seq_len=16, seed=3)
    x = inp["logits"].float().requires_grad_(True)
    ref = inp["ref_logp"] if spec.kl_coef else None
    args = (inp["ids"], inp["old_logp"], ref, inp["advantages"], inp["mask"])
    plain = bl.torch_policy_loss_from_logits(x, *args, spec, bl.TEMPERATURE)
    fused = rk.fused_policy_loss(
        cfg,
        token_ids=inp["ids"],
        old_logp=inp["old_logp"],
        advantages=inp["advantages"],
        mask=inp["mask"],
        logits=x,
        temperature=bl.TEMPERATURE,
        ref_logp=ref,
    ).loss
    torch.testing.assert_close(plain, fused, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(plain, x)[0], torch.autograd.grad(fused, x)[0])


def test_liger_configuration_binds_by_name():
    class FakeGrpo:  # the parameter list of liger-kernel 0.8.5's GrpoLossFunction.forward
        @staticmethod
        def forward(
            ctx, logits, old_logp, ref_logp, completion_ids, advantages, completion_mask, temperature, beta,
            eps_low, eps_high, inplace, loss_type="grpo", max_completion_length=None, reduce=True,
            importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
            vllm_is_ratio=None, delta=None, use_bias_correction_kl=False, num_items_in_batch=None,
            phi_seq=None,
        ):  # fmt: skip
            raise AssertionError

    dapo = bl.liger_loss_kwargs(bl.LossSpec("ppo", 0.2, 0.28, 1e-3, "token-mean", dual_clip=10.0))
    tensors = {k: k.upper() for k in bl.LIGER_TENSOR_ARGS}
    args = bl.liger_grpo_args(FakeGrpo, **tensors, **dapo)
    assert args[:6] == ["LOGITS", "OLD_LOGP", "REF_LOGP", "COMPLETION_IDS", "ADVANTAGES", "COMPLETION_MASK"]
    assert args[6:15] == [bl.TEMPERATURE, 1e-3, 0.2, 0.28, False, "dapo", None, True, "token"]
    gspo = bl.liger_loss_kwargs(bl.LossSpec("gspo", 3e-4, 4e-4, 0.0, "seq-mean-token-mean"))
    assert (gspo["loss_type"], gspo["importance_sampling_level"], gspo["beta"]) == ("grpo", "sequence", 0.0)

    class OldGrpo:
        @staticmethod
        def forward(ctx, logits, old_logp, ref_logp, completion_ids, advantages, completion_mask, temperature,
                    beta, eps_low, eps_high, inplace):  # fmt: skip
            raise AssertionError

    with pytest.raises(ValueError, match="importance_sampling_level"):
        bl.liger_grpo_args(OldGrpo, **tensors, **gspo)


def test_harness_runs_any_suite_and_records_failures(tmp_path):
    """A toy suite through the generic harness: the plug-in interface later suites use."""
    x = torch.randn(8, 8)

    def setup(device, impls, copies):
        def good(i):
            return harness.CallResult((x.sum(),))

        def close(i):
            return harness.CallResult((x.sum() + 1e-3,))

        def bad(i):
            raise RuntimeError("boom")

        return harness.Prepared({"good": good, "close": close, "bad": bad, "skip": harness.Skip("n/a")})

    impls = ("good", "close", "bad", "skip")
    workload = harness.Workload("toy", "fwd", {"n": 8}, 512, 10**6, 256, impls, "good", setup)
    suite = harness.Suite("toy", "a toy", impls, ("toy",), ("n",), "good", lambda opts: [workload])
    opts = harness.Options(device=torch.device("cpu"), smoke=True, warmup=0, rounds=2, reps=2)
    rows, meta = harness.run_suite(suite, opts, log=lambda line: None)
    by = {r["impl"]: r for r in rows}
    assert list(by) == [*impls, "ceiling"]
    assert by["good"]["status"] == "ok" and by["good"]["samples"] == 4
    assert by["close"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert by["bad"]["status"] == "error: RuntimeError: boom" and by["bad"]["median_ms"] is None
    assert by["skip"]["status"] == "skipped: n/a"
    c = meta["ceilings"]
    expected_s = max(512 / (c["copy_tbps"] * 1e12), 10**6 / (c["gemm_tflops"] * 1e12))
    assert by["ceiling"]["median_ms"] == pytest.approx(expected_s * 1e3)
    csv_path, _ = harness.write_results(suite, rows, meta, tmp_path)
    assert csv_path.read_text().splitlines()[0].startswith("suite,workload,pass,n,impl,status,median_ms")
    table = report.format_table(rows, suite.param_columns)
    assert "error: RuntimeError: boom" in table and "skipped: n/a" in table


def test_progress_line_says_time_first_call_and_peak():
    """The console line of a workload keeps the numbers a run stopped before writing its files
    would lose: median, first call, peak memory (CUDA only), or the status."""
    m = harness.Measurement("a", samples=[1.0, 2.0, 3.0], first_call_s=3.0, peak_bytes=2.5e9)
    assert harness._progress(m) == "a 2 ms (1st call 3.0 s) [peak +2.50 GB]"
    assert harness._progress(harness.Measurement("b", samples=[0.5])) == "b 0.5 ms"
    assert harness._progress(harness.Measurement("c", status="oom")) == "c oom"


@pytest.mark.parametrize(
    ("caps", "expected"),
    [((None, None, None), (2, 3, 2)), ((0, 2, 1), (0, 2, 1)), ((5, 9, 9), (2, 3, 2))],
)
def test_harness_workload_caps(caps, expected):
    """``Workload.max_warmup/max_rounds/max_reps`` cap the run's warm-up calls, rounds and calls per
    round for that workload (never raise them): the calls counted are first + warm-up + the memory
    call + rounds × reps, and the row's ``samples`` is rounds × reps."""
    warmup, rounds, reps = expected
    counted = []

    def setup(device, impls, copies):
        def call(i):
            counted.append(i)
            return harness.CallResult((torch.ones(()),))

        return harness.Prepared({"a": call})

    workload = harness.Workload(
        "toy", "fwd", {"n": 8}, None, None, 256, ("a",), "a", setup,
        max_warmup=caps[0], max_rounds=caps[1], max_reps=caps[2],
    )  # fmt: skip
    suite = harness.Suite("toy", "a toy", ("a",), ("toy",), ("n",), "a", lambda opts: [workload])
    opts = harness.Options(device=torch.device("cpu"), smoke=True, warmup=2, rounds=3, reps=2)
    assert workload.capped(opts) == expected
    rows, _ = harness.run_suite(suite, opts, log=lambda line: None)
    assert rows[0]["samples"] == rounds * reps
    assert len(counted) == 1 + warmup + 1 + rounds * reps


@pytest.mark.parametrize("oracle_fails", [False, True])
def test_harness_untimed_reference(oracle_fails):
    """A reference that is not one of the timed implementations (an oracle the setup provides under
    the workload's ``reference`` name): called once, given no row, and every row is cross-checked
    against it; if it fails, the rows stand without a cross-check."""
    x = torch.randn(8, 8)
    oracle_calls = []

    def setup(device, impls, copies):
        def oracle(i):
            oracle_calls.append(i)
            if oracle_fails:
                raise RuntimeError("out of oracle")
            return harness.CallResult((x.sum(),), (x,))

        def a(i):
            return harness.CallResult((x.sum() + 2e-3,), (x * 1.5,))

        def b(i):
            return harness.CallResult((x.sum(),), (x,))

        return harness.Prepared({"a": a, "b": b, "oracle": oracle})

    workload = harness.Workload("toy", "fwd", {"n": 8}, 512, None, 256, ("a", "b"), "oracle", setup)
    suite = harness.Suite("toy", "a toy", ("a", "b"), ("toy",), ("n",), "a", lambda opts: [workload])
    opts = harness.Options(device=torch.device("cpu"), smoke=True, warmup=0, rounds=1, reps=1)
    rows, _ = harness.run_suite(suite, opts, log=lambda line: None)
    by = {r["impl"]: r for r in rows}
    assert list(by) == ["a", "b", "ceiling"] and oracle_calls == [0]
    assert by["a"]["status"] == by["b"]["status"] == "ok"
    if oracle_fails:
        assert by["a"]["max_abs_diff"] is None and by["b"]["grad_rel_diff"] is None
    else:
        assert by["a"]["max_abs_diff"] == pytest.approx(2e-3, rel=1e-2)
        assert by["a"]["grad_rel_diff"] == pytest.approx(0.5) and by["b"]["max_abs_diff"] == 0


def test_time_interleaved_queue_ahead_flag_on_cpu_is_plain_timing():
    """``queue_ahead`` only changes CUDA timing; on the CPU the calls are timed as before."""
    calls = {"a": lambda i: sum(range(100)), "b": lambda i: sum(range(200))}
    out = harness.time_interleaved(calls, torch.device("cpu"), rounds=2, reps=2, queue_ahead=True)
    assert set(out) == {"a", "b"} and all(len(v) == 4 and min(v) >= 0 for v in out.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_time_hides_the_host():
    """``gpu_time_ms`` of a call that spends ~0.1 ms on the host before launching one tiny kernel
    is the kernel's time (the queued write outlasts the host time); the same call timed in
    isolation includes the host time."""
    import time

    x = torch.ones(1024, device="cuda")

    def call():
        # 0.1 ms of "host work" before the launch (< the ~0.35 ms queued): a busy wait, since
        # time.sleep(0.0001) overshoots by up to a few tenths of a ms on a loaded host (it once
        # outlasted the queued write on the H100 host: 0.08 ms of host time leaked into the result).
        end = time.perf_counter() + 1e-4
        while time.perf_counter() < end:
            pass
        x.add_(1)

    kernel_ms = harness.gpu_time_ms(call, torch.device("cuda"), reps=5, warmup=1)
    isolated = harness.time_interleaved({"c": lambda i: call()}, torch.device("cuda"), rounds=1, reps=3)
    assert kernel_ms < 0.05 < 0.1 <= min(isolated["c"])


def _fake_gpu_results(folder):
    """A committed-looking ``logits.json`` / ``logits.csv`` of a GPU run in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"meta": {"env": {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}}, "columns": [], "rows": []}
    (folder / "logits.json").write_text(json.dumps(meta))
    (folder / "logits.csv").write_text("gpu results\n")


def test_smoke_never_overwrites_measured_results(tmp_path, monkeypatch, capsys):
    """Issue 29: ``bench <suite> --smoke`` from a checkout wrote its CPU rows over the committed
    ``benchmarks/results/<suite>.*``. Without ``--out`` a smoke run now writes to a new temporary
    folder; with ``--out`` naming a folder of measured results it refuses (exit 2); an earlier smoke
    run's folder may be reused."""
    monkeypatch.chdir(tmp_path)  # the default --out is relative: a fake checkout here
    committed = tmp_path / cli.DEFAULT_OUT
    _fake_gpu_results(committed)
    fast = ["logits", "--smoke", "--rounds", "1", "--loop", "0", "--impl", "torch", "--no-plot",
            "--workload", "logprobs_fwd", "--n", "8", "--v", "16"]  # fmt: skip
    assert cli.main(fast) == 0
    assert (committed / "logits.csv").read_text() == "gpu results\n"
    wrote = capsys.readouterr().out.split("wrote ")[-1].split(", ")[0]
    smoke_dir = Path(wrote).parent
    assert smoke_dir.is_dir() and smoke_dir.resolve() != committed.resolve() and smoke_dir.name.startswith(
        "rlkernel-bench-logits-smoke-"
    )
    assert cli.main([*fast, "--out", str(committed)]) == 2
    err = capsys.readouterr().err
    assert "holds the logits results of a measured run" in err and "does not overwrite them" in err
    assert (committed / "logits.csv").read_text() == "gpu results\n"
    assert cli.main([*fast, "--out", str(smoke_dir)]) == 0  # a smoke folder: overwritten
    shutil.rmtree(smoke_dir)
