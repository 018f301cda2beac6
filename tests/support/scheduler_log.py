"""A record of what the server's scheduler emits, for tests that drive engine/serving/scheduler.py directly."""

from __future__ import annotations

import threading

from stowage.engine.runtime.generation import GenerationResult, TokenEvent

TIMEOUT = 60  # seconds a test waits for the scheduler before failing instead of hanging


class Log:
    """Every event of every request, in the order the scheduler thread emitted them."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []
        self.done = {}
        self._all_done = threading.Condition()

    def emitter(self, name, then=None):
        def emit(event):
            with self._all_done:
                self.events.append((name, event))
                if isinstance(event, (GenerationResult, Exception)):  # a request's last event
                    self.done[name] = event
                    self._all_done.notify_all()
            if then is not None:
                then(event)
        return emit

    def wait(self, *names):
        with self._all_done:
            assert self._all_done.wait_for(lambda: all(n in self.done for n in names), TIMEOUT), self.done
        return [self.done[n] for n in names]

    def order(self):
        return [name for name, e in self.events if isinstance(e, TokenEvent)]


def run_to_end(scheduler, prompt_ids, max_tokens):
    """Submit one greedy request and wait for its result (a test fails instead of hanging)."""
    from stowage.engine.runtime.sampler import SamplingParams

    done, out = threading.Event(), []

    def emit(event):
        if isinstance(event, (GenerationResult, Exception)):
            out.append(event)
            done.set()

    scheduler.submit(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens), emit, threading.Event())
    assert done.wait(TIMEOUT)
    assert isinstance(out[0], GenerationResult), out[0]
    return out[0]


def kv_files(kv_dir):
    """The KV store's entry files under kv_dir (one folder per model)."""
    return sorted(kv_dir.glob("*/*.kv"))
