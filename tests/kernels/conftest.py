"""Kernel tests run the Triton kernels: on CUDA when a GPU is present, else in the CPU interpreter
(``TRITON_INTERPRET=1`` is set by the root ``tests/conftest.py``). ``RLKERNEL_BACKEND=triton`` is set
per test (autouse fixture) and restored after.
"""

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    """Force the Triton path for every test in this directory; monkeypatch restores the old value."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    yield
