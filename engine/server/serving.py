"""What the server serves now, and swapping it (POST /stowage/load): the new model is read and planned first,
counting the memory the old one holds as free, and refused then with the old model still served; otherwise the old
model's requests end, its scheduler stops and its engine's memory is released, then the new model is planned against
the memory free now and loaded on a worker thread, and a new Scheduler takes it.

A scheduler thread still owns its engine alone: a swap closes the scheduler before it frees the engine, and starts
the next scheduler only once the next engine is loaded. Handlers read `Serving.current` once per request; it is
None while a load runs and after one failed or was cancelled.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..formats.discovery import FoundModel, Places, discover
from ..errors import GenerationCancelled, InsufficientMemoryError, InvalidArgumentError, WeightsChangedError
from ..planning import Budgets, ModelInfo, Plan, PlanRequest, default_context_tokens, detect_budgets, inspect, plan
from ..serving.scheduler import Scheduler
from .schemas import LoadRequest

STOP_POLL_SECONDS = 0.01  # how often a swap looks whether the old scheduler has answered its cancelled requests
log = logging.getLogger(__name__)
Report = Callable[[float, str], None]  # the fraction of the model loaded, and the stage: as Engine.load reports


@dataclass(frozen=True)
class LoadDefaults:
    """What `stowage serve` was started with, for loads that do not say; and where this machine's models are."""

    places: Places
    parallel: int
    max_queue: int
    gpu_layers: int | str | None = None
    kv_disk_budget: int | None = None


def plan_serving(model: Path | ModelInfo, request: PlanRequest, budgets: Budgets | None = None) -> Plan:
    """The plan of request.num_seqs sequences of request.context_tokens against budgets (None: this machine's memory
    now); InvalidArgumentError for what no memory would change (check_shape), InsufficientMemoryError when it does
    not fit."""
    planned = plan(model if isinstance(model, ModelInfo) else inspect(model), request, budgets or detect_budgets())
    check_shape(planned)
    return require_fit(planned)


def require_fit(planned: Plan) -> Plan:
    """planned if it fits; InsufficientMemoryError with the planner's words otherwise."""
    if planned.fits or planned.num_seqs == 1:
        return planned.require_fit()
    raise InsufficientMemoryError(f"{planned.error} With --parallel {planned.num_seqs}, each sequence holds a whole "
                                  "context of KV cache: fewer sequences need less.")


def check_shape(planned: Plan) -> None:
    """What no amount of memory changes: a context within the model's positions, and at most a prefill chunk of
    sequences (the planner charges a decode step's activations as a chunk's); InvalidArgumentError otherwise."""
    if planned.context_tokens > planned.max_position_embeddings:
        raise InvalidArgumentError(planned.error)  # the planner's words, which say so
    if planned.num_seqs > planned.prefill_chunk:
        raise InvalidArgumentError(f"--parallel {planned.num_seqs} is more than the prefill chunk of "
                                   f"{planned.prefill_chunk} tokens; serve at most that many sequences")


def after_unload(budgets: Budgets, held: Plan) -> Budgets:
    """budgets as they will be once the engine of plan `held` is gone: what it holds on each device counted as free
    (its planned bytes: weights read in place from a file are counted again, which only makes the check lenient)."""
    held_bytes = {d.device: d.total_bytes for d in held.devices}

    def freed(budget):
        return replace(budget, free_bytes=budget.free_bytes + held_bytes.get(budget.device, 0))

    return replace(budgets, gpus=tuple(freed(g) for g in budgets.gpus), ram=freed(budgets.ram))


@dataclass(frozen=True)
class LoadPlan:
    """A load checked before anything changes: the listed model, its header, the plan request, and its plan against
    the memory free once the model served now is unloaded."""

    found: FoundModel
    info: ModelInfo
    request: PlanRequest
    plan: Plan


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
        self.unloaded: str | None = None  # why the last model served was unloaded without a request asking
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None  # the running load's
        if current is not None:
            self._watch(current)

    def _watch(self, served: Served) -> None:
        """Unload `served` if a weights file changes under it (its scheduler's on_broken)."""
        served.scheduler.on_broken = lambda e: self._unload_broken(served, e)

    def _unload_broken(self, served: Served, e: WeightsChangedError) -> None:
        """On the scheduler's thread, before its requests end with e: say so in one line, stop serving the
        model, and free it on a thread of its own (closing joins the scheduler's thread). The server goes on."""
        log.warning("%s unloaded: %s", served.name, e)
        with self._lock:
            if self.current is not served:
                return
            self.current = None
            self.unloaded = f"{served.name} was unloaded: {e}"

        def close() -> None:
            served.close()
            release_memory()

        threading.Thread(target=close, name="stowage-unload", daemon=True).start()

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

    def prepare(self, found: FoundModel, asked: LoadRequest) -> LoadPlan:
        """After begin_load, on a worker thread, before anything changes: read found's header and plan it against the
        memory free once the model served now is gone. ModelFormatError or UnsupportedModelError for a file that
        cannot be served; InvalidArgumentError for what no memory would change (check_shape)."""
        defaults = self.defaults
        info = inspect(found.path)
        request = PlanRequest(asked.context_tokens or default_context_tokens(found.path), dtype=asked.dtype,
                              kv_dtype=asked.kv_dtype, gpu_layers=defaults.gpu_layers,
                              num_seqs=asked.parallel or defaults.parallel, kv_disk_budget=defaults.kv_disk_budget)
        budgets = detect_budgets()
        served = self.current  # only a load replaces it, and this one holds the load
        planned = plan(info, request, budgets if served is None else after_unload(budgets, served.engine.plan))
        check_shape(planned)
        return LoadPlan(found, info, request, planned)

    def load(self, prepared: LoadPlan, report: Report, cancel: threading.Event) -> Served:
        """After prepare, on the same worker thread: refuse a plan that cannot fit even once the model served now is
        gone (which then stays served), or stop that model, plan against the memory free then, and load; ends the
        load. Raises GenerationCancelled once `cancel` is set (between tensors), leaving no model served."""
        from ..runtime.engine import Engine

        try:
            if cancel.is_set():  # gone before anything changed: the model served stays
                raise GenerationCancelled("loading cancelled")
            old = self.current
            try:
                require_fit(prepared.plan)
            except InsufficientMemoryError as e:
                if old is None:
                    raise
                raise InsufficientMemoryError(f"{e} (This counts the memory {old.name} holds as free; it is still "
                                              "served.)") from None
            self.current = None
            if old is not None:
                report(0.0, f"unloading {old.name}")
                old.stop()
                del old
                release_memory()
            report(0.0, "planning")
            planned = plan_serving(prepared.info, prepared.request)  # against the memory free now
            if cancel.is_set():
                raise GenerationCancelled("loading cancelled")
            found = prepared.found
            engine = Engine.load(found.path, planned, progress=report, cancel=cancel)
            scheduler = Scheduler(engine, max_running=planned.num_seqs, max_waiting=self.defaults.max_queue)
            served = Served(found.name, scheduler)
            self._watch(served)
            scheduler.start()
            self.current, self.unloaded = served, None
            return served
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
