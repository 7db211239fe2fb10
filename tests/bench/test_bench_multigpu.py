"""The ``multigpu`` bench suite end to end on the CPU (``--smoke``: torchrun, 2 gloo ranks, tiny
sizes, about 5 s): its rows and columns, the cross-checks and ratios in them, the results page's
several-GPU section; then the pieces without torchrun (GPU counts, records -> rows, the time limit,
the command line's errors)."""

from __future__ import annotations

import csv
import json
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch

from rlkernel.bench import SUITES, BenchError, cli, harness, report
from rlkernel.bench import multigpu as mg
from rlkernel.bench import readme as bench_readme

SUITE = SUITES["multigpu"]
REPO = Path(__file__).resolve().parents[2]
TP, FSDP2 = "tp_logprobs_entropy_fwd_bwd", "fsdp2_head_fwd_bwd"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One ``rlkernel bench multigpu --smoke`` (torchrun of 2 CPU ranks) through the CLI."""
    out = tmp_path_factory.mktemp("bench_multigpu")
    rc = cli.main(["multigpu", "--smoke", "--out", str(out)])
    with (out / "multigpu.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rc, out, rows


def test_smoke_rows_and_columns(smoke):
    rc, out, rows = smoke
    assert rc == 0
    assert list(rows[0]) == list(harness.columns_for(SUITE))
    assert list(rows[0])[3:8] == ["gpus", "world_size", "n_tokens", "hidden", "vocab"]
    got = [(r["workload"], r["gpus"], r["n_tokens"], r["hidden"], r["impl"]) for r in rows]
    want = [(TP, "1", "32", "16", "rlkernel"), (TP, "2", "32", "16", "rlkernel_tp"),
            (TP, "2", "32", "16", "all_reduce_dhidden"), (TP, "2", "32", "16", "ceiling")]
    for n, h in (("32", "16"), ("16", "8")):
        want += [(FSDP2, "1", n, h, "rlkernel"), (FSDP2, "2", n, h, "rlkernel_dtensor"),
                 (FSDP2, "2", n, h, "rlkernel_dtensor_fp32"), (FSDP2, "2", n, h, "all_gather_reduce_scatter")]
    assert got == want  # fmt: skip
    for r in rows:
        assert r["world_size"] == "2" and r["vocab"] == "101" and r["pass"] == "fwd+bwd"
        assert r["device"] == "cpu" and "smoke" in r["gpu"] and r["torch"] == torch.__version__
        assert r["commit"] and r["date_utc"].endswith("Z") and r["notes"]
        if r["impl"] == "ceiling":
            assert r["status"] == "model" and float(r["frac_gemm"]) == pytest.approx(1.0)
            continue
        assert r["status"] == "ok", r
        assert r["samples"] == "2"  # smoke: 2 rounds of 1 step
        assert 0 < float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"])
    data = json.loads((out / "multigpu.json").read_text())
    (run,) = data["meta"]["runs"]
    assert run["world_size"] == 2 and run["returncode"] == 0 and run["problem"] is None
    assert "--nproc-per-node 2 -m rlkernel.bench._multigpu_worker" in run["command"]
    assert data["meta"]["env"]["device"] == "cpu" and len(data["rows"]) == len(rows)
    assert (out / "multigpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_ratios_and_cross_checks(smoke):
    """Each size's ratios are against the 1-GPU ``rlkernel`` row of the same run; the TP and DTensor
    rows are cross-checked against it (rank 0's weight-gradient rows: a wrong slice would be off by
    ~100 %), the collectives alone are not."""
    _, _, rows = smoke
    base = {(r["workload"], r["hidden"]): float(r["median_ms"]) for r in rows if r["impl"] == "rlkernel"}
    for r in rows:
        ms, b = float(r["median_ms"]), base[(r["workload"], r["hidden"])]
        if r["impl"] in mg.ALONE:
            assert r["speedup_vs_baseline"] == "" and r["max_abs_diff"] == "" and "GB/s" in r["notes"]
            assert float(r["bytes_gb"]) > 0
            continue
        assert float(r["speedup_vs_baseline"]) == pytest.approx(b / ms, rel=1e-4)
        if r["impl"] in ("rlkernel_tp", "rlkernel_dtensor", "rlkernel_dtensor_fp32"):
            assert float(r["max_abs_diff"]) <= 1e-3 and float(r["grad_rel_diff"]) <= 2e-2, r
        if r["impl"] == "rlkernel_tp":
            assert f"perfect split (1 GPU / 2) = {b / 2:.3g} ms" in r["notes"] and "51 / 50" in r["notes"]
        if r["impl"].startswith("rlkernel_dtensor"):
            assert f"DTensor / plain = {ms / b:.2f}x" in r["notes"]
    fp32 = next(r for r in rows if r["impl"] == "rlkernel_dtensor_fp32")
    assert "fp32 shards" in fp32["notes"] and "cast to hidden's bf16 before the gather" in fp32["notes"]


def test_results_page_section_and_readme_run_line(smoke, tmp_path):
    _, out, rows = smoke
    page = bench_readme.results_page(out)
    section = page[page.index("## Several GPUs (`multigpu`)") :]
    assert "**CPU smoke run: not a performance measurement.**" in section
    tp_row = next(line for line in section.splitlines() if line.startswith("| 2 | N = 32, H = 16, V = 101 |"))
    cells = tp_row.split(" | ")
    one, tp = (next(float(r["median_ms"]) for r in rows if r["impl"] == i)
               for i in ("rlkernel", "rlkernel_tp"))
    assert cells[4] == f"{one / tp:.2f}×" and cells[5] == f"{report._ms(one / 2)} ms"
    assert section.count("| 2 | N = 32, H = 16, V = 101 |") == 2
    assert "| 2 | N = 16, H = 8, V = 101 |" in section
    assert "## `multigpu`" not in page  # not also as a generic table
    assert "`multigpu` on 2× cpu" in bench_readme.readme_block(out)
    # Without multigpu.csv the section says so, with no numbers.
    shutil.copy(out / "multigpu.csv", tmp_path / "other.csv")
    section = bench_readme.results_page(tmp_path).split("## Several GPUs (`multigpu`)")[1]
    assert "Not measured: there is no" in section and "multigpu.csv" in section and "| " not in section


def test_committed_results_page_has_the_section():
    """The committed page (regenerated from the committed CSVs, tests/bench/test_bench_sliced.py)
    has the several-GPU section; its link target exists."""
    text = (REPO / bench_readme.RESULTS_PAGE).read_text()
    assert "## Several GPUs (`multigpu`)" in text
    assert "## Benchmark" in (REPO / "docs/guides/multi-gpu.md").read_text()


def test_world_sizes_and_visible_devices():
    assert mg.world_sizes(None, 8, False) == (2, 4, 8)
    assert mg.world_sizes(None, 6, False) == (2, 4)
    assert mg.world_sizes((4, 2, 4), 4, False) == (4, 2)
    assert mg.world_sizes(None, 0, True) == (2,) and mg.world_sizes((3,), 0, True) == (3,)
    with pytest.raises(BenchError, match="needs at least 2 CUDA GPUs, this machine has 1"):
        mg.world_sizes(None, 1, False)
    with pytest.raises(BenchError, match="--gpus 4: this machine has 2"):
        mg.world_sizes((2, 4), 2, False)
    with pytest.raises(BenchError, match="must be >= 2"):
        mg.world_sizes((1,), 8, False)
    assert mg.visible_devices(2, None) == "0,1" and mg.visible_devices(2, "") == "0,1"
    assert mg.visible_devices(2, "4, 5,6,7") == "4,5"


def test_timing_counts_keep_ten_steps():
    def counts(**kw):
        return mg.timing_counts(harness.Options(device=torch.device("cuda"), **kw))

    assert counts(warmup=1, rounds=5, reps=3) == (2, 5, 3)
    assert counts(warmup=1, rounds=3, reps=2) == (2, 3, 4)  # --quick: still >= 10 steps
    assert counts(rounds=1, reps=1) == (2, 1, 10)
    assert mg.timing_counts(harness.Options(device=torch.device("cpu"), smoke=True, warmup=0, rounds=2,
                                            reps=1)) == (0, 2, 1)  # fmt: skip


def _rec(impl, gpus, samples, **kw):
    return {"workload": TP, "pass": "fwd+bwd", "world_size": 4, "n_tokens": 8, "hidden": 4, "vocab": 10,
            "impl": impl, "gpus": gpus, "status": "ok", "samples": samples, "notes": "n", **kw}  # fmt: skip


def test_make_rows_from_records():
    records = [
        _rec("rlkernel", 1, [40.0, 38.0, 42.0], flops=8e12, peak_bytes=2e9),
        _rec("rlkernel_tp", 4, [12.0, 10.0, 11.0, 30.0], flops=8e12),
        _rec("all_reduce_dhidden", 4, [2.0], bytes=4e9),
        {**_rec("ceiling", 4, None, flops=8e12), "status": "model"},
    ]
    env = {"gpu": "G", "commit": "abc"}
    rows = mg.make_rows(records, env, {"gemm_tflops": 1000.0, "copy_tbps": 3.0})
    one, tp, ar, ceil = rows
    assert one["median_ms"] == 40.0 and one["speedup_vs_baseline"] == 1.0 and one["peak_extra_gb"] == 2.0
    assert tp["median_ms"] == statistics.median([12.0, 10.0, 11.0, 30.0]) == 11.5
    assert tp["speedup_vs_baseline"] == pytest.approx(40 / 11.5)
    assert "perfect split (1 GPU / 4) = 10 ms" in tp["notes"]
    assert tp["tflops"] == pytest.approx(8e12 / 11.5e-3 / 1e12)
    assert tp["frac_gemm"] == pytest.approx(tp["tflops"] / 4000)  # of the 4 GPUs' GEMM rate
    assert ar["speedup_vs_baseline"] is None and "2000 GB/s" in ar["notes"]
    assert ceil["median_ms"] == pytest.approx(8e12 / 4e15 * 1e3) and ceil["status"] == "model"
    assert all(r["gpu"] == "G" and r["suite"] == "multigpu" for r in rows)
    failed = mg.failed_rows(FSDP2, 2, [(8, 4), (4, 2)], 10, "rank 1: boom\n  more", env)
    assert [(r["impl"], r["gpus"], r["hidden"]) for r in failed[:4]] == [
        ("rlkernel", 1, 4), ("rlkernel_dtensor", 2, 4), ("rlkernel_dtensor_fp32", 2, 4),
        ("all_gather_reduce_scatter", 2, 4)]  # fmt: skip
    assert len(failed) == 8 and all(r["status"] == "error: rank 1: boom more" for r in failed)


def test_launch_echoes_progress_and_kills_at_the_time_limit():
    """Progress lines are echoed, the rest only kept for the tail; a run past its limit is killed
    (its whole session) and reported as such."""
    said = []
    code = f"print('{mg.PROGRESS} started'); print('other'); raise SystemExit(3)"
    rc, tail = mg.launch([sys.executable, "-c", code], {}, 60.0, said.append)
    assert rc == 3 and said == ["    started"] and tail.splitlines()[-1] == "other"
    rc, tail = mg.launch([sys.executable, "-c", "import time; time.sleep(60)"], {}, 0.5, said.append)
    assert rc is None and tail == "(killed after 0.5 s)"


def test_printed_table_keeps_a_size_together():
    """The end-of-run table separates sizes, not the 1-GPU baseline from the rows over W GPUs."""
    rows = mg.make_rows([_rec("rlkernel", 1, [4.0]), _rec("rlkernel_tp", 4, [2.0])], {}, {})
    rows += mg.make_rows([{**_rec("rlkernel", 1, [4.0]), "hidden": 8}], {}, {})
    lines = report.format_table(rows, SUITE.param_columns, SUITE.baseline).splitlines()
    assert [bool(line.strip()) for line in lines] == [True, True, True, False, True]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["multigpu", "--smoke", "--gpus", "1"], "--gpus: every count must be >= 2"),
        (["logits", "--smoke", "--gpus", "2"], "--gpus applies to the multigpu suite, not to 'logits'"),
        (["multigpu", "--smoke", "--n", "8"], "--n does not apply to the multigpu suite"),
        (["multigpu", "--smoke", "--workload", "nope"], "unknown workload 'nope' for suite 'multigpu'"),
    ],
)
def test_bad_command_lines(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_cuda_the_full_run_points_to_smoke(capsys):
    assert cli.main(["multigpu"]) == 2
    assert "rlkernel bench multigpu --smoke" in capsys.readouterr().err


def test_list_shows_the_suite(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "multigpu: the LM head over several GPUs" in out
    assert f"workloads:       {TP}, {FSDP2}" in out and "rlkernel_dtensor_fp32" in out
