"""How close rlkernel.integrations.openrlhf.PolicyLoss is to OpenRLHF 0.11.2's own PolicyLoss: the
table of docs/integrations/openrlhf.md ("How exact"), on more and larger batches than the CPU suite.

    PYTHONPATH=src python scripts/measure_openrlhf_agreement.py [--seeds 25] [--B 16] [--T 64]

Runs every setting of the tests' SWEEP (tests/integrations/test_openrlhf.py) in float32 and float64,
with each normalizer set and both advantage layouts, on ``--seeds`` fresh batches each, loading
OpenRLHF's class the way the tests do (tests/integrations/conftest.py). Prints, per loss type and
dtype, the largest |Δloss| (absolute and relative), |Δ gradient|, |Δ statistic| and the count of
bitwise-equal cases. Needs a checkout (it imports the tests' helpers) and OpenRLHF 0.11.2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers, by design

from integrations.conftest import _without_openrlhf_gpu_stack  # noqa: E402
from integrations.test_openrlhf import NORMALIZERS, SWEEP, make_batch, run  # noqa: E402
from rlkernel.integrations.openrlhf import PolicyLoss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=25)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=64)
    args = ap.parse_args()
    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        sys.exit("OpenRLHF is not installed: pip install --no-deps openrlhf==0.11.2")
    with _without_openrlhf_gpu_stack(next(iter(spec.submodule_search_locations))):
        reference = importlib.import_module("openrlhf.models.loss").PolicyLoss
    worst = defaultdict(lambda: dict(loss=0.0, rel=0.0, grad=0.0, stats=0.0, bitwise=0, cases=0))
    for index, settings in enumerate(SWEEP):
        for dtype in (torch.float32, torch.float64):
            for forward in NORMALIZERS.values():
                for layout in ("token", "sequence"):
                    for seed in range(args.seeds):
                        batch = make_batch(
                            10**6 + 97 * seed + index, dtype, advantages=layout, B=args.B, T=args.T
                        )
                        (out, grad), (ref, ref_grad) = (
                            run(PolicyLoss, settings, batch, **forward),
                            run(reference, settings, batch, **forward),
                        )
                        row = worst[
                            (settings.get("policy_loss_type", "ppo"), str(dtype).removeprefix("torch."))
                        ]
                        diff = (out[0] - ref[0]).abs().item()
                        row["loss"] = max(row["loss"], diff)
                        row["rel"] = max(row["rel"], diff / max(ref[0].abs().item(), 1e-30))
                        row["grad"] = max(row["grad"], (grad - ref_grad).abs().max().item())
                        for mine, theirs in zip(out[1:], ref[1:], strict=True):
                            if mine is not None:
                                row["stats"] = max(
                                    row["stats"], (mine.double() - theirs.double()).abs().item()
                                )
                        row["bitwise"] += bool(torch.equal(out[0], ref[0]) and torch.equal(grad, ref_grad))
                        row["cases"] += 1
    print("loss type  dtype    cases  max|Δloss|  max rel  max|Δgrad|  max|Δstat|  bitwise")
    for (loss_type, dtype), r in worst.items():
        print(
            f"{loss_type:9s}  {dtype:7s}  {r['cases']:5d}  {r['loss']:10.2e}  {r['rel']:7.1e}"
            f"  {r['grad']:10.2e}  {r['stats']:10.2e}  {r['bitwise']}/{r['cases']}"
        )


if __name__ == "__main__":
    main()
