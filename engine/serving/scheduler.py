"""The one generation loop: continuous batching, requests joining and leaving between decode steps.

`Scheduler.step` drives every reply: the server's scheduler thread calls it for the requests of all its clients,
and an in-process reply (Engine.generate, runtime/generation.py) calls it on the thread that iterates it, on the
engine's own scheduler of one sequence. One step runs at most one prefill chunk (so one long prompt does not stall
the other streams), then one decode step for every sequence that has a token to feed: one pass over the weights for
all of them (`Transformer.decode_step`), attention per sequence through its block table. The KV cache is planned for
`max_running` sequences of the whole context, so a running sequence always finds room once idle cached
conversations are evicted (prefix_pool.py): blocks it shares with others are counted once, which only lowers use.

A request takes its cache (PrefixPool.take) just before its first prefill chunk, not when admitted: prompts are
prefilled one at a time in admission order, so by then those admitted before it are cached, and it shares the
whole blocks it has in common with them (a system prompt sent by several clients at once is prefilled once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from stowage.kernels.cpu_decode import MAX_LANES, torch_on_one_thread

from ..errors import GenerationCancelled, StowageError, WeightsChangedError
from ..runtime.generation import GenerationResult, StopMatcher, TokenEvent
from ..runtime.sampler import Sampler, SamplingParams

log = logging.getLogger(__name__)

# Called on the thread that steps the scheduler: TokenEvents (PrefillProgress while a long prompt is read), then one
# GenerationResult, or an exception in its place.
Emit = Callable[[object], None]


@dataclass(frozen=True)
class PrefillProgress:
    """Prompt tokens in the cache so far, of the whole prompt: sent after each prefill chunk but the last."""

    done_tokens: int
    prompt_tokens: int


class ServerBusyError(StowageError):
    """Every sequence is busy and the waiting queue is full."""


class _Request:
    """One submitted request: its conversation, and the per-token state of its sequence."""

    def __init__(self, prompt_ids: list[int], sampling: SamplingParams, emit: Emit, cancel: threading.Event,
                 tokenizer):
        self.prompt_ids, self.sampling, self.emit, self.cancel = prompt_ids, sampling, emit, cancel
        self.result = GenerationResult(prompt_tokens=len(prompt_ids))
        self.submitted = time.perf_counter()
        self.sampler = Sampler(sampling)
        self.decoder = tokenizer.stream_decoder()
        self.stops = StopMatcher(sampling.stop)
        self.seen = list(prompt_ids)  # for the repetition penalty
        self.conv = None  # the Conversation whose Sequence holds this request's K/V, once admitted
        self.cursor = 0  # prompt tokens in the cache
        self.next_token: int | None = None  # sampled, to be fed by the next decode step
        self.stop_matched = False  # the last token was EOS, completed a stop string or the reply's grammar

    def start(self, conv, reused: int) -> None:
        self.conv, self.cursor = conv, reused
        self.result.reused_tokens = reused

    @property
    def is_prefilling(self) -> bool:
        return self.cursor < len(self.prompt_ids)

    def sample(self, logits: torch.Tensor) -> int:
        penalty = self.sampling.repetition_penalty != 1.0
        return self.sampler(logits, torch.tensor(self.seen) if penalty else None)

    def accept(self, token: int, engine) -> None:
        """Take a sampled token: stream its text, and either finish or feed it to the next decode step."""
        r = self.result
        if not r.token_ids:
            r.first_token_seconds = time.perf_counter() - self.submitted
        self.stop_matched = token in engine.eos_ids
        if not self.stop_matched:
            r.token_ids.append(token)
            r.completion_tokens += 1
            self.seen.append(token)
            engine.stats.generated_tokens += 1
            text, self.stop_matched = self.stops.feed(self.decoder.push(token))
            r.text += text
            # every token, its text empty or not: a special token decodes to nothing, and a reader of the model's
            # own markers (gpt-oss's channels, Mistral's [TOOL_CALLS]) knows it by its id
            self.send(TokenEvent(token, text))
        # a grammar complete (a JSON value closed): only an EOS could follow, which would cost a step to sample
        self.stop_matched = self.stop_matched or self.sampler.is_finished
        reason = self.stop_reason(engine.cache.context_tokens)
        if reason is not None:
            self.finish(reason)
        else:
            self.next_token = token

    def stop_reason(self, context_tokens: int) -> str | None:
        """Why this request ends now, or None: the stop rule of every reply, asked after each sampled token and
        before each step.

        A full context: the prompt and the reply fill the context's tokens. The last token sampled needs no K/V to be
        shown, but a chat feeds the whole reply back with the next turn's prompt, where it must fit."""
        r = self.result
        if self.stop_matched:
            return "stop"
        if r.completion_tokens >= self.sampling.max_tokens:
            return "length"
        if r.prompt_tokens + r.completion_tokens >= context_tokens:
            return "context_full"
        if self.cancel.is_set():
            return "cancelled"
        return None

    def finish(self, reason: str) -> None:
        self.next_token = None
        self.result.finish_reason = reason
        tail = self.stops.flush() if reason != "cancelled" else ""
        if tail:  # empty after a stop string: the match dropped what followed it
            self.result.text += tail
            self.send(TokenEvent(-1, tail))

    def send(self, event) -> None:
        try:
            self.emit(event)
        except Exception:  # the client's side is gone (its event loop closed): nobody to generate for
            self.cancel.set()


class Scheduler:
    """Runs an engine's replies, `max_running` at a time: `submit` from any thread; `step` from one thread only,
    its own once started (the server) or the one iterating an in-process reply."""

    def __init__(self, engine, *, max_running: int, max_waiting: int,
                 on_broken: Callable[[WeightsChangedError], None] | None = None):
        """on_broken: called once, on the stepping thread, when a weights file changed under the model, just before
        every open request ends with that error; every later submit raises it (the server unloads the model)."""
        self.engine = engine
        self.on_broken = on_broken
        self.broken: WeightsChangedError | None = None
        self.max_running, self.max_waiting = max_running, max_waiting
        self.pool = engine.pool  # the engine's one eviction policy, whichever scheduler runs it
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._num_active = 0  # submitted and not yet answered in full: waiting + running
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="stowage-scheduler", daemon=True)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop after the current step; requests still open end with GenerationCancelled."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, emit: Emit,
               cancel: threading.Event) -> GenerationResult:
        """Queue a completion of prompt_ids; its events go to emit on the stepping thread; cancel.set() stops it.
        Returns the result the steps fill in (its last event, unless an error takes its place).

        Raises ServerBusyError when max_running requests run and max_waiting more wait already."""
        with self._cond:
            if self.broken is not None:
                raise self.broken
            if self._closed:
                raise GenerationCancelled("the server is shutting down")
            if self._num_active >= self.max_running + self.max_waiting:
                raise ServerBusyError(
                    f"the server is busy: all {self.max_running} sequences are generating and {self.max_waiting} "
                    "requests are waiting; retry shortly (or serve with a larger --parallel or --max-queue)")
            request = _Request(list(prompt_ids), sampling, emit, cancel, self.engine.tokenizer)
            self._waiting.append(request)
            self._num_active += 1
            self._cond.notify()
        return request.result

    def step(self) -> None:
        """Admit what waits (up to max_running), then run at most one prefill chunk and one decode step for every
        sequence with a token to feed; send each request its events, and its last one once it ends."""
        with self._cond:
            admitted = [self._waiting.popleft()
                        for _ in range(min(len(self._waiting), self.max_running - len(self._running)))]
        for request in admitted:
            self._admit(request)
        for request in self._running:  # cancelled since the last step
            reason = request.stop_reason(self.engine.cache.context_tokens)
            if reason is not None and request.result.finish_reason is None:
                request.finish(reason)
        prefilling = next((r for r in self._running if r.is_prefilling and r.result.finish_reason is None), None)
        if prefilling is not None:
            self._guarded([prefilling], self._prefill_chunk)
        decoding = [r for r in self._running if r.next_token is not None]
        if decoding:
            self._guarded(decoding, self._decode)
        for request in [r for r in self._running if r.result.finish_reason is not None]:
            self._answer(request, request.result)

    # -- the scheduler thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self._running):
                    self._cond.wait()
                if self._closed:
                    break
            self.step()
        for request in [*self._running, *self._waiting]:
            self._answer(request, GenerationCancelled("the server is shutting down"))
        self.pool.clear()

    def _admit(self, request: _Request) -> None:
        reason = request.stop_reason(self.engine.cache.context_tokens)
        if reason is not None:  # cancelled while it waited: leave the cached conversations as they are
            request.finish(reason)
            return self._answer(request, request.result)
        self._running.append(request)

    def _start(self, request: _Request) -> None:
        """Give a request its conversation: the longest prefix of its prompt cached, idle or in a running sequence."""
        running = [r.conv.seq for r in self._running if r.conv is not None]
        conv, reused = self.pool.take(request.prompt_ids, running)
        request.start(conv, reused)
        self.engine.stats.reused_tokens += reused

    def _prefill_chunk(self, requests: list[_Request]) -> None:
        (r,) = requests
        if r.conv is None:
            self._start(r)
        engine, seq = self.engine, r.conv.seq
        chunk = r.prompt_ids[r.cursor : r.cursor + engine.prefill_chunk]
        self.pool.make_room([(seq, len(chunk))])
        start = time.perf_counter()
        engine.check_weights()
        with torch_on_one_thread() if engine.model.prefills_on_native_tiles else nullcontext():
            logits = engine.model.forward(chunk, seq, engine.cache)
        engine.check_weights()  # a file truncated during the chunk: its pages read as zeros; discard what it gave
        r.result.prefill_seconds += time.perf_counter() - start
        r.cursor += len(chunk)
        r.result.prefilled_tokens += len(chunk)
        engine.stats.prefilled_tokens += len(chunk)
        if r.is_prefilling:
            r.send(PrefillProgress(r.cursor, len(r.prompt_ids)))
            return
        with self._torch_part(1):
            r.accept(r.sample(logits[-1]), engine)

    def _decode(self, requests: list[_Request]) -> None:
        engine = self.engine
        seqs = [r.conv.seq for r in requests]
        self.pool.make_room([(seq, 1) for seq in seqs])
        start = time.perf_counter()
        engine.check_weights()
        with self._torch_part(len(requests)):
            logits = engine.model.decode_step([r.next_token for r in requests], seqs, engine.cache)  # [n, vocab]
            engine.check_weights()  # as after a prefill chunk
            elapsed = time.perf_counter() - start
            for r, row in zip(requests, logits):
                r.result.decode_seconds += elapsed
                r.accept(r.sample(row), engine)

    def _torch_part(self, num_seqs: int):
        """Where the native step runs a token's layers, torch's part of it (the rest of a decode step, sampling) is
        small ops: on one thread (kernels/cpu_decode.torch_on_one_thread)."""
        engine = self.engine
        native = engine.model.native(engine.cache) is not None and num_seqs <= MAX_LANES
        return torch_on_one_thread() if native else nullcontext()

    def _guarded(self, requests: list[_Request], work: Callable[[list[_Request]], None]) -> None:
        # A failure (NaN scores from a corrupt file, a bug) ends the requests in this step; the server goes on.
        try:
            work(requests)
        except WeightsChangedError as e:  # no step can run on this model again: end every request with it
            self._break(e)
        except Exception as e:
            if not isinstance(e, StowageError):
                log.exception("a step of %d request(s) failed", len(requests))
            for r in requests:
                r.next_token = None
                self._answer(r, e)

    def _break(self, e: WeightsChangedError) -> None:
        with self._cond:
            self.broken = e
            waiting, self._waiting = list(self._waiting), deque()
        if self.on_broken is not None:  # first, so whoever reads the error event finds the model already unloaded
            self.on_broken(e)
        for r in [*self._running, *waiting]:
            r.next_token = None
            self._answer(r, e)

    def _answer(self, request: _Request, last: object) -> None:
        """Send the last event and let the request go: its blocks stay cached if it finished, else are freed."""
        if request in self._running:
            self._running.remove(request)
        if request.conv is not None:
            if last is request.result and request.result.finish_reason != "cancelled":
                self.pool.give_back(request.conv)
            else:
                self.pool.release(request.conv)
            request.conv = None
        request.send(last)
        with self._cond:
            self._num_active -= 1
