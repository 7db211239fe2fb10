"""Bad input to the public functions of ``rlkernel.distributed`` (docs/api/distributed.md) and to the
context-parallel arguments of the losses, in one process: a TypeError/ValueError naming the
argument, raised before (or instead of) any work.

The cross-rank cases (one rank's bad shard or layout makes every rank raise) run in several
processes in tests/distributed/test_vocab_parallel.py and test_context_parallel.py; here a one-rank
gloo group stands in for the group.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.distributed import (
    context_parallel_split,
    gather_lm_head,
    global_normalizers,
    vocab_parallel_linear_token_logprobs,
)

COVERED = [
    vocab_parallel_linear_token_logprobs,
    rk.global_normalizers,
    gather_lm_head,
    context_parallel_split,
]

N, V, H = 3, 5, 4


def _vp_args(**changes):
    g = torch.Generator().manual_seed(0)
    args = dict(
        hidden=torch.randn(N, H, generator=g),
        weight=torch.randn(V, H, generator=g),
        token_ids=torch.randint(0, V, (N,), generator=g),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize("group", [object(), "world", None])
def test_vocab_parallel_group_must_be_a_process_group(group):
    args = _vp_args()
    with pytest.raises(TypeError, match="tp_group must be a torch.distributed ProcessGroup"):
        vocab_parallel_linear_token_logprobs(**args, tp_group=group)


VP_CASES = {
    "weight not [V_r, H]": (dict(weight=torch.randn(V, H - 1)), "weight"),
    "id outside the global vocabulary": (dict(token_ids=torch.tensor([0, V + 2, 1])), r"outside \[0, 5\)"),
    "chunk_rows 0": (dict(chunk_rows=0), "chunk_rows must be > 0"),
    "temperature < 0": (dict(temperature=-1.0), "temperature"),
}


@pytest.mark.parametrize("case", list(VP_CASES))
def test_vocab_parallel_bad_input(one_rank_group, case):
    changes, match = VP_CASES[case]
    with pytest.raises(ValueError, match=match):
        vocab_parallel_linear_token_logprobs(**_vp_args(**changes), tp_group=one_rank_group)


GN_CASES = {
    "empty list": (dict(mask=[]), ValueError, "non-empty list of micro-batch masks"),
    "mask not a tensor": (dict(mask=[[1, 0]]), TypeError, r"mask\[0\] must be a torch.Tensor"),
    "1-D mask without cu_seqlens": (dict(mask=torch.ones(3)), ValueError, r"mask must be \[B, T\]"),
    "3-D mask": (dict(mask=torch.ones(2, 3, 4)), ValueError, r"mask must be \[B, T\]"),
    "cu_seqlens list length": (
        dict(mask=[torch.ones(3), torch.ones(3)], cu_seqlens=[torch.tensor([0, 3])]),
        ValueError,
        "cu_seqlens has 1 entries for 2 masks",
    ),
    "group not a process group": (dict(mask=torch.ones(2, 3), group="dp"), TypeError, "group must be"),
}


@pytest.mark.parametrize("case", list(GN_CASES))
def test_global_normalizers_bad_input(case):
    kwargs, error, match = GN_CASES[case]
    with pytest.raises(error, match=match):
        global_normalizers(**kwargs)


def test_gather_lm_head_bad_input(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    w = torch.randn(V, H)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        gather_lm_head(w.tolist())
    with pytest.raises(TypeError, match="bias must be a torch.Tensor .* or None"):
        gather_lm_head(w, bias=[0.0] * V)
    with pytest.raises(ValueError, match="dtype must be None, torch.float16 or torch.bfloat16"):
        gather_lm_head(w, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(ValueError, match=r"weight is a DTensor .*Partial\(sum\) is not supported"):
        gather_lm_head(DTensor.from_local(w, mesh, [Partial()]))

SPLIT_CASES = {
    "cp_size 0": (dict(seq_lens=[4], cp_size=0), ValueError, "cp_size must be > 0"),
    "cp_rank outside": (dict(seq_lens=[4], cp_rank=2), ValueError, r"cp_rank must be in \[0, cp_size"),
    "negative length": (dict(seq_lens=[4, -1]), ValueError, "seq_lens must be >= 0"),
    "float length": (dict(seq_lens=[4.0]), TypeError, "seq_lens must be an int"),
    "float tensor": (dict(seq_lens=torch.ones(2)), TypeError, "seq_lens must be an integer"),
    "load_balanced not a bool": (dict(load_balanced=1), TypeError, "load_balanced must be a bool"),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_context_parallel_split_bad_input(case):
    changes, error, match = SPLIT_CASES[case]
    with pytest.raises(error, match=match):
        context_parallel_split(**dict(dict(seq_lens=[4], cp_size=2, cp_rank=0), **changes))


def test_context_parallel_split_layouts():
    """Every position of every sequence on exactly one rank; Megatron's chunks r and 2·cp − 1 − r
    when the length divides; ``index`` points at each token in the packed stream."""
    lengths = [8, 5, 0, 3, 12]
    starts = torch.tensor([0, 8, 13, 13, 16])
    for cp_size in (1, 2, 3):
        for load_balanced in (True, False):
            seen = [[] for _ in lengths]
            for r in range(cp_size):
                got = context_parallel_split(lengths, cp_size=cp_size, cp_rank=r, load_balanced=load_balanced)
                sizes = got.cu_seqlens.diff().tolist()
                for i, piece in enumerate(got.positions.split(sizes)):
                    seen[i] += piece.tolist()
                    assert torch.equal(got.index.split(sizes)[i], piece + starts[i])
            assert [sorted(s) for s in seen] == [list(range(n)) for n in lengths]
    got = context_parallel_split(12, cp_size=3, cp_rank=1)  # chunks of 2: chunk 1 and chunk 4
    assert got.positions.tolist() == [2, 3, 8, 9] and got.cu_seqlens.tolist() == [0, 4]


ZEROS = torch.zeros(2, 3, dtype=torch.long)
CP_CASES = {  # (changes, group: None / "group" (a string) / "one" (a one-rank group), error, match)
    "cp_positions without cp_group": (dict(cp_positions=ZEROS), None, ValueError,
                                      "cp_positions applies with cp_group only"),
    "cp_group not a group": (dict(), "group", TypeError, "cp_group must be a torch.distributed ProcessGroup"),
    "cp_positions float": (dict(cp_positions=torch.zeros(2, 3)), "one", TypeError,
                           "rank 0 rejected its inputs: cp_positions must be an integer tensor"),
    "cp_positions shape": (dict(cp_positions=ZEROS[:, :2]), "one", ValueError,
                           r"cp_positions must have shape \(2, 3\)"),
    "cp_positions not a partition": (dict(cp_positions=ZEROS), "one", ValueError,
                                     "cp_positions do not partition sequence"),
}  # fmt: skip


@pytest.mark.parametrize("call", ["policy_loss", "fused_policy_loss"])
@pytest.mark.parametrize("case", list(CP_CASES))
def test_context_parallel_arguments(request, case, call):
    changes, group, error, match = CP_CASES[case]
    if group == "one":
        changes = dict(changes, cp_group=request.getfixturevalue("one_rank_group"))
    elif group == "group":
        changes = dict(changes, cp_group="world")
    g = torch.Generator().manual_seed(1)
    kw = dict(old_logp=-torch.rand(2, 3, generator=g), advantages=torch.randn(2, generator=g))
    kw.update(mask=torch.ones(2, 3), **changes)
    cfg = rk.PolicyLossConfig.preset("gspo")
    with pytest.raises(error, match=match):
        if call == "policy_loss":
            rk.policy_loss(-torch.rand(2, 3, generator=g), cfg=cfg, **kw)
        else:
            rk.fused_policy_loss(cfg, logits=torch.randn(2, 3, V, generator=g), token_ids=ZEROS, **kw)


def test_context_parallel_one_rank_is_the_plain_loss(one_rank_group):
    """A group of one rank holds whole sequences: the same loss, gradient and metrics as no group."""
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    kw = dict(
        old_logp=logp.detach() + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64),
        advantages=torch.randn(3, generator=g, dtype=torch.float64),
        mask=torch.rand(3, 5, generator=g) > 0.3,
    )
    columns = torch.arange(5).expand(3, 5)
    for name in ("gspo", "grpo", "dr_grpo"):
        cfg = rk.PolicyLossConfig.preset(name, kl_coef=0.0)
        a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        plain = rk.policy_loss(a, cfg=cfg, **kw)
        cp = rk.policy_loss(b, cfg=cfg, cp_group=one_rank_group, cp_positions=columns, **kw)
        plain.loss.backward()
        cp.loss.backward()
        torch.testing.assert_close(cp.loss, plain.loss, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-14, atol=1e-15)
        assert list(cp.metrics) == list(plain.metrics)
        for k in plain.metrics:
            torch.testing.assert_close(cp.metrics[k], plain.metrics[k], rtol=1e-14, atol=1e-15)


def test_global_normalizers_cp_group_bad_input():
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed ProcessGroup"):
        global_normalizers(torch.ones(2, 3), cp_group="cp")
