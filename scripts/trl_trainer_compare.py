"""``RLKernelGRPOTrainer`` next to TRL 1.16's ``GRPOTrainer``: the same GRPO steps, their losses,
gradients, parameters, step times and peak memory.

    python scripts/trl_trainer_compare.py --out results.json                 # GPU: 407 M Qwen3, bf16
    python scripts/trl_trainer_compare.py --device cpu --size tiny --precisions fp32   # about a minute

Everything is made in-process (the GPU machine has no internet): a byte-level BPE tokenizer trained
on a few sentences, a random-init Qwen3 (``--size gpu``: Qwen3-0.6B's shapes with 16 layers, i.e.
hidden 1024, 16 heads, 8 KV heads, head dim 128, intermediate 3072, vocabulary 151,936, tied
embeddings: 407 M parameters, 4 prompts x 8 completions of <= 256 tokens per step; ``--size tiny``:
hidden 64, 2 layers, the tokenizer's 300 tokens), prompts of random corpus words (``--size gpu``:
24 to 48 words), and a deterministic reward of the completion's token ids (the share
of even ids: the model's vocabulary exceeds the tokenizer's, so a text reward would see mostly
empty strings). A random model would almost never end a completion: the sampler (not the model)
gets a bias on the end-of-sequence logit (TRL's ``generation_kwargs``, ``sequence_bias``) for a
probability of ~2/``--completion`` per token, so completions end at ragged lengths.

For each precision and setting (``defaults``: TRL's loss settings, dapo, beta = 0, on-policy;
``beta``: beta = 0.04 with TRL's default bias-corrected KL; ``off_policy``: 2 iterations per
generation, the second with old log-probs and ratios != 1) both trainers run ``--steps`` optimizer
steps from the same saved model with the same seed, config and prompts (generation by transformers'
``generate``, no vLLM; rlkernel under ``rk.use_backend(--backend)``, ``triton`` on CUDA). Each
trainer's ``training_step``, ``_prepare_inputs`` and ``compute_loss`` are timed (device
synchronized) to split a step into generation + scoring ("gen"), the loss forward and the backward
("loss+bwd" is their sum: the backbone and the LM head + loss, the optimizer step excluded); the peak
memory is ``torch.cuda.max_memory_allocated`` from the end of ``_prepare_inputs`` to the end of the
backward, absolute and above that start. Reported:

    loss      each step's training loss of both and the max |Δ| (the same completions are sampled as
              long as the parameters agree: "same completions" says, per generation, whether they did)
    grads     the first optimizer step's gradients (same batch in both): max |Δ|, ‖Δ‖/‖g‖; in bf16 /
              amp also each one's distance to an fp32 oracle (TRL's training_step in float32 on the
              recorded batch from the same start): rlkernel's should be no larger than TRL's
    params    after the last step: max |Δ|, and ‖Δ‖ over ‖how far training moved them‖
    time      over steps 2.. (step 1 includes Triton compilation): a step's mean time, the median of
              generation + scoring over the steps that generate, the median loss forward + backward

Precisions: ``bf16`` (bf16 weights, ``bf16=True``), ``amp`` (float32 weights under bf16 autocast,
TRL's recipe when it loads a model by name: rlkernel's LM head then runs in float32, the weight's
dtype, while TRL's runs in bf16 under the autocast), ``fp32`` (agreement to rounding). The optimizer
is SGD (``--optim``): Adam's first steps turn rounding-level differences of ~0 gradients into
full-size updates; the GPU learning rate 1 moves the parameters by at most 1 in norm per step after
TRL's default clipping to grad norm 1 (0.25 % of their norm), enough for bf16 weights to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world", "one two three four five"] * 10
SIZES = {
    "gpu": dict(hidden=1024, layers=16, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                batch=32, generations=8, prompt_words=48, completion=256, steps=4, lr=1.0),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=0,
                 batch=8, generations=4, prompt_words=4, completion=8, steps=3, lr=0.005),
}  # fmt: skip
# TRL's defaults are on-policy: the ratio is exp(logp − sg[logp]) = 1, so the loss value does not
# depend on the log-probs (its gradient does); with beta > 0 from step 2 on, and with old log-probs
# (2 iterations per generation) at every second step, it does.
SETTINGS = {"defaults": {}, "beta": {"beta": 0.04}, "off_policy": {"num_iterations": 2}}
PRECISIONS = ("bf16", "amp", "fp32")
LOG_KEYS = ("loss", "grad_norm", "reward", "reward_std", "kl", "completions/mean_length", "step_time")


def log(message: str) -> None:
    print(message, flush=True)


def tokenizer():
    """A byte-level BPE tokenizer of 300 tokens trained here; eos = pad = ``<|endoftext|>`` (id 1:
    transformers 5.17's ``sequence_bias`` rejects token id 0, so an unused ``<|reserved|>`` takes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|reserved|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, bpe)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def prompts(count: int, words: int, seed: int) -> list[str]:
    """``count`` prompts of words/2 .. words random corpus words (fixed by ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    vocab = sorted({w for line in CORPUS for w in line.split()})
    out = []
    for _ in range(count):
        n = int(torch.randint(max(words // 2, 1), words + 1, (1,), generator=g))
        out.append(" ".join(vocab[i] for i in torch.randint(0, len(vocab), (n,), generator=g).tolist()))
    return out


def even_id_reward(completion_ids, **kwargs) -> list[float]:
    """The share of even token ids in each completion (0 for an empty one)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


@torch.no_grad()
def eos_bias(model, eos: int, p_eos: float, prompt_ids: torch.Tensor, seed: int) -> float:
    """The bias b on the end-of-sequence logit for a sampling probability of about ``p_eos`` per
    token: over contexts of prompt tokens followed by random ids (as in generation),
    b = median(logsumexp of the other logits − the eos logit) + log(p_eos / (1 − p_eos))."""
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(0, model.config.vocab_size, (prompt_ids.shape[0], 16), generator=g)
    ids = torch.cat([prompt_ids, tail], 1).to(model.device)
    h = model.model(input_ids=ids).last_hidden_state[:, prompt_ids.shape[1] - 1 :].flatten(0, 1)
    logits = (h @ model.lm_head.weight.T).float()
    z_eos = logits[:, eos].clone()
    logits[:, eos] = -math.inf
    return (logits.logsumexp(-1) - z_eos).median().item() + math.log(p_eos / (1 - p_eos))


@dataclasses.dataclass
class Case:
    """One comparison: the options, the saved model and what the sampler needs."""

    options: argparse.Namespace
    path: str  # the saved model and tokenizer
    tmp: str
    precision: str
    setting: str
    eos: int
    bias: float

    @property
    def cuda(self) -> bool:
        return self.options.device == "cuda"


def save_model(path: str, options, tok, precision: str) -> tuple[int, float]:
    """Build the random-init Qwen3 and save it (weights in the precision's dtype) with the tokenizer;
    its parameter count and the sampler's end-of-sequence bias (:func:`eos_bias`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    size = options.size_values
    config = Qwen3Config(
        vocab_size=size["vocab"] or len(tok), hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        intermediate_size=size["intermediate"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"], max_position_embeddings=4096,
        tie_word_embeddings=not options.untied, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(options.seed)
    with torch.device(options.device):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    text = prompts(8, size["prompt_words"], options.seed)
    prompt_ids = tok(text, return_tensors="pt", padding=True, padding_side="left")["input_ids"]
    bias = eos_bias(model, tok.eos_token_id, 2.0 / size["completion"], prompt_ids, options.seed)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()), bias


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def to_cpu(value, dtype: torch.dtype | None = None):
    """A CPU copy of a tensor (never a view of it), else the value."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().to("cpu", dtype=dtype or value.dtype, copy=True)


class StepProbe:
    """Wraps a trainer's ``training_step``, ``_prepare_inputs`` and ``compute_loss`` (instance
    attributes, which the Trainer loop calls): per micro-step timings, peak memory and loss; the
    completions of each generation; the batches and gradients of the first optimizer step."""

    def __init__(self, trainer, cuda: bool, name: str, breakdown: bool = False) -> None:
        self.trainer, self.cuda, self.name = trainer, cuda, name
        # --memory-breakdown: the allocator's history over the second micro-step (after compilation)
        self.breakdown, self._recorder = breakdown and cuda, None
        self.records: list[dict] = []
        self.generations: list[torch.Tensor] = []
        self.first_batches: list[tuple[dict, object]] = []
        self.first_grads: dict[str, torch.Tensor] | None = None
        self._wrap("training_step", self._training_step)
        self._wrap("_prepare_inputs", self._prepare_inputs)
        self._wrap("compute_loss", self._compute_loss)

    def _wrap(self, attr: str, wrapper) -> None:
        original = getattr(self.trainer, attr)
        setattr(self.trainer, attr, lambda *a, **k: wrapper(original, *a, **k))  # seam: timing probes

    def _timed(self, key: str, fn, *args, **kwargs):
        sync(self.cuda)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(self.cuda)
        self.record[key] = time.perf_counter() - start
        return out

    def _training_step(self, original, model, inputs, num_items_in_batch=None):
        trainer = self.trainer
        first_window = trainer._step < trainer.current_gradient_accumulation_steps
        self.record = record = {}
        loss = self._timed("step_s", original, model, inputs, num_items_in_batch)
        record["loss"] = loss.float().item()
        if self.cuda:
            record["peak_bytes"] = torch.cuda.max_memory_allocated()
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            record["peak_breakdown"] = found = self._recorder.breakdown()
            self._recorder = None
            log(
                f"  [{self.name}] micro-step {len(self.records) + 1}: live at its peak "
                f"({found['peak_bytes'] / 2**30:.2f} GiB allocated during the step), by site:"
            )
            for size, count, where in found["sites"]:
                log(f"    {size / 2**30:7.3f} GiB  {count:4d} blocks  {where}")
        if first_window:
            self.first_batches.append((self._batch, to_cpu(num_items_in_batch)))
            if trainer._step == trainer.current_gradient_accumulation_steps:
                self.first_grads = grads(model)
        self.records.append(record)
        total = trainer.args.max_steps * trainer.current_gradient_accumulation_steps
        log(
            f"  [{self.name}] micro-step {len(self.records)}/{total}: loss {record['loss']:+.6f}, "
            f"{record['step_s']:.2f} s (generation + scoring {record['prepare_s']:.2f} s)"
        )
        return loss

    def _prepare_inputs(self, original, batch):
        trainer = self.trainer
        buffered = trainer._buffered_inputs
        inputs = self._timed("prepare_s", original, batch)
        self.record["generated"] = trainer._buffered_inputs is not buffered
        if self.record["generated"]:
            self.generations.append(torch.cat([b["completion_ids"] for b in trainer._buffered_inputs]).cpu())
        if trainer._step < trainer.current_gradient_accumulation_steps:
            self._batch = {k: to_cpu(v) for k, v in inputs.items()}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.record["base_bytes"] = torch.cuda.memory_allocated()
        if self.breakdown and len(self.records) == 1:
            from rlkernel.bench.memory import Recorder

            self._recorder = Recorder().__enter__()
        return inputs

    def _compute_loss(self, original, model, inputs, **kwargs):
        return self._timed("forward_s", original, model, inputs, **kwargs)


def grads(model) -> dict[str, torch.Tensor]:
    """A float32 CPU copy of every parameter's gradient (a copy: the Trainer clips them in place)."""
    return {n: to_cpu(p.grad, torch.float32) for n, p in model.named_parameters() if p.grad is not None}


def params(model) -> dict[str, torch.Tensor]:
    return {n: to_cpu(p, torch.float32) for n, p in model.named_parameters()}


def build_trainer(cls, case: Case, output_dir: str, precision: str):
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, Qwen3ForCausalLM
    from trl import GRPOConfig

    options, size = case.options, case.options.size_values
    args = GRPOConfig(
        output_dir=output_dir, max_steps=size["steps"], per_device_train_batch_size=size["batch"],
        num_generations=size["generations"], max_completion_length=size["completion"],
        learning_rate=size["lr"], optim=options.optim, bf16=precision != "fp32", use_cpu=not case.cuda,
        report_to="none", save_strategy="no", logging_steps=1, seed=options.seed, disable_tqdm=True,
        generation_kwargs={"sequence_bias": [[[case.eos], case.bias]]}, **SETTINGS[case.setting],
    )  # fmt: skip
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    data = prompts(4 * size["batch"], size["prompt_words"], options.seed)
    trainer = cls(
        model=Qwen3ForCausalLM.from_pretrained(case.path, dtype=dtype), reward_funcs=even_id_reward,
        args=args, train_dataset=Dataset.from_dict({"prompt": data}),
        processing_class=AutoTokenizer.from_pretrained(case.path),  # explicitly: TRL would look it up
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    return trainer


def release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def train(cls, name: str, case: Case) -> dict:
    """Train ``cls`` for the configured steps: what :class:`StepProbe` saw, the logs, the final parameters."""
    import rlkernel as rk

    trainer = build_trainer(cls, case, f"{case.tmp}/{name}", case.precision)
    probe = StepProbe(trainer, case.cuda, name, case.options.memory_breakdown)
    with rk.use_backend(case.options.backend):
        trainer.train()
    history = [{k: e[k] for k in LOG_KEYS if k in e} for e in trainer.state.log_history if "loss" in e]
    out = dict(
        records=probe.records, generations=probe.generations, first_batches=probe.first_batches,
        first_grads=probe.first_grads, params=params(trainer.model), history=history,
    )  # fmt: skip
    del trainer, probe
    release(case.cuda)
    return out


def oracle(case: Case, batches: list) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's first optimizer step in float32 on the recorded batches: its loss and gradients."""
    from trl import GRPOTrainer

    return replay(GRPOTrainer, case, batches, "fp32")


def replay(cls, case: Case, batches: list, precision: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The first optimizer step of trainer ``cls`` in ``precision`` on the recorded batches (no
    generation): its loss and gradients. On the GPU the two trainers' samplers need not draw the
    same completions, so each trainer's gradients are compared on one batch: TRL's."""
    trainer = build_trainer(cls, case, f"{case.tmp}/replay_{cls.__name__}_{precision}", precision)
    trainer._prepare_inputs = lambda inputs: inputs  # seam: the recorded batches, no generation
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    device = trainer.accelerator.device
    loss = 0.0
    for batch, num_items in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        num_items = num_items.to(device) if isinstance(num_items, torch.Tensor) else num_items
        loss += trainer.training_step(trainer.model, batch, num_items).item()
    out = loss, grads(trainer.model)
    del trainer
    release(case.cuda)
    return out


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], relative_to_ref: bool = True) -> dict:
    """Over all parameters: max |a − b| and ‖a − b‖; relative to the reference ``b``, ‖a − b‖ / ‖b‖
    and max |b|."""
    if a.keys() != b.keys():
        raise RuntimeError("the two runs' parameter names differ")
    norm = sum(((a[n] - b[n]).double() ** 2).sum().item() for n in a) ** 0.5
    out = dict(max_abs=max((a[n] - b[n]).abs().max().item() for n in a), norm=norm)
    if relative_to_ref:
        ref = sum((b[n].double() ** 2).sum().item() for n in a) ** 0.5
        out["rel_norm"] = norm / ref if ref else math.nan
        out["ref_max_abs"] = max(b[n].abs().max().item() for n in a)
    return out


def timing(records: list[dict], cuda: bool) -> dict:
    """Seconds over the micro-steps after the first (it compiles): the mean step, the median
    generation + scoring of those that generate, the median loss forward and forward + backward."""
    later = records[1:] or records
    generating = [r for r in later if r["generated"]] or records[:1]
    out = dict(
        first_step_s=records[0]["step_s"], step_s=statistics.mean(r["step_s"] for r in later),
        prepare_s=statistics.median(r["prepare_s"] for r in generating),
        loss_forward_s=statistics.median(r["forward_s"] for r in later),
        loss_and_backward_s=statistics.median(r["step_s"] - r["prepare_s"] for r in later),
    )  # fmt: skip
    if cuda:
        out["peak_gib"] = max(r["peak_bytes"] for r in records) / 2**30
        out["peak_above_start_gib"] = max(r["peak_bytes"] - r["base_bytes"] for r in records) / 2**30
    return out


def compare(case: Case) -> dict:
    """Both trainers on one case, and the fp32 oracle when the precision is not fp32."""
    from trl import GRPOTrainer

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    log(f"== {case.precision} / {case.setting}: {SETTINGS[case.setting] or 'TRL defaults'}")
    runs = {}
    for label, cls in (("trl", GRPOTrainer), ("rlkernel", RLKernelGRPOTrainer)):
        log(f"  {label}: {cls.__name__}")
        runs[label] = train(cls, label, case)
    trl, rk = runs["trl"], runs["rlkernel"]
    losses = {label: [r["loss"] for r in run["records"]] for label, run in runs.items()}
    first_same = all(
        torch.equal(a[k], b[k])
        for (a, _), (b, _) in zip(trl["first_batches"], rk["first_batches"], strict=True)
        for k in a
        if isinstance(a[k], torch.Tensor)
    )
    from transformers import Qwen3ForCausalLM

    initial = params(Qwen3ForCausalLM.from_pretrained(case.path))
    moved = distance(trl["params"], initial, relative_to_ref=False)  # how far TRL's training moved them
    apart = distance(rk["params"], trl["params"], relative_to_ref=False)
    changed = sum(int((trl["params"][n] != initial[n]).sum()) for n in initial)
    same = [bool(torch.equal(a, b)) for a, b in zip(trl["generations"], rk["generations"], strict=True)]
    count = sum(t.numel() for t in initial.values())
    step_diffs = [abs(a - b) for a, b in zip(losses["trl"], losses["rlkernel"], strict=True)]
    result = dict(
        precision=case.precision, setting=case.setting, grpo_overrides=SETTINGS[case.setting],
        loss=dict(trl=losses["trl"], rlkernel=losses["rlkernel"],
                  max_abs_diff=max(step_diffs), step1_abs_diff=step_diffs[0]),
        same_completions=same, same_first_batch=first_same,
        grads=distance(rk["first_grads"], trl["first_grads"]),
        params=dict(max_abs_diff=apart["max_abs"], rel_to_moved=apart["norm"] / max(moved["norm"], 1e-30),
                    max_abs_moved=moved["max_abs"], moved_fraction=changed / count),
        time=dict(trl=timing(trl["records"], case.cuda), rlkernel=timing(rk["records"], case.cuda)),
        logs=dict(trl=trl["history"], rlkernel=rk["history"]),
    )  # fmt: skip
    if case.precision != "fp32":
        log("  fp32 oracle: TRL's first step in float32 on the recorded batch")
        loss, ref = oracle(case, trl["first_batches"])
        result["oracle"] = dict(
            loss=loss, trl_loss_abs_diff=abs(losses["trl"][0] - loss),
            rlkernel_loss_abs_diff=abs(losses["rlkernel"][0] - loss),
            trl_grads=distance(trl["first_grads"], ref), rlkernel_grads=distance(rk["first_grads"], ref),
        )  # fmt: skip
    if not first_same or case.options.replay:  # rlkernel's step on TRL's batch: like-for-like numbers
        log("  RLKernelGRPOTrainer's first step replayed on TRL's recorded batch")
        rk_loss, rk_grads = replay(RLKernelGRPOTrainer, case, trl["first_batches"], case.precision)
        result["replay"] = dict(
            loss=rk_loss, loss_abs_diff_vs_trl=abs(rk_loss - losses["trl"][0]),
            grads_vs_trl=distance(rk_grads, trl["first_grads"]),
        )  # fmt: skip
        if "oracle" in result:
            result["replay"]["loss_abs_diff_vs_oracle"] = abs(rk_loss - result["oracle"]["loss"])
            result["replay"]["grads_vs_oracle"] = distance(rk_grads, ref)
    return result


def versions() -> dict:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for name in ("torch", "triton", "transformers", "trl", "accelerate", "datasets", "rlkernel"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def table(results: list[dict], cuda: bool) -> str:
    """The compact summary: two rows (TRL, rlkernel) per precision and setting."""
    head = f"{'precision/setting':15s} {'trainer':8s} {'loss step 1':>12s} {'|Δloss|':>8s} {'|Δgrad|':>8s}"
    head += f" {'‖Δg‖/‖g‖':>8s} {'|Δparam|':>8s} {'step s':>7s} {'gen s':>6s} {'loss+bwd ms':>11s}"
    head += f" {'peak GiB':>8s} {'+start':>6s}" if cuda else ""
    lines = [head]
    for r in results:
        for label in ("trl", "rlkernel"):
            t = r["time"][label]
            diffs = ["", "", "", ""]
            if label == "rlkernel":
                values = (r["loss"]["max_abs_diff"], r["grads"]["max_abs"], r["grads"]["rel_norm"],
                          r["params"]["max_abs_diff"])  # fmt: skip
                diffs = [f"{v:.1e}" for v in values]
            key = f"{r['precision']}/{r['setting']}" if label == "trl" else ""
            row = f"{key:15s} {label:8s} {r['loss'][label][0]:+12.6f} {diffs[0]:>8s} {diffs[1]:>8s}"
            row += f" {diffs[2]:>8s} {diffs[3]:>8s} {t['step_s']:7.3f} {t['prepare_s']:6.2f}"
            row += f" {1000 * t['loss_and_backward_s']:11.1f}"
            row += f" {t['peak_gib']:8.2f} {t['peak_above_start_gib']:6.2f}" if cuda else ""
            lines.append(row)
        if "oracle" in r:
            o = r["oracle"]
            lines.append(
                f"{'':15s} vs fp32 oracle: |Δloss| TRL {o['trl_loss_abs_diff']:.1e}, rlkernel "
                f"{o['rlkernel_loss_abs_diff']:.1e}; ‖Δg‖/‖g‖ TRL {o['trl_grads']['rel_norm']:.1e}, "
                f"rlkernel {o['rlkernel_grads']['rel_norm']:.1e}"
                + ("" if r["same_first_batch"] else " (rlkernel on its own batch: see the next line)")
            )
        if "replay" in r:
            q = r["replay"]
            line = (f"{'':15s} rlkernel on TRL's batch: |Δloss| vs TRL {q['loss_abs_diff_vs_trl']:.1e}, "
                    f"‖Δg‖/‖g‖ vs TRL {q['grads_vs_trl']['rel_norm']:.1e}")  # fmt: skip
            if "grads_vs_oracle" in q:
                line += (f"; vs fp32 oracle |Δloss| {q['loss_abs_diff_vs_oracle']:.1e}, "
                         f"‖Δg‖/‖g‖ {q['grads_vs_oracle']['rel_norm']:.1e}")  # fmt: skip
            lines.append(line)
        p = r["params"]
        lines.append(
            f"{'':15s} same completions per generation {r['same_completions']}; ‖Δparam‖/‖moved‖ "
            f"{p['rel_to_moved']:.1e} (moved: max {p['max_abs_moved']:.1e}, "
            f"{100 * p['moved_fraction']:.0f} % of the elements)"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    parser.add_argument("--size", choices=list(SIZES), help="defaults (gpu on cuda, tiny on cpu)")
    parser.add_argument("--precisions", help=f"comma list of {PRECISIONS} (bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {list(SETTINGS)}")
    parser.add_argument("--backend", help="rlkernel's backend (triton on cuda, auto on cpu)")
    parser.add_argument("--optim", default="sgd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untied", action="store_true", help="an LM head of its own (default: tied)")
    for key, value in SIZES["gpu"].items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), help="overrides the size's")
    parser.add_argument("--out", help="write the report as JSON here")
    parser.add_argument(
        "--memory-breakdown", action="store_true",
        help="CUDA: what is allocated at the peak of each trainer's second micro-step, by site (log + JSON)",
    )  # fmt: skip
    parser.add_argument(
        "--replay", action="store_true", help="replay rlkernel's step on TRL's batch also when they agree"
    )
    options = parser.parse_args(argv)
    if options.device == "cuda" and not cuda:
        parser.error("--device cuda: no CUDA device")
    options.size = options.size or ("gpu" if options.device == "cuda" else "tiny")
    options.size_values = {
        k: v if getattr(options, k) is None else getattr(options, k) for k, v in SIZES[options.size].items()
    }
    options.precisions = (options.precisions or ("bf16" if options.device == "cuda" else "fp32")).split(",")
    options.settings = options.settings.split(",")
    options.backend = options.backend or ("triton" if options.device == "cuda" else "auto")
    for flag, allowed in (("precisions", PRECISIONS), ("settings", SETTINGS)):
        if any(v not in allowed for v in getattr(options, flag)):
            parser.error(f"--{flag}: {getattr(options, flag)} must be among {list(allowed)}")
    return options


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; return the report (also written as JSON with ``--out``)."""
    from transformers.utils import logging as transformers_logging

    options = parse(argv)
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # loading / saving bars would bury the progress lines
    try:
        report = run(options)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    if options.out:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        Path(options.out).write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {options.out}")
    return report


def run(options: argparse.Namespace) -> dict:
    cuda = options.device == "cuda"
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if cuda else "cpu", versions=versions(),
        options={k: v for k, v in vars(options).items() if k != "size_values"}, size=options.size_values,
        models={}, results=[],
    )  # fmt: skip
    tok = tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        for precision in options.precisions:
            path = f"{tmp}/model-{precision}"
            count, bias = save_model(path, options, tok, precision)
            report["models"][precision] = dict(parameters=count, eos_sampling_bias=bias)
            log(f"random-init Qwen3, {precision}: {count / 1e6:.1f} M parameters ({options.size_values}); "
                f"rlkernel backend {options.backend}; {report['device']}")  # fmt: skip
            for setting in options.settings:
                case = Case(options, path, tmp, precision, setting, tok.eos_token_id, bias)
                report["results"].append(compare(case))
    log("\n" + table(report["results"], cuda))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
