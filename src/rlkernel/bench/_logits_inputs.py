"""The inputs of the ``logits`` benchmark suite and the traffic each workload must move at least.

Two layouts (see :mod:`rlkernel.bench.logits` for the workloads and implementations):

    sliced       the users' call pattern, the suite's headline: the logits are the view
                 ``out[:, P-1:-1]`` of a model output ``out`` ``[B, P+T, V]`` (P = 128 prompt positions,
                 T = 1024 response positions, N = B·T), which requires grad when the workload has a
                 backward (the gradient is the base's, ``[B, P+T, V]``); response lengths are ragged,
                 uniform in ``[T/4, T]`` (one fixed draw per (B, T): every input copy and every run
                 has the same lengths, so the byte model below is exact), the mask 0 beyond each
                 length. Log-prob workloads: ids equal to ``ignore_index`` (-100) beyond each length
                 for rlkernel (how its API expresses padding), valid ids everywhere for the others
                 (TRL gets ``row_mask``), and upstream gradients 0 beyond each length.
    contiguous   the second view, unchanged since the suite's first runs: a fresh contiguous leaf,
                 ``[N, V]`` for log-probs (no padding), ``[B, T, V]`` for losses with ~10 % right
                 padding (lengths uniform in ``[0.8·T, T]``).

Values: bf16 logits ``2·randn`` (never zeros), uniform random token ids, per-sequence advantages
``randn`` broadcast to tokens, old/ref log-probs = the true log-probs + 0.1·randn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.bench._logits_baselines import LOSSES, TEMPERATURE, torch_token_logprobs

SEQ_LEN, SMOKE_SEQ_LEN = 1024, 16
PROMPT_LEN, SMOKE_PROMPT_LEN = 128, 4
LOGP_NOISE = 0.1
SEED = 1234
LENGTH_SEED = 4321  # the ragged lengths' own generator: the same for every input copy and device
IGNORE_INDEX = -100  # rlkernel.token_logprobs' default ignore_index
E = 2  # bytes per bf16 logit


@dataclass(frozen=True)
class Kind:
    pass_: str
    entropy: bool = False
    loss: str | None = None  # a key of LOSSES
    sliced: bool = False  # the users' layout (see the module docstring); False: contiguous


# The headline (sliced) kinds first: the run, its CSV and the README table lead with them.
KINDS: dict[str, Kind] = {
    "sliced_dapo_kl_fwd_bwd": Kind("fwd+bwd", loss="dapo", sliced=True),
    "sliced_gspo_fwd_bwd": Kind("fwd+bwd", loss="gspo", sliced=True),
    "sliced_logprobs_entropy_fwd_bwd": Kind("fwd+bwd", entropy=True, sliced=True),
    "sliced_logprobs_entropy_fwd": Kind("fwd", entropy=True, sliced=True),
    "logprobs_fwd": Kind("fwd"),
    "logprobs_entropy_fwd": Kind("fwd", entropy=True),
    "logprobs_fwd_bwd": Kind("fwd+bwd"),
    "logprobs_entropy_fwd_bwd": Kind("fwd+bwd", entropy=True),
    "dapo_kl_fwd_bwd": Kind("fwd+bwd", loss="dapo"),
    "gspo_fwd_bwd": Kind("fwd+bwd", loss="gspo"),
}


@dataclass(frozen=True)
class Geometry:
    """The ``[B, T]`` layout of N scored tokens (and P prompt positions before them, sliced only)."""

    b: int
    t: int
    p: int

    @property
    def n(self) -> int:
        return self.b * self.t


def _seq_len(n: int, smoke: bool) -> int:
    t = SMOKE_SEQ_LEN if smoke else SEQ_LEN
    return t if n % t == 0 else n


def geometry(n: int, smoke: bool) -> Geometry:
    """B sequences of T = 1024 (16 with ``smoke``) tokens, or one of N when T does not divide N."""
    t = _seq_len(n, smoke)
    return Geometry(b=n // t, t=t, p=SMOKE_PROMPT_LEN if smoke else PROMPT_LEN)


def ragged_lengths(b: int, t: int) -> torch.Tensor:
    """``[B]`` int64 response lengths, uniform in ``[ceil(T/4), T]``, drawn on the CPU from a fixed
    seed: the same on every device and for every input copy."""
    gen = torch.Generator().manual_seed(LENGTH_SEED)
    return torch.randint(math.ceil(t / 4), t + 1, (b,), generator=gen)


def active_tokens(geo: Geometry) -> int:
    """Σ lengths: the tokens of the sliced workloads' N that are not padding."""
    return int(ragged_lengths(geo.b, geo.t).sum())


def _randn(shape, device, gen, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    # Drawn in the target dtype: no fp32 temporary of the size of the logits.
    return torch.randn(shape, device=device, generator=gen, dtype=dtype).mul_(scale)


@torch.no_grad()
def _true_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs of ``ids`` under ``logits`` ``[..., V]`` (any strides), 1024 rows at a time, so
    neither a strided view nor the fp32 log-softmax is materialized whole."""
    rows = [logits] if logits.dim() == 2 else list(logits)  # [T, V] views of a [B, T, V] tensor
    id_rows = [ids] if ids.dim() == 1 else list(ids)
    out = torch.empty(ids.shape, device=logits.device, dtype=torch.float32)
    flat = out.view(-1)
    k = 0
    for x, i in zip(rows, id_rows, strict=True):
        for s in range(0, x.shape[0], 1024):
            got = torch_token_logprobs(x[s : s + 1024], i[s : s + 1024], TEMPERATURE, False)
            flat[k : k + got.numel()] = got
            k += got.numel()
    return out


def _loss_tensors(inp: dict[str, Any], logits: torch.Tensor, gen, lead: tuple[int, int]) -> None:
    """old/ref log-probs near the true ones and per-sequence advantages, into ``inp``."""
    device = logits.device
    true = _true_logp(logits, inp["ids"])
    inp["old_logp"] = true + _randn(lead, device, gen, scale=LOGP_NOISE)
    inp["ref_logp"] = true + _randn(lead, device, gen, scale=LOGP_NOISE)
    inp["adv_seq"] = _randn((lead[0],), device, gen)
    inp["advantages"] = inp["adv_seq"][:, None].expand(*lead).contiguous()


def make_inputs(kind: Kind, n: int, v: int, device: torch.device, *, seq_len: int, seed: int) -> dict:
    """One set of contiguous inputs; loss workloads are ``[B, T]`` with B·T = n, log-prob workloads
    flat ``[n]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b = n // seq_len
    lead = (n,) if kind.loss is None else (b, seq_len)
    x = _randn((*lead, v), device, gen, torch.bfloat16, scale=2.0)
    ids = torch.randint(0, v, lead, device=device, generator=gen)
    inp: dict[str, Any] = {"logits": x, "ids": ids, "b": b, "t": seq_len}
    if kind.loss is None:
        if kind.pass_ == "fwd+bwd":
            inp["grad_out"] = tuple(_randn((n,), device, gen) for _ in range(1 + kind.entropy))
        return inp
    lengths = torch.randint(int(math.ceil(0.8 * seq_len)), seq_len + 1, (b,), device=device, generator=gen)
    inp["mask"] = torch.arange(seq_len, device=device)[None, :] < lengths[:, None]
    _loss_tensors(inp, x, gen, lead)
    return inp


def make_sliced_inputs(kind: Kind, geo: Geometry, v: int, device: torch.device, *, seed: int) -> dict:
    """One set of inputs of the users' layout: ``base`` ``[B, P+T, V]`` (the model output; the
    caller makes it require grad), ``p``, ``ids`` / ``mask`` ``[B, T]`` with the ragged lengths, and
    per kind ``ids_ignore`` + ``grad_out`` (log-probs) or the loss tensors."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t, p = geo.b, geo.t, geo.p
    base = _randn((b, p + t, v), device, gen, torch.bfloat16, scale=2.0)
    ids = torch.randint(0, v, (b, t), device=device, generator=gen)
    lengths = ragged_lengths(b, t).to(device)
    mask = torch.arange(t, device=device)[None, :] < lengths[:, None]
    inp: dict[str, Any] = {"base": base, "p": p, "ids": ids, "mask": mask, "b": b, "t": t}
    if kind.loss is None:
        inp["ids_ignore"] = ids.masked_fill(~mask, IGNORE_INDEX)
        if kind.pass_ == "fwd+bwd":
            inp["grad_out"] = tuple(_randn((b, t), device, gen) * mask for _ in range(1 + kind.entropy))
        return inp
    _loss_tensors(inp, window(base, p), gen, (b, t))
    return inp


def window(base: torch.Tensor, p: int) -> torch.Tensor:
    """``base[:, P-1:-1]``: the positions whose logits predict the T response tokens (a view)."""
    return base[:, p - 1 : -1]


def prompt_extended(x: torch.Tensor, p: int, fill: float | int) -> torch.Tensor:
    """``[B, P-1+T]``: ``x`` ``[B, T]`` after P-1 positions of ``fill`` (contiguous). Liger's
    ``GrpoLossFunction`` reads logits ``[B, L+1, V]`` (it drops the last position itself): given the
    whole model output ``[B, P+T, V]``, its per-token inputs cover the P-1 prompt positions too,
    which a mask of 0 there keeps out of the loss (its kernels skip masked rows)."""
    pad = x.new_full((x.shape[0], p - 1), fill)
    return torch.cat([pad, x], dim=1)


def liger_logits(x: torch.Tensor, b: int, t: int, gen_seed: int) -> torch.Tensor:
    """``[B, T+1, V]`` contiguous, first T positions = ``x`` (viewed as ``[B, T, V]``), last random:
    Liger's input on the contiguous workloads."""
    v = x.shape[-1]
    ext = torch.empty(b, t + 1, v, device=x.device, dtype=x.dtype)
    ext[:, :t].copy_(x.reshape(b, t, v))
    gen = torch.Generator(device=x.device).manual_seed(gen_seed)
    ext[:, t].copy_(_randn((b, v), x.device, gen, x.dtype, scale=2.0))
    return ext


def _per_token_bytes(kind: Kind) -> int:
    if kind.loss is None:
        return 8 + 4 * (1 + kind.entropy)  # ids in, logp (+ entropy) out
    return 8 + 4 + 4 + 1 + (4 if LOSSES[kind.loss][1].get("kl_coef") else 0)  # ids, old, adv, mask (+ ref)


def bytes_moved(kind: Kind, n: int, v: int, geo: Geometry | None = None) -> int:
    """The minimal traffic of one call (the ``ceiling`` row is it at the measured copy bandwidth).

    Contiguous: ``fwd`` N·V·E + N·(8 + 4k); ``fwd+bwd`` 3·N·V·E (read the logits in forward, read
    them again and write the bf16 gradient in backward) + the per-token tensors twice.

    Sliced (``geo`` given; A = active tokens, padding rows need not be read): ``fwd`` A·V·E +
    N·(8 + 4k); ``fwd+bwd`` 2·A·V·E + B·(P+T)·V·E (read the active rows in forward and backward,
    write the base's whole gradient, zeros included) + the per-token tensors twice.
    """
    per_tok = _per_token_bytes(kind)
    if not kind.sliced:
        if kind.pass_ == "fwd":
            return n * v * E + n * per_tok
        return 3 * n * v * E + 2 * n * per_tok
    if geo is None:
        raise ValueError("the sliced workloads' bytes need their geometry")
    active = active_tokens(geo)
    if kind.pass_ == "fwd":
        return active * v * E + n * per_tok
    return 2 * active * v * E + geo.b * (geo.p + geo.t) * v * E + 2 * n * per_tok
