"""The cross-rank agreement protocol shared by the vocab-parallel checks
(``rlkernel.ops._vocab_parallel_checks``) and the context-parallel ones
(``rlkernel.rl.context_parallel_checks``).

Each rank runs its local checks and describes its call in an int64 descriptor: the fields of the
caller, then its local error's message (UTF-8, truncated to :data:`MSG_BYTES`) as :data:`MSG_WORDS`
int64 words. One ``all_gather`` (:func:`gather_rows`, the one host read) gives every rank the same
table, so every rank computes the same verdict and raises the same error, or none: no rank is left
waiting in a collective for a peer that raised alone. Here: the message words, the gather, the
verdict on failed local checks (:func:`rejected`) and float64 bits. Below every layer (it imports
only torch), so both packages can use it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch
import torch.distributed as dist

from rlkernel import _validate as check

MSG_BYTES = 384  # a local error's message travels in the descriptor, truncated to this many bytes
MSG_WORDS = MSG_BYTES // 8
_DTYPES = (None,) + check.FLOAT_DTYPES
_DEVICE_TYPES = ("other", "cpu", "cuda")


def dtype_code(dtype: torch.dtype) -> int:
    """A float dtype as a descriptor field (0: another dtype)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else 0


def device_code(device: torch.device) -> int:
    """A device's type as a descriptor field (0: neither CPU nor CUDA)."""
    return _DEVICE_TYPES.index(device.type) if device.type in _DEVICE_TYPES else 0


def describe_code(field: str, value: int) -> str:
    """A ``"dtype"`` or ``"device_type"`` field in words (else the number)."""
    if field == "dtype":
        return str(_DTYPES[value]) if 0 < value < len(_DTYPES) else "?"
    if field == "device_type":
        return _DEVICE_TYPES[value] if 0 <= value < len(_DEVICE_TYPES) else "?"
    return str(value)


def error_code(error: Exception | None) -> int:
    """0 (no error), 1 (ValueError) or 2 (TypeError)."""
    if error is None:
        return 0
    return 2 if isinstance(error, TypeError) else 1


def message_words(error: Exception) -> list[int]:
    """``str(error)`` as :data:`MSG_WORDS` int64 words (UTF-8, zero-padded, truncated)."""
    raw = str(error).encode("utf-8")[:MSG_BYTES].ljust(MSG_BYTES, b"\0")
    return list(struct.unpack(f"<{MSG_WORDS}q", raw))


def message(words: list[int]) -> str:
    """The text of :func:`message_words`."""
    raw = struct.pack(f"<{MSG_WORDS}q", *words)
    return raw.rstrip(b"\0").decode("utf-8", "ignore")


def gather_rows(desc: torch.Tensor, group: object, device: torch.device) -> list[list[int]]:
    """Every rank's descriptor (rank order), on every rank: one ``all_gather`` and a host read."""
    desc = desc.to(device)
    parts = [torch.empty_like(desc) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, desc, group=group)
    return torch.stack(parts).cpu().tolist()


def rejected(codes: list[int], messages: list[str]) -> tuple[type[Exception], list[str]] | None:
    """The verdict on the ranks' local checks (``codes`` from :func:`error_code`, the ranks'
    messages): None when every rank passed; else ``(TypeError if every rank failed a type check,
    else ValueError, one problem per distinct message naming its ranks)``."""
    failed = [r for r, code in enumerate(codes) if code]
    if not failed:
        return None
    kinds = {codes[r] for r in failed}
    exc = TypeError if kinds == {2} and len(failed) == len(codes) else ValueError
    by_message: dict[str, list[int]] = {}
    for r in failed:
        by_message.setdefault(messages[r], []).append(r)
    return exc, [
        f"rank {ranks[0]} rejected its inputs: {msg}"
        if len(ranks) == 1
        else f"ranks {ranks} rejected their inputs: {msg}"
        for msg, ranks in by_message.items()
    ]


def local_rejections(table: list[list[int]], error_field: int, n_fields: int):
    """:func:`rejected` of a gathered descriptor table whose rows hold the :func:`error_code` at
    ``error_field`` and the :func:`message_words` after their first ``n_fields`` fields."""
    return rejected([row[error_field] for row in table], [message(row[n_fields:]) for row in table])


def disagreements(
    table: list[list[int]], index: dict[str, int], must_agree, describe: Callable[[str, int], str]
) -> list[str]:
    """``"<words> differs across ranks (rank 0: …, rank 1: …)"`` for each ``(field, words)`` of
    ``must_agree`` whose values differ between the table's rows, in that order; ``describe(field,
    value)`` puts a value in words."""
    problems = []
    for field, words in must_agree:
        values = [row[index[field]] for row in table]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {describe(field, v)}" for r, v in enumerate(values))
            problems.append(f"{words} differs across ranks ({per_rank})")
    return problems


def float_bits(x: float) -> int:
    """The float64 bits of ``x`` as an int64 (exact: a descriptor field)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(b: int) -> float:
    """The inverse of :func:`float_bits`."""
    return struct.unpack("<d", struct.pack("<q", b))[0]
