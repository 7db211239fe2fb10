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
7. **Timing.** Prefill forward (the first batch of the largest prefill size, no grad) and one decode
   step (the largest decode batch, KV cache primed with the prompts, median over the generated
   steps), unpatched and patched: CUDA events on the GPU, ``perf_counter`` on the CPU; median of
   ``--reps`` after warmup.

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
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Preset:
    """A ``--config`` choice: the architecture, its HF config fields, and the defaults it runs with."""

    arch: str  # "qwen3" | "llama"
    fields: dict[str, Any]
    device: str
    dtype: str
    run: dict[str, Any]  # num_seqs, prompt_len, gen_len, decode / prefill batch sizes


_RUN_SMALL = {"num_seqs": 8, "prompt_len": 8, "gen_len": 16, "decode": (1, 8), "prefill": (2, 8)}
_RUN_GPU = {"num_seqs": 32, "prompt_len": 16, "gen_len": 128, "decode": (1, 32), "prefill": (8, 32)}
_TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}
CONFIGS: dict[str, Preset] = {
    "tiny": Preset("qwen3", _TINY, "cpu", "float32", _RUN_SMALL),
    "tiny-llama": Preset("llama", _TINY, "cpu", "float32", _RUN_SMALL),
    "anchor": Preset(
        "qwen3",
        {
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 4096,
        },
        "cuda",
        "bfloat16",
        _RUN_GPU,
    ),
    "qwen3-8b-slice": Preset(
        "qwen3",
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 2,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 4096,
        },
        "cuda",
        "bfloat16",
        _RUN_GPU,
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAD_ID = 0


def _log(msg: str) -> None:
    print(f"[consistency] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------------------


def build_model(name: str, *, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A random-weight model of one of :data:`CONFIGS`, in eval mode, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    preset = CONFIGS[name]
    qwen3 = preset.arch == "qwen3"
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if qwen3 else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(
        **preset.fields, tie_word_embeddings=False, attn_implementation="sdpa", pad_token_id=PAD_ID
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialize where it runs: the 8B slice has 1.2e9 embedding/head weights
        model = model_cls(config)
    return model.to(dtype).eval()


def load_model(path: str, *, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A local HF checkpoint (no download), SDPA attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval()


def make_prompts(num_seqs: int, prompt_len: int, vocab: int, *, seed: int) -> list[torch.Tensor]:
    """``num_seqs`` random prompts (CPU int64), lengths uniform in [ceil(P/2), P], the first P long."""
    gen = torch.Generator().manual_seed(seed)
    lo = max(1, math.ceil(prompt_len / 2))
    lengths = torch.randint(lo, prompt_len + 1, (num_seqs,), generator=gen).tolist()
    lengths[0] = prompt_len
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def _left_pad(seqs: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _right_pad(seqs: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def _chunks(n: int, size: int) -> list[range]:
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def _generation_config(gen_len: int, *, sample: bool) -> Any:
    from transformers import GenerationConfig

    kw: dict[str, Any] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
    return GenerationConfig(
        max_new_tokens=gen_len,
        min_new_tokens=gen_len,  # a checkpoint's EOS must not end a completion early
        pad_token_id=PAD_ID,
        eos_token_id=None,
        bos_token_id=None,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
        do_sample=sample,
        **kw,
    )


@torch.no_grad()
def rollout(
    model: torch.nn.Module, prompts: list[torch.Tensor], gen_len: int, batch_size: int, *, seed: int
) -> torch.Tensor:
    """Sampled completions ``[S, gen_len]`` (CPU int64) from ``generate()`` in batches of ``batch_size``."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    out = []
    for rows in _chunks(len(prompts), batch_size):
        ids, mask = _left_pad([prompts[i] for i in rows], device)
        res = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=_generation_config(gen_len, sample=True)
        )
        out.append(res.sequences[:, ids.shape[1] :].cpu())
    return torch.cat(out)


class _ForceTokens:
    """A logits processor that makes greedy decoding emit the given tokens (teacher forcing)."""

    def __init__(self, tokens: torch.Tensor, prompt_width: int) -> None:
        self.tokens, self.prompt_width = tokens, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_width
        forced = torch.full_like(scores, -math.inf)
        return forced.scatter_(1, self.tokens[:, t : t + 1], 0.0)


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The one log-softmax path: fp32 logits (an exact cast from bf16) through rk.token_logprobs."""
    import rlkernel as rk

    return rk.token_logprobs(logits.float(), ids)


@torch.no_grad()
def decode_logprobs(
    model: torch.nn.Module, prompts: list[torch.Tensor], completions: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """``[S, G]`` fp32: each completion token's log-prob from KV-cache decode at ``batch_size``."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    gen_len = completions.shape[1]
    out = torch.empty(completions.shape, dtype=torch.float32)
    for rows in _chunks(len(prompts), batch_size):
        ids, mask = _left_pad([prompts[i] for i in rows], device)
        tokens = completions[rows.start : rows.stop].to(device)
        res = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=_generation_config(gen_len, sample=False),
            logits_processor=LogitsProcessorList([_ForceTokens(tokens, ids.shape[1])]),
        )
        if not torch.equal(res.sequences[:, ids.shape[1] :], tokens):
            raise RuntimeError("teacher-forced generate() did not reproduce the rollout tokens")
        for t, step_logits in enumerate(res.logits):
            out[rows.start : rows.stop, t] = _token_logprobs(step_logits, tokens[:, t]).cpu()
    return out


@torch.no_grad()
def prefill_logprobs(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    completions: torch.Tensor,
    batch_size: int,
    *,
    packed: bool = False,
) -> torch.Tensor:
    """``[S, G]`` fp32: each completion token's log-prob from one training-style forward per batch.

    ``packed=False``: right-padded ``[b, L]`` with an attention mask. ``packed=True``: the batch's
    sequences concatenated into one row ``[1, Σ L_i]``, ``position_ids`` restarting at 0 per sequence,
    no attention mask.
    """
    device = next(model.parameters()).device
    gen_len = completions.shape[1]
    out = torch.empty(completions.shape, dtype=torch.float32)
    for rows in _chunks(len(prompts), batch_size):
        seqs = [torch.cat([prompts[i], completions[i]]) for i in rows]
        if packed:
            ids = torch.cat(seqs)[None].to(device)
            pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            starts = torch.tensor([0] + [len(s) for s in seqs[:-1]]).cumsum(0).tolist()
            picks = [
                logits[st + len(prompts[i]) - 1 : st + len(prompts[i]) - 1 + gen_len]
                for st, i in zip(starts, rows, strict=True)
            ]
        else:
            ids, mask = _right_pad(seqs, device)
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            picks = [
                logits[j, len(prompts[i]) - 1 : len(prompts[i]) - 1 + gen_len] for j, i in enumerate(rows)
            ]
        for j, i in enumerate(rows):
            out[i] = _token_logprobs(picks[j], completions[i].to(device)).cpu()
    return out


# --------------------------------------------------------------------------------------------------
# Comparison and timing
# --------------------------------------------------------------------------------------------------


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """max |a − b|, mean |a − b| and the percentage of bitwise-equal entries (fp32 log-probs)."""
    d = (a.double() - b.double()).abs()
    return {
        "max_abs_diff": d.max().item(),
        "mean_abs_diff": d.mean().item(),
        "bitwise_equal_pct": 100.0 * torch.eq(a, b).double().mean().item(),
    }


def _timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@torch.no_grad()
def time_prefill(model, prompts, completions, batch_size: int, *, reps: int, warmup: int = 2) -> float:
    """Median ms of one right-padded prefill forward over the first ``batch_size`` sequences."""
    device = next(model.parameters()).device
    n = min(batch_size, len(prompts))
    ids, mask = _right_pad([torch.cat([prompts[i], completions[i]]) for i in range(n)], device)

    def call():
        return model(input_ids=ids, attention_mask=mask, use_cache=False)

    for _ in range(warmup):
        call()
    return statistics.median(_timed_ms(call, device) for _ in range(reps))


@torch.no_grad()
def time_decode_step(model, prompts, completions, batch_size: int, *, steps: int, warmup: int = 1) -> float:
    """Median ms of one decode step (``batch_size`` rows, KV cache primed with the left-padded
    prompts, then ``steps`` steps feeding the completion tokens)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    n = min(batch_size, len(prompts))
    ids, mask = _left_pad([prompts[i] for i in range(n)], device)
    tokens = completions[:n].to(device)
    steps = min(steps, tokens.shape[1])
    times: list[float] = []
    for rep in range(warmup + 1):
        cache = DynamicCache(config=model.config)
        am = mask.clone()
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True)
        for t in range(steps):
            am = torch.cat([am, am.new_ones(n, 1)], dim=1)
            step_pos = am.sum(-1, keepdim=True) - 1
            tok = tokens[:, t : t + 1]

            def call(tok=tok, am=am, step_pos=step_pos, cache=cache):
                return model(
                    input_ids=tok,
                    attention_mask=am,
                    position_ids=step_pos,
                    past_key_values=cache,
                    use_cache=True,
                )

            ms = _timed_ms(call, device)
            if rep == warmup:
                times.append(ms)
    return statistics.median(times)


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


def score_all(model, prompts, completions, s: Settings) -> dict[str, torch.Tensor]:
    """Every way of computing the completions' log-probs: ``decode bs=b``, ``prefill bs=b``, ``packed``."""
    ways: dict[str, torch.Tensor] = {}
    for b in s.decode_batch_sizes:
        t0 = time.perf_counter()
        ways[f"decode bs={b}"] = decode_logprobs(model, prompts, completions, b)
        _log(f"  decode bs={b}: {time.perf_counter() - t0:.1f} s")
    for b in s.prefill_batch_sizes:
        ways[f"prefill bs={b}"] = prefill_logprobs(model, prompts, completions, b)
    b = max(s.prefill_batch_sizes)
    ways[f"packed bs={b}"] = prefill_logprobs(model, prompts, completions, b, packed=True)
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
                patch_hf_model(model)
            _log(f"{label}{variant}: scoring")
            ways = score_all(model, prompts, completions, s)
            results[variant] = {"pairs": pairs(ways), "all_ways_bitwise_equal_pct": _all_equal(ways)}
            timing[f"{variant}_prefill_ms"] = time_prefill(
                model, prompts, completions, max(s.prefill_batch_sizes), reps=s.reps
            )
            timing[f"{variant}_decode_step_ms"] = time_decode_step(
                model, prompts, completions, max(s.decode_batch_sizes), steps=max(s.reps, 8)
            )
        except Exception as exc:  # noqa: BLE001 - report the other variant's numbers, then fail
            msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            _log(f"{label}{variant}: FAILED: {msg}")
            results.setdefault(variant, {"pairs": [], "all_ways_bitwise_equal_pct": None})["error"] = msg
        finally:
            if variant == "patched":
                unpatch_hf_model(model)
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
        help="exit 1 unless the patched model is 100%% bitwise equal",
    )


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
        reps=max(1, reps),
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
        f"{'model':<10} {'rollout':<13} {'training':<15} {'max |dlogp|':>12} {'mean |dlogp|':>13} "
        f"{'bitwise equal':>14}",
    ]
    for variant in ("unpatched", "patched"):
        res = report["results"][variant]
        for p in res["pairs"]:
            lines.append(
                f"{variant:<10} {p['rollout']:<13} {p['training']:<15} {p['max_abs_diff']:>12.3g} "
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

    lines += [
        "",
        f"speed: prefill forward {ms('unpatched_prefill_ms')} unpatched, {ms('patched_prefill_ms')} patched "
        f"({ratio('prefill_patched_over_unpatched')}); decode step {ms('unpatched_decode_step_ms')} "
        f"unpatched, {ms('patched_decode_step_ms')} patched ({ratio('decode_patched_over_unpatched')})",
        f"{'PASS' if ok else 'FAIL'}: the patched model is {'' if ok else 'NOT '}100% bitwise equal "
        "in every pair",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``rlkernel consistency``; returns the exit code: 0; 1 if a variant failed to run, or with
    ``--require-bitwise`` if the patched model is not 100% bitwise equal; 2 on a bad command line."""
    try:
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
