"""GPU check of rlkernel.invariant.attention: invariance, accuracy, backward, timings vs SDPA.

    PYTHONPATH=src python3 scripts/gpu_check_attention.py            # H100, bf16, ~1 minute
    PYTHONPATH=src python3 scripts/gpu_check_attention.py --smoke    # CPU interpreter, tiny sizes

The kernel runs a one-level online softmax over key blocks (BLOCK_N = 64) anchored at each
sequence's first real key, prefill tile BLOCK_M = 64 / 4 warps (head_dim 128, bf16); decode uses the
prefill tile (``DECODE_TILES`` is empty: no smaller tile passed the full check). A split-KV variant
was tried on 2026-11-21 and removed (benchmarks/NOTES.md).

Sections (each one runs on its own: an exception prints FAIL with the traceback's last lines and
the next section runs):
  1. invariance (torch.equal), for (Hq, Hkv) = (32, 8) and (16, 8), head_dim 128, bf16: one
     sequence's rows alone (batch 1) vs in a right-padded batch of 32 vs a left-padded batch of 32
     (key_start) vs packed (cu_seqlens) vs chunked prefill vs KV-cache decode at batch 1 and 32
     (left-padded cache, as HF generate() builds it); and through the HF adapter's layout
     ([B, H, T, D] tensors transposed, strided reads). Sequences up to 2600 keys.
  2. the same through the transformers adapter (HF masks, [B, H, T, D] tensors): left-padded decode
     at batch 5 vs right-padded prefill, 1, 2, 3 and 5 steps back (the case that failed with the
     removed split-KV variant), lengths up to 2600.
  3. decode tile == prefill tile (PASS/FAIL): the production decode tile (``launch_config`` at one
     query) gives the prefill configuration's bits at several positions and batch sizes. INFO: the
     other decode BLOCK_M candidates; the new prefill tile vs the former BM = 128 / 8 warps.
  4. accuracy vs an fp32 SDPA (math) oracle, next to bf16 SDPA's own error.
  5. backward vs fp32 SDPA autograd (relative error of dq, dk, dv) and determinism (two runs equal).
  6. timings (CUDA events, median of 20 after warmup) vs torch SDPA (flash backend): prefill
     forward B=8,T=2048 and B=1,T=8192 (also in the HF layout); forward+backward; decode step
     B = 1, 8, 16, 32, 64, cache 4096; prefill at the former tile (BM=128/w8) and BM=64/w8.
Ends with one table. Exit code 0 iff no FAIL/ERROR.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["RLKERNEL_BACKEND"] = "triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rlkernel.invariant.attention import attention  # noqa: E402
from rlkernel.kernels import attention as kern  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float32 if SMOKE else torch.bfloat16
D = 16 if SMOKE else 128
HEADS = [(4, 2)] if SMOKE else [(32, 8), (16, 8)]
RESULTS: list[tuple[str, str, str]] = []
TIMES: list[tuple[str, float, float, str]] = []


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def section(name: str, info: bool = False):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
            status = "INFO" if info else ("PASS" if ok else "FAIL")
        except Exception as exc:
            status, detail = ("INFO" if info else "FAIL"), f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(limit=4)
        RESULTS.append((status, name, f"{detail}  [{time.perf_counter() - t0:.1f} s]"))
        print(f"{status:5s} {name}: {detail}", flush=True)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return fn

    return wrap


def rand(*shape, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32).to(DTYPE)


def bench(fn, reps=20, warmup=5) -> float:
    """Median milliseconds of ``fn()`` (CUDA events; wall clock in smoke mode)."""
    if SMOKE:
        reps, warmup = 1, 0
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if DEV.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def sdpa(q, k, v, causal):
    """torch SDPA on [B, T, H, D] inputs (flash backend on the GPU), GQA by repeating K/V heads."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    if group > 1:
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def flash_ctx():
    if DEV.type != "cuda":
        import contextlib

        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


# ---------------------------------------------------------------------------------- invariance
def invariance(hq: int, hkv: int):
    n_seq = 4 if SMOKE else 32
    max_len = 70 if SMOKE else 2600
    g = torch.Generator().manual_seed(hq)
    lens = torch.randint(max_len // 4, max_len + 1, (n_seq,), generator=g).tolist()
    lens[0] = max_len
    seqs = [
        (rand(t, hq, D, seed=3 * i), rand(t, hkv, D, seed=3 * i + 1), rand(t, hkv, D, seed=3 * i + 2))
        for i, t in enumerate(lens)
    ]
    total = max(lens)
    check_ids = [0, 1, n_seq - 1]
    fails = []

    def pad(parts, side):
        out = torch.randn(len(parts), total, *parts[0].shape[1:], device=DEV).to(DTYPE)  # junk padding
        for i, p in enumerate(parts):
            if side == "left":
                out[i, total - p.shape[0] :] = p
            else:
                out[i, : p.shape[0]] = p
        return out

    alone = {i: attention(*(x[None] for x in seqs[i]))[0] for i in check_ids}
    right = attention(*(pad([s[j] for s in seqs], "right") for j in range(3)))
    starts = torch.tensor([total - t for t in lens], device=DEV)
    left = attention(*(pad([s[j] for s in seqs], "left") for j in range(3)), key_start=starts)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
    packed = attention(*(torch.cat([s[j] for s in seqs]) for j in range(3)), cu_seqlens_q=cu, cu_seqlens_k=cu)
    # HF layout: [B, H, T, D] storage read through transposed views
    hf = attention(
        *(pad([s[j] for s in seqs], "right").transpose(1, 2).contiguous().transpose(1, 2) for j in range(3))
    )
    for i in check_ids:
        t = lens[i]
        for name, rows in (
            ("right-padded batch", right[i, :t]),
            ("left-padded batch", left[i, total - t :]),
            ("packed", packed[cu[i] : cu[i + 1]]),
            ("HF strided layout", hf[i, :t]),
        ):
            if not torch.equal(rows, alone[i]):
                fails.append(f"seq{i} {name}")
        q, k, v = seqs[i]
        step = max(1, t // 3)
        chunks = [
            attention(q[None, a : a + step], k[None, : a + step], v[None, : a + step])[0]
            for a in range(0, t, step)
        ]
        if not torch.equal(torch.cat(chunks), alone[i]):
            fails.append(f"seq{i} chunked")
        for pos in sorted({0, 63, 64, t // 2, 1023, 1024, t - 1}):
            pos = min(pos, t - 1)
            d1 = attention(q[None, pos : pos + 1], k[None, : pos + 1], v[None, : pos + 1])[0, 0]
            if not torch.equal(d1, alone[i][pos]):
                fails.append(f"seq{i} decode b1 pos{pos}")
    # decode at batch n_seq: every sequence's token at (its length − back), cache left-padded
    for back in (1, 2, 3, 5):
        width = total - back + 1
        cut = [[x[: t - back + 1] for x in s] for s, t in zip(seqs, lens, strict=True)]
        cache_k = torch.zeros(n_seq, width, hkv, D, device=DEV, dtype=DTYPE)
        cache_v = torch.zeros_like(cache_k)
        qd = torch.empty(n_seq, 1, hq, D, device=DEV, dtype=DTYPE)
        ks = []
        for i, (q, k, v) in enumerate(cut):
            n = k.shape[0]
            cache_k[i, width - n :], cache_v[i, width - n :], qd[i, 0] = k, v, q[-1]
            ks.append(width - n)
        out = attention(qd, cache_k, cache_v, key_start=torch.tensor(ks, device=DEV))
        for i in check_ids:
            if not torch.equal(out[i, 0], right[i, lens[i] - back]):
                fails.append(f"seq{i} decode b{n_seq} back{back}")
    return not fails, "all equal" if not fails else "NOT equal: " + ", ".join(fails[:8])


def decode_tile_check():
    """The production decode tile (``launch_config`` at one query per sequence) reproduces the
    prefill configuration's bits: at batch 1 and 8, several positions. PASS/FAIL."""
    hq, hkv = HEADS[0]
    t = 64 if SMOKE else 1500
    q, k, v = rand(2, t, hq, D), rand(2, t, hkv, D, seed=1), rand(2, t, hkv, D, seed=2)
    base = kern.fwd_config(D, DTYPE)
    tile = kern.launch_config(D, DTYPE, hq // hkv)
    full, lse = kern.attention_fwd(q, k, v, scale=D**-0.5)
    bad = []
    for pos in sorted({min(p, t - 1) for p in (0, 63, 64, t // 2, t - 2, t - 1)}):
        step, step_lse = kern.attention_fwd(
            q[:, pos : pos + 1], k[:, : pos + 1], v[:, : pos + 1], scale=D**-0.5
        )
        if not torch.equal(step[:, 0], full[:, pos]):
            bad.append(f"pos{pos}")
        want_lse = lse.view(hq, 2, t)[:, :, pos]
        if not torch.equal(step_lse.view(hq, 2), want_lse):
            bad.append(f"pos{pos} lse")
    detail = f"prefill {base}; decode {tile}"
    return not bad, detail + ("; equal" if not bad else "; NOT equal: " + ", ".join(bad))


def decode_block_m_info():
    """Would decode with another BLOCK_M reproduce the prefill bits? And the new prefill tile vs
    the former BM = 128 / 8 warps (INFO: informs the tiles)."""
    hq, hkv = HEADS[0]
    t = 64 if SMOKE else 1000
    q, k, v = rand(1, t, hq, D), rand(1, t, hkv, D, seed=1), rand(1, t, hkv, D, seed=2)
    base = kern.fwd_config(D, DTYPE)
    full, _ = kern.attention_fwd(q, k, v, scale=D**-0.5)
    lines = []
    for bm, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8)):
        cfg = kern.FwdConfig(bm, base.block_n, warps, base.num_stages)
        ok = True
        for pos in (t - 1, t // 2):
            step, _ = kern.attention_fwd(
                q[:, pos : pos + 1], k[:, : pos + 1], v[:, : pos + 1], scale=D**-0.5, config=cfg
            )
            ok &= torch.equal(step[0, 0], full[0, pos])
        lines.append(f"BM={bm}/w{warps}: {'equal' if ok else 'differs'}")
    prefill = []
    for bm, warps in ((128, 8), (64, 8), (128, 4)):
        cfg = kern.FwdConfig(bm, base.block_n, warps, base.num_stages)
        got, _ = kern.attention_fwd(q, k, v, scale=D**-0.5, config=cfg)
        prefill.append(f"BM={bm}/w{warps} {'equal' if torch.equal(got, full) else 'differs'}")
    return True, (
        f"prefill config {base}; decode with "
        + "; ".join(lines)
        + "; prefill tiles vs default: "
        + ", ".join(prefill)
    )


def adapter_invariance():
    """Through the transformers adapter (masks as transformers builds them, [B, H, T, D] tensors):
    left-padded batch decode == right-padded batch prefill, row for row."""
    from rlkernel.invariant.hf_attention import hf_attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    hq, hkv = HEADS[0]
    lens = [12, 40, 27] if SMOKE else [300, 1200, 777, 1024, 2600]
    total, n = max(lens), len(lens)
    seqs = [
        (rand(hq, t, D, seed=5 * i), rand(hkv, t, D, seed=5 * i + 1), rand(hkv, t, D, seed=5 * i + 2))
        for i, t in enumerate(lens)
    ]

    def stack(parts, width, side):
        out = torch.randn(n, parts[0].shape[0], width, D, device=DEV).to(DTYPE)
        for i, x in enumerate(parts):
            if side == "left":
                out[i, :, width - x.shape[1] :] = x
            else:
                out[i, :, : x.shape[1]] = x
        return out

    def mask(valid, tq, tk):
        keys = torch.arange(tk, device=DEV)
        causal = keys[None, :] <= (tk - tq + torch.arange(tq, device=DEV))[:, None]
        return (causal[None] & valid[:, None, :])[:, None]

    valid = torch.stack([torch.arange(total, device=DEV) < t for t in lens])
    qkv = [stack([x[j] for x in seqs], total, "right") for j in range(3)]
    right = hf_attention_forward(Module(), *qkv, mask(valid, total, total))[0]
    fails = []
    for back in (1, 2, 3, 5):
        width = total - back + 1
        parts = [[x[:, : t - back + 1] for x in s] for s, t in zip(seqs, lens, strict=True)]
        q, k, v = (stack([p[j] for p in parts], width, "left") for j in range(3))
        valid = torch.stack([torch.arange(width, device=DEV) >= width - (t - back + 1) for t in lens])
        out = hf_attention_forward(Module(), q[:, :, -1:], k, v, mask(valid, 1, width))[0]
        for i, t in enumerate(lens):
            if not torch.equal(out[i, 0], right[i, t - back]):
                fails.append(f"seq{i} back{back}")
    return not fails, "all equal" if not fails else "NOT equal: " + ", ".join(fails)


# ------------------------------------------------------------------------------------ accuracy
def accuracy(hq: int, hkv: int):
    b, t = (2, 40) if SMOKE else (4, 2048)
    q, k, v = rand(b, t, hq, D), rand(b, t, hkv, D, seed=1), rand(b, t, hkv, D, seed=2)
    oracle = sdpa(q.float(), k.float(), v.float(), True)
    ours = attention(q, k, v).float()
    with flash_ctx():
        theirs = sdpa(q, k, v, True).float()
    err_ours = (ours - oracle).abs().max().item()
    err_sdpa = (theirs - oracle).abs().max().item()
    ok = err_ours <= 2 * err_sdpa + 1e-3
    return ok, f"max|ours − fp32| = {err_ours:.2e}, max|SDPA bf16 − fp32| = {err_sdpa:.2e}"


def backward(hq: int, hkv: int):
    b, t = (2, 40) if SMOKE else (2, 2048)
    q, k, v = rand(b, t, hq, D), rand(b, t, hkv, D, seed=1), rand(b, t, hkv, D, seed=2)
    g = rand(b, t, hq, D, seed=3)

    def grads(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        fn(*leaves).backward(g.to(dtype))
        return [x.grad.float() for x in leaves]

    want = grads(lambda a, b_, c: sdpa(a, b_, c, True), torch.float32)
    got = grads(attention, DTYPE)
    again = grads(attention, DTYPE)
    with flash_ctx():
        theirs = grads(lambda a, b_, c: sdpa(a, b_, c, True), DTYPE)
    rel = [((a - w).norm() / w.norm()).item() for a, w in zip(got, want, strict=True)]
    rel_sdpa = [((a - w).norm() / w.norm()).item() for a, w in zip(theirs, want, strict=True)]
    deterministic = all(torch.equal(a, b_) for a, b_ in zip(got, again, strict=True))
    ok = deterministic and all(r <= max(2 * s, 1e-2) for r, s in zip(rel, rel_sdpa, strict=True))
    names = ("dq", "dk", "dv")
    detail = ", ".join(f"{n} {r:.1e} (sdpa {s:.1e})" for n, r, s in zip(names, rel, rel_sdpa, strict=True))
    return ok, f"rel err vs fp32: {detail}; two runs equal: {deterministic}"


# ------------------------------------------------------------------------------------- timings
def sdpa_baseline(q, k, v, causal):
    """The fastest SDPA call HF would make, timed without layout copies: ``[B, H, T, D]``
    tensors, flash backend, GQA through ``enable_gqa`` when this torch supports it with flash, else
    K/V heads expanded beforehand (outside the timed region). Returns ``(fn, args, label)``."""
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    try:
        with flash_ctx():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)

        def gqa(a, b_, c):
            return F.scaled_dot_product_attention(a, b_, c, is_causal=causal, enable_gqa=True)

        return gqa, (qt, kt, vt), "flash, enable_gqa"
    except Exception:
        group = q.shape[2] // k.shape[2]
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)

        def full(a, b_, c):
            return F.scaled_dot_product_attention(a, b_, c, is_causal=causal)

        return full, (qt, kt, vt), "flash, K/V pre-expanded"


def fwd_bwd(fn, args, grad):
    leaves = [x.detach().requires_grad_(True) for x in args]

    def run():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(grad)

    return run


def time_prefill(hq: int, hkv: int, b: int, t: int) -> None:
    q, k, v = rand(b, t, hq, D), rand(b, t, hkv, D, seed=1), rand(b, t, hkv, D, seed=2)
    g = rand(b, t, hq, D, seed=3)
    fn, args, label = sdpa_baseline(q, k, v, True)
    ours = bench(lambda: attention(q, k, v))
    with flash_ctx():
        ref = bench(lambda: fn(*args))
    TIMES.append((f"prefill fwd B={b} T={t}", ours, ref, label))
    # the patched HF model's call: [B, H, T, D] storage read through transposed views
    hf = [x.transpose(1, 2) for x in args[:1]] + [
        x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v)
    ]
    TIMES.append((f"prefill fwd B={b} T={t} HF layout", bench(lambda: attention(*hf)), ref, label))
    ours = bench(fwd_bwd(attention, (q, k, v), g))
    with flash_ctx():
        ref = bench(fwd_bwd(fn, args, g.transpose(1, 2).contiguous()))
    TIMES.append((f"prefill fwd+bwd B={b} T={t}", ours, ref, label))


def time_decode(hq: int, hkv: int, b: int, cache: int) -> None:
    q = rand(b, 1, hq, D)
    k, v = rand(b, cache, hkv, D, seed=1), rand(b, cache, hkv, D, seed=2)
    starts = torch.zeros(b, dtype=torch.long, device=DEV)
    fn, args, label = sdpa_baseline(q, k, v, False)
    with flash_ctx():
        ref = bench(lambda: fn(*args))
    ours = bench(lambda: attention(q, k, v, key_start=starts))
    TIMES.append((f"decode B={b} cache={cache}", ours, ref, label))


def timings():
    hq, hkv = HEADS[0]
    for b, t in [(1, 64)] if SMOKE else [(8, 2048), (1, 8192)]:
        time_prefill(hq, hkv, b, t)
    cache = 64 if SMOKE else 4096
    for b in (1, 4) if SMOKE else (1, 8, 16, 32, 64):
        time_decode(hq, hkv, b, cache)
    return True, f"{len(TIMES)} timings"


def prefill_tile_info():
    """Prefill forward at other tiles (INFO: the default is what sections 1-3 checked)."""
    hq, hkv = HEADS[0]
    b, t = (1, 64) if SMOKE else (8, 2048)
    q, k, v = rand(b, t, hq, D), rand(b, t, hkv, D, seed=1), rand(b, t, hkv, D, seed=2)
    fn, args, label = sdpa_baseline(q, k, v, True)
    with flash_ctx():
        ref = bench(lambda: fn(*args))
    base = kern.fwd_config(D, DTYPE)
    TIMES.append((f"prefill fwd B={b} T={t} default {base.block_m}/w{base.num_warps}",
                  bench(lambda: kern.attention_fwd(q, k, v, scale=D**-0.5)), ref, label))  # fmt: skip
    for bm, warps in ((16, 4),) if SMOKE else ((128, 8), (64, 8)):
        cfg = kern.FwdConfig(bm, base.block_n, warps, base.num_stages)
        ms = bench(lambda cfg=cfg: kern.attention_fwd(q, k, v, scale=D**-0.5, config=cfg))
        TIMES.append((f"prefill fwd B={b} T={t} BM={bm}/w{warps}", ms, ref, label))
    return True, f"default {base}; rows 'prefill fwd ... BM=' in the table"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    parser.parse_args()
    print(
        f"device: {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'cpu (interpreter)'}; "
        f"torch {torch.__version__}; dtype {DTYPE}; head_dim {D}"
    )
    for hq, hkv in HEADS:
        section(f"invariance Hq={hq} Hkv={hkv}")(lambda hq=hq, hkv=hkv: invariance(hq, hkv))
    section("HF adapter decode vs prefill")(adapter_invariance)
    section("decode tile == prefill tile")(decode_tile_check)
    section("decode/prefill tile alternatives", info=True)(decode_block_m_info)
    for hq, hkv in HEADS:
        section(f"accuracy vs SDPA Hq={hq} Hkv={hkv}")(lambda hq=hq, hkv=hkv: accuracy(hq, hkv))
        section(f"backward vs SDPA Hq={hq} Hkv={hkv}")(lambda hq=hq, hkv=hkv: backward(hq, hkv))
    section("timings")(timings)
    section("prefill tile timings", info=True)(prefill_tile_info)

    print("\n==== rlkernel attention GPU check ====")
    for status, name, detail in RESULTS:
        print(f"{status:5s} {name:34s} {detail}")
    title = f"workload (Hq={HEADS[0][0]} Hkv={HEADS[0][1]} D={D})"
    print(f"\n{title:40s} {'ours ms':>9s} {'SDPA ms':>9s} {'ratio':>7s}  SDPA call")
    for name, ours, ref, label in TIMES:
        print(f"{name:40s} {ours:9.3f} {ref:9.3f} {ours / ref:7.2f}  {label}")
    bad = [r for r in RESULTS if r[0] == "FAIL"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
