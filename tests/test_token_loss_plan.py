"""The typed token-loss plan (``rlkernel._token_loss_plan``): its checks, row ranges and kernel forms.

The numbers a plan gives are tested against ``policy_loss`` in ``tests/rl/test_token_loss.py`` and
the kernels against the reference in ``tests/kernels/test_token_loss_kernel.py``; here: what the
dataclasses accept and refuse, that ``rows`` is a view of the right tokens, and that the kernel
forms carry the plan's values in the order and under the names the kernels read.
"""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from rlkernel._token_loss_plan import (
    IGNORE_INDEX,
    KL_CODES,
    LOSS_CODES,
    TokenLossBranches,
    TokenLossKernelScalars,
    TokenLossPlan,
    TokenLossScalars,
)

S, T = 3, 4  # a padded [S, T] batch: N = 12 tokens


def _scalars(**changes) -> TokenLossScalars:
    base = dict(
        loss="ppo",
        clip_lo=0.8,
        clip_hi=1.28,
        delta=math.inf,
        dual_clip=3.0,
        tau_pos=1.0,
        tau_neg=1.05,
        kl="k3",
        kl_straight=False,
        kl_coef=0.1,
        entropy_coef=0.0,
        norm_mult=1.0,
        denom_floor=1.0,
    )
    return TokenLossScalars(**{**base, **changes})


def _plan(**changes) -> TokenLossPlan:
    n = S * T
    base = dict(
        ids=torch.arange(n),
        old=torch.randn(n),
        adv=torch.randn(S),
        ref=torch.randn(n),
        rollout_w=None,
        factor=torch.rand(S),
        denom=torch.tensor(7),
        scalars=_scalars(),
        seq_len=T,
        adv_per_seq=True,
        factor_per_seq=True,
    )
    return TokenLossPlan(**{**base, **changes})


def test_a_plan_reports_its_size_and_entropy_use():
    plan = _plan()
    assert plan.n_tokens == S * T and plan.row0 == 0 and plan.ignore_index == IGNORE_INDEX
    assert not plan.want_entropy
    assert _plan(scalars=_scalars(entropy_coef=-0.01)).want_entropy


def test_rows_are_views_of_the_per_token_tensors_and_keep_the_per_sequence_ones():
    plan = _plan(adv=torch.randn(S * T), adv_per_seq=False)
    part = plan.rows(5, 9)
    assert part.n_tokens == 4 and part.row0 == 5
    for name in ("ids", "old", "adv", "ref"):
        got, whole = getattr(part, name), getattr(plan, name)
        assert got.data_ptr() == whole[5:9].data_ptr() and torch.equal(got, whole[5:9]), name
    assert part.factor is plan.factor and part.denom is plan.denom  # per sequence / 0-dim: whole
    assert part.scalars is plan.scalars
    # a range of a range is the range of the whole
    sub = part.rows(1, 3)
    assert sub.row0 == 6 and torch.equal(sub.ids, plan.ids[6:8])
    assert plan.rows(0, plan.n_tokens) is plan and part.rows(0, 4) is part  # the whole range: itself


def test_kernel_scalars_are_floats_in_kernel_order():
    args = _scalars(dual_clip=None, kl_coef=1).kernel_args()
    assert isinstance(args, TokenLossKernelScalars)
    assert all(type(v) is float for v in args)
    assert args.dual_clip == 0.0 and args.kl_coef == 1.0
    # The kernels read the fields by name; their compiled order is the field order.
    assert args._fields == (
        "norm_mult", "denom_floor", "clip_lo", "clip_hi", "delta", "dual_clip", "tau_pos", "tau_neg",
        "kl_coef", "entropy_coef",
    )  # fmt: skip


def test_kernel_inputs_stand_in_for_absent_tensors():
    plan = _plan(ref=None, scalars=_scalars(kl=None), denom=None)
    absent = torch.empty(1)
    inputs = plan.kernel_inputs(absent)
    assert inputs.old is plan.old and inputs.adv is plan.adv and inputs.factor is plan.factor
    assert inputs.ref is absent and inputs.rollout_w is absent and inputs.denom is absent


def test_kernel_branches_follow_the_plan():
    plan = _plan(scalars=_scalars(loss="cispo", kl="k1", kl_straight=True, dual_clip=None, entropy_coef=0.5))
    assert plan.kernel_branches() == TokenLossBranches(
        LOSS=LOSS_CODES["cispo"],
        KL=KL_CODES["k1"],
        KL_STRAIGHT=True,
        HAS_DUAL=False,
        HAS_OLD=True,
        HAS_ENTROPY=True,
        HAS_ROLLOUT=False,
        HAS_FACTOR=True,
        HAS_DENOM=True,
        ADV_PER_SEQ=True,
        FACTOR_PER_SEQ=True,
    )
    bare = _plan(factor=None, factor_per_seq=False, denom=None, scalars=_scalars(kl=None)).kernel_branches()
    assert (bare.KL, bare.HAS_FACTOR, bare.FACTOR_PER_SEQ, bare.HAS_DENOM) == (0, False, False, False)
    hash(bare)  # a constexpr value must be hashable (Triton keys its compiled kernels on it)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(loss="gspo"), "loss must be one of"),
        (dict(kl="k9"), "kl must be one of"),
        (dict(kl=None, kl_straight=True), "kl_straight=True needs"),
    ],
)
def test_scalars_refuse_unknown_branches(changes, match):
    with pytest.raises(ValueError, match=match):
        _scalars(**changes)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(scalars={"loss": "ppo"}), TypeError, "scalars must be a TokenLossScalars"),
        (dict(ids=torch.zeros(S * T)), TypeError, "ids must be an integer tensor"),
        (dict(ids=torch.zeros(S, T, dtype=torch.long)), ValueError, "ids must be flat"),
        (dict(old=[0.0] * (S * T)), TypeError, "old must be a torch.Tensor"),  # None: on-policy
        (dict(old=torch.randn(S * T - 1)), ValueError, r"old must be \[12\]"),
        (dict(old=torch.arange(S * T)), TypeError, "old must be a floating-point tensor"),
        (dict(adv=torch.randn(S - 1)), ValueError, r"adv must be \[S >= 3\]"),
        (dict(adv=torch.randn(S), adv_per_seq=False), ValueError, r"adv must be \[12\]"),
        (dict(ref=None), ValueError, "ref is required with a KL term"),
        (dict(rollout_w=torch.rand(S)), ValueError, "rollout_w must be"),
        (dict(factor=None), ValueError, "factor_per_seq=True needs a factor"),
        (dict(denom=torch.ones(1)), ValueError, "denom must be a 0-dim tensor"),
        (dict(ref=torch.randn(S * T, device="meta")), ValueError, "ref must be on cpu"),
        (dict(denom=torch.tensor(1.0, device="meta")), ValueError, "denom must be on cpu"),
        (dict(seq_len=0), ValueError, "seq_len must be >= 1"),
        (dict(row0=-1), ValueError, "row0 >= 0"),
    ],
)
def test_plan_refuses_what_the_kernels_cannot_read(changes, error, match):
    with pytest.raises(error, match=match):
        _plan(**changes)


def test_a_row_range_past_the_sequences_is_refused():
    """A per-sequence tensor must cover every sequence the range's tokens fall in."""
    plan = _plan()
    plan.rows(8, 12)  # the last sequence: fine
    with pytest.raises(ValueError, match=r"adv must be \[S >= 4\]"):
        dataclasses.replace(plan, row0=1)


def test_the_plan_and_the_reference_import_without_triton():
    """The plan sits below every layer: the reference (the CPU path) takes it and needs no Triton."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import rlkernel._token_loss_plan, rlkernel.reference.token_loss, rlkernel.rl.token_loss\n"
    )
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
