"""``rlkernel.invariant.attention`` at real sizes on the GPU: bitwise batch invariance in every layout
a rollout or a trainer uses, the transformers adapter, the decode tile, accuracy and backward
against SDPA.

Shapes: bf16, head_dim 128, (Hq, Hkv) ∈ {(32, 8), (16, 8)} (GQA groups of 4 and 2); 32 sequences of
lengths uniform in [650, 2600] (the first one 2600: several 64-key blocks, partial last blocks).
Padding positions hold random values (never zeros), so a kernel that read them would show.

Invariance (``torch.equal``): one sequence's rows computed alone (batch 1) equal its rows in a
right-padded batch, a left-padded batch (``key_start``), the packed form (``cu_seqlens``), HF's
``[B, H, T, D]`` layout read through transposed views, a chunked prefill, and decode steps against a
KV cache at batch 1 and at batch 32 (left-padded cache, as HF ``generate()`` builds it).

Accuracy: max |out − fp32 SDPA| at most 2× bf16 SDPA's own error (+ 1e-3); backward ‖Δ‖/‖ref‖ of
dq, dk, dv at most max(2× bf16 SDPA's, 1e-2) against fp32 SDPA autograd, and bitwise equal twice.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import rlkernel as rk
from rlkernel.invariant import attention
from rlkernel.kernels import attention as kern

from .conftest import DEVICE, ON_GPU, SIZES, generator, rel_err

pytestmark = pytest.mark.gpu

S = SIZES.attention
D = S.head_dim
DTYPE = S.dtype
HEAD_IDS = [f"Hq{hq}_Hkv{hkv}" for hq, hkv in S.heads]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=generator(seed), device=DEVICE, dtype=torch.float32).to(DTYPE)


def sdpa(q, k, v, causal):
    """torch SDPA on ``[B, T, H, D]`` inputs, GQA by repeating the K/V heads."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    if group > 1:
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def flash_only():
    """SDPA's FlashAttention backend on the GPU (the bf16 baseline users get)."""
    if not ON_GPU:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


# ------------------------------------------------------------------------------------- invariance
@pytest.fixture(scope="module", params=S.heads, ids=HEAD_IDS)
def batch(request):
    """The sequences of one head configuration, the rows of three of them computed alone, and the
    right-padded batch (the prefill the decode steps are compared with)."""
    hq, hkv = request.param
    g = torch.Generator().manual_seed(hq)
    lens = torch.randint(S.max_len // 4, S.max_len + 1, (S.n_seq,), generator=g).tolist()
    lens[0] = S.max_len
    seqs = [
        (rand(t, hq, D, seed=3 * i), rand(t, hkv, D, seed=3 * i + 1), rand(t, hkv, D, seed=3 * i + 2))
        for i, t in enumerate(lens)
    ]
    total = max(lens)

    def pad(parts, side, seed):
        out = rand(len(parts), total, *parts[0].shape[1:], seed=seed)  # random, never-zero padding
        for i, p in enumerate(parts):
            if side == "left":
                out[i, total - p.shape[0] :] = p
            else:
                out[i, : p.shape[0]] = p
        return out

    check_ids = sorted({0, 1, S.n_seq - 1})
    with rk.use_backend("triton"):
        alone = {i: attention(*(x[None] for x in seqs[i]))[0] for i in check_ids}
        right = attention(*(pad([s[j] for s in seqs], "right", 1000 + j) for j in range(3)))
    return SimpleNamespace(
        hq=hq,
        hkv=hkv,
        lens=lens,
        seqs=seqs,
        total=total,
        pad=pad,
        check_ids=check_ids,
        alone=alone,
        right=right,
    )


@pytest.mark.parametrize("layout", ["right_padded", "left_padded", "packed", "hf_strided"])
def test_batch_layouts_equal_the_sequence_alone(batch, layout):
    """A sequence's rows inside a 32-sequence batch, in each layout, equal its rows alone."""
    b = batch
    parts = [[s[j] for s in b.seqs] for j in range(3)]
    if layout == "right_padded":
        out = b.right
        rows = {i: out[i, : b.lens[i]] for i in b.check_ids}
    elif layout == "left_padded":
        starts = torch.tensor([b.total - t for t in b.lens], device=DEVICE)
        out = attention(*(b.pad(p, "left", 2000 + j) for j, p in enumerate(parts)), key_start=starts)
        rows = {i: out[i, b.total - b.lens[i] :] for i in b.check_ids}
    elif layout == "packed":
        cu = torch.tensor([0, *torch.tensor(b.lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
        out = attention(*(torch.cat(p) for p in parts), cu_seqlens_q=cu, cu_seqlens_k=cu)
        rows = {i: out[cu[i] : cu[i + 1]] for i in b.check_ids}
    else:  # HF's [B, H, T, D] storage read through transposed views
        hf = [
            b.pad(p, "right", 3000 + j).transpose(1, 2).contiguous().transpose(1, 2)
            for j, p in enumerate(parts)
        ]
        out = attention(*hf)
        rows = {i: out[i, : b.lens[i]] for i in b.check_ids}
    differ = [i for i in b.check_ids if not torch.equal(rows[i], b.alone[i])]
    assert not differ, f"sequences {differ} differ from their rows alone ({layout})"


def test_chunked_prefill_equals_the_sequence_alone(batch):
    """A prefill in three chunks (each chunk's queries against all keys so far) gives the rows of the
    one-shot prefill."""
    differ = []
    for i in batch.check_ids:
        q, k, v = batch.seqs[i]
        t = batch.lens[i]
        step = max(1, t // 3)
        chunks = [
            attention(q[None, a : a + step], k[None, : a + step], v[None, : a + step])[0]
            for a in range(0, t, step)
        ]
        if not torch.equal(torch.cat(chunks), batch.alone[i]):
            differ.append(i)
    assert not differ, f"sequences {differ}: chunked prefill differs"


def test_decode_at_batch_1_equals_prefill(batch):
    """One query against the KV cache up to its position (decode at batch 1) gives that position's
    prefill row, at block edges (63, 64, 1023, 1024), the middle and the end."""
    differ = []
    for i in batch.check_ids:
        q, k, v = batch.seqs[i]
        t = batch.lens[i]
        for pos in sorted({min(p, t - 1) for p in (*S.decode_positions, t // 2, t - 1)}):
            step = attention(q[None, pos : pos + 1], k[None, : pos + 1], v[None, : pos + 1])[0, 0]
            if not torch.equal(step, batch.alone[i][pos]):
                differ.append(f"seq{i}@{pos}")
    assert not differ, f"decode rows differ: {differ}"


@pytest.mark.parametrize("back", [1, 2, 3, 5])
def test_decode_in_left_padded_batch_equals_right_padded_prefill(batch, back):
    """Decode at batch 32: every sequence's token ``back`` steps from its end, against a left-padded
    KV cache (``key_start``; cache padding zero, as a fresh cache), equals its row of the
    right-padded prefill."""
    b = batch
    width = b.total - back + 1
    cache_k = torch.zeros(S.n_seq, width, b.hkv, D, device=DEVICE, dtype=DTYPE)
    cache_v = torch.zeros_like(cache_k)
    qd = torch.empty(S.n_seq, 1, b.hq, D, device=DEVICE, dtype=DTYPE)
    starts = []
    for i, ((q, k, v), t) in enumerate(zip(b.seqs, b.lens, strict=True)):
        n = t - back + 1
        cache_k[i, width - n :], cache_v[i, width - n :], qd[i, 0] = k[:n], v[:n], q[n - 1]
        starts.append(width - n)
    out = attention(qd, cache_k, cache_v, key_start=torch.tensor(starts, device=DEVICE))
    differ = [i for i in b.check_ids if not torch.equal(out[i, 0], b.right[i, b.lens[i] - back])]
    assert not differ, f"sequences {differ} differ"


@pytest.mark.parametrize("back", [1, 2, 3, 5])
def test_hf_adapter_left_padded_decode_equals_right_padded_prefill(back):
    """Through the transformers adapter (``[B, H, T, D]`` tensors, masks as transformers builds
    them): a left-padded batch decode step equals the right-padded prefill row (lengths 300 … 2600;
    the case that failed with the removed split-KV variant)."""
    from rlkernel.invariant.hf_attention import hf_attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    hq, hkv = S.heads[0]
    lens = S.adapter_lens
    total, n = max(lens), len(lens)
    seqs = [
        (rand(hq, t, D, seed=5 * i), rand(hkv, t, D, seed=5 * i + 1), rand(hkv, t, D, seed=5 * i + 2))
        for i, t in enumerate(lens)
    ]

    def stack(parts, width, side, seed):
        out = rand(n, parts[0].shape[0], width, D, seed=seed)
        for i, x in enumerate(parts):
            if side == "left":
                out[i, :, width - x.shape[1] :] = x
            else:
                out[i, :, : x.shape[1]] = x
        return out

    def mask(valid, tq, tk):
        keys = torch.arange(tk, device=DEVICE)
        causal = keys[None, :] <= (tk - tq + torch.arange(tq, device=DEVICE))[:, None]
        return (causal[None] & valid[:, None, :])[:, None]

    valid = torch.stack([torch.arange(total, device=DEVICE) < t for t in lens])
    qkv = [stack([x[j] for x in seqs], total, "right", 100 + j) for j in range(3)]
    right = hf_attention_forward(Module(), *qkv, mask(valid, total, total))[0]
    width = total - back + 1
    parts = [[x[:, : t - back + 1] for x in s] for s, t in zip(seqs, lens, strict=True)]
    q, k, v = (stack([p[j] for p in parts], width, "left", 200 + j) for j in range(3))
    valid = torch.stack([torch.arange(width, device=DEVICE) >= width - (t - back + 1) for t in lens])
    out = hf_attention_forward(Module(), q[:, :, -1:], k, v, mask(valid, 1, width))[0]
    differ = [i for i, t in enumerate(lens) if not torch.equal(out[i, 0], right[i, t - back])]
    assert not differ, f"sequences {differ} differ"


@pytest.mark.cpu_smoke
def test_decode_tile_gives_the_prefill_bits():
    """The production decode launch (``launch_config`` at one query per sequence) reproduces the
    prefill configuration's output and log-sum-exp bits at batch 2, at several positions."""
    hq, hkv = S.heads[0]
    t = S.tile_len
    q, k, v = rand(2, t, hq, D), rand(2, t, hkv, D, seed=1), rand(2, t, hkv, D, seed=2)
    full, lse = kern.attention_fwd(q, k, v, scale=D**-0.5)
    differ = []
    for pos in sorted({min(p, t - 1) for p in (0, 63, 64, t // 2, t - 2, t - 1)}):
        step, step_lse = kern.attention_fwd(
            q[:, pos : pos + 1], k[:, : pos + 1], v[:, : pos + 1], scale=D**-0.5
        )
        if not torch.equal(step[:, 0], full[:, pos]):
            differ.append(f"out@{pos}")
        if not torch.equal(step_lse.view(hq, 2), lse.view(hq, 2, t)[:, :, pos]):
            differ.append(f"lse@{pos}")
    tiles = f"prefill {kern.fwd_config(D, DTYPE)}, decode {kern.launch_config(D, DTYPE, hq // hkv)}"
    assert not differ, f"{tiles}: decode differs at {differ}"


# --------------------------------------------------------------------------------------- accuracy
@pytest.mark.cpu_smoke
@pytest.mark.parametrize("heads", S.heads, ids=HEAD_IDS)
def test_forward_accuracy_vs_fp32_sdpa(heads):
    """Causal prefill, B = 4, T = 2048: max |ours − fp32 SDPA| within twice bf16 SDPA's own error."""
    hq, hkv = heads
    b, t = S.accuracy
    q, k, v = rand(b, t, hq, D), rand(b, t, hkv, D, seed=1), rand(b, t, hkv, D, seed=2)
    oracle = sdpa(q.float(), k.float(), v.float(), True)
    err_ours = (attention(q, k, v).float() - oracle).abs().max().item()
    with flash_only():
        err_sdpa = (sdpa(q, k, v, True).float() - oracle).abs().max().item()
    assert err_ours <= 2 * err_sdpa + 1e-3, f"ours {err_ours:.2e}, SDPA {err_sdpa:.2e}"


@pytest.mark.parametrize("heads", S.heads, ids=HEAD_IDS)
def test_backward_vs_fp32_sdpa_and_twice_bitwise(heads):
    """Causal prefill, B = 2, T = 2048: dq, dk, dv against fp32 SDPA autograd within max(2× bf16
    SDPA's relative error, 1e-2), and two backward runs bitwise equal."""
    hq, hkv = heads
    b, t = S.backward
    q, k, v = rand(b, t, hq, D), rand(b, t, hkv, D, seed=1), rand(b, t, hkv, D, seed=2)
    g = rand(b, t, hq, D, seed=3)

    def grads(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        fn(*leaves).backward(g.to(dtype))
        return [x.grad.float() for x in leaves]

    want = grads(lambda a, b_, c: sdpa(a, b_, c, True), torch.float32)
    got = grads(attention, DTYPE)
    again = grads(attention, DTYPE)
    with flash_only():
        theirs = grads(lambda a, b_, c: sdpa(a, b_, c, True), DTYPE)
    assert all(torch.equal(a, c) for a, c in zip(got, again, strict=True)), "backward not deterministic"
    for name, ours, sdpa_grad, exact in zip(("dq", "dk", "dv"), got, theirs, want, strict=True):
        err, base = rel_err(ours, exact), rel_err(sdpa_grad, exact)
        assert err <= max(2 * base, 1e-2), f"{name}: ours {err:.1e}, SDPA {base:.1e}"
