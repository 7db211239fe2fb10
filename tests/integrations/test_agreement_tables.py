"""The "How exact" tables of docs/integrations/openrlhf.md and docs/integrations/verl.md, measured:
each integration next to the framework's own losses on ``[16, 64]`` batches over the whole sweep of
its comparison tests (test_openrlhf.py: every setting × normalizers; test_verl.py: every mode ×
aggregation × ``global_batch_info``; both advantage layouts, float32 and float64), with
``--agreement-seeds`` fresh batches per case (default 1; the pages' tables: 25). Each test prints its
table (``-s`` shows it) and asserts the bounds the page states:

    pytest tests/integrations/test_agreement_tables.py --agreement-seeds 25 -s
"""

from __future__ import annotations

from collections import defaultdict

import torch

from rlkernel.integrations.openrlhf import PolicyLoss

from . import test_openrlhf as openrlhf_cases
from . import test_verl as verl_cases

B, T = 16, 64
DTYPES = (torch.float32, torch.float64)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_openrlhf_agreement_table(openrlhf_policy_loss, request):
    seeds = request.config.getoption("--agreement-seeds")
    worst = defaultdict(lambda: dict(loss=0.0, rel=0.0, grad=0.0, stats=0.0, bitwise=0, cases=0))
    for index, settings in enumerate(openrlhf_cases.SWEEP):
        for dtype in DTYPES:
            for forward in openrlhf_cases.NORMALIZERS.values():
                for layout in ("token", "sequence"):
                    for seed in range(seeds):
                        batch = openrlhf_cases.make_batch(10**6 + 97 * seed + index, dtype, advantages=layout,
                                                          B=B, T=T)  # fmt: skip
                        out, grad = openrlhf_cases.run(PolicyLoss, settings, batch, **forward)
                        ref, ref_grad = openrlhf_cases.run(openrlhf_policy_loss, settings, batch, **forward)
                        row = worst[(settings.get("policy_loss_type", "ppo"), _name(dtype))]
                        diff = (out[0] - ref[0]).abs().item()
                        row["loss"] = max(row["loss"], diff)
                        row["rel"] = max(row["rel"], diff / max(ref[0].abs().item(), 1e-30))
                        row["grad"] = max(row["grad"], (grad - ref_grad).abs().max().item())
                        for mine, theirs in zip(out[1:], ref[1:], strict=True):
                            if mine is not None:
                                stat = (mine.double() - theirs.double()).abs().item()
                                row["stats"] = max(row["stats"], stat)
                        row["bitwise"] += bool(torch.equal(out[0], ref[0]) and torch.equal(grad, ref_grad))
                        row["cases"] += 1
    print(f"\nOpenRLHF agreement, {seeds} seed(s) per case, [{B}, {T}]")
    print("| loss type | dtype | cases | max |Δloss| | max relative | max |Δ∂loss/∂log_probs| | max |Δstat| "
          "| bitwise |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for (loss_type, dtype), r in worst.items():
        print(f"| {loss_type} | {dtype} | {r['cases']} | {r['loss']:.1e} | {r['rel']:.1e} | "
              f"{r['grad']:.1e} | {r['stats']:.1e} | {r['bitwise']} / {r['cases']} |")  # fmt: skip
    # The page: ppo bitwise (loss, gradient, statistics); gspo to rounding, statistics bitwise.
    for (loss_type, dtype), r in worst.items():
        assert r["stats"] == 0, (loss_type, dtype)
        if loss_type == "ppo":
            assert r["bitwise"] == r["cases"] and r["grad"] == 0, dtype
        else:
            tol = openrlhf_cases.GSPO_TOL[getattr(torch, dtype)]
            assert r["loss"] <= tol and r["grad"] <= tol, (dtype, r)
    assert {k[0] for k in worst} == {"ppo", "gspo"}


def test_verl_agreement_table(verl, request):
    seeds = request.config.getoption("--agreement-seeds")
    worst = defaultdict(lambda: dict(loss=0.0, rel=0.0, grad=0.0, metric=0.0, bitwise=0, cases=0))
    for index, mode in enumerate(verl_cases.MODES):
        ours_fn = verl.core_algos.get_policy_loss_fn(f"rk_{mode}")
        theirs_fn = verl.core_algos.get_policy_loss_fn(mode)
        for dtype in DTYPES:
            for agg in verl_cases.AGGS:
                for info in verl_cases.INFOS.values():
                    config = verl_cases.actor_config(verl, info)
                    for layout in ("token", "seq"):
                        for seed in range(seeds):
                            batch = verl_cases.make_batch(10**6 + 97 * seed + index, advantages=layout,
                                                          dtype=dtype, B=B, T=T)  # fmt: skip
                            loss, metrics, grad = verl_cases.run(ours_fn, batch, agg, config)
                            ref, ref_metrics, ref_grad = verl_cases.run(theirs_fn, batch, agg, config)
                            row = worst[(mode, _name(dtype))]
                            diff = (loss - ref).abs().item()
                            row["loss"] = max(row["loss"], diff)
                            row["rel"] = max(row["rel"], diff / max(ref.abs().item(), 1.0))
                            row["grad"] = max(row["grad"], (grad - ref_grad).abs().max().item())
                            assert list(metrics) == list(ref_metrics), mode
                            for name, value in ref_metrics.items():
                                row["metric"] = max(row["metric"], abs(metrics[name] - value))
                            row["bitwise"] += int(torch.equal(loss, ref) and torch.equal(grad, ref_grad))
                            row["cases"] += 1
    print(f"\nverl agreement, {seeds} seed(s) per case, [{B}, {T}]")
    print("| mode | dtype | max |Δloss| | max |Δloss| / max(1, |loss|) | max |Δ∂loss/∂log_prob| "
          "| max |Δmetric| | bitwise loss and gradient |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for (mode, dtype), r in worst.items():
        print(f"| {mode} | {dtype} | {r['loss']:.1e} | {r['rel']:.1e} | {r['grad']:.1e} | "
              f"{r['metric']:.1e} | {r['bitwise']} / {r['cases']} |")  # fmt: skip
    # The page: the gradients bitwise or to ~1e-9, the losses to a few float32 roundings of their sums.
    for (mode, dtype), r in worst.items():
        fp32 = dtype == "float32"
        assert r["rel"] <= (1e-5 if fp32 else 1e-13), (mode, dtype, r)
        assert r["grad"] <= (1e-8 if fp32 else 1e-15), (mode, dtype, r)
        assert r["metric"] <= 1e-6, (mode, dtype, r)
    assert {k[0] for k in worst} == set(verl_cases.MODES)
