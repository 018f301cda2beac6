"""Choosing the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty; within a grammar's
allowed tokens when the reply has one (engine/text/grammar.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError, ModelFormatError
from ..text.grammar import Grammar

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_STOPS = 4  # stop strings a reply takes, as OpenAI's API
MAX_STOP_CHARS = 512  # characters of each: far past a turn marker ("\n\nUser:"); docs/robustness.md


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
    grammar: Grammar | None = None  # the reply must match it (a JSON schema, a tool call); None: free text

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            try:
                number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            except OverflowError:  # an int past float's range
                number = None
            if number is None or not math.isfinite(number):
                raise InvalidArgumentError(f"{name} must be a finite number, got {value!r:.40}")
            # a float from here on: torch cannot multiply a tensor by an int past int64 (10**30 reached the sampler)
            object.__setattr__(self, name, number)
        for name in ("top_k", "max_tokens"):
            if not _is_int(getattr(self, name)):
                raise InvalidArgumentError(f"{name} must be an integer, got {getattr(self, name)!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
               f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop),
               f"stop must be a tuple of strings, got {self.stop!r:.80}")
        _check(len(self.stop) <= MAX_STOPS, f"at most {MAX_STOPS} stop strings, got {len(self.stop)}; "
                                            f"keep the ones that end a reply")
        _check(self.grammar is None or isinstance(self.grammar, Grammar),
               f"grammar must be a Grammar (engine/text/grammar.py bind), got {type(self.grammar).__name__}")
        for i, s in enumerate(self.stop):
            _check(len(s) <= MAX_STOP_CHARS, f"stop string {i + 1} has {len(s):,} characters; at most "
                                             f"{MAX_STOP_CHARS} are matched: give the text that ends a reply")

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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgumentError(message)
