"""scripts/trl_true_on_policy.py in its CPU smoke mode, and examples/trl_true_on_policy.py.

The script trains stock ``trl.GRPOTrainer`` and ``RLKernelGRPOTrainer(true_on_policy=True)`` from the
same start (on the GPU a 500 M Qwen3; here the tiny size, 4 steps, a generation every 2 steps) and
reports per step the mismatch TRL's names carry, the scoring forwards and the times; its ``--docs``
mode writes the docs table from a results file.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from .trl_helpers import require_trl

ROOT = Path(__file__).resolve().parents[2]
DIFF_MAX = "sampling/sampling_logp_difference/max"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses / pickling resolve names through it
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


@pytest.fixture(scope="module")
def script():
    require_trl()
    return _load(ROOT / "scripts" / "trl_true_on_policy.py", "trl_true_on_policy")


@pytest.fixture(scope="module")
def report(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_true_on_policy")
    returned = script.main(["--device", "cpu", "--size", "tiny", "--out", str(out)])
    return returned, out


def test_smoke_report(report):
    returned, out = report
    written = json.loads((out / "trl_true_on_policy.json").read_text())
    assert written["runs"].keys() == returned["runs"].keys() == {"trl", "rlkernel"}
    trl, ours = (returned["runs"][name] for name in ("trl", "rlkernel"))
    assert len(trl["steps"]) == len(ours["steps"]) == 4
    # Measured on the first step of each generation (2 optimizer steps per generation).
    assert trl["summary"]["measured_steps"] == ours["summary"]["measured_steps"] == [1, 3]
    for step in ours["steps"]:
        if DIFF_MAX in step:
            assert step[DIFF_MAX] == 0.0 and step["sampling/importance_sampling_ratio/min"] == 1.0
            assert step["sampling/importance_sampling_ratio/max"] == 1.0
    assert ours["summary"]["scoring_forwards"] == 0 and ours["summary"]["logp_difference_max"] == 0.0
    # Stock TRL scores the old log-probs (16 rows in chunks of 4, twice) and they differ from the sampler's.
    assert trl["summary"]["scoring_forwards"] == 8 and trl["summary"]["logp_difference_max"] > 0
    for run in (trl, ours):
        assert all(s["generation_s"] > 0 for s in run["steps"] if s["step"] in (1, 3))
        first = run["steps"][0]
        assert first["loss_backward_s"] > 0 and first["reward"] is not None
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "trl_true_on_policy.png").stat().st_size > 10_000


def test_docs_block(script, report, tmp_path):
    _, out = report
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{script.DOCS_BEGIN}\nplaceholder\n{script.DOCS_END}\n\nafter\n")
    script.main(["--docs", str(page), "--results", str(out / "trl_true_on_policy.json")])
    text = page.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "placeholder" not in text and "| trl.GRPOTrainer (stock) |" in text
    assert "| RLKernelGRPOTrainer(true_on_policy=True) |" in text and "1: 0, 3: 0" in text
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- trl-true-on-policy:begin -->"):
        script.main(["--docs", str(page), "--results", str(out / "trl_true_on_policy.json")])


def test_bad_arguments_exit_2(script, capsys):
    with pytest.raises(SystemExit) as info:
        script.main(["--device", "cpu", "--steps-per-generation", "2"])  # = accumulation: no old log-probs
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        script.main(["--docs", "page.md"])  # no --results
    assert "--docs needs --results" in capsys.readouterr().err


def test_example_prints_zero_with_true_on_policy(capsys):
    require_trl()
    example = _load(ROOT / "examples" / "trl_true_on_policy.py", "trl_true_on_policy_example")
    worst = example.main(steps=2)
    assert worst["true on-policy"] == 0.0 and worst["stock"] > 0
    lines = capsys.readouterr().out.splitlines()
    expected = "true on-policy  step 1: |Δlogp| mean 0 max 0; ratio min 1 max 1"
    assert any(line.startswith(expected) for line in lines)
