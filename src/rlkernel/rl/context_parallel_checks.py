"""The cross-rank checks of a context-parallel loss call: every rank raises the same error, or none.

A ``cp_group`` call (``policy_loss`` / ``fused_policy_loss``) makes collectives inside its algebra
(:mod:`rlkernel.rl.context_parallel`), so every rank must take the same path: the same sequences,
configuration, inputs present, backend and gradient mode. :func:`agree_on_layout` checks that before
the first data collective, in one ``all_gather`` of a small int64 descriptor per rank (its local
check's error and message, the layout, a checksum of the configuration and the options, which inputs
are present, dtype, device type, whether a gradient is needed, the normalizers, the bad-id count of
an id check) and one host read; every rank computes the same verdict from the same table. With
``cp_positions`` a second collective (one SUM all-reduce of ``[2, S]`` int64 and one host read)
checks that the positions partition every sequence: rank r's count of each sequence's tokens and a
sum of a 64-bit mix of their positions, against the sum over 0 … n_i − 1 (a wrong map — a position
repeated, missing or out of range — changes the sum but with probability ~2^-64).

The protocol is that of the vocab-parallel checks (``rlkernel.ops._vocab_parallel_checks``; the
shared pieces in :mod:`rlkernel._rank_agreement`); the
user-facing description is in ``docs/guides/multi-gpu.md`` ("Cross-rank checks").
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist

from rlkernel import _dispatch
from rlkernel import _rank_agreement as agreement
from rlkernel import _validate as check
from rlkernel._options import current_options
from rlkernel.ops._vocab_parallel_checks import check_group, collective_device
from rlkernel.rl.context_parallel import ContextParallel

_FIELDS = (
    "error",  # 0 ok, 1 ValueError, 2 TypeError (the local checks failed)
    "packed",
    "n_seqs",
    "local_width",
    "local_tokens",
    "positions",
    "config",  # crc32 of repr(cfg)
    "options",  # crc32 of the options and the requested backend
    "inputs",  # bit mask of _INPUTS
    "advantages",  # 0 per token, 1 per sequence, 2 either (packed with N = S: the others decide)
    "dtype",
    "device_type",
    "needs_grad",
    "global_tokens_kind",  # 0 None, 1 a number, 2 a tensor
    "global_tokens",  # the float64 bits of its value
    "global_seqs_kind",
    "global_seqs",
    "vocab",  # the id check's V (0: no id check)
    "bad_ids",
    "first_bad_id",
)
_F = {name: i for i, name in enumerate(_FIELDS)}
_DESC_LEN = len(_FIELDS) + agreement.MSG_WORDS  # the fields, then a local error's message
_INPUTS = ("old_logp", "ref_logp", "rollout_logp", "rollout_weights", "entropy")
_MUST_AGREE = (
    ("packed", "layout (padded [B, T] or packed with cu_seqlens)"),
    ("n_seqs", "sequence count S"),
    ("positions", "cp_positions given"),
    ("config", "cfg (a checksum of repr(cfg))"),
    ("options", "rlkernel options and backend (a checksum)"),
    ("inputs", "inputs given"),
    ("dtype", "log-prob source dtype"),
    ("device_type", "device type"),
    ("needs_grad", "whether a gradient is computed"),
    ("global_tokens_kind", "global_tokens given as"),
    ("global_tokens", "global_tokens"),
    ("global_seqs_kind", "global_seqs given as"),
    ("global_seqs", "global_seqs"),
    ("vocab", "vocabulary size V"),
)


@dataclasses.dataclass(frozen=True)
class IdCheck:
    """The id range check of ``fused_policy_loss`` (active ids in ``[0, vocab)``, none exempt),
    folded into the descriptor so that a bad id on one rank raises on every rank."""

    name: str
    token_ids: torch.Tensor
    active: torch.Tensor
    vocab: int


def _crc(value: object) -> int:
    return zlib.crc32(repr(value).encode("utf-8"))


def _normalizer_fields(value) -> tuple[int, int | torch.Tensor]:
    if value is None:
        return 0, 0
    if isinstance(value, torch.Tensor):
        return 2, value.detach().reshape(()).to(torch.float64).view(torch.int64)
    return 1, agreement.float_bits(float(value))


def _descriptor(batch, error, has_positions, sources, entropy, ids: IdCheck | None, device) -> torch.Tensor:
    host = [0] * _DESC_LEN
    if error is not None:
        host[_F["error"]] = agreement.error_code(error)
        host[len(_FIELDS) :] = agreement.message_words(error)
        return torch.tensor(host, dtype=torch.int64, device=device)
    seg = batch.segments
    host[_F["packed"]] = int(seg.is_packed)
    host[_F["n_seqs"]] = seg.n_seqs
    host[_F["local_width"]] = seg.max_len
    host[_F["local_tokens"]] = int(torch.Size(seg.token_shape).numel())
    host[_F["positions"]] = int(has_positions)
    host[_F["config"]] = _crc(batch.cfg)
    host[_F["options"]] = _crc((current_options(), _dispatch.requested_backend()))
    present = (
        batch.old_logp is not None,
        batch.ref_logp is not None,
        batch.rollout_logp is not None,
        batch.rollout_weights is not None,
        bool(entropy),
    )
    host[_F["inputs"]] = sum(int(p) << i for i, p in enumerate(present))
    host[_F["advantages"]] = 2 if batch.advantages_ambiguous else int(batch.advantages_per_seq)
    source = sources[0]
    host[_F["dtype"]] = agreement.dtype_code(source.dtype)
    host[_F["device_type"]] = agreement.device_code(source.device)
    host[_F["needs_grad"]] = int(torch.is_grad_enabled() and any(t.requires_grad for t in sources))
    on_device = {}
    for name, value in (("global_tokens", batch.global_tokens), ("global_seqs", batch.global_seqs)):
        host[_F[f"{name}_kind"]], bits = _normalizer_fields(value)
        if isinstance(bits, torch.Tensor):
            on_device[name] = bits
        else:
            host[_F[name]] = bits
    if ids is not None:
        host[_F["vocab"]] = ids.vocab
    desc = torch.tensor(host, dtype=torch.int64).to(device)
    for name, bits in on_device.items():
        desc[_F[name]] = bits.to(device)
    if ids is not None and ids.token_ids.numel():
        flat, active = ids.token_ids.reshape(-1).long(), ids.active.reshape(-1)
        bad = active & ((flat < 0) | (flat >= ids.vocab))
        first = flat[bad.to(torch.uint8).argmax()]  # the first bad id (any id when none is bad)
        desc[_F["bad_ids"]] = bad.sum().to(device)
        desc[_F["first_bad_id"]] = first.to(device)
    return desc


def _format(field: str, value: int) -> str:
    if field in ("dtype", "device_type"):
        return agreement.describe_code(field, value)
    if field == "inputs":
        return "{" + ", ".join(n for i, n in enumerate(_INPUTS) if value >> i & 1) + "}"
    if field in ("global_tokens", "global_seqs"):
        return repr(agreement.bits_float(value))
    if field.endswith("_kind"):
        return ("None", "a number", "a tensor")[value]
    if field in ("packed", "positions", "needs_grad"):
        return str(bool(value))
    if field in ("config", "options"):
        return f"{value:08x}"
    return str(value)


def _verdict(table: list[list[int]], ids_name: str | None) -> tuple[type[Exception], list[str]] | None:
    """The same ``(exception type, problems)`` on every rank, or None when the ranks agree."""
    failed = agreement.local_rejections(table, _F["error"], len(_FIELDS))
    if failed is not None:
        return failed
    problems = agreement.disagreements(table, _F, _MUST_AGREE, _format)
    readings = {row[_F["advantages"]] for row in table} - {2}
    if len(readings) > 1:
        per_rank = ", ".join(
            f"rank {r}: {('per token', 'per sequence', 'either')[row[_F['advantages']]]}"
            for r, row in enumerate(table)
        )
        problems.append(f"advantages are per sequence on some ranks and per token on others ({per_rank})")
    if not problems and ids_name is not None:
        for r, row in enumerate(table):
            if row[_F["bad_ids"]]:
                msg = check.token_ids_message(ids_name, row[_F["bad_ids"]], row[_F["vocab"]], None,
                                              row[_F["first_bad_id"]])  # fmt: skip
                problems.append(f"on rank {r}, {msg}")
    return (ValueError, problems) if problems else None


def _raise_for(verdict, world: int, what: str, cause: Exception | None) -> None:
    exc, problems = verdict
    raise exc(
        f"context-parallel {what} over the {world} ranks of cp_group (every rank raises this error): "
        + "; ".join(problems)
    ) from cause


# --------------------------------------------------------------------------- the position map
_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # 64-bit odd constants


def _mix(pos: torch.Tensor) -> torch.Tensor:
    """A 64-bit mix of each int64 position (wrapping arithmetic: exact and order-free to sum)."""
    x = (pos + 0x2545F4914F6CDD1D) * _MIX[0]
    x = x ^ (x >> 31)
    x = x * _MIX[1]
    x = x ^ (x >> 29)
    return x * _MIX[2]


def _check_partition(cp: ContextParallel, positions: torch.Tensor, what: str) -> None:
    """Every sequence's positions, over the ranks, are 0 … n_i − 1 each exactly once."""
    seg = cp.segments
    pos = positions.to(torch.int64)
    local = torch.stack(
        [
            seg.to_padded(torch.ones_like(pos), fill=0).reshape(seg.n_seqs, -1).sum(-1),
            seg.to_padded(_mix(pos), fill=0).reshape(seg.n_seqs, -1).sum(-1),
        ]
    )
    counts, mixed = cp.sum(local.to(cp.device)).cpu().unbind()  # the host read
    longest = int(counts.max()) if counts.numel() else 0
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), _mix(torch.arange(longest)).cumsum(0)])
    wrong = (prefix[counts] != mixed).nonzero().flatten().tolist()
    if wrong:
        shown = ", ".join(str(i) for i in wrong[:8]) + (", …" if len(wrong) > 8 else "")
        _raise_for(
            (ValueError, [
                f"cp_positions do not partition sequence(s) {shown} of {seg.n_seqs}: each sequence's "
                "positions over the ranks must be 0 … n_i − 1 (n_i = its token count summed over the "
                "ranks), each on exactly one rank"
            ]),
            cp.world, what, None,
        )  # fmt: skip


def agree_on_layout(
    group: object,
    *,
    batch,
    error: Exception | None,
    positions: torch.Tensor | None,
    has_positions: bool,
    sources: tuple[torch.Tensor, ...],
    entropy: bool | None,
    ids: IdCheck | None,
    what: str,
) -> ContextParallel:
    """The cross-rank check of one context-parallel call (module docstring): a collective.

    Args:
        group: the ``cp_group`` (checked to be a ProcessGroup first, locally).
        batch: this rank's validated :class:`~rlkernel.rl.batch.LossBatch`, or None when its local
            checks failed (``error``).
        error: the local checks' error (TypeError/ValueError) or None.
        positions: this rank's checked ``cp_positions`` (the per-token shape), or None.
        has_positions: whether ``cp_positions`` was given (also when its local check failed).
        sources: the tensors the log-probs come from (``logp``; logits; hidden, weight, bias): the
            first one's dtype and device, and whether any needs a gradient, must agree.
        entropy: whether ``entropy`` is given (``policy_loss``), else None.
        ids: the id check of ``fused_policy_loss`` (None: no check here).
        what: the call's name in errors.

    Returns:
        this rank's :class:`ContextParallel`.

    Raises:
        TypeError / ValueError: on every rank alike (see the module docstring).
    """
    check_group("cp_group", group)
    like = sources[0] if sources and isinstance(sources[0], torch.Tensor) else None
    device = collective_device(group, like)
    desc = _descriptor(batch, error, has_positions, sources, entropy, ids, device)
    table = agreement.gather_rows(desc, group, device)  # the one host read of an agreeing call
    verdict = _verdict(table, None if ids is None else ids.name)
    if verdict is not None:
        _raise_for(verdict, len(table), what, error)
    cp = ContextParallel(
        group=group,
        rank=dist.get_rank(group),
        world=len(table),
        device=device,
        segments=batch.segments,
        local_widths=tuple(row[_F["local_width"]] for row in table),
        local_tokens=tuple(row[_F["local_tokens"]] for row in table),
        positions=positions,
        # A rank with N = S tokens (packed) reads advantages as the others do; all such: per token.
        advantages_per_seq=1 in {row[_F["advantages"]] for row in table},
    )
    if positions is not None:
        _check_partition(cp, positions, what)
    return cp
