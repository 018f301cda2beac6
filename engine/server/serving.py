"""What the server serves now, and swapping it (POST /stowage/load): the old model's requests end, its scheduler
stops and its engine's memory is released, then the new model is planned and loaded on a worker thread and a new
Scheduler takes it.

A scheduler thread still owns its engine alone: a swap closes the scheduler before it frees the engine, and starts
the next scheduler only once the next engine is loaded. Handlers read `Serving.current` once per request; it is
None while a load runs and after one failed or was cancelled.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..formats.discovery import FoundModel, Places, discover
from ..errors import GenerationCancelled, InsufficientMemoryError, InvalidArgumentError
from ..planning import Plan, PlanRequest, check, default_context_tokens, detect_budgets, inspect
from ..serving.scheduler import Scheduler
from .schemas import LoadRequest

STOP_POLL_SECONDS = 0.01  # how often a swap looks whether the old scheduler has answered its cancelled requests
Report = Callable[[float, str], None]  # the fraction of the model loaded, and the stage: as Engine.load reports


@dataclass(frozen=True)
class LoadDefaults:
    """What `stowage serve` was started with, for loads that do not say; and where this machine's models are."""

    places: Places
    parallel: int
    max_queue: int
    gpu_layers: int | str | None = None
    kv_disk_budget: int | None = None


def plan_serving(path: Path, request: PlanRequest) -> Plan:
    """The plan of request.num_seqs sequences of request.context_tokens against this machine's memory now;
    InsufficientMemoryError or InvalidArgumentError when it cannot be served."""
    try:
        plan = check(inspect(path), request, detect_budgets())
    except InsufficientMemoryError as e:
        if request.num_seqs == 1:
            raise
        raise InsufficientMemoryError(f"{e} With --parallel {request.num_seqs}, each sequence holds a whole context "
                                      "of KV cache: fewer sequences need less.") from None
    if request.num_seqs > plan.prefill_chunk:  # the planner charges a decode step's activations as a chunk's
        raise InvalidArgumentError(f"--parallel {request.num_seqs} is more than the prefill chunk of "
                                   f"{plan.prefill_chunk} tokens; serve at most that many sequences")
    return plan


class Served:
    """One loaded model: the scheduler that owns its engine, and what the API says of it."""

    def __init__(self, name: str, scheduler: Scheduler):
        self.name, self.scheduler, self.engine = name, scheduler, scheduler.engine
        self.created = int(time.time())
        # fixed once loaded (the KV cache is allocated whole), and read here rather than from the event loop while
        # the scheduler thread runs the engine; kept after close, for handlers that read them during a swap
        self.context_tokens = self.engine.cache.context_tokens
        self.memory_report = self.engine.memory_report()
        self._lock = threading.Lock()
        self._cancels: set[threading.Event] = set()  # the open requests' cancel events
        self._stopping = False

    def track(self, cancel: threading.Event) -> None:
        """Count a request as open until untrack; one that arrives while the model stops is cancelled at once."""
        with self._lock:
            if self._stopping:
                cancel.set()
            self._cancels.add(cancel)

    def untrack(self, cancel: threading.Event) -> None:
        with self._lock:
            self._cancels.discard(cancel)

    def stop(self) -> None:
        """Cancel the open requests (each ends with its final event, `finish_reason` cancelled), then close."""
        with self._lock:
            self._stopping = True
            cancels = list(self._cancels)
        for cancel in cancels:
            cancel.set()
        # the scheduler answers a cancelled request at its next step; closed before, it would answer "shutting down"
        while self.scheduler.num_running or self.scheduler.num_waiting:
            time.sleep(STOP_POLL_SECONDS)
        self.close()

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()


class Serving:
    """The model served now (None: none), and the one load that may run; `defaults` None: loads are not offered."""

    def __init__(self, current: Served | None, defaults: LoadDefaults | None = None):
        self.current = current
        self.defaults = defaults
        self.loading: str | None = None  # the id of the model a load is loading
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None  # the running load's
        self.on_loaded: Callable[[Served], None] | None = None  # told of each model a load made current

    @classmethod
    def of(cls, scheduler: Scheduler) -> "Serving":
        """A started scheduler's model, served without loads (an app made in a test)."""
        return cls(Served(scheduler.engine.name, scheduler))

    def models(self) -> tuple[FoundModel, ...]:
        """The models this machine lists (`stowage list`): the only ones a load may name."""
        return discover(self.defaults.places).models if self.defaults is not None else ()

    def find(self, model_id: str) -> FoundModel | None:
        """The listed model whose id is model_id (the first where two places hold one name); never a path."""
        return next((m for m in self.models() if m.name == model_id), None)

    def begin_load(self, model_id: str, cancel: threading.Event) -> bool:
        """Take the one load; False while another runs."""
        with self._lock:
            if self.loading is not None:
                return False
            self.loading, self._cancel = model_id, cancel
            return True

    def end_load(self) -> None:
        with self._lock:
            self.loading = self._cancel = None

    def load(self, found: FoundModel, request: LoadRequest, report: Report, cancel: threading.Event) -> Served:
        """After begin_load, on a worker thread: stop the model served now, plan `found` and load it; ends the load.

        Raises GenerationCancelled once `cancel` is set (between tensors), leaving no model served."""
        from ..runtime.engine import Engine

        try:
            if cancel.is_set():  # gone before anything changed: the model served stays
                raise GenerationCancelled("loading cancelled")
            old, self.current = self.current, None
            if old is not None:
                report(0.0, f"unloading {old.name}")
                old.stop()
                del old
                release_memory()
            defaults = self.defaults
            report(0.0, "planning")
            plan = plan_serving(found.path, PlanRequest(
                request.context_tokens or default_context_tokens(found.path), dtype=request.dtype,
                kv_dtype=request.kv_dtype, gpu_layers=defaults.gpu_layers,
                num_seqs=request.parallel or defaults.parallel, kv_disk_budget=defaults.kv_disk_budget))
            if cancel.is_set():
                raise GenerationCancelled("loading cancelled")
            engine = Engine.load(found.path, plan, progress=report, cancel=cancel)
            scheduler = Scheduler(engine, max_running=plan.num_seqs, max_waiting=defaults.max_queue).start()
            self.current = Served(found.name, scheduler)
            if self.on_loaded is not None:
                self.on_loaded(self.current)
            return self.current
        finally:
            self.end_load()

    def close(self) -> None:
        """At shutdown: cancel a load that runs, and close the model served."""
        with self._lock:
            if self._cancel is not None:
                self._cancel.set()
        if self.current is not None:
            self.current.close()


def release_memory() -> None:
    """Collect what a closed engine left: Engine.load froze its objects (gc.freeze), which the collector skips."""
    gc.unfreeze()
    gc.collect()
