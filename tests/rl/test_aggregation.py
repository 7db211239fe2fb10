"""Aggregation modes: global normalizers across micro-batches, packed == padded, and the reducer."""

import pytest
import torch

from rlkernel.rl.aggregate import Segments, aggregate

from .helpers import AGGREGATIONS, LOSS_CONFIGS, assert_close, config, grads, make_batch, pack, run


def _rows(batch, rows):
    out = {k: v.detach()[rows] for k, v in batch.items()}
    for name in ("logp", "entropy"):
        out[name] = out[name].clone().requires_grad_(True)
    return out


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", ["ppo", "gspo", "gspo_token", "cispo", "sapo", "gmpo", "reinforce"])
def test_micro_batches_with_global_normalizers_add_up(name, aggregation):
    cfg = config(name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.02, rollout_correction="seq_tis")
    full = make_batch(6, 5, seed=31)
    full["mask"][4] = False  # a second empty sequence, in the second micro-batch
    mask = full["mask"]
    global_tokens = int(mask.sum())
    global_seqs = torch.tensor(int(mask.any(-1).sum()))  # a 0-dim tensor, as a trainer would all-reduce
    whole = run(cfg, full)
    parts = [_rows(full, rows) for rows in (slice(0, 2), slice(2, 3), slice(3, 6))]
    losses = [run(cfg, p, global_tokens=global_tokens, global_seqs=global_seqs).loss for p in parts]
    assert_close(sum(losses), whole.loss)
    whole_grads = grads(whole.loss, full)
    for k in range(2):
        joined = torch.cat([grads(loss, p)[k] for loss, p in zip(losses, parts, strict=True)])
        assert_close(joined, whole_grads[k])


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_packed_equals_padded(name, aggregation):
    cfg = config(
        name,
        aggregation=aggregation,
        kl_coef=0.1,
        entropy_coef=0.02,
        rollout_correction="token_mis",
        rollout_clip_min=0.7,
    )
    batch = make_batch(5, 8, seed=17, per_token_adv=aggregation == "token-mean")
    lengths = [8, 0, 3, 6, 2]
    packed, cu, padded = pack(batch, lengths)
    # seq-mean-token-sum-norm divides by the padded width (8) or the longest packed sequence (8).
    out_packed = run(cfg, packed, cu_seqlens=cu)
    out_padded = run(cfg, padded)
    torch.testing.assert_close(out_packed.loss, out_padded.loss, atol=1e-13, rtol=1e-12)
    for key in out_padded.metrics:
        torch.testing.assert_close(out_packed.metrics[key], out_padded.metrics[key], atol=1e-13, rtol=1e-12)
    g_packed, g_padded = grads(out_packed.loss, packed), grads(out_padded.loss, padded)
    for k in range(2):
        expected = torch.cat([g_padded[k][i, :n] for i, n in enumerate(lengths)])
        torch.testing.assert_close(g_packed[k], expected, atol=1e-13, rtol=1e-12)


def test_packed_norm_length_defaults_to_longest_sequence():
    cfg = config("reinforce", aggregation="seq-mean-token-sum-norm")
    batch = make_batch(3, 9, seed=3, empty_row=False)
    packed, cu, padded = pack(batch, [4, 2, 3])
    narrow = {k: (v[:, :4] if v.dim() == 2 else v) for k, v in padded.items()}
    torch.testing.assert_close(run(cfg, packed, cu_seqlens=cu).loss, run(cfg, narrow).loss)
    fixed = config("reinforce", aggregation="seq-mean-token-sum-norm", norm_length=32)
    torch.testing.assert_close(run(fixed, packed, cu_seqlens=cu).loss, run(fixed, padded).loss)


def _manual(loss, mask, mode, tokens=None, seqs=None, length=None):
    m = mask.double()
    n_i = m.sum(-1)
    n_seq = seqs if seqs is not None else float((n_i > 0).sum())
    if mode == "token-mean":
        return (loss * m).sum() / (tokens if tokens is not None else m.sum())
    if mode == "seq-mean-token-mean":
        return sum((loss[i] * m[i]).sum() / n_i[i] for i in range(len(n_i)) if n_i[i] > 0) / n_seq
    if mode == "seq-mean-token-sum":
        return (loss * m).sum() / n_seq
    return (loss * m).sum() / (n_seq * (length or mask.shape[1]))


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_reducer(mode):
    torch.manual_seed(0)
    loss = torch.randn(4, 5, dtype=torch.float64)
    mask = torch.rand(4, 5) > 0.4
    mask[2] = False
    mask[0, 0] = True
    assert_close(aggregate(loss, mask, mode, width=5), _manual(loss, mask, mode))
    got = aggregate(loss, mask, mode, global_tokens=11, global_seqs=torch.tensor(7), norm_length=3, width=5)
    assert_close(got, _manual(loss, mask, mode, tokens=11, seqs=7, length=3))
    assert aggregate(loss, torch.zeros_like(mask), mode, width=5).item() == 0.0


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), "mean")


def test_segments_gather_packed_rows():
    cu = torch.tensor([0, 3, 3, 5])
    seg = Segments.packed(cu, 5, torch.device("cpu"))
    assert (seg.n_seqs, seg.max_len, seg.is_packed) == (3, 3, True)
    x = torch.arange(1.0, 6.0)
    assert seg.to_padded(x).tolist() == [[1, 2, 3], [0, 0, 0], [4, 5, 0]]
    assert seg.to_padded(x > 0, fill=False).tolist() == [[True] * 3, [False] * 3, [True, True, False]]
    padded = Segments.padded((2, 4))
    assert padded.to_padded(x) is x and not padded.is_packed
