"""``rlkernel consistency`` on the tiny CPU model: the patched model's decode and prefill log-probs
agree bitwise over decode batch sizes {1, 3} and prefill batch sizes {2, 4} plus packing and the
fused hidden-state path (``invariant=True``), also in bf16 with fp32 LM-head logits; the report
(table and JSON) is complete; the model is left unpatched; bad command lines exit 2.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from rlkernel import cli as rk_cli
from rlkernel.invariant import consistency as cons
from rlkernel.invariant.patch import is_patched

CPU = torch.device("cpu")
SMALL = ["--num-seqs", "6", "--prompt-len", "6", "--gen-len", "8", "--reps", "1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cons.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("consistency") / "out.json"
    argv = [*SMALL, "--decode-batch-sizes", "1,3", "--prefill-batch-sizes", "2,4", "--json", str(path)]
    argv += ["--lm-head-dtype", "float32"]  # an fp32 model: the same as the default
    rc = rk_cli.main(["consistency", *argv, "--require-bitwise"])
    return rc, json.loads(path.read_text())


def test_patched_model_is_bitwise_consistent(report):
    rc, rep = report
    assert rc == 0 and rep["patched_bitwise"] is True
    pairs = rep["results"]["patched"]["pairs"]
    ways = {(p["rollout"], p["training"]) for p in pairs}
    expected = {
        (d, t)
        for d in ("decode bs=1", "decode bs=3")
        for t in ("prefill bs=2", "prefill bs=4", "packed bs=4", "fused inv bs=4")
    }
    assert ways == expected | {("decode bs=1", "decode bs=3")}
    for p in pairs:
        assert p["bitwise_equal_pct"] == 100.0 and p["max_abs_diff"] == 0.0 and p["mean_abs_diff"] == 0.0
    assert rep["results"]["patched"]["all_ways_bitwise_equal_pct"] == 100.0


def test_unpatched_numbers_are_reported(report):
    # fp32 on the CPU: the unpatched model may or may not be bitwise consistent; only report it.
    _, rep = report
    pairs = rep["results"]["unpatched"]["pairs"]
    assert len(pairs) == len(rep["results"]["patched"]["pairs"])
    assert {p["training"] for p in pairs} >= {"fused bs=4"}  # the default hidden-state path
    for p in pairs:
        assert 0.0 <= p["bitwise_equal_pct"] <= 100.0
        assert 0.0 <= p["mean_abs_diff"] <= p["max_abs_diff"] < 1e-3  # fp32: tiny, but maybe not 0


def test_report_fields(report):
    _, rep = report
    assert rep["model"]["architecture"] == "Qwen3ForCausalLM" and rep["model"]["layers"] == 2
    assert rep["device"] == "cpu" and rep["dtype"] == "float32"
    assert rep["settings"]["decode_batch_sizes"] == [1, 3] and rep["tokens"] == 6 * 8
    assert rep["settings"]["lm_head_dtype"] == "float32"
    t = rep["timing"]
    for key in (
        "unpatched_prefill_ms",
        "patched_prefill_ms",
        "unpatched_decode_step_ms",
        "patched_decode_step_ms",
    ):
        assert t[key] > 0
    assert t["prefill_patched_over_unpatched"] == pytest.approx(
        t["patched_prefill_ms"] / t["unpatched_prefill_ms"]
    )
    assert rep["device_type"] == "cpu"
    text = cons.format_report(rep)
    assert "PASS" in text and "packed bs=4" in text and "fused inv bs=4" in text
    # Issue 29: a CPU speed ratio (14x one run, 0.5x the next) was printed as if it meant something.
    speed = next(line for line in text.splitlines() if line.startswith("speed"))
    assert speed.startswith("speed (CPU: not a measurement") and "x)" not in speed and "x;" not in speed
    gpu = cons.format_report({**rep, "device_type": "cuda"})
    assert "speed: prefill forward" in gpu and f"({t['prefill_patched_over_unpatched']:.2f}x)" in gpu


def test_decode_timing_passes_the_cache_without_a_deprecation_warning():
    """Issue 29: `past_key_values` is deprecated (transformers 5.2x: ``cache``), and the warning came
    from our own decode-timing call; the forward's own argument name is used."""
    import warnings

    from rlkernel.invariant import scoring

    model = cons.build_model("tiny", device=CPU, dtype=torch.float32, seed=0)
    prompts = scoring.make_prompts(2, 4, model.config.vocab_size, seed=0)
    completions = torch.randint(0, model.config.vocab_size, (2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning from our call fails the test
        times = scoring._decode_timer(model, prompts, completions, 2, steps=2)()
    assert len(times) == 2 and all(t > 0 for t in times)


def test_bf16_with_fp32_lm_head_is_bitwise_consistent(capsys):
    """bf16 weights, ``--lm-head-dtype float32``: the patched model's fp32 logits at decode, in the
    logits prefill and through the fused invariant path (``logits_dtype=torch.float32``) agree."""
    argv = ["--num-seqs", "3", "--prompt-len", "4", "--gen-len", "4", "--reps", "1", "--dtype", "bfloat16"]
    argv += ["--decode-batch-sizes", "1,3", "--prefill-batch-sizes", "3", "--lm-head-dtype", "float32"]
    rc = cons.run(_args([*argv, "--require-bitwise", "--json"]))
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["patched_bitwise"] and rep["settings"]["lm_head_dtype"] == "float32"
    fused = [p for p in rep["results"]["patched"]["pairs"] if p["training"] == "fused inv bs=3"]
    assert len(fused) == 2 and all(p["bitwise_equal_pct"] == 100.0 for p in fused)


def test_require_bitwise_covers_the_fused_pair(monkeypatch, capsys):
    """A fused invariant path one ulp off fails --require-bitwise (exit 1), the rest being equal."""
    real = cons.fused_prefill_logprobs

    def off_by_one_ulp(*args, invariant, **kw):
        out = real(*args, invariant=invariant, **kw)
        return torch.nextafter(out, torch.zeros_like(out)) if invariant else out

    monkeypatch.setattr(cons, "fused_prefill_logprobs", off_by_one_ulp)  # seam: a broken fused path
    argv = ["--num-seqs", "2", "--prompt-len", "3", "--gen-len", "2", "--reps", "1"]
    argv += ["--decode-batch-sizes", "1", "--prefill-batch-sizes", "2", "--require-bitwise"]
    rc = cons.run(_args(argv))
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL: the patched model is NOT" in out
    line = next(x for x in out.splitlines() if x.startswith("patched") and "fused inv bs=2" in x)
    assert line.endswith(" 0.0%")


def test_json_to_stdout_parses_and_model_left_unpatched(capsys, monkeypatch):
    built = []
    real_build = cons.build_model

    def build(*a, **kw):
        built.append(real_build(*a, **kw))
        return built[-1]

    monkeypatch.setattr(cons, "build_model", build)  # seam: stub model
    argv = ["--config", "tiny-llama", "--num-seqs", "2", "--prompt-len", "3", "--gen-len", "2", "--reps", "1"]
    rc = cons.run(_args([*argv, "--decode-batch-sizes", "1,2", "--prefill-batch-sizes", "2", "--json"]))
    out = capsys.readouterr().out
    rep = json.loads(out)
    assert rc == 0 and rep["model"]["architecture"] == "LlamaForCausalLM" and rep["patched_bitwise"]
    assert not is_patched(built[0]) and built[0].config._attn_implementation == "sdpa"


def test_same_tokens_scored_everywhere():
    """Teacher-forced decode scores exactly the rollout tokens, at any batch size."""
    model = cons.build_model("tiny", device=CPU, dtype=torch.float32, seed=1)
    prompts = cons.make_prompts(3, 5, 512, seed=1)
    assert [len(p) for p in prompts][0] == 5 and min(len(p) for p in prompts) >= 3
    comp = cons.rollout(model, prompts, 4, 3, seed=1)
    assert comp.shape == (3, 4)
    a = cons.decode_logprobs(model, prompts, comp, 1)
    b = cons.prefill_logprobs(model, prompts, comp, 3)
    assert a.shape == b.shape == (3, 4) and bool((a <= 0).all())
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_compare():
    a = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    b = torch.tensor([-1.0, -2.5, -3.0, -4.0])
    assert cons.compare(a, b) == {"max_abs_diff": 0.5, "mean_abs_diff": 0.125, "bitwise_equal_pct": 75.0}


@pytest.mark.parametrize(
    "argv",
    [["--num-seqs", "0"], ["--device", "cuda"] if not torch.cuda.is_available() else ["--gen-len", "0"]],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert cons.run(_args(argv)) == 2
    assert "error" in capsys.readouterr().err


def test_bad_batch_size_list_is_rejected():
    with pytest.raises(SystemExit):
        _args(["--decode-batch-sizes", "1,x"])
    with pytest.raises(SystemExit):
        _args(["--prefill-batch-sizes", "0"])


def test_model_path_loads_a_local_checkpoint(tmp_path, capsys):
    model = cons.build_model("tiny-llama", device=CPU, dtype=torch.float32, seed=2)
    model.save_pretrained(tmp_path)
    loaded = cons.load_model(str(tmp_path), device=CPU, dtype=torch.float32)
    ids = torch.randint(1, 512, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    argv = [
        "--model",
        str(tmp_path),
        "--device",
        "cpu",
        "--num-seqs",
        "2",
        "--prompt-len",
        "3",
        "--gen-len",
        "2",
    ]
    rc = cons.run(_args([*argv, "--reps", "1", "--decode-batch-sizes", "1,2", "--prefill-batch-sizes", "2"]))
    out = capsys.readouterr().out
    assert rc == 0 and str(tmp_path) in out and "LlamaForCausalLM" in out and "PASS" in out


def test_a_failing_patched_run_is_reported_not_raised(monkeypatch, capsys):
    import rlkernel.invariant.patch as patch_mod

    def broken(model):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(patch_mod, "patch_hf_model", broken)  # seam: fake failure
    argv = ["--num-seqs", "2", "--prompt-len", "3", "--gen-len", "2", "--reps", "1"]
    rc = cons.run(_args([*argv, "--decode-batch-sizes", "1", "--prefill-batch-sizes", "2"]))
    out = capsys.readouterr().out
    assert rc == 1
    assert "patched    FAILED: RuntimeError: kernel exploded" in out and "unpatched  decode bs=1" in out
    assert "FAIL: the patched model is NOT" in out and "n/a" in out
