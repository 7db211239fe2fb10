"""``rlkernel.invariant.attention`` at 32k tokens on the GPU: decode == prefill bitwise across the
split boundaries of the two-level softmax (issue 25), padded and packed, batch 1 and 32, by both
decode paths (split-decode: split partials + combine kernel; one-pass), and a deterministic
backward at that length.

Shapes: bf16, head_dim 128, Hq 32, Hkv 8; S = the default split size (2048). 32 sequences whose
lengths sit just below, at and just above multiples of S (32767, 32768, 30719, 30720, 30721, …,
down to 12287): every sequence's last rows and every decode step below end near a split edge.
Padding positions hold random values (never zeros). Under ``RLKERNEL_GPU_SMOKE=1`` (no GPU) the
same code runs at 96 keys with S = 32 in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.invariant import attention
from rlkernel.kernels import attention as kern

from .conftest import DEVICE, SIZES, generator

pytestmark = pytest.mark.gpu

A = SIZES.attention
D = A.head_dim
DTYPE = A.dtype
HQ, HKV = A.heads[0]
SPLIT = A.long_split if A.long_split is not None else kern.split_keys(D, DTYPE)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=generator(seed), device=DEVICE, dtype=torch.float32).to(DTYPE)


def opts(mode: str = "auto"):
    """This module's split size (the option) and a split-decode mode."""
    return rk.use_options(attention_split_keys=A.long_split, attention_split_decode=mode)


def lengths() -> list[int]:
    """``long_n_seq`` lengths at multiples of the split −1, +0, +1, from ``long_len`` down."""
    out = []
    for j in range(A.long_len // SPLIT, 0, -1):
        out += [t for t in (j * SPLIT - 1, j * SPLIT, j * SPLIT + 1) if t <= A.long_len]
    return out[: A.long_n_seq]


@pytest.fixture(scope="module")
def long_batch():
    """The sequences, their right-padded prefill (the rows every other form is compared with), and
    the first three sequences' rows alone."""
    lens = lengths()
    total = max(lens)
    seqs = [(rand(t, HQ, D, seed=7 * i), rand(t, HKV, D, seed=7 * i + 1), rand(t, HKV, D, seed=7 * i + 2))
            for i, t in enumerate(lens)]  # fmt: skip
    with rk.use_backend("triton"), opts():
        padded = []
        for j in range(3):
            x = rand(len(lens), total, *seqs[0][j].shape[1:], seed=900 + j)  # random padding
            for i, s in enumerate(seqs):
                x[i, : lens[i]] = s[j]
            padded.append(x)
        prefill = attention(*padded)
        del padded
        alone = {i: attention(*(x[None] for x in seqs[i]))[0] for i in range(3)}
    return lens, seqs, prefill, alone


def test_long_prefill_rows_equal_the_sequence_alone(long_batch):
    """The batch-32 right-padded prefill's rows equal each sequence's rows alone (batch 1)."""
    lens, _, prefill, alone = long_batch
    differ = [i for i, rows in alone.items() if not torch.equal(prefill[i, : lens[i]], rows)]
    assert not differ, f"sequences {differ} differ from their rows alone (split {SPLIT})"


def test_batch1_decode_at_split_edges_equals_prefill(long_batch):
    """Batch-1 decode steps of the longest sequence against caches of S − 1, S, S + 1, 2S, 4S + 1,
    8S − 1 and the full length: the prefill row and its lse2, by both decode paths."""
    lens, seqs, _, alone = long_batch
    q, k, v = seqs[1]
    t = lens[1]
    edges = (SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT, 4 * SPLIT + 1, 8 * SPLIT - 1, t)
    caches = sorted({c for c in edges if c <= t})
    _, lse = kern.attention_fwd(q[None], k[None], v[None], scale=D**-0.5, split=SPLIT, split_decode="never")
    differ = []
    for mode in ("always", "never", "auto"):
        with opts(mode):
            for c in caches:
                qc, kc, vc = q[None, c - 1 : c], k[None, :c], v[None, :c]
                step = attention(qc, kc, vc)[0, 0]
                _, step_lse = kern.attention_fwd(qc, kc, vc, scale=D**-0.5, split=SPLIT, split_decode=mode)
                if not torch.equal(step, alone[1][c - 1]):
                    differ.append(f"{mode} out@{c}")
                if not torch.equal(step_lse[:, 0], lse[:, c - 1]):
                    differ.append(f"{mode} lse@{c}")
    assert not differ, f"split {SPLIT}: decode differs from prefill: {differ}"


@pytest.mark.parametrize("back", [1, 2])
def test_batch32_left_padded_decode_equals_prefill(long_batch, back):
    """Batch-32 decode of every sequence's token ``back`` steps from its end against a left-padded
    cache (``key_start``; padding zero, as a fresh cache), by both decode paths ("auto" runs the
    one-pass kernel at this batch): each sequence's prefill row."""
    lens, seqs, prefill, _ = long_batch
    n = len(lens)
    width = max(lens) - back + 1
    cache_k = torch.zeros(n, width, HKV, D, device=DEVICE, dtype=DTYPE)
    cache_v = torch.zeros_like(cache_k)
    qd = torch.empty(n, 1, HQ, D, device=DEVICE, dtype=DTYPE)
    starts = []
    for i, ((q, k, v), t) in enumerate(zip(seqs, lens, strict=True)):
        c = t - back + 1
        cache_k[i, width - c :], cache_v[i, width - c :], qd[i, 0] = k[:c], v[:c], q[c - 1]
        starts.append(width - c)
    starts = torch.tensor(starts, device=DEVICE)
    want = [prefill[i, t - back] for i, t in enumerate(lens)]
    differ = []
    for mode in ("auto", "always"):
        with opts(mode):
            out = attention(qd, cache_k, cache_v, key_start=starts)
        differ += [f"{mode} seq{i}" for i, t in enumerate(lens) if not torch.equal(out[i, 0], want[i])]
    assert not differ, f"split {SPLIT}: {differ}"


def test_packed_prefill_and_decode_equal_prefill(long_batch):
    """The packed form: a prefill of the first four sequences (cu_seqlens) and a batch-32 packed
    decode step (one query per sequence against its cache of t − 1 keys), by both decode paths."""
    lens, seqs, prefill, _ = long_batch

    def cu(counts):
        return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)

    four = lens[:4]
    c4 = cu(four)
    with opts():
        qkv = [torch.cat([s[j] for s in seqs[:4]]) for j in range(3)]
        packed = attention(*qkv, cu_seqlens_q=c4, cu_seqlens_k=c4)
        del qkv
    rows = [packed[c4[i] : c4[i + 1]] for i in range(4)]
    differ = [f"prefill seq{i}" for i, t in enumerate(four) if not torch.equal(rows[i], prefill[i, :t])]
    del packed, rows
    cu_q, cu_k = cu([1] * len(lens)), cu([t - 1 for t in lens])
    qp = torch.stack([q[t - 2] for (q, _, _), t in zip(seqs, lens, strict=True)])
    kp = torch.cat([k[: t - 1] for (_, k, _), t in zip(seqs, lens, strict=True)])
    vp = torch.cat([v[: t - 1] for (_, _, v), t in zip(seqs, lens, strict=True)])
    want = [prefill[i, t - 2] for i, t in enumerate(lens)]
    for mode in ("auto", "always", "never"):
        with opts(mode):
            out = attention(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        differ += [f"{mode} decode {i}" for i, t in enumerate(lens) if not torch.equal(out[i], want[i])]
    assert not differ, f"split {SPLIT}: {differ}"


def test_chunked_prefill_across_split_edges_equals_prefill(long_batch):
    """The longest sequence prefilled in chunks of 0.7·S queries (edges off the split edges), each
    chunk against all keys so far, by both paths: the one-shot rows."""
    lens, seqs, _, alone = long_batch
    q, k, v = seqs[1]
    t = lens[1]
    step = max(1, (7 * SPLIT) // 10)
    differ = []
    for mode in ("auto", "always"):
        with opts(mode):
            for a in range(0, t, step):
                b = min(t, a + step)
                if not torch.equal(attention(q[None, a:b], k[None, :b], v[None, :b])[0], alone[1][a:b]):
                    differ.append(f"{mode} [{a}, {b})")
    assert not differ, f"split {SPLIT}: chunks differ: {differ}"


def test_long_backward_is_deterministic(long_batch):
    """Forward + backward of the longest sequence (batch 1, every row past the first split merges
    splits, the backward recomputes P from the merged lse2): dq, dk, dv bitwise equal twice, and
    finite."""
    lens, seqs, _, _ = long_batch
    q, k, v = seqs[1]
    g = rand(*q.shape, seed=5)

    def grads():
        leaves = [x[None].detach().clone().requires_grad_(True) for x in (q, k, v)]
        with opts():
            attention(*leaves).backward(g[None])
        return [x.grad for x in leaves]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), "backward not deterministic"
    assert all(bool(x.isfinite().all()) for x in first)
