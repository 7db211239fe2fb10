"""Property tests over random shapes, masks and configs (hypothesis): the loss matches the formula,
packed equals padded, micro-batches add up, and masked garbage never matters."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlkernel as rk

from .formulas import group_advantages as group_advantages_formula
from .helpers import (
    AGGREGATIONS,
    LOSS_CONFIGS,
    add_garbage,
    assert_close,
    config,
    grads,
    make_batch,
    oracle,
    pack,
    run,
)

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None)

configs = st.builds(
    lambda name, aggregation, kl, ent, rollout: config(
        name, aggregation=aggregation, kl_coef=kl, entropy_coef=ent, rollout_correction=rollout
    ),
    st.sampled_from(list(LOSS_CONFIGS)),
    st.sampled_from(AGGREGATIONS),
    st.sampled_from([0.0, 0.05]),
    st.sampled_from([0.0, -0.01, 0.02]),
    st.sampled_from([None, "token_tis", "seq_tis", "token_mis", "seq_mis"]),
)


@SETTINGS
@given(
    cfg=configs,
    batch=st.integers(1, 5),
    width=st.integers(1, 7),
    seed=st.integers(0, 10_000),
    per_token=st.booleans(),
)
def test_matches_formula_and_ignores_garbage(cfg, batch, width, seed, per_token):
    data = make_batch(batch, width, seed=seed, per_token_adv=per_token)
    out = run(cfg, data)
    expected = oracle(cfg, data)
    assert_close(out.loss, expected)
    assert_close(grads(out.loss, data)[0], grads(expected, data)[0])
    dirty = add_garbage(data)
    assert torch.equal(run(cfg, dirty).loss, out.loss)


@SETTINGS
@given(cfg=configs, lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5), seed=st.integers(0, 10_000))
def test_packed_equals_padded(cfg, lengths, seed):
    cfg = dataclasses.replace(cfg, norm_length=6)  # the default width differs by design (padded T vs longest)
    data = make_batch(len(lengths), 6, seed=seed, empty_row=False)
    packed, cu, padded = pack(data, lengths)
    a, b = run(cfg, packed, cu_seqlens=cu), run(cfg, padded)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-12, rtol=1e-11)
    g_packed, g_padded = grads(a.loss, packed)[0], grads(b.loss, padded)[0]
    torch.testing.assert_close(g_packed, torch.cat([g_padded[i, :n] for i, n in enumerate(lengths)]))


@SETTINGS
@given(cfg=configs, batch=st.integers(2, 6), split=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_micro_batches_add_up(cfg, batch, split, seed):
    split = min(split, batch - 1)
    data = make_batch(batch, 5, seed=seed)
    tokens, seqs = int(data["mask"].sum()), int(data["mask"].any(-1).sum())
    whole = run(cfg, data).loss
    halves = []
    for rows in (slice(0, split), slice(split, batch)):
        part = {k: v.detach()[rows] for k, v in data.items()}
        halves.append(run(cfg, part, global_tokens=max(tokens, 1), global_seqs=max(seqs, 1)).loss)
    assert_close(halves[0] + halves[1], whole)


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]),
    seed=st.integers(0, 10_000),
)
def test_group_advantages_random_groups(sizes, estimator, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), 1000 - 7 * k) for k, n in enumerate(sizes)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    rewards = torch.randn(ids.numel(), generator=g)
    groups = {}
    for i, gid in enumerate(ids.tolist()):
        groups.setdefault(gid, []).append(i)
    got = rk.group_advantages(rewards, group_ids=ids, estimator=estimator)
    expected = group_advantages_formula(rewards, list(groups.values()), estimator)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
