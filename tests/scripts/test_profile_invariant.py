"""scripts/profile_invariant.py --smoke: the op, model and kernel sections run on the CPU (the ops
through the Triton interpreter) and end with the table of every row."""

from __future__ import annotations

import re


def test_every_section(load_script, capsys):
    script = load_script("profile_invariant")
    assert script.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("=== host overhead and model times") :]
    rows = re.findall(r"^(.{36})  (.{48}) +([\d.]+) ?(us|ms)?$", table, re.MULTILINE)
    variants = {(g.strip(), v.strip()) for g, v, _, _ in rows}
    for on in ("fast launch", "triton launch"):  # every op, both launch paths
        assert ("linear [2,32]x[32,32]", f"rk linear (public), {on}") in variants
        assert ("rms_norm qk [2,1,4,16]", f"kernels.rmsnorm.rms_norm_fwd, {on}") in variants
        assert ("attention decode B=2 Tk=8", f"rk hf_attention_forward, {on}") in variants
    for model in ("unpatched", "patched fast", "patched triton"):  # models, interleaved
        for measure in ("wall", "host", "host CPU"):
            assert ("model tiny decode B=2 cache=16", f"{model} {measure}") in variants
            assert ("model tiny masked prime+8 steps B=2", f"{model} {measure}") in variants
    assert ("model tiny prefill B=2 T=16", "patched GPU kernels") in variants  # kernels section
    timed = [float(x) for g, v, x, unit in rows if unit in ("us", "ms") and "GPU" not in v]
    assert timed and all(x > 0 for x in timed)
    assert "== cProfile: patched decode B=2 cache=16" in out
