"""Choosing the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0 is greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1 or self.top_k < 0:
            raise ValueError("max_tokens must be >= 1 and top_k >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seen_ids: torch.Tensor | None = None) -> int:
        """logits: [vocab] fp32 (on any device); seen_ids: token ids the penalty applies to."""
        p = self.params
        logits = logits.float().cpu()
        if p.repetition_penalty != 1.0 and seen_ids is not None and seen_ids.numel():
            # As Hugging Face: shrink the score of every seen token towards "less likely".
            scores = logits.gather(0, seen_ids)
            scores = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
            logits = logits.scatter(0, seen_ids, scores)
        if p.is_greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the token that crosses it included)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
