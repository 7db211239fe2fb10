"""Shared input checks for every public function.

Each check raises ``TypeError`` (not a tensor, wrong dtype family) or ``ValueError`` (shape, device,
range, unknown name) with a message that names the argument and says what was expected and what
arrived, so that bad input never becomes a silent wrong number or a crash deep inside a kernel.
Checks that need a host sync (token-id range) are opt-out through the callers' ``validate=False``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def describe(t: torch.Tensor) -> str:
    """``shape=(2, 3) dtype=torch.float32 device=cpu`` for error messages."""
    return f"shape={tuple(t.shape)} dtype={t.dtype} device={t.device}"


def tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def float_tensor(name: str, t: object, *, min_dim: int = 0) -> torch.Tensor:
    """A floating-point tensor with at least ``min_dim`` dimensions."""
    t = tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (fp16/bf16/fp32/fp64), got {describe(t)}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got {describe(t)}")
    return t


def int_tensor(name: str, t: object) -> torch.Tensor:
    t = tensor(name, t)
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got {describe(t)}")
    return t


def mask_tensor(name: str, t: object) -> torch.Tensor:
    """A bool, integer or float 0/1 mask; returned as the tensor itself (callers convert)."""
    t = tensor(name, t)
    if t.dtype != torch.bool and t.dtype not in INT_DTYPES and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a bool, integer or float mask, got {describe(t)}")
    return t


def same_shape(name: str, t: torch.Tensor, ref_name: str, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} (the shape of {ref_name}), got {describe(t)}"
        )


def same_device(name: str, t: torch.Tensor, ref_name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of {ref_name}), got {describe(t)}")


FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal float32


def _shown(value: object) -> str:
    """``value`` for an error message (an int too large for a float is not printed in full)."""
    if isinstance(value, int) and abs(value) > 10**20:
        return f"an int of {len(str(abs(value)))} digits"
    return repr(value)


def real(name: str, value: object) -> float:
    """A Python ``int`` or ``float`` (not bool) as a float; TypeError otherwise, ValueError for an int
    too large to be a float (rather than the OverflowError of ``float()``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}") from None


def positive_float(name: str, value: object) -> float:
    x = real(name, value)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {_shown(value)}")
    return x


def nonneg_float(name: str, value: object) -> float:
    x = real(name, value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {_shown(value)}")
    return x


def fp32_float(name: str, value: float, *, positive: bool = False) -> float:
    """An already-checked finite number that a float32 computation can use as it is: magnitude at
    most the largest float32 (else it becomes inf there), and, with ``positive``, at least the
    smallest normal float32 (else it becomes 0 or loses its precision there)."""
    if abs(value) > FP32_MAX:
        raise ValueError(
            f"{name} must be at most {FP32_MAX:.6g} in magnitude (the loss is computed in float32), "
            f"got {_shown(value)}"
        )
    if positive and value < FP32_TINY:
        raise ValueError(
            f"{name} must be at least {FP32_TINY:.6g} (the smallest normal float32; the loss is computed "
            f"in float32), got {_shown(value)}"
        )
    return value


def positive_int(name: str, value: object, *, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {_shown(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {_shown(value)}")
    return value


def boolean(name: str, value: object) -> bool:
    """A flag: ``True`` or ``False`` only (a string such as ``"False"`` would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def choice(name: str, value: object, choices: Iterable[object]) -> object:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def token_ids_in_range(name: str, ids: torch.Tensor, vocab_size: int, ignore_index: int | None) -> None:
    """Every id is in ``[0, vocab_size)`` or equals ``ignore_index`` (``None``: no id is exempt).

    Costs one host sync (``rlkernel.ops.id_checks`` has the sync-free form for CUDA)."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bool(bad.any()):
        first = int(ids[bad].flatten()[0].item())
        raise ValueError(token_ids_message(name, int(bad.sum().item()), vocab_size, ignore_index, first))


def token_ids_message(name: str, count: int, vocab_size: int, ignore_index: int | None, first: int) -> str:
    """The error of :func:`token_ids_in_range` (``count`` bad ids, ``first`` the first one)."""
    exempt = f" that are not ignore_index={ignore_index}" if ignore_index is not None else ""
    return (
        f"{name} has {count} id(s) outside [0, {vocab_size}){exempt} (first: {first}); "
        "pass validate=False only if you are sure the ids are valid"
    )


def cu_seqlens_tensor(name: str, cu: object, total: int) -> torch.Tensor:
    """Cumulative sequence lengths ``[S + 1]``: int, starts at 0, non-decreasing, ends at ``total``."""
    cu = cu_seqlens_shape(name, cu)
    cu_seqlens_values(name, cu.detach().to("cpu", torch.int64), total)
    return cu


def cu_seqlens_shape(name: str, cu: object) -> torch.Tensor:
    """The checks of :func:`cu_seqlens_tensor` that need no host values: an int tensor ``[S + 1]``."""
    cu = int_tensor(name, cu)
    if cu.device.type == "meta":  # its values are read on the host: a meta tensor has none
        raise ValueError(
            f"{name} is on the meta device: its values are read on the host to split the packed "
            f"sequences, so it must hold real values (CPU or the device), got {describe(cu)}"
        )
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(
            f"{name} must be 1-D with at least one entry (cumulative lengths), got {describe(cu)}"
        )
    return cu


def cu_seqlens_values(name: str, cpu: torch.Tensor, total: int) -> None:
    """The value checks of :func:`cu_seqlens_tensor` on a host (CPU, int64) copy: starts at 0,
    non-decreasing (every length >= 0), ends at ``total``."""
    if cpu[0].item() != 0:
        raise ValueError(f"{name} must start at 0, got {cpu[0].item()}")
    if cpu.numel() > 1 and bool((cpu[1:] < cpu[:-1]).any()):
        raise ValueError(
            f"{name} must be non-decreasing (every sequence length >= 0), got {cpu.tolist()[:16]}"
        )
    if cpu[-1].item() != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {cpu[-1].item()}")


def finite_float(name: str, value: object) -> float:
    """Any finite number (negative allowed), e.g. a coefficient whose sign is meaningful."""
    x = real(name, value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
    return x


def float_like(name: str, t: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor with the shape and device of ``ref``."""
    t = float_tensor(name, t)
    same_shape(name, t, ref_name, ref.shape)
    same_device(name, t, ref_name, ref.device)
    return t


def normalizer(name: str, value: object, device: torch.device) -> float | torch.Tensor | None:
    """A global normalizer: ``None``, 0 or a number in float32's normal range, or a 0-dim int/float
    tensor.

    0 is the count of a step that is all-masked on every rank (``global_normalizers`` returns it):
    the loss is then 0. A tensor may live on ``device`` or on the CPU (a CPU scalar never forces a
    device sync). Its value is not checked here (that would cost a host sync); the aggregation
    turns a tensor that is negative or not finite, or 0 with active tokens, into a NaN loss.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a 0-dim tensor (a scalar), got {describe(value)}")
        if value.dtype == torch.bool or (value.dtype not in FLOAT_DTYPES and value.dtype not in INT_DTYPES):
            raise TypeError(
                f"{name} must be an integer or floating-point scalar tensor, got {describe(value)}"
            )
        if value.device != device and value.device.type != "cpu":
            raise ValueError(f"{name} must be on {device} or the CPU, got {describe(value)}")
        return value
    # A number is a count: 0, or within float32's normal range (the loss is computed in float32;
    # 1e39 would divide by inf, 1e-45 by a denormal or 0), as the config's fields are checked.
    x = nonneg_float(name, value)
    return x if x == 0 else fp32_float(name, x, positive=True)
