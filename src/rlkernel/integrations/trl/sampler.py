"""The sampler's per-token log-probs, kept from the logits ``model.generate`` sampled from, and the
mismatch between them and a trainer's log-probs under TRL's metric names.

TRL 1.16's ``GRPOTrainer`` without vLLM samples through ``model.generate`` and throws the sampler's
log-probs away. :class:`SamplerLogprobs` keeps them:

    with SamplerLogprobs(model, temperature=τ) as sampler:
        sequences = model.generate(...)
    logp = sampler.logprobs(completion_ids)      # [B, N] float32, 0 past each completion's end

What is kept, for every generated token: ``log_softmax(z / τ)[id]`` of the *full* distribution of
the raw logits ``z`` the model returned at that step (the float32 copy ``generate`` samples from,
before any logits processor), at the token id the sequence continues with. These are TRL's training
semantics: its loss scores the completion tokens under softmax(z / τ) over the whole vocabulary.
Logits processors (``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``sequence_bias``, ...)
change what is *drawn*, not what is kept: with them, the kept log-prob of a token is the trainer's,
not the log-prob of the truncated or penalized distribution it was drawn from (TRL's vLLM correction
instead reads vLLM's processed log-probs). For a row that finished (EOS) before the others, the
positions after its end hold the pad id ``generate`` appended; they are not part of its completion.

How: a forward hook (``nn.Module.register_forward_hook(..., with_kwargs=True)``) on the model while
the context is open. ``generate`` calls the model once for the prompt (prefill, or several chunks)
and once per new token with a KV cache; the input of a decode step is the token the previous step
appended, so the hook scores the previous step's logits at that token (:func:`rlkernel.token_logprobs`,
batch invariant); the last step's token is read from the completions. Memory: one ``[B, V]`` float32
copy of the last step's logits; time: one log-prob call per decode step.

:func:`sampling_metrics` compares a trainer's log-probs of the same tokens with these, under the names
TRL gives its vLLM mismatch metrics (``sampling/sampling_logp_difference/{mean,max}``,
``sampling/importance_sampling_ratio/{min,mean,max}``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlkernel import token_logprobs

__all__ = ["METRIC_NAMES", "SamplerLogprobs", "sampling_metrics"]

# TRL 1.16's names for the sampler/trainer mismatch (logged by its GRPOTrainer with vLLM only).
METRIC_NAMES = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


class SamplerLogprobs:
    """Records each generated token's log-prob under the logits it was sampled from (module docstring).

    Args:
        model: the module whose forward ``generate`` calls (a transformers causal LM); its output has
            ``.logits`` ``[B, S, V]``, its inputs are given as ``input_ids=``.
        temperature: τ > 0, the sampling temperature (applied to the model's output logits, which
            already hold any logit scale of the model).

    Use it as a context manager around one ``generate`` call, then :meth:`logprobs`.
    """

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        self.model, self.temperature = model, float(temperature)
        self._handle = None
        self._steps: list[torch.Tensor] = []  # [B] float32 log-prob of each decoded position
        self._ids: list[torch.Tensor] = []  # [B] the token id each of them scored
        self._pending: torch.Tensor | None = None  # [B, V] float32 logits of the last step

    def __enter__(self) -> SamplerLogprobs:
        if self._handle is not None:
            raise RuntimeError("SamplerLogprobs is already recording")
        self._steps, self._ids, self._pending = [], [], None
        self._handle = self.model.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._handle = None

    def _hook(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if ids is None or logits is None:
            raise RuntimeError(
                "SamplerLogprobs needs the model called with input_ids and returning logits (generate from "
                "token ids, not inputs_embeds)"
            )
        if ids.shape[-1] == 1 and self._pending is not None:  # a decode step: ids = the previous token
            token = ids[:, 0].to(self._pending.device)
            self._steps.append(token_logprobs(self._pending, token, temperature=self.temperature))
            self._ids.append(token)
        elif self._steps:
            raise RuntimeError(
                "generate ran a forward over more than one new token after decoding started (no KV cache, "
                "use_cache=False?): SamplerLogprobs cannot tell which logits sampled which token"
            )
        # What generate samples from: the last position's logits as a float32 copy (exact from bf16).
        self._pending = logits[:, -1].to(dtype=torch.float32, copy=True)

    @torch.no_grad()
    def logprobs(
        self, completion_ids: Sequence[Sequence[int]] | torch.Tensor, width: int | None = None
    ) -> torch.Tensor:
        """``[B, width]`` float32: the kept log-prob of each completion token, 0 past its end.

        Args:
            completion_ids: the generated tokens of each row as ``generate`` appended them, in the
                batch's order: lists (TRL's, cut after the first EOS), or a ``[B, N]`` tensor.
            width: the output's width (default: the longest completion); at least that.

        Raises:
            RuntimeError: nothing was recorded, or the recorded steps do not line up with the
                completions (a token id differs: never a silently misaligned log-prob).
        """
        if self._pending is None:
            raise RuntimeError("SamplerLogprobs recorded no forward: call it around model.generate")
        if isinstance(completion_ids, torch.Tensor):
            completion_ids = completion_ids.tolist()
        rows = len(completion_ids)
        batch = self._pending.shape[0]
        if rows != batch:
            raise RuntimeError(f"{rows} completions for a generate batch of {batch} rows")
        longest = max((len(c) for c in completion_ids), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width must be >= the longest completion ({longest}), got {width}")
        device = self._pending.device
        steps, ids = list(self._steps), list(self._ids)
        if longest == len(steps) + 1:
            # The last position: its token is not the input of any forward; read it from the completions.
            last = torch.tensor([c[-1] if len(c) == longest else 0 for c in completion_ids], device=device)
            steps.append(token_logprobs(self._pending, last, temperature=self.temperature))
            ids.append(last)
        elif longest > len(steps):  # (generate may run past the end and drop those steps: fewer is fine)
            raise RuntimeError(
                f"the completions are {longest} tokens long but generate ran {len(steps) + 1} steps"
            )
        out = torch.zeros(rows, width, dtype=torch.float32, device=device)
        if longest == 0:
            return out
        logp = torch.stack(steps[:longest], 1)
        recorded = torch.stack(ids[:longest], 1)
        lengths = torch.tensor([len(c) for c in completion_ids], device=device)
        within = torch.arange(longest, device=device)[None] < lengths[:, None]
        expected = torch.tensor([list(c) + [0] * (longest - len(c)) for c in completion_ids], device=device)
        if not bool((recorded == expected)[within].all()):
            raise RuntimeError(
                "the tokens generate fed back differ from the completions: the recorded log-probs do not "
                "line up with them (a generation mode other than sampling or greedy search?)"
            )
        out[:, :longest] = torch.where(within, logp, 0.0)
        return out


def mismatch_totals(train_logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    """``[6]`` float32 over the given tokens (1-D, the active ones): Σ|Δ|, count, Σρ, max|Δ|, max ρ,
    −min ρ, with Δ = train − sampler and ρ = exp(Δ). Sums and maxima combine across micro-batches
    and processes by adding / taking the maximum (:func:`combine_totals`); an empty input gives
    zeros and −inf maxima."""
    delta = train_logp.float() - sampler_logp.float()
    ratio = torch.exp(delta)
    if delta.numel() == 0:
        zero, low = delta.new_zeros(()), delta.new_full((), -torch.inf)
        return torch.stack([zero, zero, zero, low, low, low])
    size = delta.new_tensor(float(delta.numel()))
    return torch.stack([delta.abs().sum(), size, ratio.sum(), delta.abs().max(), ratio.max(), -ratio.min()])


def combine_totals(totals: torch.Tensor) -> torch.Tensor:
    """``[..., 6]`` totals (:func:`mismatch_totals`) combined over the leading dimensions into one ``[6]``."""
    flat = totals.reshape(-1, 6)
    return torch.cat([flat[:, :3].sum(0), flat[:, 3:].amax(0)])


def metrics_from_totals(totals: torch.Tensor) -> dict[str, float]:
    """TRL's metric names from combined totals; ``{}`` when no token was compared."""
    values = totals.tolist()
    if values[1] == 0:
        return {}
    diff_sum, count, ratio_sum, diff_max, ratio_max, neg_ratio_min = values
    return dict(
        zip(
            METRIC_NAMES,
            (diff_sum / count, diff_max, -neg_ratio_min, ratio_sum / count, ratio_max),
            strict=True,
        )
    )


def sampling_metrics(
    train_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """The sampler/trainer mismatch of one batch under TRL's names (:data:`METRIC_NAMES`).

    ``sampling_logp_difference``: mean and max of |train − sampler| over the tokens;
    ``importance_sampling_ratio``: min, mean and max of ρ = exp(train − sampler) per token (TRL's
    vLLM ratio before any truncation: exp(old − sampling)). Exactly 0 and 1 when the two agree bit
    for bit.

    Args:
        train_logp, sampler_logp: float log-probs of the same tokens, same shape.
        mask: bool/int, the tokens to compare (default: all).

    Returns:
        name → float; ``{}`` when no token is compared.
    """
    if train_logp.shape != sampler_logp.shape:
        raise ValueError(
            f"train_logp {tuple(train_logp.shape)} and sampler_logp {tuple(sampler_logp.shape)} must have "
            "the same shape"
        )
    if mask is not None:
        if mask.shape != train_logp.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must have the shape {tuple(train_logp.shape)}")
        keep = mask.bool()
        train_logp, sampler_logp = train_logp[keep], sampler_logp[keep]
    return metrics_from_totals(mismatch_totals(train_logp.reshape(-1), sampler_logp.reshape(-1)))
