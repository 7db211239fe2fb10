"""scripts/trl_trainer_compare.py at tiny size on the CPU: its report says what the two trainers did.

The script runs TRL 1.16's ``GRPOTrainer`` and ``RLKernelGRPOTrainer`` side by side (on the GPU at
407 M parameters, bf16). Here, in float32, the two must agree to rounding on every number the report
compares (losses, first-step gradients, final parameters), and under bf16 autocast ("amp") the
script's float32 oracle must be right: TRL's own gradients are within bf16 rounding of it (a broken
oracle, e.g. gradients read after the Trainer clipped them in place, is off by the clip factor) and
rlkernel's are no farther from it than twice TRL's distance.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from .trl_helpers import require_trl

TOL = 1e-6
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trl_trainer_compare.py"


@pytest.fixture(scope="module")
def script():
    require_trl()
    spec = importlib.util.spec_from_file_location("trl_trainer_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the script's annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="module")
def report(script, tmp_path_factory):
    """Two optimizer steps of each trainer; off-policy (2 iterations per generation: the second step's
    loss reads old log-probs), in float32 and under bf16 autocast."""
    out = tmp_path_factory.mktemp("trl_compare") / "report.json"
    argv = ["--device", "cpu", "--size", "tiny", "--precisions", "fp32,amp", "--settings", "off_policy"]
    argv.append("--replay")
    returned = script.main([*argv, "--steps", "2", "--out", str(out)])
    written = json.loads(out.read_text())
    return returned, written


def test_float32_trainers_agree(report):
    returned, _ = report
    [r] = [r for r in returned["results"] if r["precision"] == "fp32"]
    assert r["same_first_batch"] and r["same_completions"] == [True]  # one generation for 2 steps
    assert len(r["loss"]["trl"]) == 2
    assert r["loss"]["rlkernel"] == pytest.approx(r["loss"]["trl"], abs=TOL)
    assert r["loss"]["max_abs_diff"] <= TOL
    assert r["grads"]["max_abs"] <= TOL and r["grads"]["rel_norm"] <= 1e-5
    assert r["grads"]["ref_max_abs"] > 100 * TOL  # the gradients compared are not ~0
    assert r["params"]["max_abs_diff"] <= TOL
    assert r["params"]["max_abs_moved"] > 100 * TOL  # training moved the parameters
    # The second step is off-policy: its loss depends on the log-probs (not only the advantages).
    assert r["loss"]["trl"][1] != r["loss"]["trl"][0]
    assert "oracle" not in r


def test_autocast_oracle(report):
    returned, _ = report
    [r] = [r for r in returned["results"] if r["precision"] == "amp"]
    assert r["same_first_batch"]
    oracle = r["oracle"]
    assert 0 < oracle["trl_grads"]["rel_norm"] <= 0.05  # bf16 rounding, not a wrong oracle
    assert oracle["rlkernel_grads"]["rel_norm"] <= 2 * oracle["trl_grads"]["rel_norm"]
    assert oracle["rlkernel_loss_abs_diff"] <= 1e-3 and oracle["trl_loss_abs_diff"] <= 1e-3
    assert r["grads"]["rel_norm"] <= 0.05


def test_replay_on_trls_batch(report):
    """--replay: rlkernel's first step on TRL's recorded batch (how the GPU run compares gradients
    when the two samplers draw different completions): in float32 equal to TRL's own step; under
    autocast as close to the fp32 oracle as TRL's."""
    returned, _ = report
    by_precision = {r["precision"]: r for r in returned["results"]}
    fp32, amp = by_precision["fp32"]["replay"], by_precision["amp"]["replay"]
    assert fp32["loss_abs_diff_vs_trl"] <= TOL and fp32["grads_vs_trl"]["rel_norm"] <= 1e-5
    assert "grads_vs_oracle" not in fp32
    oracle = by_precision["amp"]["oracle"]
    assert amp["grads_vs_oracle"]["rel_norm"] <= 2 * oracle["trl_grads"]["rel_norm"]
    assert amp["loss_abs_diff_vs_oracle"] <= 1e-3


def test_json_report(report):
    returned, written = report
    assert written == json.loads(json.dumps(returned))  # the file is the returned report
    assert written["device"] == "cpu" and written["date"]
    for package in ("torch", "triton", "transformers", "trl", "datasets"):
        assert written["versions"][package]
    assert written["models"]["fp32"]["parameters"] > 0
    assert [(r["precision"], r["setting"]) for r in written["results"]] == [
        ("fp32", "off_policy"),
        ("amp", "off_policy"),
    ]
    for r in written["results"]:
        assert r["grpo_overrides"] == {"num_iterations": 2}
        for trainer in ("trl", "rlkernel"):
            times = r["time"][trainer]
            for key in ("first_step_s", "step_s", "prepare_s", "loss_forward_s", "loss_and_backward_s"):
                assert times[key] > 0
            assert len(r["logs"][trainer]) == 2 and "grad_norm" in r["logs"][trainer][0]


def test_bad_flags(script):
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--precisions", "fp16"])
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--settings", "nope"])
