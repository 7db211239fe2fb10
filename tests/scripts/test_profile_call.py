"""scripts/profile_call.py --smoke: every case and section runs on the CPU and reports its numbers."""

from __future__ import annotations

import re

import pytest

from rlkernel.bench import profiling

CASES = ["dapo", "gspo", "logprobs", "hidden_dapo", "hidden_frozen", "hidden_logprobs"]


def _rows(out: str) -> dict[str, list[str]]:
    """The summary table's rows: case label -> its cells."""
    table = out[out.rindex("\ncase ") :].splitlines()[2:]
    return {" ".join(r.split()[:-10]): r.split()[-10:] for r in table if r.strip()}


def test_every_case_and_section(load_script, capsys):
    script = load_script("profile_call")
    argv = ["--smoke", "--cases", *CASES, "--kernels", "--marks", "--accounting", "--cprofile"]
    argv += ["--label", "A"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    labels = [f"A {c} sliced V=100 N=64" for c in CASES[:3]] + [f"A {c} V=100 N=64" for c in CASES[3:]]
    assert list(rows) == labels
    for cells in rows.values():
        isolated, b2b, host, cpu = (float(c) for c in cells[:4])
        assert isolated > 0 and b2b > 0 and host > 0 and cpu > 0
        assert cells[4:6] == ["-", "-"] and cells[6] == "0"  # no GPU kernels on the CPU
    assert out.count("\n=== A ") == len(CASES)
    assert "accounting: isolated" in out  # hidden cases: next to the GEMM floor
    assert "(totals over 2 calls)" in out  # cProfile
    # --marks: the loss calls pass the entry's checks (repeat calls: their kept decision), each mark
    # with its host entry <= exit
    marks = re.findall(r"^ +([\d.]+) +([\d.]+) +- +(.+)$", out, re.MULTILINE)
    assert {"rlkernel.rl.fused:checked_call", "(call end)"} <= {m[2] for m in marks}
    assert all(float(enter) <= float(leave) for enter, leave, _ in marks)


def test_options_and_switches(load_script, capsys):
    script = load_script("profile_call")
    argv = ["--smoke", "--option", "token_level_fusion=false", "--no-validate", "--contiguous"]
    argv += ["--forward-only"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "options {'token_level_fusion': False}" in out
    assert list(_rows(out)) == ["dapo contiguous V=100 N=64"]


BAD_OPTIONS = [("nope=1", "nope"), ("fast_launch", "NAME=VALUE"), ("grad_in_forward_max_vocab=-1", "max_voc")]


@pytest.mark.parametrize(("option", "message"), BAD_OPTIONS)
def test_bad_option_is_a_usage_error(load_script, capsys, option, message):
    script = load_script("profile_call")
    with pytest.raises(SystemExit) as exc:
        script.main(["--smoke", "--option", option])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_default_marks_name_functions_that_exist(load_script):
    """The stages --marks times by default: a renamed function must be renamed in the list too."""
    script = load_script("profile_call")
    _, missing = profiling.host_marks(lambda: None, script.MARKS, profiling.torch.device("cpu"), reps=1)
    assert missing == []
