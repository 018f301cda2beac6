"""What a reply is sampled with (SamplingParams), checked when made: apart from the sampler (torch) so that a client
of an engine (`stowage generate`, `chat`, the app) checks its arguments without importing torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
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
        _check(self.grammar is None or _is_grammar(self.grammar),
               f"grammar must be a Grammar (engine/text/grammar.py bind), got {type(self.grammar).__name__}")
        for i, s in enumerate(self.stop):
            _check(len(s) <= MAX_STOP_CHARS, f"stop string {i + 1} has {len(s):,} characters; at most "
                                             f"{MAX_STOP_CHARS} are matched: give the text that ends a reply")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_grammar(value) -> bool:
    from ..text.grammar import Grammar  # only a reply with a grammar has one to check, and torch is loaded then

    return isinstance(value, Grammar)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgumentError(message)
