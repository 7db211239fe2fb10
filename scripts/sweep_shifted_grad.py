"""The shifted gradient kernel's rows per program and warps: ms, TB/s and bits at M = 2048, V = 151,936.

    PYTHONPATH=src python3 scripts/sweep_shifted_grad.py      (CUDA, TMA: sm90+)

Each (rows, warps) pair runs ``linear_head_grad_from_shifted`` on the same stored exponents 10 times
(CUDA events, median) and is compared bitwise with the first pair's output (an elementwise kernel:
the launch shape must not move a bit). The pairs repeat, to show the run's noise.
"""
import statistics

import torch

from rlkernel.kernels import linear_head as lh

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
m, hdim, v = 2048, 4096, 151936
h = torch.randn(m, hdim, device=dev, generator=g).bfloat16()
w = (torch.randn(v, hdim, device=dev, generator=g) / 64).bfloat16()
ids = torch.randint(0, v, (m,), device=dev, generator=g)
out = torch.empty(m, v, device=dev, dtype=torch.bfloat16)
logp, lse, ent, tmax = lh.linear_head_stats_shifted(h, w, ids, out, with_entropy=True)
keep = out.clone()
gl, ge = torch.randn(m, device=dev, generator=g), torch.randn(m, device=dev, generator=g)
orig = lh._launch_shifted_grad.__call__
ref = None
for rows, warps in [(16, 4), (16, 8), (8, 4), (16, 4), (16, 8), (8, 4), (8, 8)]:
    lh.SHIFTED_GRAD_ROWS = rows

    def call(grid, args, constexprs, options, _w=warps):
        return orig(grid, args, constexprs, {**options, "num_warps": _w})

    launcher = lh._launch_shifted_grad
    lh._launch_shifted_grad = call
    times = []
    for i in range(12):
        out.copy_(keep)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        lh.linear_head_grad_from_shifted(out, tmax, ids, lse, ent, gl, ge)
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e))
    lh._launch_shifted_grad = launcher
    ms = statistics.median(times)
    same = "ref" if ref is None else ("bitwise" if torch.equal(out, ref) else "DIFFERENT")
    if ref is None:
        ref = out.clone()
    print(f"rows {rows:3d} warps {warps}: {ms:.3f} ms  {m * v * 4 / ms / 1e9:.2f} TB/s  {same}")
