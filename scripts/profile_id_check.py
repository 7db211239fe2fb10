"""Host time of the deferred token-id check, and of a fused forward with and without it (CUDA).

    PYTHONPATH=src python3 scripts/profile_id_check.py

Per line: microseconds of host time per call (``perf_counter`` over 1000 calls after 50 warm-up
calls, the queue drained around the loop): ``check_token_ids`` (one Triton launch, a clone, a
non-blocking copy to pinned memory, an event), the kernel's launcher alone, and
``fused_policy_loss`` (DAPO + k3 KL, forward only) with ``validate`` True and False.
"""

import dataclasses
import time

import torch

import rlkernel as rk
from rlkernel.kernels.ids import bad_id_stats
from rlkernel.ops import id_checks


def host_us(name: str, fn, n: int = 1000) -> None:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:50s} {elapsed:8.1f} us/call host", flush=True)


def main() -> None:
    for n in (256, 8192):
        ids = torch.randint(0, 1000, (n,), device="cuda")
        active = torch.rand(n, device="cuda") > 0.1
        host_us(f"check_token_ids N={n}",
                lambda: id_checks.check_token_ids("x", ids, 1000, None, defer=True, active=active))  # noqa: B023
        host_us(f"bad_id_stats N={n}", lambda: bad_id_stats(ids, 1000, None, active))  # noqa: B023
    cfg = dataclasses.replace(rk.PolicyLossConfig.preset("dapo"), kl_coef=1e-3)
    for n, vocab in ((256, 1024), (8192, 32768)):
        b, t = 8, n // 8
        x = torch.randn(b, t + 1, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        ids = torch.randint(0, vocab, (b, t), device="cuda")
        mask = torch.rand(b, t, device="cuda") > 0.1
        old = -torch.rand(b, t, device="cuda")
        adv = torch.randn(b, device="cuda")
        for validate in (True, False):
            kw = dict(token_ids=ids, old_logp=old, ref_logp=old, advantages=adv, mask=mask, validate=validate)
            host_us(f"fused fwd only N={n} V={vocab} validate={validate}",
                    lambda kw=kw, x=x: rk.fused_policy_loss(cfg, logits=x[:, :-1], **kw), n=300)
    rk.raise_pending_errors()


if __name__ == "__main__":
    main()
