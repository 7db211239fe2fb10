"""Time and peak memory of the fused LM head with and without ``invariant=True`` (CUDA).

    PYTHONPATH=src python3 scripts/profile_invariant_head.py

N = 8192 tokens (10 % ignored), H = 4096, V = 151,936, bf16, trainable weight: ``linear_token_logprobs``
(+ entropy) forward + backward, and ``fused_policy_loss(hidden=...)`` DAPO + k3 KL forward +
backward, each with ``invariant`` False / True (bf16 logits) / True with fp32 logits. Median of 5
isolated calls (CUDA events) after 2 warm-up calls.
"""

import dataclasses
import statistics

import torch

import rlkernel as rk

N, H, V = 8192, 4096, 151936


def timed(fn, reps: int = 5) -> tuple[float, float]:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts), (torch.cuda.max_memory_allocated() - before) / 2**30


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, H, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    w = torch.randn(V, H, device="cuda", generator=g, dtype=torch.bfloat16).mul_(H**-0.5).requires_grad_(True)
    ids = torch.randint(0, V, (N,), device="cuda", generator=g)
    ids[torch.rand(N, device="cuda", generator=g) < 0.1] = -100
    b = 8
    mask = (ids != -100).view(b, -1)
    old = -torch.rand(b, N // b, device="cuda", generator=g) * 5
    adv = torch.randn(b, device="cuda", generator=g)
    cfg = dataclasses.replace(rk.PolicyLossConfig.preset("dapo"), kl_coef=1e-3)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; N={N} H={H} V={V} bf16")
    for name, kw in (("default", {}), ("invariant bf16", dict(invariant=True)),
                     ("invariant fp32", dict(invariant=True, logits_dtype=torch.float32))):  # fmt: skip
        def prim(kw=kw):
            logp, ent = rk.linear_token_logprobs(h, w, ids, return_entropy=True, **kw)
            (logp.sum() + ent.sum()).backward()
            h.grad = w.grad = None

        def loss(kw=kw):
            batch = dict(token_ids=ids.view(b, -1), old_logp=old, ref_logp=old, advantages=adv, mask=mask)
            out = rk.fused_policy_loss(cfg, hidden=h.view(b, -1, H), weight=w, **batch, **kw)
            out.loss.backward()
            h.grad = w.grad = None

        runs = (("linear_token_logprobs+entropy fwd+bwd", prim), ("fused_policy_loss DAPO fwd+bwd", loss))
        for label, fn in runs:
            ms, gb = timed(fn)
            print(f"{label:40s} {name:15s} {ms:8.2f} ms  peak extra {gb:5.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
