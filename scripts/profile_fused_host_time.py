"""Host time of one ``fused_policy_loss`` fwd+bwd call (DAPO + k3 KL, GSPO), on a CUDA machine.

    PYTHONPATH=src python3 scripts/profile_fused_host_time.py head            # the timings
    PYTHONPATH=src python3 scripts/profile_fused_host_time.py head --profile  # + cProfile, tiny size
    PYTHONPATH=old/src python3 scripts/profile_fused_host_time.py base        # an A/B: another tree

Per size and ``validate``: the median host time of a call (``perf_counter`` around the call, the
queue drained before each), and the time per call of back-to-back calls. At small sizes the GPU
work is tiny, so the first number is the Python/launch cost of the call. The logits are a view
``logits[:, :-1]`` of a ``[B, T + 1, V]`` bf16 tensor, as a trainer slices them.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import time

import torch

import rlkernel as rk

DEV = "cuda"


def _inputs(b: int, t: int, v: int):
    g = torch.Generator().manual_seed(0)
    return dict(
        logits=torch.randn(b, t + 1, v, generator=g).to(DEV, torch.bfloat16).requires_grad_(True),
        ids=torch.randint(0, v, (b, t), generator=g).to(DEV),
        mask=(torch.rand(b, t, generator=g) > 0.1).to(DEV),
        old=(-torch.rand(b, t, generator=g)).to(DEV),
        ref=(-torch.rand(b, t, generator=g)).to(DEV),
        adv=torch.randn(b, generator=g).to(DEV),
    )


def _step_fn(preset: str, x: dict, validate: bool, fusion: bool = True):
    cfg = rk.PolicyLossConfig.preset(preset)
    if preset == "dapo":
        cfg = dataclasses.replace(cfg, kl_coef=1e-3, kl_estimator="k3")

    def step():
        with rk.use_options(token_level_fusion=fusion):
            out = rk.fused_policy_loss(
                cfg,
                logits=x["logits"][:, :-1],
                token_ids=x["ids"],
                old_logp=x["old"],
                advantages=x["adv"],
                mask=x["mask"],
                ref_logp=x["ref"],
                validate=validate,
            )
        out.loss.backward()

    return step


def time_call(step, iters: int = 300) -> tuple[float, float]:
    """(median host ms of an isolated call, ms per call back to back)."""
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    host = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return statistics.median(host) * 1e3, (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("label", help="a name for this tree in the output (e.g. base, head)")
    parser.add_argument("--profile", action="store_true", help="also cProfile 200 tiny calls")
    parser.add_argument("--composed", action="store_true", help="also token_level_fusion=False rows")
    args = parser.parse_args()
    sizes = ((4, 64, 1024), (8, 1024, 151936))
    inputs = {size: _inputs(*size) for size in sizes}
    for preset in ("dapo", "gspo"):
        for fusion in (True, False) if args.composed else (True,):
            for validate in (True, False):
                for b, t, v in sizes:
                    host, piped = time_call(_step_fn(preset, inputs[b, t, v], validate, fusion), iters=100)
                    name = preset + ("" if fusion else "-composed")
                    print(
                        f"{args.label:5s} {name:14s} validate={validate!s:5s} N={b * t:5d} V={v:6d}: "
                        f"host {host:6.3f} ms/call, back-to-back {piped:6.3f} ms/call",
                        flush=True,
                    )
    for preset in ("dapo", "gspo") if args.profile else ():
        step = _step_fn(preset, inputs[sizes[0]], validate=True)
        time_call(step, iters=20)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
