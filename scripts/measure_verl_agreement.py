"""How close the ``rk_<mode>`` losses of rlkernel.integrations.verl are to verl 0.9.1's own losses: the
table of docs/integrations/verl.md ("How exact"), on more and larger batches than the CPU suite.

    PYTHONPATH=src python scripts/measure_verl_agreement.py [--seeds 25] [--B 16] [--T 64]

Runs every registered mode with every ``loss_agg_mode`` rlkernel has, each ``global_batch_info`` of
the tests (none; dp_size=1 with the mini-batch's counts; dp_size=4 with ``loss_scale_factor``) and
both advantage layouts, in float32 and float64, on ``--seeds`` fresh batches each, importing verl
the way the tests do (tests/integrations/verl_env.py). Prints, per mode and dtype, the largest
|Δloss| (absolute, and relative to max(1, |loss|)), |Δ gradient| and |Δ metric|, and the count of
bitwise-equal losses and gradients. Needs a checkout (it imports the tests' helpers) and verl 0.9.1.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers, by design

from integrations import verl_env  # noqa: E402
from integrations.test_verl import AGGS, INFOS, MODES, actor_config, make_batch, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=25)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=64)
    args = ap.parse_args()
    reason = verl_env.unavailable_reason()
    if reason is not None:
        sys.exit(reason)
    core_algos, config_module = verl_env.import_verl("verl.trainer.ppo.core_algos", "verl.workers.config")
    verl = types.SimpleNamespace(
        ActorConfig=config_module.ActorConfig, PolicyLossConfig=config_module.PolicyLossConfig
    )
    worst = defaultdict(lambda: dict(loss=0.0, rel=0.0, grad=0.0, metric=0.0, bitwise=0, cases=0))
    for index, mode in enumerate(MODES):
        ours_fn, theirs_fn = core_algos.get_policy_loss_fn(f"rk_{mode}"), core_algos.get_policy_loss_fn(mode)
        for dtype in (torch.float32, torch.float64):
            for agg in AGGS:
                for info in INFOS.values():
                    config = actor_config(verl, info)
                    for layout in ("token", "seq"):
                        for seed in range(args.seeds):
                            batch = make_batch(
                                10**6 + 97 * seed + index, advantages=layout, dtype=dtype, B=args.B, T=args.T
                            )
                            (loss, metrics, grad) = run(ours_fn, batch, agg, config)
                            (ref, ref_metrics, ref_grad) = run(theirs_fn, batch, agg, config)
                            row = worst[(mode, str(dtype).removeprefix("torch."))]
                            diff = (loss - ref).abs().item()
                            row["loss"] = max(row["loss"], diff)
                            row["rel"] = max(row["rel"], diff / max(ref.abs().item(), 1.0))
                            row["grad"] = max(row["grad"], (grad - ref_grad).abs().max().item())
                            for name, value in ref_metrics.items():
                                row["metric"] = max(row["metric"], abs(metrics[name] - value))
                            row["bitwise"] += int(torch.equal(loss, ref) and torch.equal(grad, ref_grad))
                            row["cases"] += 1
    print("| mode | dtype | max |Δloss| | max |Δloss| / max(1, |loss|) | max |Δ∂loss/∂log_prob| ", end="")
    print("| max |Δmetric| | bitwise |")
    print("|---|---|---|---|---|---|---|")
    for (mode, dtype), r in worst.items():
        print(
            f"| {mode} | {dtype} | {r['loss']:.1e} | {r['rel']:.1e} | {r['grad']:.1e} | {r['metric']:.1e} | "
            f"{r['bitwise']} / {r['cases']} |"
        )


if __name__ == "__main__":
    main()
