"""``rlkernel demo``: train a tiny Qwen3 policy with GRPO (or any preset) on a toy task.

Wired into the ``rlkernel`` command by :mod:`rlkernel.cli` through :func:`add_arguments` and
:func:`run`. Prints one line per step (with the time left at the pace so far), a summary at the end,
and writes ``reward_curve.png`` (reward; loss, KL and entropy) and ``run.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata
from pathlib import Path

from rlkernel.demo.grpo import DTYPES, DemoConfig
from rlkernel.rl import ADVANTAGE_ESTIMATORS, PRESETS

_D = DemoConfig()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``rlkernel demo`` options (defaults: a ~1-3 minute CPU run whose reward rises clearly)."""
    parser.description = (
        "Train a randomly initialized tiny Qwen3-architecture policy with RL (GRPO by default) to reverse "
        "3-digit strings, through rlkernel's log-prob and policy-loss ops. Reward = fraction of answer "
        "positions right; it starts near 0.07 (random policy) and rises toward 1."
    )
    g = parser.add_argument_group("run")
    g.add_argument("--steps", type=_positive_int, default=_D.steps, help="GRPO steps (default %(default)s)")
    g.add_argument(
        "--seed",
        type=int,
        default=_D.seed,
        help="seed of the init, prompts and sampling (default %(default)s)",
    )
    g.add_argument(
        "--device",
        default=None,
        help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)",
    )
    g.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=_D.dtype,
        help="weights and activations (default %(default)s; bfloat16 is for GPUs)",
    )
    g.add_argument(
        "--out",
        type=Path,
        default=Path("runs/demo"),
        help="output folder for reward_curve.png and run.json (default %(default)s)",
    )
    g.add_argument("--quiet", action="store_true", help="print only the summary, not one line per step")
    r = parser.add_argument_group("RL")
    r.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=_D.preset,
        metavar="PRESET",
        help=f"PolicyLossConfig preset: {', '.join(PRESETS)} (default %(default)s)",
    )
    r.add_argument(
        "--estimator",
        choices=ADVANTAGE_ESTIMATORS,
        default=None,
        help="advantage estimator (default: dr_grpo for --preset dr_grpo, else grpo)",
    )
    r.add_argument(
        "--group-size",
        type=_positive_int,
        default=_D.group_size,
        help="samples per prompt, >= 2 (default %(default)s)",
    )
    r.add_argument(
        "--batch-prompts",
        type=_positive_int,
        default=_D.batch_prompts,
        help="prompts per step (default %(default)s)",
    )
    r.add_argument(
        "--lr", type=_positive_float, default=_D.lr, help="AdamW learning rate (default %(default)s)"
    )
    r.add_argument(
        "--temperature",
        type=_positive_float,
        default=_D.temperature,
        help="sampling temperature, also applied to the training log-probs (default %(default)s)",
    )
    r.add_argument(
        "--ppo-epochs",
        type=_positive_int,
        default=_D.ppo_epochs,
        help="passes over each rollout batch (default %(default)s)",
    )
    r.add_argument(
        "--minibatches",
        type=_positive_int,
        default=_D.minibatches,
        help="optimizer steps per epoch (default %(default)s)",
    )
    r.add_argument(
        "--micro-batches",
        type=_positive_int,
        default=_D.micro_batches,
        help="gradient-accumulation chunks per minibatch, global normalizers (default %(default)s)",
    )
    m = parser.add_argument_group("task and model")
    m.add_argument(
        "--task-length",
        type=_positive_int,
        default=_D.task_length,
        help="digits to reverse (default %(default)s)",
    )
    m.add_argument(
        "--hidden-size",
        type=_positive_int,
        default=_D.hidden_size,
        help="Qwen3 hidden size (default %(default)s)",
    )
    m.add_argument(
        "--num-layers",
        type=_positive_int,
        default=_D.num_layers,
        help="Qwen3 decoder layers (default %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """A :class:`DemoConfig` from parsed arguments; resolves ``--device`` and checks what argparse can't.

    Raises:
        ValueError: an unusable device or an inconsistent batch layout, with a message saying why.
    """
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--device {device!r} is not a torch device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available on this machine (use --device cpu)")
    if args.group_size < 2:
        raise ValueError(
            f"--group-size must be >= 2 (advantages compare samples of a prompt), got {args.group_size}"
        )
    n_seqs = args.batch_prompts * args.group_size
    if args.minibatches * args.micro_batches > n_seqs:
        raise ValueError(
            f"--minibatches x --micro-batches ({args.minibatches} x {args.micro_batches}) must not exceed "
            f"the sequences per step (--batch-prompts x --group-size = {n_seqs})"
        )
    return DemoConfig(
        steps=args.steps,
        seed=args.seed,
        device=str(dev),
        dtype=args.dtype,
        preset=args.preset,
        estimator=args.estimator,
        task_length=args.task_length,
        group_size=args.group_size,
        batch_prompts=args.batch_prompts,
        lr=args.lr,
        temperature=args.temperature,
        ppo_epochs=args.ppo_epochs,
        minibatches=args.minibatches,
        micro_batches=args.micro_batches,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
    )


def _versions() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("rlkernel", "transformers", "triton", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _device_info(device: str) -> dict[str, object]:
    import torch

    from rlkernel import _dispatch

    dev = torch.device(device)
    try:
        backend = _dispatch.resolve_backend(dev, has_kernel=True)
    except ValueError as e:
        backend = f"error: {e}"
    info: dict[str, object] = {"device": device}
    if dev.type == "cuda":
        info["name"] = torch.cuda.get_device_name(dev)
    else:
        info["name"] = f"{_cpu_model()} CPU, {torch.get_num_threads()} torch threads"
        # What a CPU run's bits depend on (docs/guides/demo.md, "Reproducibility"): ATen's
        # vectorized kernels for this capability, and the thread count.
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["torch_threads"] = torch.get_num_threads()
    info["rlkernel_backend"] = backend
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _window(n: int) -> int:
    """Steps averaged for the start and end reward: a fifth of the run, at most 20."""
    return max(1, min(20, n // 5))


def duration(seconds: float) -> str:
    """``"45s"``, ``"3m07s"`` or ``"1h02m"``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_seconds(step: int, steps: int, elapsed_s: float) -> float:
    """The time the remaining steps take at the mean pace so far."""
    return elapsed_s / max(step, 1) * (steps - step)


def _step_line(rec: dict, steps: int, kl_name: str) -> str:
    eta = eta_seconds(rec["step"], steps, rec["elapsed_s"])
    return (
        f"step {rec['step']:>{len(str(steps))}}/{steps}  reward {rec['reward_mean']:.3f}  "
        f"exact {rec['exact_match']:.2f}  loss {rec['loss']:+.4f}  clip {rec['clip_frac']:.3f}  "
        f"{kl_name} {rec['kl']:.2e}  entropy {rec['entropy_mean']:.3f}  "
        f"max|Δlogp| {rec['max_abs_logp_diff']:.1e}  {rec['elapsed_s']:.1f}s  ETA {duration(eta)}"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; returns the exit status (0 on success, 2 on bad options)."""
    from rlkernel._cli_paths import output_dir_problem

    try:
        problem = output_dir_problem("--out", args.out)  # before training: the files come last
        if problem:
            raise ValueError(problem)
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"rlkernel demo: error: {e}", file=sys.stderr)
        return 2

    from rlkernel.demo.grpo import train
    from rlkernel.demo.plot import plot_reward_curve

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = _device_info(cfg.device)
    kl_name = "kl_ref" if PRESETS[cfg.preset].get("kl_coef", 0) > 0 else "approx_kl"
    print(
        f"rlkernel demo: preset {cfg.preset} ({cfg.resolved_estimator()} advantages), tiny Qwen3 "
        f"(hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.dtype}) reversing {cfg.task_length}-digit "
        f"strings; {cfg.steps} steps x {cfg.batch_prompts} prompts x {cfg.group_size} samples on "
        f"{dev['name']} (rlkernel backend: {dev['rlkernel_backend']})",
        flush=True,
    )

    def log(rec: dict) -> None:
        if not args.quiet:
            print(_step_line(rec, cfg.steps, kl_name), flush=True)

    history, info = train(cfg, log=log)

    k = _window(len(history))
    start = sum(r["reward_mean"] for r in history[:k]) / k
    end = sum(r["reward_mean"] for r in history[-k:]) / k
    start_em = sum(r["exact_match"] for r in history[:k]) / k
    end_em = sum(r["exact_match"] for r in history[-k:]) / k
    summary = {
        "start_reward": start,
        "end_reward": end,
        "start_exact_match": start_em,
        "end_exact_match": end_em,
        "window_steps": k,
        "max_abs_logp_diff": max(r["max_abs_logp_diff"] for r in history),
        "elapsed_s": info["elapsed_s"],
    }
    curve = plot_reward_curve(
        history,
        out_dir / "reward_curve.png",
        window=k,
        kl_name=kl_name,
        title=f"rlkernel demo: {cfg.preset} on tiny Qwen3, reverse {cfg.task_length} digits "
        f"({dev['device']}, seed {cfg.seed}, {info['elapsed_s']:.0f} s)",
    )
    record = {
        "args": {k_: (str(v) if isinstance(v, Path) else v) for k_, v in vars(args).items() if k_ != "func"},
        "config": info["config"],
        "summary": summary,
        "device": dev,
        "versions": _versions(),
        "run": {k_: v for k_, v in info.items() if k_ != "config"},
        "steps": history,
    }
    (out_dir / "run.json").write_text(json.dumps(record, indent=1))

    print(
        f"reward {start:.3f} -> {end:.3f} (mean of the first / last {k} steps), exact match "
        f"{start_em:.2f} -> {end_em:.2f}; max |rollout - training logp| {summary['max_abs_logp_diff']:.1e}; "
        f"{info['elapsed_s']:.1f} s"
    )
    print("samples: " + "   ".join(info["final_samples"]))
    print(f"wrote {curve} and {out_dir / 'run.json'}")
    if end <= start:
        print("warning: the reward did not rise; try more --steps or another --seed", file=sys.stderr)
    return 0
