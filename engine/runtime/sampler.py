"""Choosing the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty; within a grammar's
allowed tokens when the reply has one (engine/text/grammar.py)."""

from __future__ import annotations

import torch

from ..errors import ModelFormatError
from .sampling_params import MAX_SEED, MAX_STOP_CHARS, MAX_STOPS, SamplingParams  # noqa: F401 (read from here too)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        # the reply's place in its grammar; its first mask is computed from here on, while the prompt is read
        self.constraint = params.grammar.constraint() if params.grammar is not None else None

    @property
    def is_finished(self) -> bool:
        """The reply's grammar is complete: nothing but an EOS may follow."""
        return self.constraint is not None and self.constraint.is_finished

    def __call__(self, logits: torch.Tensor, seen_ids: torch.Tensor | None = None) -> int:
        """logits: [vocab] fp32 (on any device); seen_ids: token ids the penalty applies to. With a grammar, only
        a token it allows is chosen, and the grammar moves past it."""
        token = self._choose(logits, seen_ids)
        if self.constraint is not None:
            self.constraint.consume(token)
        return token

    def _choose(self, logits: torch.Tensor, seen_ids: torch.Tensor | None) -> int:
        p = self.params
        logits = logits.float().cpu()
        if not bool(torch.isfinite(logits.sum(dtype=torch.float64))):  # one pass: any NaN or inf makes the sum one
            # NaN or inf scores come from weights holding NaN/inf, or from a float16 overflow; sampling from
            # them would pick garbage (or fail), so say where they come from.
            raise ModelFormatError("the model produced NaN or infinite scores: its weights may hold NaN/inf values "
                                   "(a corrupt file), or float16 overflowed (try --dtype float32)")
        if p.repetition_penalty != 1.0 and seen_ids is not None and seen_ids.numel():
            # As Hugging Face: shrink the score of every seen token towards "less likely".
            scores = logits.gather(0, seen_ids)
            scores = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
            logits = logits.scatter(0, seen_ids, scores)
        if self.constraint is not None:
            logits = logits.masked_fill(self.constraint.disallowed(), float("-inf"))  # never all: an EOS at least
        if p.is_greedy:
            return int(logits.argmax())
        # Shift so the best score is 0, in float64 (a float32 0 for temperature 1e-300 would divide 0 by 0):
        # a tiny temperature then sends the others to -inf, never to NaN.
        logits = (logits.double() - logits.max()) / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            probs = _nucleus(probs, p.top_p)
        return draw(probs, self.generator)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn with probability probs[i] / probs.sum() (probs >= 0, float64): the first whose running sum
    passes a uniform draw, so a token of probability 0 is never drawn. Much cheaper than torch.multinomial on a
    large vocabulary, which a server pays for every stream's every token (docs/benchmarks.md)."""
    total = probs.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * total[-1]
    return min(int(torch.searchsorted(total, u, right=True)), probs.numel() - 1)


NUCLEUS_CANDIDATES = 1024  # the most likely tokens sorted first; the whole vocabulary only when they hold < top_p


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs with all but the smallest most-likely set whose mass reaches top_p set to 0 (the token that crosses
    it included). Sorting a 150k vocabulary costs milliseconds a token: the candidates come from topk, which
    holds the whole set unless the distribution is flat."""
    k = min(NUCLEUS_CANDIDATES, probs.numel())
    sorted_probs, order = probs.topk(k)
    if k < probs.numel() and float(sorted_probs.sum()) < top_p:
        sorted_probs, order = probs.sort(descending=True)
    drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
    return torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
