"""Compile every Triton kernel of the package for the H100 (sm_90) on a machine without a GPU.

    python -m rlkernel._sm90_compile            # one line per kernel launch; exit 1 on failure
    python -m rlkernel._sm90_compile --digest   # ... each with a digest of its PTX

Why: CI has no GPU and runs the kernels in the CPU interpreter, which does not compile them. Some
errors exist only in the compiled path (found on the H100 on 2026-11-21: a module-level float read
inside a kernel; also type errors the interpreter's numpy emulation lets through, shared-memory
overflows of a tile configuration). Triton's frontend, its LLVM passes and ``ptxas`` (shipped in
the triton wheel) need no GPU, so this module compiles each kernel down to a cubin for
``GPUTarget("cuda", 90, 32)``.

How: the real launchers (``kernels.matmul._matmul``, ``kernels.rmsnorm``, ``kernels.attention``,
``kernels.logprobs``, ``kernels.token_loss`` …) are called on small CPU tensors, with
``JITFunction.run`` replaced by a function that does what Triton's own launch does up to the
binary — bind the arguments, specialize them (dtype, 16-byte alignment, int classes), pack the
constexprs and options — and then ``triton.compile`` for sm_90 instead of launching. So every
kernel is compiled with the signature and the constexprs our launchers really pass, for each
configuration listed in :func:`launches`. Flags that exist only for the interpreter
(``INTERPRETED``) are compiled as on the GPU (False).

Must run in a process without ``TRITON_INTERPRET=1`` (the kernels must be ``JITFunction``s):
``tests/kernels/test_sm90_compile.py`` starts it as a subprocess. The TMA (tensor-descriptor)
matmul kernel is not compiled here (its descriptors need the driver); the GPU tests cover it.

``--digest`` adds to each line a digest of the PTX with its debug records removed (see
:func:`ptx_digest`): two builds whose digests agree run the same GPU code, so a refactor
of kernel source (a helper extracted, an interpreter-only branch added) can be shown to leave the
GPU binaries unchanged without a GPU (``ptxas`` is deterministic for a given PTX and options).

Caveats:
    * It compiles with the installed Triton (CI: the latest release), which may differ from the
      GPU machine's; a kernel that compiles here can still fail there, and the reverse.
    * Only the listed configurations are compiled (every table configuration of the matmul for
      bf16, the production tiles of the others), not every shape a user may pass.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

_INTERPRETER_ONLY = ("INTERPRETED",)


def ptx_digest(ptx: str) -> str:
    """A digest of ``ptx`` that ignores its debug records: the ``.debug_*`` sections (they follow
    the code), ``.loc``/``.file`` lines and the ``$L__tmp`` labels that only the debug records use.
    Source lines and inlining records move with edits that do not change the code."""
    import hashlib
    import re

    code = ptx.split("\t.section\t.debug", 1)[0]
    kept = [
        line.strip()
        for line in code.splitlines()
        if line.strip()
        and not line.strip().startswith((".loc", ".file", "//"))
        and not re.fullmatch(r"\$L__tmp\d+:", line.strip())
    ]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def _compile_instead_of_launch(results: list[tuple[str, str, float]]):
    """A replacement for ``JITFunction.run``: compile for sm_90, record (the status carries the PTX
    digest), do not launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binders: dict[object, object] = {}

    def run(self, *args, grid, warmup, **kwargs):
        for name in _INTERPRETER_ONLY:
            if name in kwargs:
                kwargs[name] = False
        kwargs["debug"] = kwargs.get("debug", self.debug) or False
        if self not in binders:
            binders[self] = jit.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound_args, specialization, options
        )
        label = f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__} " + " ".join(
            f"{k}={v}" for k, v in kwargs.items() if k.isupper() and k not in _INTERPRETER_ONLY
        )
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)  # fmt: skip
            assert "cubin" in compiled.asm, "no cubin produced"
            results.append((f"ok {ptx_digest(compiled.asm['ptx'])}", label, time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail at the end
            msg = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
            results.append(
                (f"FAIL {msg[-1][:300] if msg else type(exc).__name__}", label, time.perf_counter() - t0)
            )
        return None

    jit.JITFunction.run = run


def launches() -> list[tuple[str, object]]:
    """(description, zero-argument callable that calls one launcher on small CPU tensors)."""
    import torch

    from rlkernel.kernels import attention as ka
    from rlkernel.kernels import attention_bwd as kab
    from rlkernel.kernels import logprobs as kl
    from rlkernel.kernels import matmul as km
    from rlkernel.kernels import matmul_table as mt
    from rlkernel.kernels import rmsnorm as kr

    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype)

    out: list[tuple[str, object]] = []
    # matmul: every pointer configuration of the bf16 and fp32 tables (the TMA ones need a driver).
    for dtype in (bf16, torch.float32):
        for cfg in mt.table_configs(dtype, "tuned"):
            if cfg.tma:
                continue
            a, b = rnd(64, 512, dtype=dtype), rnd(512, 256, dtype=dtype)
            out.append((f"matmul {cfg.name}", lambda a=a, b=b, cfg=cfg: km.matmul(a, b, config=cfg)))
    x, w = rnd(8, 1024), rnd(1024)
    out.append(("rms_norm fwd (rstd)", lambda: kr.rms_norm_fwd(x, w, 1e-6)))
    out.append(("rms_norm fwd (no rstd)", lambda: kr.rms_norm_forward(x, w, 1e-6)))
    out.append(("rms_norm bwd", lambda: kr.rms_norm_bwd(rnd(8, 1024), x, w, torch.ones(8))))
    q, k, v = rnd(2, 3, 8, 128), rnd(2, 40, 2, 128), rnd(2, 40, 2, 128)
    ks = torch.tensor([0, 5])
    out.append(("attention fwd", lambda: ka.attention_fwd(q, k, v, scale=0.09, key_start=ks)))
    out.append(  # split-decode: the split partials and their combine
        ("attention fwd split-decode",
         lambda: ka.attention_fwd(q[:, :1], k, v, scale=0.09, key_start=ks, split=64, split_decode="always"))
    )  # fmt: skip
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    out.append(
        ("attention fwd heads_first", lambda: ka.attention_fwd(qh, kh, vh, scale=0.09, heads_first=True))
    )
    out_a, lse = torch.empty_like(q), torch.zeros(8, 6)
    out.append(("attention bwd", lambda: kab.attention_bwd(rnd(2, 3, 8, 128), q, k, v, out_a, lse, scale=0.09,
                                                          key_start=ks, cu_seqlens_q=None, cu_seqlens_k=None,
                                                          max_seqlen_q=3)))  # fmt: skip
    logits, ids = rnd(6, 1000), torch.tensor([1, 2, -100, 999, 0, 5])
    out.append(("logprobs fwd", lambda: kl.token_logprobs_fwd(logits, ids, return_entropy=True)))
    lse_l, ent = torch.zeros(6), torch.zeros(6)
    out.append(
        ("logprobs bwd", lambda: kl.token_logprobs_bwd(logits, ids, lse_l, ent, torch.ones(6), torch.ones(6)))
    )
    out += _linear_row_launches(rnd)
    out += _fused_loss_launches(rnd)
    return out


def _linear_row_launches(rnd) -> list[tuple[str, object]]:
    """The linear path's row kernels: padding compaction's index (with and without the storage rows
    of a hidden read in place) and the group staging (gathered or in order, ignored rows zeroed)."""
    import torch

    from rlkernel.kernels import ids as ki
    from rlkernel.kernels import stage_rows as ks

    ids = torch.tensor([1, -100, 3, 4, -100, 6, 7, 8])
    hidden, index = rnd(8, 64), torch.tensor([0, 2, 3, 5])
    h_out, ids_out = torch.empty(8, 64, dtype=hidden.dtype), torch.empty(8, dtype=torch.int64)
    return [
        ("active rows", lambda: ki.active_rows(ids, -100)),
        ("active rows + storage rows", lambda: ki.active_rows(ids, -100, 4, 2, storage=True)),
        ("stage rows (in order, ignored zeroed)",
         lambda: ks.stage_rows_unchecked(h_out, ids_out, hidden, ids, 0, 8, 8, -100, zero_ignored=True)),
        ("stage rows (compacted, padded)",
         lambda: ks.stage_rows_unchecked(h_out, ids_out, hidden, ids, 0, 4, 8, -100, index, index)),
    ]  # fmt: skip


def _fused_loss_launches(rnd) -> list[tuple[str, object]]:
    """The fused token-level loss kernels (block kernel for V > 65,536, gradient-in-forward row
    kernel below, backward, scale; the sequence-ratio kernel) through ``fused_policy_loss``
    forward + backward, for configs that cover their constexpr branches (loss types, KL, entropy,
    rollout correction)."""
    import torch

    import rlkernel as rk

    cfgs = {
        "dapo+kl": rk.PolicyLossConfig.preset("dapo", kl_coef=0.01),
        "cispo": rk.PolicyLossConfig.preset("cispo"),
        "sapo+entropy": rk.PolicyLossConfig.preset("sapo", entropy_coef=0.01),
        "ppo+seq_tis": rk.PolicyLossConfig.preset("ppo", rollout_correction="seq_tis"),
        # the sequence-ratio kernel (kernels.seq_token_loss): its three kinds, KL and entropy branches
        "gspo+kl": rk.PolicyLossConfig.preset("gspo", kl_coef=0.01),
        "gspo_token+entropy": rk.PolicyLossConfig(loss_type="gspo_token", entropy_coef=0.01),
        "gmpo": rk.PolicyLossConfig(loss_type="gmpo"),
    }
    b, t = 2, 4
    mask = torch.ones(b, t, dtype=torch.bool)
    out = []
    for vocab in (70000, 1000):  # block kernel + logprobs bwd; row kernel (V <= 65,536)
        logits = rnd(b, t, vocab).requires_grad_()
        ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(1))
        for name, cfg in cfgs.items():

            def call(cfg=cfg, logits=logits, ids=ids):
                kw = dict(
                    token_ids=ids, old_logp=torch.randn(b, t) - 3, advantages=torch.randn(b, t), mask=mask
                )
                if cfg.kl_coef:
                    kw["ref_logp"] = torch.randn(b, t) - 3
                if cfg.rollout_correction:
                    kw["rollout_logp"] = torch.randn(b, t) - 3
                rk.fused_policy_loss(cfg, logits=logits, validate=False, **kw).loss.backward()

            out.append((f"fused loss {name} V={vocab}", call))
    return out


def main(argv: list[str] | None = None) -> int:
    show_digest = "--digest" in (sys.argv[1:] if argv is None else argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "run without TRITON_INTERPRET=1: the kernels must be compiled, not interpreted", file=sys.stderr
        )
        return 2
    results: list[tuple[str, str, float]] = []
    _compile_instead_of_launch(results)
    # The public ops route CPU tensors to the kernels only in the interpreter; here they must reach
    # the (intercepted) launches: force the Triton backend and let it accept CPU tensors.
    from rlkernel import _dispatch

    os.environ[_dispatch.ENV_VAR] = "triton"
    _dispatch._kernel_can_run_on = lambda device: True
    t0 = time.perf_counter()
    for desc, call in launches():
        n = len(results)
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a launcher that fails before the kernel
            results.append((f"FAIL launcher: {type(exc).__name__}: {str(exc)[:200]}", desc, 0.0))
        if len(results) == n:
            results.append(("FAIL no kernel launched", desc, 0.0))
    for status, label, secs in results:
        ok = status.startswith("ok ")
        digest = f"{status[3:]}  " if ok and show_digest else ""
        head = "ok" if ok else status[:4]
        print(f"{head:4s} {secs:5.1f} s  {digest}{label}" + ("" if ok else f"\n     {status}"))
    failed = [r for r in results if not r[0].startswith("ok ")]
    print(f"{len(results) - len(failed)}/{len(results)} kernel launches compiled for sm_90 in "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
