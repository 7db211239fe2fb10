"""Backend selection: env var, context override, forced modes, errors."""

import pytest
import torch

from rlkernel import _dispatch


def test_default_is_auto_and_cpu_goes_to_reference(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert _dispatch.requested_backend() == "auto"
    assert _dispatch.resolve_backend(torch.device("cpu"), has_kernel=True) == "reference"


def test_env_var_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "reference")
    assert _dispatch.requested_backend() == "reference"
    monkeypatch.setenv(_dispatch.ENV_VAR, " Triton ")
    assert _dispatch.requested_backend() == "triton"


def test_unknown_env_value_raises(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="RLKERNEL_BACKEND"):
        _dispatch.requested_backend()


def test_context_override_nests_and_restores(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "auto")
    with _dispatch.use_backend("reference"):
        assert _dispatch.requested_backend() == "reference"
        with _dispatch.use_backend("triton"):
            assert _dispatch.requested_backend() == "triton"
        assert _dispatch.requested_backend() == "reference"
    assert _dispatch.requested_backend() == "auto"
    with pytest.raises(RuntimeError):
        with _dispatch.use_backend("reference"):
            raise RuntimeError("boom")
    assert _dispatch.requested_backend() == "auto"


def test_unknown_context_value_raises():
    with pytest.raises(ValueError, match="backend must be one of"):
        with _dispatch.use_backend("fast"):
            pass


def test_op_without_kernel_falls_back_silently(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton")
    assert _dispatch.resolve_backend(torch.device("cpu"), has_kernel=False) == "reference"


def test_forced_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton")
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)  # seam: fake: Triton importable
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _dispatch.resolve_backend(torch.device("cpu"), has_kernel=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _dispatch.resolve_backend(torch.device("cpu"), has_kernel=True) == "triton"


def test_forced_triton_without_triton_raises(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton")
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)  # seam: fake: no Triton
    with pytest.raises(ValueError, match="cannot be imported"):
        _dispatch.resolve_backend(torch.device("cpu"), has_kernel=True)


def test_auto_on_cuda_device_picks_triton_when_available(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)  # seam: fake: Triton importable
    assert _dispatch.resolve_backend(torch.device("cuda", 0), has_kernel=True) == "triton"
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)  # seam: fake: no Triton
    assert _dispatch.resolve_backend(torch.device("cuda", 0), has_kernel=True) == "reference"
