"""One reply in process: a request to the engine's scheduler (engine/serving/scheduler.py), stepped by the thread
that iterates it; and the records every reply fills, in process or served."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the text this token adds (may be "" while a character is incomplete)


@dataclass
class GenerationResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0  # tokens generated: token_ids' count, or a server's usage where it sends no ids
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "context_full", "cancelled"
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the cache from earlier turns
    prefilled_tokens: int = 0  # prompt tokens computed now
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    first_token_seconds: float = 0.0
    # a server's reply only: the tool calls it made, as OpenAI's API writes them ({"id", "type", "function"})
    tool_calls: list[dict] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes from prefill's logits; the rest each cost one decode step
        steps = max(self.completion_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


PrefillProgress = Callable[[int, int], None]  # (tokens prefilled so far, tokens this prefill computes)


class Stepper(Protocol):
    """What a Generation drives (serving/scheduler.py Scheduler): the one generation loop."""

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, emit: Callable[[object], None],
               cancel: threading.Event) -> GenerationResult: ...

    def step(self) -> None: ...


class Generation:
    """Iterate for TokenEvents; `result` fills in as it goes and is final when iteration ends.

    Iterating submits the prompt to the scheduler and steps it on this thread until the reply ends; a failed step's
    error is raised here. Leaving the iteration early cancels the reply. `progress`, when given (or set before
    iterating), is called after each prefill chunk with (done, total): the prompt tokens computed so far and all it
    computes now (the cached prefix not counted), so a long prompt can show a progress bar.
    """

    def __init__(self, scheduler: Stepper, prompt_ids: list[int], sampling: SamplingParams,
                 cancel: threading.Event | None, *, progress: PrefillProgress | None = None):
        self.scheduler, self.prompt_ids, self.sampling = scheduler, prompt_ids, sampling
        self.cancel, self.progress = cancel, progress
        self.result = GenerationResult(prompt_tokens=len(prompt_ids))
        self._started = False

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._started:
            raise RuntimeError("a Generation can be iterated once")
        self._started = True
        return self._run()

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result

    def _run(self) -> Iterator[TokenEvent]:
        events: deque[object] = deque()
        # the request's own: set when the caller's is, and when the caller stops iterating (never the caller's)
        cancel = threading.Event()
        r = self.result = self.scheduler.submit(self.prompt_ids, self.sampling, events.append, cancel)
        last: object = None  # the request's last event: its result, or the error that ended it
        reported = 0  # prefilled tokens told to progress
        try:
            while last is None:
                if self.cancel is not None and self.cancel.is_set():
                    cancel.set()
                self.scheduler.step()
                if self.progress is not None and r.prefilled_tokens > reported:
                    reported = r.prefilled_tokens
                    self.progress(reported, r.prompt_tokens - r.reused_tokens)
                while events and last is None:
                    event = events.popleft()
                    if isinstance(event, TokenEvent):
                        yield event
                    elif isinstance(event, (GenerationResult, Exception)):
                        last = event
        finally:
            cancel.set()  # a no-op once the request ended; else it ends at the next step
            while last is None:
                self.scheduler.step()
                last = next((e for e in events if isinstance(e, (GenerationResult, Exception))), None)
        if isinstance(last, Exception):
            raise last


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that could start one.

    Incremental (Knuth-Morris-Pratt, one automaton per stop string): a feed costs its text's length times the
    number of stop strings, whatever their length; the text held back is the longest tail of all text fed that is
    a prefix of a stop string, so a stop split across tokens is found."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._fallback = [_fallback(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: the longest tail of the text that is a prefix of it
        self.pending = ""  # the text held back: as long as the longest of those tails

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to show now, and whether a stop string was met (the text before the earliest one)."""
        start = None  # where the earliest stop met starts, in pending + text
        for i, (stop, fallback) in enumerate(zip(self.stops, self._fallback)):
            k = self._matched[i]
            for j, c in enumerate(text):
                while k and stop[k] != c:
                    k = fallback[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):  # a later end of this stop starts later too: the first is the one
                    at = len(self.pending) + j + 1 - k
                    start = at if start is None else min(start, at)
                    break
            self._matched[i] = k
        if start is not None:
            out, self.pending = (self.pending + text)[:start], ""
            return out, True
        pending = self.pending + text
        cut = len(pending) - max(self._matched, default=0)
        out, self.pending = pending[:cut], pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        self._matched = [0] * len(self.stops)
        return out


def _fallback(stop: str) -> list[int]:
    """KMP's failure function: fallback[k] is the longest proper prefix of stop[:k + 1] that is also its suffix."""
    fallback, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fallback[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fallback[i] = k
    return fallback
