"""Bad input to the log-prob primitives and to ``use_backend``: a TypeError/ValueError that names the
argument and what was expected, raised before any backend runs (checked on both backends).

More cases live beside the ops' own tests (tests/ops/test_token_logprobs.py,
tests/ops/test_linear_token_logprobs.py, tests/test_dispatch.py); this file is the registry the
public-API walker (tests/test_public_api_bad_input.py) reads through ``COVERED``.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk

COVERED = [rk.token_logprobs, rk.linear_token_logprobs, rk.use_backend]

META = torch.device("meta")  # a second device on a CPU-only machine
N, V, H = 4, 9, 6


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    with rk.use_backend(request.param):
        yield request.param


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------- token_logprobs
def _logits_args(**changes):
    g = _g(1)
    args = dict(logits=torch.randn(N, V, generator=g), token_ids=torch.randint(0, V, (N,), generator=g))
    args.update(changes)
    return args


TOKEN_LOGPROBS_CASES = {
    "logits not a tensor": (dict(logits=[[0.0] * V] * N), TypeError, "logits must be a torch.Tensor"),
    "integer logits": (
        dict(logits=torch.zeros(N, V, dtype=torch.long)),
        TypeError,
        "logits must be a floating",
    ),
    "0-dim logits": (dict(logits=torch.tensor(1.0)), ValueError, "logits must have at least 1"),
    "no vocabulary": (dict(logits=torch.zeros(N, 0)), ValueError, "vocabulary dimension >= 1"),
    "float ids": (dict(token_ids=torch.zeros(N)), TypeError, "token_ids must be an integer tensor"),
    "ids shape": (
        dict(token_ids=torch.zeros(N + 1, dtype=torch.long)),
        ValueError,
        "token_ids must have shape",
    ),
    "ids device": (
        dict(token_ids=torch.zeros(N, dtype=torch.long, device=META)),
        ValueError,
        "token_ids must be on",
    ),
    "id = V": (dict(token_ids=torch.tensor([0, V, 1, 2])), ValueError, r"outside \[0, 9\)"),
    "negative id": (dict(token_ids=torch.tensor([0, -1, 1, 2])), ValueError, "token_ids has 1 id"),
    "temperature 0": (dict(temperature=0.0), ValueError, "temperature"),
    "temperature inf": (dict(temperature=float("inf")), ValueError, "temperature"),
    "temperature str": (dict(temperature="1"), TypeError, "temperature"),
    # below float32's normal range (issue 29): the logits / 1e-40 overflowed to NaN / -inf
    "temperature 1e-40": (dict(temperature=1e-40), ValueError, "temperature must be at least 1.17549e-38"),
    "temperature 1e39": (dict(temperature=1e39), ValueError, "temperature must be at most 3.40282e.38"),
    "ignore_index float": (dict(ignore_index=1.5), TypeError, "ignore_index"),
}


@pytest.mark.parametrize("case", list(TOKEN_LOGPROBS_CASES))
def test_token_logprobs(backend, case):
    changes, error, match = TOKEN_LOGPROBS_CASES[case]
    args = _logits_args(**changes)
    with pytest.raises(error, match=match):
        rk.token_logprobs(args.pop("logits"), args.pop("token_ids"), **args)


# ------------------------------------------------------------------------ linear_token_logprobs
def _linear_args(**changes):
    g = _g(2)
    args = dict(
        hidden=torch.randn(N, H, generator=g),
        weight=torch.randn(V, H, generator=g),
        token_ids=torch.randint(0, V, (N,), generator=g),
        bias=torch.randn(V, generator=g),
    )
    args.update(changes)
    return args


LINEAR_CASES = {
    "hidden not a tensor": (dict(hidden=1.0), TypeError, "hidden must be a torch.Tensor"),
    "integer hidden": (
        dict(hidden=torch.zeros(N, H, dtype=torch.long)),
        TypeError,
        "hidden must be a floating",
    ),
    "weight not [V, H]": (dict(weight=torch.randn(V, H + 1)), ValueError, r"weight must be \[V, H\]"),
    "weight 1-D": (dict(weight=torch.randn(H)), ValueError, r"weight must be \[V, H\]"),
    "no vocabulary rows": (
        dict(weight=torch.randn(0, H), bias=None),
        ValueError,
        "at least one vocabulary row",
    ),
    "weight dtype": (dict(weight=torch.randn(V, H, dtype=torch.float64)), TypeError, "weight dtype"),
    "weight device": (dict(weight=torch.randn(V, H, device=META)), ValueError, "weight must be on"),
    "bias shape": (dict(bias=torch.randn(V - 1)), ValueError, "bias must have shape"),
    "bias integer": (dict(bias=torch.zeros(V, dtype=torch.long)), TypeError, "bias must be a floating"),
    "ids shape": (
        dict(token_ids=torch.zeros(N, 2, dtype=torch.long)),
        ValueError,
        "token_ids must have shape",
    ),
    "id out of range": (dict(token_ids=torch.tensor([0, 1, V + 3, 2])), ValueError, "outside"),
    "temperature nan": (dict(temperature=float("nan")), ValueError, "temperature"),
    "temperature 1e-40": (dict(temperature=1e-40), ValueError, "temperature must be at least 1.17549e-38"),
    "tp_group not a group": (dict(tp_group="world"), TypeError, "tp_group must be a torch.distributed"),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_token_logprobs(backend, case):
    changes, error, match = LINEAR_CASES[case]
    args = _linear_args(**changes)
    with pytest.raises(error, match=match):
        rk.linear_token_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("token_ids"), **args)


# ---------------------------------------------------------------------------------- use_backend
@pytest.mark.parametrize("name", ["cuda", "", None, 3, "Triton!"])
def test_use_backend_unknown_name(name):
    with pytest.raises(ValueError, match="backend must be one of"):
        with rk.use_backend(name):
            pass


def test_use_backend_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with rk.use_backend("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        rk.token_logprobs(torch.randn(N, V), torch.zeros(N, dtype=torch.long))
