"""``rlkernel consistency``: do rollout (KV-cache decode) and training (prefill) agree on every log-prob?

The command builds one model, samples one set of rollouts, and then computes the log-prob of every
generated token several ways, the way an RL system does: by the rollout engine (decode with a KV cache,
at some batch size) and by the trainer (one prefill forward over prompt + completion, at another batch
size, right-padded or packed). It does this for the model as HF runs it (``unpatched``) and after
:func:`rlkernel.invariant.patch_hf_model` (``patched``, same weights), and reports per pair of ways
max |Δlogp|, mean |Δlogp| and the share of tokens whose fp32 log-probs are bitwise equal.

Method (docs/guides/consistency.md has the reading guide):

1. **Model.** ``--config tiny`` (default: a 2-layer Qwen3 with hidden 64, fp32 on the CPU),
   ``tiny-llama`` (the same shapes as a Llama), ``anchor`` (4 layers of hidden 1024, 16/8 heads,
   head_dim 128, vocab 151,936, bf16 on CUDA: the configuration the numbers in DESIGN.md were
   measured on), ``qwen3-8b-slice`` (2 layers of Qwen3-8B's shapes, bf16 on CUDA) with random
   weights (``--seed``), or ``--model PATH``, a local HF checkpoint. Attention starts as SDPA.
2. **Prompts.** ``--num-seqs`` random prompts whose lengths differ (uniform in [P/2, P], the first
   one P = ``--prompt-len`` long), so every batch of more than one prompt is left-padded by
   ``generate()`` and right-padded by the trainer.
3. **Rollout tokens, once.** ``generate()`` (KV cache, sampling at temperature 1 from the full
   distribution, ``torch.manual_seed(seed)``) with the *unpatched* model at the largest decode batch
   size gives ``--gen-len`` tokens per prompt (no EOS: every completion has the full length). These
   token sequences are fixed from here on: every comparison is about the log-probs of the same tokens.
   Scoring generated tokens rather than re-generating at each batch size matters: once greedy or
   sampled decoding diverges, two runs no longer score the same tokens and the difference stops
   meaning anything.
4. **Decode log-probs** at each ``--decode-batch-sizes`` b: the prompts in batches of b go through
   ``generate()`` again with a logits processor that forces the known next token (greedy over a
   one-hot score), so the model sees exactly what the rollout engine saw, step by step through the
   KV cache, at batch size b, left-padded. The log-prob of token t is taken from that step's raw
   logits (``output_logits=True``: the fp32 copy of the last position's logits before any
   processor).
5. **Prefill log-probs** at each ``--prefill-batch-sizes`` b: prompt + completion in batches of b,
   right-padded with an attention mask, one training-style forward without a cache (``padded``);
   and ``packed``: each batch of the largest size concatenated into one row, ``position_ids``
   restarting at 0 per sequence and no attention mask (HF's packed-sequence convention, which turns
   the mask into a block-diagonal one). Token t's log-prob comes from the logits at the position
   before it.
6. **One log-softmax path.** Every logits tensor is cast to fp32 (exact from bf16) and goes through
   :func:`rlkernel.token_logprobs` (itself batch invariant), so the log-softmax cannot be the source
   of any difference; only the model's forward can.
6b. **The memory-flat training path** (``fused bs=B`` / ``fused inv bs=B``): the same right-padded
   prefill batches of the largest size through the base model (``model.model``, no LM head), then
   :func:`rlkernel.linear_token_logprobs` from the last hidden states and ``lm_head.weight``, as a
   trainer that never materializes the logits scores them: the default path for the unpatched
   model, ``invariant=True`` (with the patched LM head's ``logits_dtype``) for the patched one.
7. **Timing.** Prefill forward (the first batch of the largest prefill size, no grad) and one decode
   step (the largest decode batch, KV cache primed with the prompts, 8 steps per round), unpatched
   and patched in ``--reps`` alternating rounds after a warm-up round (HF eager decode is host
   bound, and host-bound timings drift over seconds: interleaving gives both variants the same
   drift): CUDA events on the GPU, ``perf_counter`` on the CPU; medians.

Where things live: :mod:`rlkernel.invariant.scoring` builds the models, samples the rollout and
scores and times it (steps 1-7); this module compares the ways (:func:`compare`, :func:`pairs`),
runs the whole check (:func:`run_check`), formats the report and holds the command line.

Caveats:
    * The CPU result (tiny config, fp32) says the pipeline and the invariant reference path are right;
      the numbers that matter come from ``--config anchor`` / ``qwen3-8b-slice`` on a GPU, where the
      unpatched kernels (cuBLAS, SDPA/FlashAttention) change their reduction order with the shape.
    * The unpatched model may be 100% bitwise equal on the CPU for some pairs (fp32, small shapes: the
      CPU GEMM does not always change its blocking with M); nothing is wrong with that.
    * ``--model PATH`` must be a Qwen3 or Llama checkpoint for the patched half (other architectures:
      TypeError from patch_hf_model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.invariant.scoring import (  # noqa: F401 - Preset, PAD_ID: re-exported
    _RUN_GPU,
    _RUN_SMALL,
    CONFIGS,
    DTYPES,
    PAD_ID,
    Preset,
    _chunks,
    build_model,
    decode_logprobs,
    load_model,
    make_prompts,
    prefill_logprobs,
    rollout,
    time_patched_vs_unpatched,
)


def _log(msg: str) -> None:
    print(f"[consistency] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """max |a − b|, mean |a − b| and the percentage of bitwise-equal entries (fp32 log-probs)."""
    d = (a.double() - b.double()).abs()
    return {
        "max_abs_diff": d.max().item(),
        "mean_abs_diff": d.mean().item(),
        "bitwise_equal_pct": 100.0 * torch.eq(a, b).double().mean().item(),
    }


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    num_seqs: int
    prompt_len: int
    gen_len: int
    decode_batch_sizes: tuple[int, ...]
    prefill_batch_sizes: tuple[int, ...]
    seed: int
    reps: int
    lm_head_dtype: torch.dtype | None = None  # the patched LM head's (None: the weight's dtype)


@torch.no_grad()
def fused_prefill_logprobs(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    completions: torch.Tensor,
    batch_size: int,
    *,
    invariant: bool,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``[S, G]`` fp32: each completion token's log-prob from the hidden-state (memory-flat) path.

    Prompt + completion in right-padded batches of ``batch_size`` through the base model (no LM
    head, no cache), then ``rlkernel.linear_token_logprobs(hidden, lm_head.weight, ids, ...)`` with
    the completion tokens as ids at the positions before them and ``ignore_index`` everywhere else
    (prompt and padding): one call per batch, as a trainer scores its micro-batch.
    """
    import rlkernel as rk

    device = next(model.parameters()).device
    head = model.lm_head
    gen_len = completions.shape[1]
    out = torch.empty(completions.shape, dtype=torch.float32)
    for rows in _chunks(len(prompts), batch_size):
        seqs = [torch.cat([prompts[i], completions[i]]) for i in rows]
        width = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        target = torch.full((len(seqs), width), -100, dtype=torch.long)
        for j, i in enumerate(rows):
            p = len(prompts[i])
            ids[j, : len(seqs[j])], mask[j, : len(seqs[j])] = seqs[j], 1
            target[j, p - 1 : p - 1 + gen_len] = completions[i]
        hidden = model.model(
            input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False
        ).last_hidden_state
        inv = {"invariant": invariant, "logits_dtype": logits_dtype}
        logp = rk.linear_token_logprobs(hidden, head.weight, target.to(device), bias=head.bias, **inv).cpu()
        for j, i in enumerate(rows):
            p = len(prompts[i])
            out[i] = logp[j, p - 1 : p - 1 + gen_len]
    return out


def score_all(model, prompts, completions, s: Settings, *, patched: bool = False) -> dict[str, torch.Tensor]:
    """Every way of computing the completions' log-probs: ``decode bs=b``, ``prefill bs=b``,
    ``packed``, and the hidden-state path: ``fused bs=B`` (default) or, for the ``patched`` model,
    ``fused inv bs=B`` (``invariant=True``)."""
    ways: dict[str, torch.Tensor] = {}
    for b in s.decode_batch_sizes:
        t0 = time.perf_counter()
        ways[f"decode bs={b}"] = decode_logprobs(model, prompts, completions, b)
        _log(f"  decode bs={b}: {time.perf_counter() - t0:.1f} s")
    for b in s.prefill_batch_sizes:
        ways[f"prefill bs={b}"] = prefill_logprobs(model, prompts, completions, b)
    b = max(s.prefill_batch_sizes)
    ways[f"packed bs={b}"] = prefill_logprobs(model, prompts, completions, b, packed=True)
    if patched:
        ways[f"fused inv bs={b}"] = fused_prefill_logprobs(
            model, prompts, completions, b, invariant=True, logits_dtype=s.lm_head_dtype
        )
    else:
        ways[f"fused bs={b}"] = fused_prefill_logprobs(model, prompts, completions, b, invariant=False)
    return ways


def pairs(ways: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Each decode way against each prefill/packed way, then decode vs decode."""
    dec = [k for k in ways if k.startswith("decode")]
    pre = [k for k in ways if not k.startswith("decode")]
    out = [{"rollout": d, "training": p, **compare(ways[d], ways[p])} for d in dec for p in pre]
    out += [{"rollout": dec[0], "training": d, **compare(ways[dec[0]], ways[d])} for d in dec[1:]]
    return out


def _all_equal(ways: dict[str, torch.Tensor]) -> float:
    """% of tokens whose log-prob is bitwise the same in every way."""
    vals = list(ways.values())
    same = torch.ones_like(vals[0], dtype=torch.bool)
    for v in vals[1:]:
        same &= torch.eq(v, vals[0])
    return 100.0 * same.double().mean().item()


def run_check(model: torch.nn.Module, s: Settings, *, label: str = "") -> dict[str, Any]:
    """The whole measurement on ``model`` (left unpatched at the end); returns the result dict."""
    from rlkernel.invariant.patch import patch_hf_model, unpatch_hf_model

    vocab = model.config.vocab_size
    prompts = make_prompts(s.num_seqs, s.prompt_len, vocab, seed=s.seed)
    t0 = time.perf_counter()
    completions = rollout(model, prompts, s.gen_len, max(s.decode_batch_sizes), seed=s.seed)
    _log(f"{label}rollout: {s.num_seqs} x {s.gen_len} tokens sampled in {time.perf_counter() - t0:.1f} s")
    results: dict[str, Any] = {}
    timing: dict[str, float] = {}
    for variant in ("unpatched", "patched"):
        try:
            if variant == "patched":
                # (lm_head_dtype passed only when set: the default call is patch_hf_model(model))
                head = {} if s.lm_head_dtype is None else {"lm_head_dtype": s.lm_head_dtype}
                patch_hf_model(model, **head)
            _log(f"{label}{variant}: scoring")
            ways = score_all(model, prompts, completions, s, patched=variant == "patched")
            results[variant] = {"pairs": pairs(ways), "all_ways_bitwise_equal_pct": _all_equal(ways)}
        except Exception as exc:  # noqa: BLE001 - report the other variant's numbers, then fail
            msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            _log(f"{label}{variant}: FAILED: {msg}")
            results.setdefault(variant, {"pairs": [], "all_ways_bitwise_equal_pct": None})["error"] = msg
        finally:
            if variant == "patched":
                unpatch_hf_model(model)
    if all("error" not in results.get(v, {"error": "not run"}) for v in ("unpatched", "patched")):
        _log(f"{label}timing unpatched vs patched (interleaved rounds)")
        timing.update(
            time_patched_vs_unpatched(
                model,
                prompts,
                completions,
                prefill_batch=max(s.prefill_batch_sizes),
                decode_batch=max(s.decode_batch_sizes),
                reps=s.reps,
                steps=8,
            )
        )
    for what, key in (("prefill", "prefill_ms"), ("decode", "decode_step_ms")):
        a, b = timing.get(f"patched_{key}"), timing.get(f"unpatched_{key}")
        timing[f"{what}_patched_over_unpatched"] = a / b if a is not None and b else None
    return {"results": results, "timing": timing}


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``consistency`` options to ``parser``."""
    parser.add_argument(
        "--config", choices=tuple(CONFIGS), default="tiny", help="random-weight model (default: tiny, CPU)"
    )
    parser.add_argument(
        "--model", metavar="PATH", help="a local HF Qwen3/Llama checkpoint instead of --config"
    )
    parser.add_argument("--device", help="cpu | cuda (default: per config; --model: cuda if available)")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), help="default: per config (tiny: float32, GPU: bfloat16)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-seqs", type=int, help="number of prompts (default: tiny 8, GPU configs 32)")
    parser.add_argument(
        "--prompt-len", type=int, help="longest prompt; lengths vary in [P/2, P] (default 8 / 16)"
    )
    parser.add_argument("--gen-len", type=int, help="generated tokens per prompt (default 16 / 128)")
    parser.add_argument("--decode-batch-sizes", type=_int_list, help="default: 1,8 (tiny) / 1,32")
    parser.add_argument("--prefill-batch-sizes", type=_int_list, help="default: 2,8 (tiny) / 8,32")
    parser.add_argument("--reps", type=int, default=None, help="timing repetitions (default: CPU 3, CUDA 20)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON to PATH (or stdout)")
    parser.add_argument(
        "--require-bitwise",
        action="store_true",
        help="exit 1 unless the patched model is 100%% bitwise equal (the fused invariant path included)",
    )
    parser.add_argument(
        "--lm-head-dtype",
        choices=("weight", "float32"),
        default="weight",
        help="the patched LM head's logits: in the weight's dtype (default) or float32 "
        "(patch_hf_model(lm_head_dtype=torch.float32); the fused invariant path matches it)",
    )


def _path_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--model`` / ``--json``, checked before any model is built: the JSON is
    written after the whole run, and a missing ``--model`` folder would otherwise reach HF's loader,
    which reads it as a Hub repo id ("Repo id must be ...")."""
    from rlkernel._cli_paths import input_dir_problem, output_file_problem

    if args.model is not None:
        problem = input_dir_problem("--model", args.model, must_contain="config.json")
        if problem:
            return f"{problem} (expected a local HF Qwen3/Llama checkpoint folder)"
    if args.json not in (None, "-"):
        return output_file_problem("--json", args.json)
    return None


def _resolve(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, Settings]:
    preset = CONFIGS[args.config]
    dev, dt, run = preset.device, preset.dtype, preset.run
    if args.model and not args.device:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device or dev)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available (use --config tiny or --device cpu)")
    dtype = DTYPES[
        args.dtype or (dt if not args.model else ("bfloat16" if device.type == "cuda" else "float32"))
    ]
    if args.model:
        run = _RUN_GPU if device.type == "cuda" else _RUN_SMALL
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    reps = args.reps if args.reps is not None else (20 if device.type == "cuda" else 3)

    def pick(value, default):
        return default if value is None else value

    s = Settings(
        num_seqs=pick(args.num_seqs, run["num_seqs"]),
        prompt_len=pick(args.prompt_len, run["prompt_len"]),
        gen_len=pick(args.gen_len, run["gen_len"]),
        decode_batch_sizes=pick(args.decode_batch_sizes, run["decode"]),
        prefill_batch_sizes=pick(args.prefill_batch_sizes, run["prefill"]),
        seed=args.seed,
        reps=reps,
        lm_head_dtype=torch.float32 if args.lm_head_dtype == "float32" else None,
    )
    for name in ("num_seqs", "prompt_len", "gen_len"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    return device, dtype, s


def format_report(report: dict[str, Any]) -> str:
    """The compact human-readable table."""
    m, st, t = report["model"], report["settings"], report["timing"]
    ok = report["patched_bitwise"]
    lines = [
        f"rlkernel consistency: {m['name']} ({m['architecture']}, {m['layers']} layers, "
        f"hidden {m['hidden']}, vocab {m['vocab']}) on {report['device']} {report['dtype']}",
        f"{st['num_seqs']} sequences x {st['gen_len']} generated tokens after prompts of "
        f"{max(1, math.ceil(st['prompt_len'] / 2))}-{st['prompt_len']} tokens "
        f"({report['tokens']} tokens per comparison)",
        "",
        f"{'model':<10} {'rollout':<13} {'training':<16} {'max |dlogp|':>12} {'mean |dlogp|':>13} "
        f"{'bitwise equal':>14}",
    ]
    for variant in ("unpatched", "patched"):
        res = report["results"][variant]
        for p in res["pairs"]:
            lines.append(
                f"{variant:<10} {p['rollout']:<13} {p['training']:<16} {p['max_abs_diff']:>12.3g} "
                f"{p['mean_abs_diff']:>13.3g} {p['bitwise_equal_pct']:>13.1f}%"
            )
        if "error" in res:
            lines.append(f"{variant:<10} FAILED: {res['error']}")
        if res.get("all_ways_bitwise_equal_pct") is not None:
            lines.append(f"{variant:<10} tokens equal in every way: {res['all_ways_bitwise_equal_pct']:.1f}%")

    def ms(key: str) -> str:
        v = t.get(key)
        return "n/a" if v is None else f"{v:.3g} ms"

    def ratio(key: str) -> str:
        v = t.get(key)
        return "n/a" if v is None else f"{v:.2f}x"

    if report.get("device_type") == "cpu":
        # The patched model runs the invariant *reference* path on the CPU (the Triton kernels are
        # GPU-only), and a 2-core machine's timings swing run to run (14x one run, 0.5x the next,
        # issue 29): no ratio is printed, and the line says why.
        speed = (
            f"speed (CPU: not a measurement; the patched model runs the invariant reference path, not "
            f"the GPU kernels, so no ratio is given; time on a GPU with --device cuda): prefill forward "
            f"{ms('unpatched_prefill_ms')} unpatched, {ms('patched_prefill_ms')} patched; decode step "
            f"{ms('unpatched_decode_step_ms')} unpatched, {ms('patched_decode_step_ms')} patched"
        )
    else:
        speed = (
            f"speed: prefill forward {ms('unpatched_prefill_ms')} unpatched, {ms('patched_prefill_ms')} "
            f"patched ({ratio('prefill_patched_over_unpatched')}); decode step "
            f"{ms('unpatched_decode_step_ms')} unpatched, {ms('patched_decode_step_ms')} patched "
            f"({ratio('decode_patched_over_unpatched')})"
        )
    lines += [
        "",
        speed,
        f"{'PASS' if ok else 'FAIL'}: the patched model is {'' if ok else 'NOT '}100% bitwise equal "
        "in every pair",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``rlkernel consistency``; returns the exit code: 0; 1 if a variant failed to run, or with
    ``--require-bitwise`` if the patched model is not 100% bitwise equal; 2 on a bad command line."""
    try:
        problem = _path_problem(args)
        if problem:
            raise ValueError(problem)
        device, dtype, s = _resolve(args)
    except ValueError as exc:
        print(f"rlkernel consistency: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.model:
        model = load_model(args.model, device=device, dtype=dtype)
        name = args.model
    else:
        model = build_model(args.config, device=device, dtype=dtype, seed=s.seed)
        name = args.config
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"model {name}: {n_params / 1e6:.1f} M parameters, {device}, {dtype}")
    measured = run_check(model, s)
    patched = measured["results"]["patched"]
    patched_ok = "error" not in patched and all(p["bitwise_equal_pct"] == 100.0 for p in patched["pairs"])
    report = {
        "model": {
            "name": name,
            "architecture": type(model).__name__,
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "heads": f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}",
            "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
            "vocab": cfg.vocab_size,
        },
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "device_type": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "settings": {
            "num_seqs": s.num_seqs,
            "prompt_len": s.prompt_len,
            "gen_len": s.gen_len,
            "decode_batch_sizes": list(s.decode_batch_sizes),
            "prefill_batch_sizes": list(s.prefill_batch_sizes),
            "seed": s.seed,
            "reps": s.reps,
            "lm_head_dtype": str(s.lm_head_dtype or dtype).removeprefix("torch."),
        },
        "tokens": s.num_seqs * s.gen_len,
        **measured,
        "patched_bitwise": patched_ok,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.json == "-":
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
            print(f"wrote {args.json}")
    failed = any("error" in r for r in measured["results"].values())
    return 1 if failed or (args.require_bitwise and not patched_ok) else 0
