"""One reply: prefill what is not cached yet, then sample token by token, streaming text."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stowage.kernels.cpu_decode import torch_on_one_thread

from .kv_cache import KVCache, Sequence
from .sampler import Sampler, SamplingParams
from ..text.tokenizer import Tokenizer


@dataclass
class Conversation:
    """A chat whose K/V stay cached between turns."""

    seq: Sequence = field(default_factory=Sequence)
    last_used: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens


class Host(Protocol):
    """What a generation needs of the engine that runs it (engine/engine.py Engine)."""

    model: object  # engine.model.Transformer: forward(token_ids, seq, cache) -> logits
    cache: KVCache
    tokenizer: Tokenizer
    eos_ids: set[int]
    stats: object  # EngineStats: prefilled_tokens, reused_tokens, generated_tokens
    prefill_chunk: int

    def make_room(self, conv: Conversation, num_tokens: int) -> None: ...

    def check_weights(self) -> None: ...  # raises if a weight file changed on disk since it was mapped


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the text this token adds (may be "" while a character is incomplete)


@dataclass
class GenerationResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "context_full", "cancelled"
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the cache from earlier turns
    prefilled_tokens: int = 0  # prompt tokens computed now
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    first_token_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes from prefill's logits; the rest each cost one decode step
        steps = max(len(self.token_ids) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


PrefillProgress = Callable[[int, int], None]  # (tokens prefilled so far, tokens this prefill computes)


class Generation:
    """Iterate for TokenEvents; `result` fills in as it goes and is final when iteration ends.

    `progress`, when given (or set before iterating), is called from the iterating thread after each
    prefill chunk with (done, total): the prompt tokens computed so far and all it computes now (the
    cached prefix not counted), so a long prompt can show a progress bar.
    """

    def __init__(self, engine: Host, conv: Conversation, prompt_ids: list[int],
                 sampling: SamplingParams, cancel: threading.Event | None, *, progress: PrefillProgress | None = None):
        self.engine, self.conv, self.prompt_ids = engine, conv, prompt_ids
        self.sampling, self.cancel, self.progress = sampling, cancel, progress
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

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def _prefill(self) -> torch.Tensor | None:
        engine, seq, prompt = self.engine, self.conv.seq, self.prompt_ids
        # Reuse the cached prefix; keep at least one token to compute, since we need its logits.
        reuse = min(common_prefix(seq.token_ids, prompt), len(prompt) - 1)
        reuse = engine.cache.truncate(seq, reuse)  # what the cache could keep: 0 when a window was recycled
        engine.make_room(self.conv, len(prompt) + 1)
        r = self.result
        r.reused_tokens = reuse
        start = time.perf_counter()
        chunk = engine.prefill_chunk
        logits = None
        for i in range(reuse, len(prompt), chunk):
            if self._cancelled():
                return None
            engine.check_weights()
            logits = engine.model.forward(prompt[i : i + chunk], seq, engine.cache)
            r.prefilled_tokens += len(prompt[i : i + chunk])
            if self.progress is not None:
                self.progress(r.prefilled_tokens, len(prompt) - reuse)
        r.prefill_seconds = time.perf_counter() - start
        engine.stats.prefilled_tokens += r.prefilled_tokens
        engine.stats.reused_tokens += reuse
        return logits[-1]

    def _run(self) -> Iterator[TokenEvent]:
        engine, r, p = self.engine, self.result, self.sampling
        self.conv.last_used = time.monotonic()
        t0 = time.perf_counter()
        logits = self._prefill()
        if logits is None:
            r.finish_reason = "cancelled"
            return
        sampler = Sampler(p)
        seen = torch.tensor(self.prompt_ids, dtype=torch.int64)
        decoder = engine.tokenizer.stream_decoder()
        stops = StopMatcher(p.stop)
        # the native step's layers: torch's part of a token is small ops (kernels/cpu_decode.torch_on_one_thread)
        one_thread = torch_on_one_thread if engine.model.native(engine.cache) is not None else nullcontext
        decode_start = time.perf_counter()
        while True:
            with one_thread():
                token = sampler(logits, seen if p.repetition_penalty != 1.0 else None)
            if not r.token_ids:
                r.first_token_seconds = time.perf_counter() - t0
            if token in engine.eos_ids:
                r.finish_reason = "stop"
                break
            r.token_ids.append(token)
            engine.stats.generated_tokens += 1
            text, stopped = stops.feed(decoder.push(token))
            r.text += text
            if text:
                yield TokenEvent(token, text)
            if stopped:
                r.finish_reason = "stop"
                break
            if len(r.token_ids) >= p.max_tokens:
                r.finish_reason = "length"
                break
            if self._cancelled():
                r.finish_reason = "cancelled"
                break
            if self.conv.seq.num_tokens >= engine.cache.max_tokens:
                r.finish_reason = "context_full"
                break
            if p.repetition_penalty != 1.0:
                seen = torch.cat([seen, torch.tensor([token])])
            engine.make_room(self.conv, self.conv.seq.num_tokens + 1)
            engine.check_weights()
            with one_thread():
                logits = engine.model.forward([token], self.conv.seq, engine.cache)[-1]
        r.decode_seconds = time.perf_counter() - decode_start
        tail = stops.flush()  # empty after a stop string: the match dropped what followed it
        if tail:
            r.text += tail
            yield TokenEvent(-1, tail)


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to show now, and whether a stop string was met."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
