"""The rule behind the option ``grad_in_forward_max_vocab``: DAPO + k3 KL fwd+bwd with the 2-pass
gradient-in-forward path against the 3-pass path, across vocabulary sizes, on a CUDA machine.

    PYTHONPATH=src python3 scripts/sweep_grad_in_forward.py [repeats [V ...]]

The trainer's call: logits = ``out[:, P - 1 : -1]`` of a ``[B, P + T, V]`` bf16 output requiring
grad (B = 8, P = 128, T = 1024: N = 8192 scored tokens, 10 % masked), default arguments. Per V and
path: isolated (CUDA events around one call, median of 20) and back-to-back (20 calls, one sync)
milliseconds, and the peak memory beyond the inputs.
"""

import dataclasses
import statistics

import torch

import rlkernel as rk

B, P, T = 8, 128, 1024
CFG = dataclasses.replace(rk.PolicyLossConfig.preset("dapo"), kl_coef=1e-3, kl_estimator="k3")


def measure(vocab: int, two_pass: bool) -> tuple[float, float, float]:
    g = torch.Generator(device="cuda").manual_seed(vocab)
    base = torch.randn(B, P + T, vocab, device="cuda", generator=g).mul_(2).to(torch.bfloat16)
    base.requires_grad_(True)
    ids = torch.randint(0, vocab, (B, T), device="cuda", generator=g)
    mask = torch.rand(B, T, device="cuda", generator=g) > 0.1
    old = -torch.rand(B, T, device="cuda", generator=g)
    ref = -torch.rand(B, T, device="cuda", generator=g)
    adv = torch.randn(B, device="cuda", generator=g)
    opts = dict(grad_in_forward_max_vocab=1 << 30 if two_pass else 0)

    def step():
        with rk.use_options(**opts):
            out = rk.fused_policy_loss(CFG, logits=base[:, P - 1 : -1], token_ids=ids, old_logp=old,
                                       advantages=adv, mask=mask, ref_logp=ref)  # fmt: skip
        out.loss.backward()
        base.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    iso = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        iso.append(s.elapsed_time(e))
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        step()
    e.record()
    torch.cuda.synchronize()
    return statistics.median(iso), s.elapsed_time(e) / 20, peak


def best(vocab: int, repeats: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(3-pass, 2-pass): per column the minimum over ``repeats`` alternating measurements (each a
    median or a mean of 20 calls)."""
    runs = [(measure(vocab, False), measure(vocab, True)) for _ in range(repeats)]
    return tuple(tuple(min(r[k][i] for r in runs) for i in range(3)) for k in range(2))


def main() -> None:
    import sys

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    vocabs = [int(v) for v in sys.argv[2:]] or [8192, 16384, 32768, 65536, 100000, 131072, 151936]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; DAPO+k3 KL, sliced logits, "
          f"N = {B * T}; best of {repeats} (3-pass and 2-pass alternate)")  # fmt: skip
    print("      V | 3-pass iso  b2b   peak | 2-pass iso  b2b   peak | 2-pass / 3-pass (b2b)")
    for vocab in vocabs:
        r3, r2 = best(vocab, repeats)
        row = " | ".join(f"{r[0]:6.2f} {r[1]:6.2f} {r[2]:5.2f}" for r in (r3, r2))
        print(f"{vocab:7d} | {row} | {r2[1] / r3[1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
