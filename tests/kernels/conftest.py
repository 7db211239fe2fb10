"""Kernel tests run the Triton kernels: on CUDA when a GPU is present, else in the CPU interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, i.e. when
``rlkernel.kernels.*`` is first imported, so it is set here, before anything imports those modules
(the public ops import them lazily, on the first Triton-path call). It stays set for the rest of
the session; that is harmless for the other test modules, which run the reference path and never
launch a kernel. ``RLKERNEL_BACKEND=triton`` is set per test (autouse fixture) and restored after.
"""

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("rlkernel.kernels._reduce", "rlkernel.kernels.logprobs"):
        if (
            _name in sys.modules
        ):  # imported before this conftest ran: its kernels are compiled, not interpreted
            raise pytest.UsageError(
                f"{_name} was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1"
            )

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    """Force the Triton path for every test in this directory; monkeypatch restores the old value."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    yield
