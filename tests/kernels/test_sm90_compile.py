"""Every Triton kernel compiles for the H100 (sm_90), on a machine without a GPU.

The rest of the CPU suite runs the kernels in the interpreter, which never compiles them; errors of
the compiled path alone (a module-level float read in a kernel, found on the H100 on 2026-11-21;
types the interpreter lets through) would otherwise reach CI's green and only fail on the GPU.
``rlkernel._sm90_compile`` drives the real launchers and compiles each launch to a cubin;
it must run without ``TRITON_INTERPRET``, so these tests start it in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(
    "nvidia" not in getattr(triton.backends, "backends", {}),
    reason="this Triton has no NVIDIA backend (ptxas) to compile with",
)


def _run(args: list[str], cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RLKERNEL_BACKEND")}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )


def test_every_kernel_compiles_for_sm90():
    proc = _run(["-m", "rlkernel._sm90_compile"])
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "kernel launches compiled for sm_90" in proc.stdout, report
    # every kernel family of the package was reached
    for name in (
        "_matmul_kernel", "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_attn_fwd_kernel",
        "_attn_combine_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel", "_token_logprobs_fwd_kernel",
        "_token_logprobs_bwd_kernel", "_token_loss_kernel", "_token_loss_rows_kernel", "_scale_kernel",
        "_active_rows_kernel", "_stage_rows_kernel",
    ):  # fmt: skip
        assert name in proc.stdout, f"{name} was not compiled:\n{report}"


def test_the_check_fails_on_a_gpu_only_compile_error(tmp_path):
    """A kernel that reads a module-level float (fine in the interpreter, a compile error on the
    GPU) is reported as FAIL: the check can fail."""
    script = tmp_path / "bad_kernel.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch
            import triton
            import triton.language as tl
            from rlkernel import _sm90_compile

            SCALE = 0.5  # not tl.constexpr

            @triton.jit
            def bad(x_ptr, n, BLOCK: tl.constexpr):
                offs = tl.arange(0, BLOCK)
                x = tl.load(x_ptr + offs, mask=offs < n)
                tl.store(x_ptr + offs, x * SCALE, mask=offs < n)

            results = []
            _sm90_compile._compile_instead_of_launch(results)
            bad[(1,)](torch.zeros(16), 16, BLOCK=16)
            print(results)
            sys.exit(0 if len(results) == 1 and results[0][0].startswith("FAIL") else 1)
            """
        )
    )
    proc = _run([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_ptx_digest_ignores_debug_records_but_not_code():
    from rlkernel._sm90_compile import ptx_digest

    code = "\t.visible .entry k(\n\t.param .u64 p\n)\n{\n\tld.global.f32 %f1, [%rd1];\n\tret;\n}\n"
    debug = "\t.section\t.debug_info\n\t{\n.b32 178\n.b64 $L__tmp1\n\t}\n"
    one = code.replace("\tld.", "\t.loc\t1 10 3\n$L__tmp1:\n\tld.") + debug
    two = code.replace("\tld.", "\t.loc\t1 42 7\n$L__tmp5:\n\tld.") + debug.replace("178", "203")
    assert ptx_digest(one) == ptx_digest(two)  # moved source lines, other debug records
    assert ptx_digest(one) != ptx_digest(one.replace("f32 %f1", "f32 %f2"))  # a code change shows
