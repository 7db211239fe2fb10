"""Host time of one fused_policy_loss DAPO+KL fwd+bwd call at small sizes (GPU time tiny), for the
src tree on sys.path[0]. Prints per-call host ms (no sync inside the timed loop except validate)."""
import sys, time, statistics
import torch
import rlkernel as rk

dev = "cuda"
def run(n_b, n_t, v, validate, cfg_name, iters=300):
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(n_b, n_t + 1, v, generator=g).to(dev, torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, v, (n_b, n_t), generator=g).to(dev)
    mask = (torch.rand(n_b, n_t, generator=g) > 0.1).to(dev)
    old = (-torch.rand(n_b, n_t, generator=g)).to(dev)
    ref = (-torch.rand(n_b, n_t, generator=g)).to(dev)
    adv = torch.randn(n_b, generator=g).to(dev)
    cfg = rk.PolicyLossConfig.preset(cfg_name)
    if cfg_name == "dapo":
        import dataclasses
        cfg = dataclasses.replace(cfg, kl_coef=1e-3, kl_estimator="k3")
    def step():
        lg = logits[:, :-1]
        out = rk.fused_policy_loss(cfg, logits=lg, token_ids=ids, old_logp=old, advantages=adv, mask=mask,
                                   ref_logp=ref, validate=validate)
        out.loss.backward()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    host = []
    for _ in range(iters):
        t0 = time.perf_counter(); step(); host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize(); pipelined = (time.perf_counter() - t0) / iters
    return statistics.median(host) * 1e3, pipelined * 1e3

for cfg_name in ("dapo", "gspo"):
    for validate in (True, False):
        for (b, t, v) in ((4, 64, 1024), (4, 1024, 151936)):
            h, p = run(b, t, v, validate, cfg_name)
            print(f"{sys.argv[1]:5s} {cfg_name} validate={validate!s:5s} N={b*t:5d} V={v:6d}: host {h:6.3f} ms/call, back-to-back {p:6.3f} ms/call", flush=True)

if len(sys.argv) > 2 and sys.argv[2] == "profile":
    import cProfile, pstats, io
    g = torch.Generator(device="cpu").manual_seed(0)
    b, t, v = 4, 64, 1024
    logits = torch.randn(b, t + 1, v, generator=g).to(dev, torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, v, (b, t), generator=g).to(dev)
    mask = (torch.rand(b, t, generator=g) > 0.1).to(dev)
    old = (-torch.rand(b, t, generator=g)).to(dev); ref = (-torch.rand(b, t, generator=g)).to(dev)
    adv = torch.randn(b, generator=g).to(dev)
    import dataclasses
    cfg = dataclasses.replace(rk.PolicyLossConfig.preset("dapo"), kl_coef=1e-3, kl_estimator="k3")
    def step():
        out = rk.fused_policy_loss(cfg, logits=logits[:, :-1], token_ids=ids, old_logp=old, advantages=adv,
                                   mask=mask, ref_logp=ref, validate=False)
        out.loss.backward()
    for _ in range(20): step()
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): step()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:6000])
