"""The demo's toy task: reverse a short digit string, with a verifiable reward.

Vocabulary (no tokenizer, nothing downloaded): ``<pad> <bos> <eos> 0 … 9 =``, 14 tokens.

A prompt is ``<bos> d1 d2 … dL =`` with ``L`` random digits; the correct completion is the digits in
reverse order followed by ``<eos>``: ``dL … d2 d1 <eos>``. Every prompt has the same length, so a
batch of prompts needs no padding and no attention mask.

Reward in [0, 1] with partial credit: each of the ``L + 1`` target positions (``L`` digits, then
``<eos>``) that the completion gets right at that position scores ``1 / (L + 1)``. A uniformly random
policy scores about ``1 / |V|`` ≈ 0.07; a perfect one scores 1. Partial credit gives GRPO a signal on
every group from the first step, where an all-or-nothing reward would be zero for almost every group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
DIGIT0 = 3  # token id of "0"; digits are 3..12
SEP = 13  # "="
TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", *"0123456789", "=")
VOCAB_SIZE = len(TOKENS)


def decode(ids: list[int] | torch.Tensor) -> str:
    """Token ids -> readable text, e.g. ``"<bos>123=" -> ...``; ``<pad>`` is dropped."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return "".join(TOKENS[i] for i in ids if i != PAD)


@dataclass(frozen=True)
class ReverseTask:
    """Reverse ``length`` digits. ``prompt_len = length + 2``; the answer is ``length + 1`` tokens."""

    length: int = 3

    @property
    def prompt_len(self) -> int:
        return self.length + 2

    @property
    def answer_len(self) -> int:
        return self.length + 1

    def sample_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` prompts ``[n, prompt_len]`` int64 on the CPU, drawn from ``generator``."""
        digits = torch.randint(0, 10, (n, self.length), generator=generator) + DIGIT0
        bos = torch.full((n, 1), BOS, dtype=torch.long)
        sep = torch.full((n, 1), SEP, dtype=torch.long)
        return torch.cat([bos, digits, sep], dim=1)

    def targets(self, prompts: torch.Tensor) -> torch.Tensor:
        """The correct completions ``[n, answer_len]``: reversed digits, then ``<eos>``."""
        digits = prompts[:, 1 : 1 + self.length].flip(1)
        eos = torch.full((prompts.shape[0], 1), EOS, dtype=prompts.dtype, device=prompts.device)
        return torch.cat([digits, eos], dim=1)

    def reward(self, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        """Rewards ``[n]`` float32 in [0, 1]: fraction of target positions matched exactly.

        ``completions`` ``[n, T]`` are the sampled tokens (``<pad>`` after ``<eos>``); positions
        beyond ``T`` count as wrong.
        """
        target = self.targets(prompts).to(completions.device)
        n, t = completions.shape
        k = min(t, self.answer_len)
        hits = (completions[:, :k] == target[:, :k]).float().sum(dim=1)
        return hits / self.answer_len
