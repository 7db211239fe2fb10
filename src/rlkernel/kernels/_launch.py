"""Repeat launches of a compiled Triton kernel with less host time than ``kernel[grid](...)``.

Why: a decode step of an HF model calls ~50 of our kernels on a few MB each, so the step is host
bound (``scripts/profile_invariant.py``). On every call ``JITFunction.run`` (Triton 3.6)
re-derives each argument's specialization, builds a cache key that includes ``str(options)``,
looks up the current device and stream, builds launch metadata and calls the (empty) launch hook
chains: ~32 us of host time per launch of the matmul kernel on the H100 host (Triton 3.6,
2026-11-21), ~17 us through ``FastLauncher``, which does that work once per *launch key* and then
calls the compiled kernel's launcher directly
(``benchmarks/results/profile_host_overhead_h100_2026-11-21_after.log``).

How: ``launcher(grid, args, constexprs, options)``. ``args`` are the kernel's runtime arguments in
signature order, ``constexprs`` its ``tl.constexpr`` arguments (in signature order, after them),
``options`` the launch options (``num_warps``, …). The launch key is (device, every argument's
specialization class, the constexpr values, the options). The first call with a new key goes through
Triton's own launch, which compiles or finds the kernel, and its ``CompiledKernel`` is kept under the
key; later calls with that key launch it directly. The specialization class of an argument is at
least as fine as what Triton specializes on (a tensor: dtype and address mod 16; an int: the
int32 / int64 / uint64 range, == 1, multiple of 16; a float: its type), so two argument lists
with one key always map to the same compiled kernel: the fast path launches exactly the binary that
Triton's own path would have launched (``tests/kernels/test_launch.py`` checks the outputs bitwise
on the GPU).

A host TMA descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``) is an argument like a
tensor: Triton specializes it on its dtype and block shape only (the compiled launcher encodes the
``CUtensorMap`` from the descriptor's base, shape and strides at every launch, on both paths), so
its class is (dtype, block shape, rank, padding, tf32 rounding).

Falls back to Triton's own launch, with no change in results, when: the CPU interpreter runs (no
compiled kernel), an argument is of another type (bool, None, a device-side descriptor; a tuple of
such), a launch hook
is installed (profilers such as proton: they see every launch as before), or this Triton's
``CompiledKernel`` lacks the attributes used here (``run``, ``function``, ``packed_metadata``: such
a kernel is not kept).

Caveats:
    * Constexpr values must be hashable; a kernel's ``do_not_specialize`` arguments are classified
      anyway (a finer key than needed, never a coarser one).
    * Module-level globals read by the kernel are frozen in the compiled binary: Triton's own launch
      raises if one changes, the fast path does not look (ours are all ``tl.constexpr`` constants,
      which ``tests/kernels/test_jit_globals.py`` checks).
"""

from __future__ import annotations

import contextlib

import torch

from rlkernel._options import current_options

# mul+add -> fma contraction for the kernels whose bits were verified with it (Triton <= 3.9's
# default; 3.9 warns that 3.10 turns the default off, which would change their bits). Passed
# explicitly by every launch that does not pin it off (attention, RMSNorm forward: False).
FP_FUSION = True


try:  # Triton >= 3.4: host TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor as _HostDescriptor
except ImportError:  # pragma: no cover - older Triton: a descriptor argument takes Triton's launch
    _HostDescriptor = None


def _descriptor_class(d) -> tuple:
    """The class of a host TMA descriptor: what Triton specializes on (dtype, block shape) and
    what else shapes the compiled signature or the encoded map (rank, padding, tf32 rounding)."""
    return ("tensordesc", d.base.dtype, tuple(d.block_shape), len(d.shape), d.padding,
            getattr(d, "round_f32_to_tf32", False))  # fmt: skip


def _classes(args: tuple) -> list:
    """The specialization class of each runtime argument (hashable). Raises TypeError or
    AttributeError for a type other than int, float, tensor or host TMA descriptor (the caller then
    takes Triton's own launch). One comprehension, no call per argument: this runs on every launch,
    so a plain ``torch.Tensor`` (most arguments) is tested first.

    An int in [-16, 16] stands for itself; a larger one maps to 100 + (multiple of 16) + 2 × (needs
    64 bits) + 4 × (needs unsigned 64 bits), so no class of one collides with a value of the other.
    A tensor maps to (dtype, address mod 16); a float to ``float``; a host descriptor to
    :func:`_descriptor_class`; a (named) tuple, which Triton specializes element by element and
    passes flattened, to the tuple of its elements' classes."""
    return [
        (a.dtype, a.data_ptr() & 15)
        if type(a) is _Tensor
        else (a if -16 <= a <= 16 else 100 + (a & 15 == 0) + 2 * (not -2147483648 <= a <= 2147483647)
              + 4 * (a > 9223372036854775807))
        if type(a) is int
        else float if type(a) is float
        else _descriptor_class(a) if type(a) is _HostDescriptor
        else tuple(_classes(a)) if isinstance(a, tuple)
        else (a.dtype, a.data_ptr() & 15)  # a tensor subclass (a Parameter, ...)
        for a in args
    ]  # fmt: skip


_Tensor = torch.Tensor
_runtime_knobs = None


def _hooks_installed() -> bool:
    """Whether a Triton launch hook is set (then every launch goes through Triton's own path): a
    non-empty ``HookChain`` (Triton 3.5+) or any non-None hook (older versions)."""
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    enter, leave = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


class FastLauncher:
    """Launches one ``@triton.jit`` kernel; see the module docstring.

    Args:
        kernel: the ``JITFunction``.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, object] = {}
        self.hits = 0  # fast launches so far (tests and the host-overhead script read it)

    def __call__(
        self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, object], options: dict[str, object]
    ) -> None:
        """Launch ``kernel[grid](*args, **constexprs, **options)``.

        Args:
            grid: 1 to 3 ints.
            args: the runtime (non-constexpr) arguments in signature order.
            constexprs: every ``tl.constexpr`` argument by name, in signature order.
            options: launch options (``num_warps``, ``num_stages``, ``enable_fp_fusion``, …).
        """
        first = args[0]
        if type(first) is _HostDescriptor:  # the device and the interpreter test read its tensor
            first = first.base
        # The option fast_launch=False (the host-overhead script times both) is read here, at the one
        # place every launch passes, rather than threaded through each launcher's arguments.
        if not first.is_cuda or not current_options().fast_launch:  # interpreter: nothing to keep
            self.kernel[grid](*args, **constexprs, **options)
            return
        device = first.get_device()
        try:
            key = (device, *_classes(args), *constexprs.values(), *options.items())
        except (TypeError, AttributeError):
            self.kernel[grid](*args, **constexprs, **options)
            return
        compiled = self._compiled.get(key)
        if compiled is None or _hooks_installed():
            compiled = self.kernel[grid](*args, **constexprs, **options)
            self._check_order(constexprs)
            self._remember(key, compiled)
            return
        n = len(grid)
        # The argument list Triton's own launch passes: every parameter, constexprs included (the
        # launcher skips them); no launch metadata and no hooks (none is installed: checked above).
        compiled.run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
            None, None, None, *args, *constexprs.values(),
        )  # fmt: skip
        self.hits += 1

    def _check_order(self, constexprs: dict[str, object]) -> None:
        """The fast path passes the constexprs positionally: a caller's dict out of signature order
        would launch with swapped values, so the first launch of each key checks it (Triton's own
        launch, by keyword, has just run correctly)."""
        params = getattr(self.kernel, "params", None)
        if params is None:  # another Triton: nothing to compare with
            return
        expected = [p.name for p in params if p.is_constexpr]
        if list(constexprs) != expected:
            raise ValueError(
                f"FastLauncher({self.kernel.__name__}): constexprs must be in signature order "
                f"{expected}, got {list(constexprs)}"
            )

    def _remember(self, key: tuple, compiled: object) -> None:
        # Kept only if it has what the direct launch calls (a Triton whose CompiledKernel differs,
        # or an asynchronous compile's future, keeps Triton's own launch for this key).
        if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            self._compiled[key] = compiled


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division of Python ints. ``triton.cdiv`` is a ConstexprFunction in recent
    Triton (argument unwrapping on every call: ~1-6 us of host time each), too slow per launch."""
    return -(-a // b)


_sm_count: dict[int, int] = {}


def num_sms(device: torch.device, *, interpreter: int) -> int:
    """Streaming multiprocessors of ``device`` (cached per device); ``interpreter`` on the CPU (the
    program count a persistent or multi-stage kernel should use to exercise its loops there)."""
    if device.type != "cuda":
        return interpreter
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """A context that makes ``t``'s GPU current for a launch; a no-op (no device switch, no host
    cost beyond one query) when it already is, or on CPU."""
    index = t.get_device()  # -1 on CPU
    # (torch._C._cuda_getDevice: torch.cuda.current_device without its lazy-init check; CUDA is
    # initialized, this tensor lives there)
    if index < 0 or index == torch._C._cuda_getDevice():
        return _NO_GUARD
    return torch.cuda.device(index)
