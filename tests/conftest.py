"""Session-wide test setup: Triton kernels run in the CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, i.e. when a ``rlkernel.kernels``
module is first imported, so it is set here, in the root conftest, before any test module (of any
directory) can import one. It is harmless for tests that run the reference path and never launch a
kernel. Directories that test kernels force ``RLKERNEL_BACKEND=triton`` in their own conftest.
"""

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    _compiled = [name for name in sys.modules if name.startswith("rlkernel.kernels.")]
    if _compiled:  # imported before this conftest ran: their kernels are compiled, not interpreted
        raise pytest.UsageError(f"{_compiled} were imported before tests/conftest.py set TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures(...)``): the
    CPU invariant path runs one small GEMV per row, and with other processes on the machine OpenMP's
    spinning threads make each ~100x slower. Bits depend on the thread count, which stays fixed
    within a module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (this process), for the ``tp_group`` paths on the CPU."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def smallest_linear_chunks(monkeypatch):
    """The Triton linear path at its smallest chunks (16 rows): the real budgets pad every call to
    thousands of rows, minutes in the interpreter."""
    import rlkernel as rk

    with rk.use_options(linear_chunk_bytes=1, linear_grad_bytes=1):
        yield


@pytest.fixture
def set_options():
    """``set_options(**changes)`` changes rlkernel options (``rk.use_options``) until the test ends:
    tests set options this way (or with a ``with`` block), never by assigning module attributes."""
    import contextlib

    import rlkernel as rk

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(rk.use_options(**changes))


def pytest_addoption(parser):
    parser.addoption(
        "--agreement-seeds",
        type=int,
        default=1,
        help="fresh batches per case of tests/integrations/test_agreement_tables.py (the docs' tables: 25)",
    )
