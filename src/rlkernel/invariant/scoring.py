"""Models, rollout, scoring and timing for ``rlkernel consistency``: the measurements it compares.

What lives here: the ``--config`` presets (:data:`CONFIGS`) and the model builders
(:func:`build_model`, :func:`load_model`); the prompts and their left/right padding; the sampled
rollout (:func:`rollout`); the two ways of scoring the same tokens, teacher-forced KV-cache decode
(:func:`decode_logprobs`) and training-style prefill, right-padded or packed
(:func:`prefill_logprobs`), both through one log-softmax path; and the timing of one prefill forward
and one decode step. :mod:`rlkernel.invariant.consistency` compares the results, reports them and
runs the command line; its docstring has the method (steps 1-7) and the Caveats.
"""

from __future__ import annotations

import inspect
import math
import statistics
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
# Timing
# --------------------------------------------------------------------------------------------------


def cache_arg(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for the model's forward: ``cache=`` where the forward takes it (transformers
    5.2x renamed the argument and warns on the old name, from our own call), else
    ``past_key_values=`` (older releases, which the ``demo`` extra still allows)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


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


def _prefill_timer(model, prompts, completions, batch_size: int) -> Callable[[], list[float]]:
    """A callable: one right-padded prefill forward over the first ``batch_size`` sequences, timed."""
    device = next(model.parameters()).device
    n = min(batch_size, len(prompts))
    ids, mask = _right_pad([torch.cat([prompts[i], completions[i]]) for i in range(n)], device)

    def run() -> list[float]:
        return [_timed_ms(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False), device)]

    return run


def _decode_timer(model, prompts, completions, batch_size: int, *, steps: int) -> Callable[[], list[float]]:
    """A callable: prime a KV cache with the first ``batch_size`` prompts (left-padded), then feed
    ``steps`` completion tokens one step at a time; returns each step's time."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    n = min(batch_size, len(prompts))
    ids, mask = _left_pad([prompts[i] for i in range(n)], device)
    tokens = completions[:n].to(device)
    steps = min(steps, tokens.shape[1])

    def run() -> list[float]:
        cache = DynamicCache(config=model.config)
        am = mask.clone()
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True, **cache_arg(model, cache))
        times = []
        for t in range(steps):
            am = torch.cat([am, am.new_ones(n, 1)], dim=1)
            step_pos = am.sum(-1, keepdim=True) - 1
            tok = tokens[:, t : t + 1]

            def call(tok=tok, am=am, step_pos=step_pos):
                return model(
                    input_ids=tok,
                    attention_mask=am,
                    position_ids=step_pos,
                    use_cache=True,
                    **cache_arg(model, cache),
                )

            times.append(_timed_ms(call, device))
        return times

    return run


@torch.no_grad()
def time_patched_vs_unpatched(
    model, prompts, completions, *, prefill_batch: int, decode_batch: int, reps: int, steps: int
) -> dict[str, float]:
    """Prefill and decode-step times of ``model`` unpatched and patched, interleaved.

    A host-bound step (HF eager decode) is sensitive to drift of the host CPU (clock, other load)
    over seconds, so the two variants are timed in alternating rounds (unpatched then patched, then
    the reverse order), each round one prefill forward and one decode run of ``steps`` steps, after
    a warm-up round of each. The model is patched and unpatched in place (class swaps, no copies)
    and left unpatched. Returns the medians: ``{variant}_prefill_ms``, ``{variant}_decode_step_ms``.
    """
    from rlkernel.invariant.patch import patch_hf_model, unpatch_hf_model

    prefill = _prefill_timer(model, prompts, completions, prefill_batch)
    decode = _decode_timer(model, prompts, completions, decode_batch, steps=steps)
    samples: dict[str, list[float]] = {}

    def round_(variant: str, keep: bool) -> None:
        (patch_hf_model if variant == "patched" else unpatch_hf_model)(model)
        for what, run in (("prefill_ms", prefill), ("decode_step_ms", decode)):
            times = run()
            if keep:
                samples.setdefault(f"{variant}_{what}", []).extend(times)

    order = ["unpatched", "patched"]
    try:
        for variant in order:
            round_(variant, keep=False)
        for r in range(reps):
            for variant in order if r % 2 == 0 else order[::-1]:
                round_(variant, keep=True)
    finally:
        unpatch_hf_model(model)
    return {key: statistics.median(v) for key, v in samples.items()}
