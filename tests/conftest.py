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
