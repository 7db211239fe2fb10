"""Validate once (issue 11): a ``fused_policy_loss`` call checks each input once on its way down —
the logits, the hidden states/weight, ``old_logp`` and the other per-token inputs, and reads
``cu_seqlens`` on the host once — whichever path (composed, fused token-level, Triton or reference)
it takes; ``policy_loss`` likewise."""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel import _validate
from rlkernel.rl import repeat_calls

from .helpers import make_batch

VOCAB, HIDDEN = 11, 6


def _inputs(packed: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    b = make_batch(3, 4, seed=3)
    ids = torch.randint(0, VOCAB, (3, 4), generator=g)
    cu = None
    if packed:
        cu = torch.tensor([0, 4, 6, 9])
        lengths = [4, 2, 3]
        take = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])  # noqa: E731
        ids = take(ids)
        b = {k: (take(v.detach()) if v.dim() == 2 else v) for k, v in b.items()}
    lead = ids.shape
    return dict(
        ids=ids,
        cu=cu,
        batch=b,
        logits=torch.randn(*lead, VOCAB, generator=g, dtype=dtype).requires_grad_(True),
        hidden=torch.randn(*lead, HIDDEN, generator=g, dtype=dtype).requires_grad_(True),
        weight=torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype).requires_grad_(True),
    )


@pytest.fixture
def checks(monkeypatch):
    """Counts, per checked object, the calls of the ``_validate`` checks that take tensors by name
    (of full checks: no decision of an earlier test's call is kept, ``rl.repeat_calls``)."""
    repeat_calls.forget()
    seen: list[tuple[str, str, int]] = []
    depth = [0]  # a check calling another (float_like -> float_tensor) counts once
    for fn_name in ("float_tensor", "float_like", "int_tensor", "mask_tensor", "cu_seqlens_tensor"):
        real = getattr(_validate, fn_name)

        def spy(name, t, *args, _real=real, _fn=fn_name, **kwargs):
            if not depth[0]:
                seen.append((_fn, name, id(t)))
            depth[0] += 1
            try:
                return _real(name, t, *args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(_validate, fn_name, spy)  # seam: spy on the checks
    return seen


def _count(seen, obj) -> int:
    return sum(1 for _, _, i in seen if i == id(obj))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])  # token-level fusion / composed path
@pytest.mark.parametrize("source", ["logits", "hidden"])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_policy_loss_checks_each_input_once(
    checks, backend, preset, source, packed, smallest_linear_chunks
):
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    p = _inputs(packed)
    b = p["batch"]
    cfg = rk.PolicyLossConfig.preset(preset)
    src = dict(logits=p["logits"]) if source == "logits" else dict(hidden=p["hidden"], weight=p["weight"])
    with rk.use_backend(backend):
        out = rk.fused_policy_loss(
            cfg,
            token_ids=p["ids"],
            old_logp=b["old_logp"],
            advantages=b["advantages"],
            mask=b["mask"],
            cu_seqlens=p["cu"],
            **src,
        )
        out.loss.backward()
        _ = out.metrics  # the lazy metrics reuse the validated batch
    assert torch.isfinite(out.loss)
    for name, obj in (
        *src.items(),
        ("old_logp", b["old_logp"]),
        ("mask", b["mask"]),
        ("token_ids", p["ids"]),
    ):
        assert _count(checks, obj) == 1, (name, [c for c in checks if c[2] == id(obj)])
    assert _count(checks, b["advantages"]) == 1
    if packed:
        assert _count(checks, p["cu"]) == 1  # one host read of the cumulative lengths


def test_policy_loss_checks_each_input_once(checks):
    p = _inputs(packed=True)
    b = p["batch"]
    logp = torch.randn(p["ids"].shape, dtype=torch.float32, requires_grad=True)
    cfg = rk.PolicyLossConfig.preset("gspo")
    rk.policy_loss(logp, b["old_logp"], b["advantages"], b["mask"], cfg, cu_seqlens=p["cu"]).loss.backward()
    for obj in (logp, b["old_logp"], b["mask"], b["advantages"], p["cu"]):
        assert _count(checks, obj) == 1
