"""Stock ``trl.GRPOTrainer`` next to ``RLKernelGRPOTrainer(true_on_policy=True)``: the same GRPO run,
per step the generation, scoring and loss + backward times, peak memory, the sampler/trainer
log-prob mismatch and the reward.

    python scripts/trl_true_on_policy.py --out results/trl_true_on_policy          # GPU: ~0.5 B Qwen3, bf16
    python scripts/trl_true_on_policy.py --device cpu --size tiny --out /tmp/top    # smoke: seconds (CI)
    python scripts/trl_true_on_policy.py --docs docs/integrations/trl.md \\
        --results benchmarks/results/trl_true_on_policy_h100.json                  # the docs table from a run

Everything is made in-process (the GPU machine has no internet), with the offline pieces of
``scripts/trl_trainer_compare.py``: a byte-level BPE tokenizer trained on a few sentences, a
random-init Qwen3 (``--size gpu``: hidden 1024, 12 layers, 16 heads, 8 KV heads, head dim 128,
intermediate 3072, vocabulary 151,936 with an LM head of its own, as Qwen3-8B has: 500 M parameters;
``--size tiny``: hidden 64, 2 layers, the tokenizer's 300 tokens), prompts of random corpus words, and
a deterministic reward of the completion's token ids: its length over ``--completion`` (the model's
vocabulary exceeds the tokenizer's, so a text reward would see mostly empty strings; a random model
can learn the length within a few steps, through its end-of-sequence logit, and not much else).
A random model would
almost never end a completion: the sampler gets a bias on the end-of-sequence logit (TRL's
``generation_kwargs``, ``sequence_bias``) for a probability of ~2/``--completion`` per token. That is
a logits processor: it changes what is drawn, not the log-probs either trainer keeps or trains on
(log_softmax of the model's logits at temperature 1, TRL's training semantics).

Both trainers start from the same saved model with the same seed and ``GRPOConfig``: bf16 weights and
``bf16=True``, TRL's loss defaults (dapo, beta = 0), ``gradient_accumulation_steps`` 2 and
``steps_per_generation`` 4, so one generation feeds two optimizer steps and the second trains on old
log-probs. There TRL scores them with one more forward over every prompt + completion at generation
time; true on-policy uses the sampler's, which are the trainer's bit for bit. Generation is
transformers' ``generate`` in both (no vLLM), sampling at temperature 1 from the full distribution.

Measured per optimizer step (device synchronized around each part): ``generation`` (the
``generate`` call), ``scoring`` (TRL's ``_get_per_token_logps_and_entropies`` calls: the old
log-probs; true on-policy answers them without a forward), ``loss+bwd`` (each micro-step's
``training_step`` minus its input preparation), the step's wall time, ``torch.cuda.max_memory_allocated``
over the step, and the policy's scoring forwards (counted by a forward pre-hook). The mismatch, under
TRL's names (``sampling/sampling_logp_difference/{mean,max}``, ``sampling/importance_sampling_ratio/
{min,mean,max}``): for TRL, this script keeps the sampler's log-probs while ``generate`` samples
(``rlkernel.integrations.trl.SamplerLogprobs``: one log-prob call per decode step, also paid by
true on-policy) and compares them with the old log-probs TRL's scoring pass computed at the same
weights; ``RLKernelGRPOTrainer`` logs its own (the loss pass's log-probs against the sampler's on the
step trained at the sampler's weights). Both are measured once per generation, on the odd steps.
Medians are over the steps after the first two (the first generation compiles the Triton kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# The offline pieces of the existing comparison (same folder): tokenizer, prompts, reward, EOS bias.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_trainer_compare import prompts, sync, tokenizer, versions  # noqa: E402
from trl_trainer_compare import save_model as compare_save_model  # noqa: E402

from rlkernel.integrations.trl.sampler import METRIC_NAMES  # noqa: E402 - imports no TRL

SIZES = {
    "gpu": dict(hidden=1024, layers=12, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                batch=8, generations=8, prompt_words=32, completion=128, steps=20, lr=1e-4),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=0,
                 batch=4, generations=4, prompt_words=4, completion=8, steps=4, lr=5e-3),
}  # fmt: skip
TRAINERS = {"trl": "trl.GRPOTrainer (stock)", "rlkernel": "RLKernelGRPOTrainer(true_on_policy=True)"}
METRICS = METRIC_NAMES  # TRL's names for the sampler/trainer mismatch: mean/max |Δlogp|, min/mean/max ratio
DOCS_BEGIN, DOCS_END = "<!-- trl-true-on-policy:begin -->", "<!-- trl-true-on-policy:end -->"


def log(message: str) -> None:
    print(message, flush=True)


def save_model(path: str, options, tok) -> tuple[int, float]:
    """The random-init bf16 Qwen3 with an LM head of its own (untied, as Qwen3-8B), saved with the
    tokenizer: ``trl_trainer_compare.save_model``'s; its parameter count and the sampler's
    end-of-sequence bias."""
    return compare_save_model(path, argparse.Namespace(**{**vars(options), "untied": True}), tok, "bf16")


class StepRecorder:
    """Per optimizer step: seconds spent in each timed part, the policy's scoring forwards, peak memory.

    ``timed(key)`` adds the device-synchronized duration of its block to the current step; the
    trainer's callback (``on_step_begin`` / ``on_step_end``) opens and closes the steps."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.steps, self.current = cuda, [], None

    @contextlib.contextmanager
    def timed(self, key: str):
        sync(self.cuda)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.cuda)
            if self.current is not None:
                self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - start

    def count(self, key: str) -> None:
        if self.current is not None:
            self.current[key] = self.current.get(key, 0) + 1

    def begin(self) -> None:
        sync(self.cuda)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.current = {"start": time.perf_counter()}

    def end(self) -> None:
        sync(self.cuda)
        record, self.current = self.current, None
        record["step_s"] = time.perf_counter() - record.pop("start")
        record["loss_backward_s"] = record.get("micro_steps_s", 0.0) - record.get("prepare_s", 0.0)
        if self.cuda:
            record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.steps.append(record)


def probed(base, recorder: StepRecorder, measure_trl: bool):
    """``base`` (a GRPOTrainer class) with timers around its generation, scoring, input preparation
    and micro-steps. ``measure_trl``: also keep the sampler's log-probs and compare them with TRL's
    old log-probs (stock TRL: observation only, nothing TRL computes changes)."""
    from rlkernel.integrations.trl import SamplerLogprobs, sampling_metrics

    class Probed(base):
        _probe_generating = False

        def _generate_single_turn(self, *args, **kwargs):
            with recorder.timed("generation_s"):
                if not measure_trl:
                    return super()._generate_single_turn(*args, **kwargs)
                with SamplerLogprobs(self.model, self.temperature) as sampler:
                    completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
                self._probe_sampler = sampler.logprobs(completion_ids)
                return completion_ids, logprobs

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            # Scoring = the calls made while preparing a generation's batch (old and reference
            # log-probs); TRL's own loss calls this too, timed as loss + backward.
            if not self._probe_generating:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with recorder.timed("scoring_s"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            self._probe_generating = True
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self._probe_generating = False
            if measure_trl:
                # TRL scored old log-probs (gradient_accumulation_steps % steps_per_generation != 0)
                # at the weights that sampled: TRL's own vLLM metric, old − sampling, here.
                old, mask = out["old_per_token_logps"], out["completion_mask"]
                sampler = torch.nn.functional.pad(
                    self._probe_sampler, (0, old.shape[1] - self._probe_sampler.shape[1])
                )
                for name, value in sampling_metrics(old, sampler, mask).items():
                    self._metrics["train"][name].append(value)
            return out

        def _prepare_inputs(self, generation_batch):
            with recorder.timed("prepare_s"):
                return super()._prepare_inputs(generation_batch)

        def training_step(self, model, inputs, num_items_in_batch=None):
            with recorder.timed("micro_steps_s"):
                return super().training_step(model, inputs, num_items_in_batch)

    Probed.__name__ = f"Probed{base.__name__}"
    return Probed


def build_trainer(name: str, options, path: str, output_dir: str, recorder: StepRecorder):
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, Qwen3ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlkernel.integrations.trl import RLKernelGRPOTrainer

    size, cuda = options.size_values, options.device == "cuda"
    args = GRPOConfig(
        output_dir=output_dir, max_steps=size["steps"], per_device_train_batch_size=size["batch"],
        num_generations=size["generations"], max_completion_length=size["completion"],
        gradient_accumulation_steps=options.accumulation, steps_per_generation=options.steps_per_generation,
        learning_rate=size["lr"], optim=options.optim, bf16=True, use_cpu=not cuda, report_to="none",
        save_strategy="no", logging_steps=1, seed=options.seed, disable_tqdm=True,
        generation_kwargs={"sequence_bias": [[[options.eos[0]], options.eos[1]]]},
    )  # fmt: skip
    data = prompts(options.prompts_needed, size["prompt_words"], options.seed)

    def length_reward(completion_ids, **kwargs) -> list[float]:
        """Each completion's length over the longest allowed."""
        return [len(ids) / size["completion"] for ids in completion_ids]

    keyword = {"true_on_policy": True} if name == "rlkernel" else {}
    cls = probed(
        RLKernelGRPOTrainer if name == "rlkernel" else GRPOTrainer, recorder, measure_trl=name == "trl"
    )
    trainer = cls(
        model=Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16), reward_funcs=length_reward,
        args=args, train_dataset=Dataset.from_dict({"prompt": data}),
        processing_class=AutoTokenizer.from_pretrained(path), **keyword,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            recorder.begin()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.end()

    trainer.add_callback(Steps())

    def count(module, args, kwargs):  # TRL's scoring pass calls the policy with fused_lm_head=True
        if kwargs.get("fused_lm_head") and trainer._probe_generating:
            recorder.count("scoring_forwards")

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)
    return trainer


def train(name: str, options, path: str, tmp: str) -> dict:
    cuda = options.device == "cuda"
    recorder = StepRecorder(cuda)
    trainer = build_trainer(name, options, path, f"{tmp}/{name}", recorder)
    log(f"  {TRAINERS[name]}: {options.size_values['steps']} steps")
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    logs = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    steps = []
    for i, record in enumerate(recorder.steps, start=1):
        entry = logs.get(i, {})
        step = dict(step=i, **record, loss=entry.get("loss"), reward=entry.get("reward"))
        step.update({name: entry[name] for name in METRICS if name in entry})
        steps.append(step)
        mismatch = f"  |Δlogp| max {step[METRICS[1]]:.3g}" if METRICS[1] in step else ""
        reward = f"  reward {step['reward']:.3f}" if step["reward"] is not None else ""
        parts = (f"generation {step.get('generation_s', 0):.2f}, scoring {step.get('scoring_s', 0):.3f}, "
                 f"loss+bwd {step['loss_backward_s']:.3f}")  # fmt: skip
        log(f"    step {i:3d}: {step['step_s']:.2f} s ({parts}){reward}{mismatch}")
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return dict(trainer=TRAINERS[name], train_s=total, steps=steps, summary=summarize(steps, cuda))


def summarize(steps: list[dict], cuda: bool) -> dict:
    """Over the steps after the first two (the first generation compiles): the mean step time, the
    median generation and scoring of the steps that generate, the median loss + backward, their
    totals; the scoring forwards and the mismatch over all steps; the reward's first and last value."""
    later = steps[2:] or steps
    generating = [s for s in later if "generation_s" in s] or [s for s in steps if "generation_s" in s]

    def median(key, rows):
        return statistics.median([r.get(key, 0.0) for r in rows]) if rows else 0.0

    measured = [s for s in steps if METRICS[0] in s]
    rewards = [s["reward"] for s in steps if s["reward"] is not None]
    out = dict(
        step_s=statistics.mean(s["step_s"] for s in later), generation_s=median("generation_s", generating),
        scoring_s=median("scoring_s", generating), loss_backward_s=median("loss_backward_s", later),
        totals_s={key: sum(s.get(key, 0.0) for s in later)
                  for key in ("step_s", "generation_s", "scoring_s", "loss_backward_s")},
        timed_steps=[s["step"] for s in later],
        scoring_forwards=sum(s.get("scoring_forwards", 0) for s in steps),
        measured_steps=[s["step"] for s in measured], reward_first=rewards[0] if rewards else None,
        reward_last=rewards[-1] if rewards else None,
    )  # fmt: skip
    if measured:
        out["logp_difference_mean"] = statistics.mean(s[METRICS[0]] for s in measured)
        out["logp_difference_max"] = max(s[METRICS[1]] for s in measured)
        out["ratio_min"] = min(s[METRICS[2]] for s in measured)
        out["ratio_max"] = max(s[METRICS[4]] for s in measured)
    if cuda:
        out["peak_gib"] = max(s["peak_gib"] for s in steps)
    return out


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(report: dict) -> str:
    """The compact summary: one row per trainer, then the time the scoring pass cost."""
    head = (f"{'trainer':42s} {'step s':>7s} {'gen s':>6s} {'score s':>7s} {'score fwd':>9s} "
            f"{'loss+bwd s':>10s} {'peak GiB':>8s} {'|Δlogp| mean':>12s} {'|Δlogp| max':>11s} "
            f"{'IS ratio min..max':>19s} {'reward':>13s}")  # fmt: skip
    lines = [head]
    for run in report["runs"].values():
        s = run["summary"]
        ratio = "–" if "ratio_min" not in s else f"{s['ratio_min']:.4g}..{s['ratio_max']:.4g}"
        reward = f"{_fmt(s['reward_first'], '.3f')}→{_fmt(s['reward_last'], '.3f')}"
        lines.append(
            f"{run['trainer']:42s} {s['step_s']:7.3f} {s['generation_s']:6.2f} {s['scoring_s']:7.3f} "
            f"{s['scoring_forwards']:9d} {s['loss_backward_s']:10.3f} {_fmt(s.get('peak_gib'), '8.2f'):>8s} "
            f"{_fmt(s.get('logp_difference_mean'), '.3g'):>12s} "
            f"{_fmt(s.get('logp_difference_max'), '.3g'):>11s} "
            f"{ratio:>19s} {reward:>13s}"
        )  # fmt: skip
    return "\n".join(lines)


def markdown(report: dict, image: str | None = None) -> str:
    """The docs block: the run's settings, one table row per trainer, the totals, the per-step mismatch."""
    runs, m, size, opts = report["runs"], report["model"], report["size"], report["options"]
    v = report["versions"]
    first = next(iter(runs.values()))["summary"]["timed_steps"]
    lines = [
        f"Measured {report['date'][:10]} on {report['device']} (commit {report.get('commit') or 'unknown'}; "
        f"torch {v['torch']}, triton {v.get('triton')}, transformers {v['transformers']}, TRL {v['trl']}): a "
        f"random-init Qwen3 of {m['parameters'] / 1e6:.3g} M parameters (vocabulary {m['vocab']:,}), bf16, "
        f"{size['steps']} optimizer steps of {size['batch'] * opts['accumulation']} completions "
        f"(<= {size['completion']} tokens), gradient accumulation {opts['accumulation']}, "
        f"steps_per_generation {opts['steps_per_generation']}. Step: mean over steps {first[0]}..{first[-1]} "
        "(the first generation compiles); generation and scoring: medians over those steps that generate; "
        "loss + backward: median per step; the mismatch over every measured step. Written by "
        "`scripts/trl_true_on_policy.py` (`--docs` regenerates this block from the results JSON).",
        "",
        "| trainer | step s | generation s | scoring s | scoring forwards | loss + backward s | peak GiB "
        "| \\|Δlogp\\| mean | \\|Δlogp\\| max | IS ratio min .. max | reward first → last |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs.values():
        s = run["summary"]
        ratio = "–" if "ratio_min" not in s else f"{s['ratio_min']:.4g} .. {s['ratio_max']:.4g}"
        lines.append(
            f"| {run['trainer']} | {s['step_s']:.3f} | {s['generation_s']:.2f} | {s['scoring_s']:.3f} "
            f"| {s['scoring_forwards']} | {s['loss_backward_s']:.3f} | {_fmt(s.get('peak_gib'), '.2f')} "
            f"| {_fmt(s.get('logp_difference_mean'), '.3g')} | {_fmt(s.get('logp_difference_max'), '.3g')} "
            f"| {ratio} | {_fmt(s['reward_first'], '.3f')} → {_fmt(s['reward_last'], '.3f')} |"
        )
    lines.append("")
    for run in runs.values():
        t = run["summary"]["totals_s"]
        per_step = ", ".join(f"{s['step']}: {s[METRICS[1]]:.3g}" for s in run["steps"] if METRICS[1] in s)
        lines.append(
            f"- {run['trainer']}: steps {first[0]}..{first[-1]} took {t['step_s']:.2f} s (generation "
            f"{t['generation_s']:.2f}, scoring {t['scoring_s']:.3f}, loss + backward "
            f"{t['loss_backward_s']:.2f}); "
            f"max |Δlogp| per measured step: {per_step or 'none'}"
        )
    if image:
        lines += ["", f"![reward, mismatch and step time per step]({image})"]
    return "\n".join(lines)


def update_docs(docs: Path, report: dict) -> None:
    """Replace the block between the markers of ``docs`` with :func:`markdown` of ``report``; the
    plot is linked when ``trl_true_on_policy.png`` lies next to the page."""
    text = docs.read_text()
    pattern = re.compile(re.escape(DOCS_BEGIN) + r".*?" + re.escape(DOCS_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{docs}: no {DOCS_BEGIN} ... {DOCS_END} block")
    image = "trl_true_on_policy.png" if (docs.parent / "trl_true_on_policy.png").exists() else None
    block = f"{DOCS_BEGIN}\n<!-- generated by scripts/trl_true_on_policy.py --docs; do not edit by hand -->\n"
    block += markdown(report, image) + f"\n{DOCS_END}"
    docs.write_text(pattern.sub(lambda _: block, text))


def plot(report: dict, path: Path) -> Path | None:
    """Three panels: reward per generation, the measured |Δlogp| max per step, step time by part."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log("matplotlib is not installed: no plot (the JSON has every number; --plot-from draws it later)")
        return None
    fig = Figure(figsize=(15, 4))
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.82, wspace=0.25)
    FigureCanvasAgg(fig)
    colors = {"trl": "tab:gray", "rlkernel": "tab:blue"}
    ax = fig.add_subplot(1, 3, 1)
    for name, run in report["runs"].items():
        points = [(s["step"], s["reward"]) for s in run["steps"] if s["reward"] is not None]
        ax.plot(*zip(*points, strict=True), "o-", color=colors[name], label=run["trainer"])
    ax.set(title="reward (at each generation)", xlabel="optimizer step")
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 3, 2)
    for name, run in report["runs"].items():
        points = [(s["step"], s[METRICS[1]]) for s in run["steps"] if METRICS[1] in s]
        if points:
            ax.plot(*zip(*points, strict=True), "o-", color=colors[name], label=run["trainer"])
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set(title="sampler vs trainer: max |Δlogp| per measured step", xlabel="optimizer step")
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 3, 3)
    parts = (("generation_s", "generation"), ("scoring_s", "scoring"), ("loss_backward_s", "loss + backward"))
    names = list(report["runs"])
    bottom = [0.0] * len(names)
    for key, label in parts:
        values = [report["runs"][n]["summary"]["totals_s"][key] for n in names]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    steps = report["runs"][names[0]]["summary"]["timed_steps"]
    ax.set(title=f"seconds over steps {steps[0]}..{steps[-1]}", ylabel="s")
    ax.legend(fontsize=7)
    count = report["model"]["parameters"]
    fig.suptitle(f"TRL GRPO, stock vs true on-policy: {report['device']}, random-init Qwen3 of "
                 f"{count / 1e6:.3g} M parameters", y=0.99)  # fmt: skip
    fig.savefig(path, dpi=110)
    return path


def _git_commit() -> str | None:
    try:
        command = ["git", "rev-parse", "--short", "HEAD"]
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    parser.add_argument("--size", choices=list(SIZES), help="defaults: gpu on cuda, tiny on cpu")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--steps-per-generation", type=int, default=4)
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of {list(TRAINERS)}")
    for key, value in SIZES["gpu"].items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), help="overrides the size's")
    parser.add_argument("--out", help="a folder: trl_true_on_policy.json and .png")
    parser.add_argument("--plot-from", help="draw the PNG of this results JSON into --out (no training)")
    parser.add_argument("--docs", help="rewrite this page's results block from --results (no training)")
    parser.add_argument("--results", help="the results JSON for --docs")
    options = parser.parse_args(argv)
    options.trainers = options.trainers.split(",")
    if any(name not in TRAINERS for name in options.trainers):
        parser.error(f"--trainers: {options.trainers} must be among {list(TRAINERS)}")
    if options.docs and not options.results:
        parser.error("--docs needs --results")
    if options.device == "cuda" and not cuda:
        parser.error("--device cuda: no CUDA device")
    options.size = options.size or ("gpu" if options.device == "cuda" else "tiny")
    options.size_values = {
        k: v if getattr(options, k) is None else getattr(options, k) for k, v in SIZES[options.size].items()
    }
    if (
        options.steps_per_generation <= options.accumulation
        or options.steps_per_generation % options.accumulation
    ):
        parser.error(
            "--steps-per-generation must be a multiple of --accumulation, and larger (old log-probs)"
        )
    size = options.size_values
    per_generation = size["batch"] * options.steps_per_generation // size["generations"]
    generations = -(-size["steps"] * options.accumulation // options.steps_per_generation)
    options.prompts_needed = per_generation * (generations + 1)
    return options


def main(argv: list[str] | None = None) -> dict | None:
    """Run both trainers (or redraw / regenerate the docs); return the report."""
    options = parse(argv)
    if options.docs:
        update_docs(Path(options.docs), json.loads(Path(options.results).read_text()))
        log(f"updated {options.docs} from {options.results}")
        return None
    if options.plot_from:
        report = json.loads(Path(options.plot_from).read_text())
        out = Path(options.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        log(f"wrote {plot(report, out / 'trl_true_on_policy.png')}")
        return report
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        report = run(options)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    log("\n" + table(report))
    if report["runs"].keys() == set(TRAINERS):
        trl, ours = (report["runs"][n]["summary"] for n in ("trl", "rlkernel"))
        log(f"scoring pass: stock TRL {trl['scoring_s']:.3f} s per generating step "
            f"({trl['scoring_forwards']} forwards in {report['size']['steps']} steps); "
            f"true on-policy {ours['scoring_forwards']} forwards")  # fmt: skip
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trl_true_on_policy.json").write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {out / 'trl_true_on_policy.json'}")
        png = plot(report, out / "trl_true_on_policy.png")
        if png:
            log(f"wrote {png}")
    return report


def run(options: argparse.Namespace) -> dict:
    threads = torch.get_num_threads()
    if options.device == "cpu":
        torch.set_num_threads(1)  # the CPU invariant path is small per-row GEMVs: threads only spin
    try:
        return _run(options)
    finally:
        torch.set_num_threads(threads)


def _run(options: argparse.Namespace) -> dict:
    cuda = options.device == "cuda"
    size = options.size_values
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=os.environ.get("RLKERNEL_GIT_COMMIT") or _git_commit(),
        device=torch.cuda.get_device_name() if cuda else "cpu", versions=versions(),
        options={k: v for k, v in vars(options).items() if k not in ("size_values",)}, size=size, runs={},
    )  # fmt: skip
    tok = tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        count, bias = save_model(f"{tmp}/model", options, tok)
        options.eos = (tok.eos_token_id, bias)
        report["model"] = dict(parameters=count, vocab=size["vocab"] or len(tok), layers=size["layers"],
                               hidden=size["hidden"], eos_sampling_bias=bias)  # fmt: skip
        log(f"random-init Qwen3: {count / 1e6:.1f} M parameters ({size}); {report['device']}")
        for name in options.trainers:
            report["runs"][name] = train(name, options, f"{tmp}/model", tmp)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
