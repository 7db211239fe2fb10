"""Every module-level name a Triton kernel reads must be something the compiler accepts.

Compiled Triton (3.3+) rejects a ``@triton.jit`` function that reads a module-level Python number
unless it is a ``tl.constexpr``; the CPU interpreter (what CI runs) does not check it. This caught
nothing on CPU and failed on the H100 on 2026-11-21 (``LOG_RATIO_BOUND = 20.0`` in
``kernels/token_loss.py``), so it is checked statically here, for every jit function in
``rlkernel.kernels`` (the names a function's code reads, looked up in its module's globals).
"""

import dis
import importlib
import pkgutil
import types

import pytest
import triton
import triton.language as tl

import rlkernel.kernels

ALLOWED = (types.ModuleType, type, tl.constexpr, tl.dtype, types.FunctionType, types.BuiltinFunctionType)


def _jit_functions():
    for info in pkgutil.iter_modules(rlkernel.kernels.__path__):
        module = importlib.import_module(f"rlkernel.kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # JITFunction and the interpreter's wrapper both have .fn
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                yield f"{info.name}.{name}", fn


JIT_FUNCTIONS = sorted(_jit_functions(), key=lambda item: item[0])


def test_kernels_were_found():
    assert len(JIT_FUNCTIONS) >= 10, [name for name, _ in JIT_FUNCTIONS]


@pytest.mark.parametrize("name,fn", JIT_FUNCTIONS, ids=[name for name, _ in JIT_FUNCTIONS])
def test_module_globals_read_by_kernels_are_constexpr(name, fn):
    bad = []
    # LOAD_GLOBAL only: co_names also holds attribute names (x.T, tl.load), which are not globals.
    loaded = {ins.argval for ins in dis.get_instructions(fn) if ins.opname == "LOAD_GLOBAL"}
    for global_name in sorted(loaded):
        if global_name not in fn.__globals__:
            continue  # builtins
        value = fn.__globals__[global_name]
        if hasattr(value, "fn") or isinstance(value, ALLOWED) or value is triton:
            continue
        bad.append(f"{global_name} = {value!r} ({type(value).__name__})")
    assert not bad, f"{name} reads non-constexpr module globals (wrap them in tl.constexpr): {bad}"
