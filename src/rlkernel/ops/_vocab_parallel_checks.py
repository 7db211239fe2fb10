"""Cross-rank validation of the vocab-parallel LM-head call, and the process-group helpers.

:func:`agree_across_ranks` is the protocol that
:func:`~rlkernel.ops.vocab_parallel.vocab_parallel_linear_token_logprobs` runs before any data
collective: each rank runs the local checks of ``linear_token_logprobs`` and builds an int64
descriptor of its call (:data:`_FIELDS`: its local error and message, N, H, V_r, dtype, …, the ids'
checksum and range); one ``all_gather`` (``rlkernel._rank_agreement.gather_rows``, the one host
read per call) gives every rank the same table, from which every rank computes the same verdict
and raises the same error (:func:`_verdict`, :func:`_raise_for`, :func:`_check_global_range`).
What passes comes back as a :class:`ShardLayout`.

:func:`check_group` and :func:`collective_device` are shared with
:func:`rlkernel.distributed.global_normalizers`. The protocol is documented for users in
``docs/api/distributed.md`` ("Validation").
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rlkernel import _rank_agreement as agreement
from rlkernel import _validate as check
from rlkernel.ops.checks import check_linear_inputs

# ------------------------------------------------------------------------------- descriptor layout
_FIELDS = (
    "error",  # 0 ok, 1 ValueError, 2 TypeError (the local checks failed)
    "n",
    "hidden_size",
    "vocab_local",
    "dtype",
    "device_type",
    "has_bias",
    "temperature",  # the float64 bits
    "ignore_index",
    "return_entropy",
    "hidden_grad",
    "chunk_rows",  # 0 = automatic
    "id_hash",
    "id_min",
    "id_max",
)
_F = {name: i for i, name in enumerate(_FIELDS)}
_DESC_LEN = len(_FIELDS) + agreement.MSG_WORDS  # the fields, then a local error's message
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)
# Fields that must agree across ranks, with the words used in the error message.
_MUST_AGREE = (
    ("n", "token count N = hidden.shape[:-1].numel()"),
    ("hidden_size", "hidden size H"),
    ("dtype", "hidden/weight dtype"),
    ("device_type", "device type"),
    ("has_bias", "bias given"),
    ("temperature", "temperature"),
    ("ignore_index", "ignore_index"),
    ("return_entropy", "return_entropy"),
    ("hidden_grad", "whether hidden requires grad"),
    ("chunk_rows", "chunk_rows (0 = automatic)"),
)  # and the ids' checksum (``id_hash``), reported by rank rather than by value (see _verdict)


def _format(field: str, value: int) -> str:
    if field in ("dtype", "device_type"):
        return agreement.describe_code(field, value)
    if field == "temperature":
        return repr(agreement.bits_float(value))
    if field in ("has_bias", "return_entropy", "hidden_grad"):
        return str(bool(value))
    return str(value)


def check_group(name: str, group: object) -> None:
    """``TypeError`` unless ``group`` is a ProcessGroup; ``ValueError`` if this process is not in it
    (raised locally, before any collective)."""
    process_group = getattr(dist, "ProcessGroup", None)
    if process_group is None or not dist.is_available():
        raise TypeError(f"{name} needs torch.distributed, which this PyTorch build does not have")
    if not isinstance(group, process_group):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup (e.g. from dist.new_group), "
            f"got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of {name}")


def collective_device(group: object, data: object) -> torch.device:
    """Where a small control tensor must live for ``group``'s backend: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return torch.device("cpu")
    if isinstance(data, torch.Tensor) and data.device.type == "cuda":
        return data.device
    return torch.device("cuda", torch.cuda.current_device())


# -------------------------------------------------------------------------------- local checks
def _local_checks(hidden, weight, bias, token_ids, temperature, ignore_index, chunk_rows) -> torch.Tensor:
    """The checks of ``linear_token_logprobs`` (and a non-empty shard); returns the int ids."""
    ids = check_linear_inputs(hidden, weight, token_ids, bias, temperature, ignore_index, shard=True)
    if chunk_rows is not None:
        check.positive_int("chunk_rows", chunk_rows)
    return ids


def _id_stats(ids: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """int64 ``[3]`` on the ids' device: a position-weighted checksum, min and max active id."""
    flat = ids.reshape(-1).long()
    if flat.numel() == 0:
        return torch.tensor([0, _INT64_MAX, _INT64_MIN], dtype=torch.int64, device=ids.device)
    pos = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    # Σ (id + c)·w(pos) with odd pseudo-random int64 weights (wrapping arithmetic is fine and
    # exact, so the sum is order-independent): two id vectors collide with probability ~2^-63.
    weights = (pos * 0x2545F4914F6CDD1D + 0x1F123BB5) | 1
    digest = ((flat + 0x51ED27) * weights).sum()
    active = flat != ignore_index
    lo = torch.where(active, flat, _INT64_MAX).amin()
    hi = torch.where(active, flat, _INT64_MIN).amax()
    return torch.stack([digest, lo, hi])


def _descriptor(hidden, weight, bias, ids, temperature, ignore_index, return_entropy, chunk_rows, error):
    """This rank's int64 descriptor (on the ids' device when the local checks passed)."""
    host = [0] * _DESC_LEN
    if error is not None:
        host[_F["error"]] = agreement.error_code(error)
        host[len(_FIELDS) :] = agreement.message_words(error)
        return torch.tensor(host, dtype=torch.int64)
    host[_F["n"]] = ids.numel()
    host[_F["hidden_size"]] = hidden.shape[-1]
    host[_F["vocab_local"]] = weight.shape[0]
    host[_F["dtype"]] = agreement.dtype_code(hidden.dtype)
    host[_F["device_type"]] = agreement.device_code(hidden.device)
    host[_F["has_bias"]] = int(bias is not None)
    host[_F["temperature"]] = agreement.float_bits(float(temperature))
    host[_F["ignore_index"]] = int(ignore_index)
    host[_F["return_entropy"]] = int(bool(return_entropy))
    host[_F["hidden_grad"]] = int(hidden.requires_grad and torch.is_grad_enabled())
    host[_F["chunk_rows"]] = 0 if chunk_rows is None else int(chunk_rows)
    desc = torch.tensor(host, dtype=torch.int64).to(ids.device)
    desc[_F["id_hash"] : _F["id_max"] + 1] = _id_stats(ids, int(ignore_index))
    return desc


def _verdict(table: list[list[int]]) -> tuple[type[Exception], list[str]] | None:
    """The same ``(exception type, problems)`` on every rank, or ``None`` when the layout agrees."""
    failed = agreement.local_rejections(table, _F["error"], len(_FIELDS))
    if failed is not None:
        return failed
    problems = agreement.disagreements(table, _F, _MUST_AGREE, _format)
    hashes = [row[_F["id_hash"]] for row in table]
    # Different N: different ids follow, nothing more to say.
    if len(set(hashes)) > 1 and not (problems and problems[0].startswith("token count")):
        differ = [r for r, v in enumerate(hashes) if v != hashes[0]]
        problems.append(f"token_ids differ across ranks: rank(s) {differ} differ from rank 0")
    return (ValueError, problems) if problems else None


def _raise_for(verdict: tuple[type[Exception], list[str]], world: int, cause: Exception | None) -> None:
    exc, problems = verdict
    raise exc(
        f"vocab-parallel linear_token_logprobs over the {world} ranks of tp_group (every rank "
        f"raises this error): " + "; ".join(problems)
    ) from cause


def _check_global_range(ids: torch.Tensor, table: list[list[int]], ignore_index: int) -> None:
    vocab = sum(row[_F["vocab_local"]] for row in table)
    lo, hi = table[0][_F["id_min"]], table[0][_F["id_max"]]
    if lo == _INT64_MAX or (lo >= 0 and hi < vocab):  # no active id, or all in range
        return
    sizes = " + ".join(str(row[_F["vocab_local"]]) for row in table)
    try:
        # The ids are the same on every rank (checksummed), so every rank raises the same message.
        check.token_ids_in_range("token_ids", ids, vocab, ignore_index)
    except ValueError as err:
        raise ValueError(
            f"{err} (the global vocabulary of tp_group: V = {sizes} = {vocab}; every rank raises this error)"
        ) from None


# ---------------------------------------------------------------------------------- the protocol
@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """What the ranks agreed on: this rank's checked ids and where its shard sits in the vocabulary.

    Attributes:
        ids: this rank's ``token_ids`` (an integer tensor, unchanged).
        vocab_start: the first global vocabulary row of this rank's shard (Σ V of the lower ranks).
        largest_shard: max V_r (chunks are sized for it, so every rank runs as many).
    """

    ids: torch.Tensor
    vocab_start: int
    largest_shard: int


def agree_across_ranks(
    hidden,
    weight,
    bias,
    token_ids,
    tp_group,
    *,
    temperature,
    ignore_index,
    return_entropy,
    chunk_rows,
    validate,
) -> ShardLayout:
    """The cross-rank checks of one vocab-parallel call (a collective: one ``all_gather`` and one
    host read). Raises on every rank alike, or returns this rank's :class:`ShardLayout`.

    Raises:
        TypeError: ``tp_group`` is not a ProcessGroup (locally, before any collective); or every
            rank failed a type check of its local inputs.
        ValueError: a rank's local checks failed, a field of :data:`_MUST_AGREE` or the ids'
            checksum differs across ranks, or (``validate``) an active id is outside the global
            ``[0, V)``.
    """
    check_group("tp_group", tp_group)
    error = None
    ids = None
    try:
        ids = _local_checks(hidden, weight, bias, token_ids, temperature, ignore_index, chunk_rows)
    except (TypeError, ValueError) as err:
        error = err
    desc = _descriptor(
        hidden, weight, bias, ids, temperature, ignore_index, return_entropy, chunk_rows, error
    )
    table = agreement.gather_rows(desc, tp_group, collective_device(tp_group, hidden))
    verdict = _verdict(table)
    if verdict is not None:
        _raise_for(verdict, len(table), error)
    if validate:
        _check_global_range(ids, table, int(ignore_index))
    sizes = [row[_F["vocab_local"]] for row in table]
    rank = dist.get_rank(tp_group)
    return ShardLayout(ids=ids, vocab_start=sum(sizes[:rank]), largest_shard=max(sizes))
