"""Bad command lines of ``rlkernel demo | bench | consistency``: exit code 2 and one clear line on
stderr, decided before any work starts (the work functions are replaced by ones that fail the test
if they are called), and ``python -m rlkernel`` runs the same command.

``COVERED`` lists the CLI subcommands these cases cover, for tests/test_public_api_bad_input.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlkernel
from rlkernel.cli import main

COVERED = ["cli:demo", "cli:bench", "cli:consistency"]

UNWRITABLE_DIR = "/dev/null/x"  # a path below a file: no folder can ever be created there


def _no_work(*args, **kwargs):
    raise AssertionError("the command started its work before rejecting its arguments")


@pytest.fixture
def no_work(monkeypatch):
    """Every long-running entry point of the three commands fails the test if called."""
    import rlkernel.bench.harness as harness
    import rlkernel.demo.grpo as grpo
    import rlkernel.invariant.consistency as consistency

    monkeypatch.setattr(grpo, "train", _no_work)  # seam: stub: no work
    monkeypatch.setattr(harness, "run_suite", _no_work)  # seam: stub: no work
    for name in ("build_model", "load_model", "run_check"):
        monkeypatch.setattr(consistency, name, _no_work)  # seam: stub: no work


def _exit_2_one_line(argv, capsys, *needles):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _read_only_dir(tmp_path: Path) -> Path:
    ro = tmp_path / "read_only"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores permission bits
        pytest.skip("running as a user that can write to read-only folders")
    return ro


# ---------------------------------------------------------------------------------------- demo
@pytest.mark.parametrize("out", [UNWRITABLE_DIR, "{file}", "{file}/sub"])
def test_demo_unwritable_out(no_work, capsys, tmp_path, out):
    file = tmp_path / "a_file"
    file.write_text("")
    out = out.format(file=file)
    _exit_2_one_line(["demo", "--out", out], capsys, "rlkernel demo: error:", "--out", out)


def test_demo_out_in_read_only_folder(no_work, capsys, tmp_path):
    out = _read_only_dir(tmp_path) / "run"
    _exit_2_one_line(["demo", "--out", str(out)], capsys, "--out", "not writable")


# --------------------------------------------------------------------------------------- bench
@pytest.mark.parametrize("out", [UNWRITABLE_DIR, "{file}"])
def test_bench_unwritable_out(no_work, capsys, tmp_path, out):
    file = tmp_path / "a_file"
    file.write_text("")
    out = out.format(file=file)
    argv = ["bench", "logits", "--smoke", "--out", out]
    _exit_2_one_line(argv, capsys, "rlkernel bench: error:", "--out", out)


def test_bench_readme_paths(no_work, capsys, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x")
    missing = tmp_path / "missing"
    _exit_2_one_line(
        ["bench", "--readme", "--results", str(missing), "--readme-path", str(readme)],
        capsys,
        "--results",
        str(missing),
    )
    _exit_2_one_line(
        ["bench", "--readme", "--results", str(tmp_path), "--readme-path", str(missing / "README.md")],
        capsys,
        "--readme-path",
    )
    _exit_2_one_line(  # the results page: a folder is no file to write
        ["bench", "--readme", "--results", str(tmp_path), "--readme-path", str(readme), "--results-page",
         str(tmp_path)],
        capsys,
        "--results-page",
        "is a folder",
    )


# --------------------------------------------------------------------------------- consistency
def test_consistency_unwritable_json(no_work, capsys):
    _exit_2_one_line(
        ["consistency", "--json", UNWRITABLE_DIR], capsys, "rlkernel consistency: error:", "--json"
    )


def test_consistency_json_is_a_folder(no_work, capsys, tmp_path):
    _exit_2_one_line(["consistency", "--json", str(tmp_path)], capsys, "--json", "is a folder")


@pytest.mark.parametrize("reps", ["-5", "0"])
def test_consistency_reps_below_one(no_work, capsys, reps):
    """Issue 29: --reps -5 ran (as 1) and exited 0."""
    argv = ["consistency", "--reps", reps]
    _exit_2_one_line(argv, capsys, "rlkernel consistency: error:", "--reps must be >= 1")


@pytest.mark.parametrize("model", ["/nonexistent/path", "{empty}", "{file}"])
def test_consistency_model_not_a_checkpoint(no_work, capsys, tmp_path, model):
    empty = tmp_path / "empty"
    empty.mkdir()
    file = tmp_path / "weights.bin"
    file.write_text("")
    model = model.format(empty=empty, file=file)
    line = _exit_2_one_line(["consistency", "--model", model], capsys, "--model", model)
    assert "Repo id" not in line


# ---------------------------------------------------------------------------- python -m rlkernel
def test_python_dash_m_rlkernel_runs_the_cli(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(rlkernel.__file__).parents[1]))
    run = subprocess.run(
        [sys.executable, "-m", "rlkernel", "demo", "--out", UNWRITABLE_DIR],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "rlkernel demo: error:" in lines[0] and "--out" in lines[0], run.stderr
    help_run = subprocess.run(
        [sys.executable, "-m", "rlkernel", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert help_run.returncode == 0 and "demo" in help_run.stdout and "consistency" in help_run.stdout
