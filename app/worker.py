"""The engine on its own thread: a worker object in a QThread, driven by queued signals.

Only this module calls the engine's load/chat; every result comes back to the GUI thread as a signal,
so no widget is ever touched from the worker thread. Cancelling uses threading.Event, which the GUI
thread may set at any time.

The engine runs in a child process (engine/process/engine_process.py: `stowage serve` on a private Unix socket, or
where Serve asks, with a key): a crash of the engine (the out-of-memory killer, SIGBUS from a weights file changed under
the model, a native fault) is then a failed reply, and the window, its chats and the partial reply stay; the next
Load starts a fresh child, and Unload returns all of its memory at once. STOWAGE_ENGINE_PROCESS=0 runs the engine
in this process instead (a developer's switch: one process to debug; docs/server.md, "How the app uses it").
"""

from __future__ import annotations

import copy
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal, Slot

# Imported here, on the GUI thread before the window shows, not lazily in the engine thread: an import
# holds the GIL and the import lock for hundreds of milliseconds (tokenizers, jinja2, kernels), and
# the GUI would freeze on them during the first load.
from stowage.engine.planning.budgets import detect_budgets
from stowage.engine.runtime.engine import Engine
from stowage.engine.process.engine_process import EngineProcess
from stowage.engine.errors import EngineCrashedError, GenerationCancelled, InvalidArgumentError, StowageError
from stowage.engine.formats.source import open_source
from stowage.engine.planning.inspect import inspect
from stowage.engine.server.schemas import ApiError, parse_chat
from stowage.engine.text import grammar
from stowage.kernels import cpu_decode

from . import context_policy, remote_source
from .remote_source import RemoteModel
from .memory_stats import release_freed_memory
from .replies import ChatRequest, Reply, ReplyStarted, describe_error, log_unexpected
from .serve_settings import ServeSettings, port_taken, taken_message

ENGINE_NICE = int(os.environ.get("STOWAGE_ENGINE_NICE", 10))  # how much lower than the GUI (0..19)
HEALTH_MS = 2000  # how often an idle engine child or a connected server is checked
HEALTH_SECONDS = 2.0  # how long a server may take to list its models before it counts as not answering
ENGINE_PROCESS = os.environ.get("STOWAGE_ENGINE_PROCESS", "1") != "0"  # the engine in a child process


class EngineWorker(QObject):
    """Lives in the engine thread. Slots run there; signals are delivered queued to the GUI thread."""

    inspected = Signal(str, object, object)  # model_dir, ModelInfo, Budgets
    inspect_failed = Signal(str, str)  # model_dir, message
    load_progress = Signal(float, str)  # fraction, message
    loaded = Signal(str, float)  # model_dir, seconds
    load_failed = Signal(str)
    load_cancelled = Signal()
    unloaded = Signal()
    reply_started = Signal(object)  # ReplyStarted
    token = Signal(int, str)  # conversation_id, decoded text delta
    reply_finished = Signal(object)  # Reply
    reply_failed = Signal(int, str)  # conversation_id, message
    conversation_full = Signal(int)  # conversation_id: its reply_failed, next, is context_policy's ConversationFullError
    tool_calls = Signal(int, object)  # conversation_id, the reply's tool calls so far (a copy), as they stream
    # with the engine in a child process only:
    prefill_progress = Signal(int, int, int)  # conversation_id, prompt tokens done, total (a long prompt)
    engine_started = Signal(int)  # the engine process's id, for graphs that follow it
    # A load began: the process that will hold the model (the child, or this one) and its resident bytes before
    # the model, which the graphs' predicted RAM adds the plan to.
    load_started = Signal(int, object)  # object: a byte count passes 2**31
    engine_crashed = Signal(str)  # how it died; `unloaded` follows
    model_unloaded = Signal(str)  # the live child unloaded its model (a weights file changed): why; `unloaded` follows
    remote_health = Signal(bool, str)  # the connected server answers again (True), or stopped answering, and why
    serve_refused = Signal(str)  # Serve's port is taken: the engine was started for the app alone instead
    # a remote server's model instead of a local one:
    remote_loaded = Signal(object, float)  # RemoteModel (with the context its server says now), seconds

    def __init__(self, use_process: bool | None = None):
        super().__init__()
        self.use_process = ENGINE_PROCESS if use_process is None else use_process
        self.engine = None  # in-process: the Engine
        self.process: EngineProcess | None = None  # or its child process
        self.remote = None  # or an engine.client.RemoteServer, whose model is remote_model
        self.remote_model: RemoteModel | None = None
        self.estimate = remote_source.TokenEstimate()  # counts a remote chat (the server's tokenizer is not here)
        self.served_model = ""  # the child's model id
        self.tokenizer = None  # counts tokens for the context policy, here whichever runs the engine
        self.context_tokens = 0
        self.threads = 0  # set_threads
        self.serve = ServeSettings()  # set_serve: where the next child listens
        self.serving: ServeSettings | None = None  # what the running child serves others (None: nothing)
        self.remote_answering = True  # what the health check said last of the connected server

    @Slot()
    def lower_priority(self) -> None:
        """Leave the GUI a core: one torch thread fewer than torch would use, and a lower priority.

        torch takes every core by default, and its threads spin at each barrier: on 2 cores with the
        event loop wanting one of them, decoding the demo model fell from ~30 to ~3 tokens/s and the
        window stalled. The nice value (Linux gives each thread its own; torch's threads inherit it)
        keeps the event loop first in line; elsewhere it does nothing.
        """
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENGINE_NICE)
        except (AttributeError, OSError):
            pass
        # The native kernels load here, before any plan is made: the GUI thread's forecasts then find them
        # loaded (never built on the GUI thread), and their pool's threads inherit this thread's priority.
        cpu_decode.current()
        # Made here so that it lives in this thread: it fires only while no load or reply keeps the thread busy.
        self.health_timer = QTimer(self)
        self.health_timer.setInterval(HEALTH_MS)
        self.health_timer.timeout.connect(self.check_health)
        self.health_timer.start()

    @Slot()
    def stop_health(self) -> None:
        """In this thread, before it ends: a timer is stopped only by its own thread."""
        timer = getattr(self, "health_timer", None)
        if timer is not None:
            timer.stop()

    @Slot()
    def check_health(self) -> None:
        """Every few seconds while idle: an engine child that died is said at once, not at the next message; a
        connected server that stops answering (or answers again) is said too."""
        if self.process is not None and not self.process.is_alive:
            self._crashed(EngineCrashedError(self.process.death()))
        elif self.process is not None:
            self._model_gone()
        elif self.remote is not None:
            try:
                self.remote.models(timeout=HEALTH_SECONDS)
                answering, why = True, ""
            except Exception as e:  # unreachable, a refused key, an answer of another shape: all "not answering"
                answering, why = False, describe_error(e)
            if answering != self.remote_answering:
                self.remote_answering = answering
                self.remote_health.emit(answering, why)

    def _model_gone(self) -> str | None:
        """The child unloaded its model (a weights file truncated, replaced or moved under it): say why, and unload
        here too, so the window says no model is loaded instead of every message failing. The message, or None."""
        reason = self.process.server.unloaded_reason(timeout=HEALTH_SECONDS)
        if reason is None:
            return None
        message = f"{reason[:1].upper()}{reason[1:]}. Press Load to load it again."
        self.model_unloaded.emit(message)
        self._unload()
        return message

    def _crashed(self, error: EngineCrashedError) -> str:
        """The child is gone: say how, and unload (the window, the chats and any partial reply stay)."""
        death = describe_error(error)
        message = f"{death[:1].upper()}{death[1:]}. Press Load to start the engine again."
        self.engine_crashed.emit(message)
        self._unload()
        return message

    @Slot(int)
    def set_threads(self, threads: int) -> None:
        """CPU threads for the next load (0: the cores the engine may use, less one for the window)."""
        self.threads = max(0, int(threads))

    @Slot(object)
    def set_serve(self, serve: ServeSettings) -> None:
        """Where the next child listens: for other programs (Serve on), else privately."""
        self.serve = serve

    def _use_threads(self) -> None:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        # The native decode step's pool may take every core: its threads take work in chunks and yield when
        # idle, so the GUI's thread is served first (they were started niced, in this thread: lower_priority).
        cpu_decode.set_threads(self.threads or cpu_decode.default_threads())

    @Slot(str, object)
    def inspect(self, model_dir: str, budget_args: dict) -> None:
        try:
            info = inspect(Path(model_dir))
            budgets = detect_budgets(**budget_args)
        except Exception as e:
            log_unexpected(e)
            self.inspect_failed.emit(model_dir, describe_error(e))
            return
        self.inspected.emit(model_dir, info, budgets)

    @Slot(str, object, object)
    def load(self, model_dir: str, plan, cancel: threading.Event) -> None:
        self._unload()  # one model at a time: loading another frees the first
        start = time.perf_counter()

        def progress(fraction: float, message: str) -> None:
            self.load_progress.emit(float(fraction), str(message))

        try:
            if self.use_process:
                self._start_process(Path(model_dir), plan, progress, cancel)
            else:
                self.load_started.emit(os.getpid(), psutil.Process().memory_info().rss)
                self.engine = Engine.load(Path(model_dir), plan, progress=progress, cancel=cancel)
                self.tokenizer = self.engine.tokenizer
                self._use_threads()
            self.context_tokens = plan.context_tokens
        except Exception as e:
            self.engine, self.process, self.tokenizer = None, None, None
            self.serving = None
            release_freed_memory()
            if isinstance(e, GenerationCancelled) or cancel.is_set():
                self.load_cancelled.emit()
            else:
                log_unexpected(e)
                self.load_failed.emit(describe_error(e))
            return
        self.loaded.emit(model_dir, time.perf_counter() - start)

    def _start_process(self, model_dir: Path, plan, progress, cancel: threading.Event) -> None:
        serve = self.serve
        if port_taken(serve):  # the model is loaded all the same, for this app alone
            self.serve_refused.emit(taken_message(serve))
            serve = ServeSettings()
        source = open_source(model_dir)
        tokenizer = source.tokenizer
        tokenizer.use_builtin_template(source.config.model_type)  # as Engine does, so counts agree
        threads = self.threads or max(1, cpu_decode.default_threads() - 1)  # the GUI a core (lower_priority)
        started = False
        # the plan's own request, planned again by the child against the memory free now: its sequences are
        # Serve's while it serves (the forecast counted their KV cache), else the chat's one
        process = EngineProcess.launch(
            model_dir, plan.request, env={"OMP_NUM_THREADS": str(threads), cpu_decode.THREADS_ENV: str(threads)},
            nice=ENGINE_NICE, **serve.listen())

        def first_progress(fraction: float, message: str) -> None:
            # The child reports once it has started Python, torch and its server and begins reading the model:
            # what it holds then is what the plan comes on top of.
            nonlocal started
            if not started:
                try:
                    held = psutil.Process(process.pid).memory_info().rss
                except psutil.Error:  # it has ended: wait_ready says how
                    held = None
                if held is not None:
                    started = True
                    self.load_started.emit(process.pid, held)
            progress(fraction, message)

        self.process = process.wait_ready(progress=first_progress, cancel=cancel)
        self.serving = serve.listening()
        self.tokenizer = tokenizer
        try:  # the name other programs ask for (Serve): the engine's own, as its server says it
            self.served_model = self.process.server.models()[0]["id"]
        except BaseException:
            self.process.kill()  # a load that fails leaves no child behind
            raise
        self.engine_started.emit(self.process.pid)

    @Slot(object, object, object)
    def connect_remote(self, model: RemoteModel, api_key: str | None, cancel: threading.Event) -> None:
        """Use a server's model: whatever is loaded here is unloaded first (one model at a time). Cancel is seen
        once the server answered (within remote_source.ASK_SECONDS)."""
        self._unload()
        start = time.perf_counter()
        try:
            server, confirmed = remote_source.connect(model, api_key)
        except Exception as e:
            log_unexpected(e)
            self.load_failed.emit(describe_error(e))
            return
        if cancel.is_set():
            server.close()
            self.load_cancelled.emit()
            return
        self.remote, self.remote_model, self.context_tokens = server, confirmed, confirmed.context_tokens
        self.remote_answering = True
        self.estimate = remote_source.TokenEstimate()  # another model's tokenizer: learnt again
        self.remote_loaded.emit(confirmed, time.perf_counter() - start)

    @property
    def is_loaded(self) -> bool:
        return self.engine is not None or self.process is not None or self.remote is not None

    @property
    def endpoint(self) -> tuple[str, str, str] | None:
        """Where other programs reach the loaded engine's API: (base URL, key, model name); None while it serves
        only the app (in process, or a child on its private socket)."""
        if self.process is None or self.process.server is None or self.serving is None:
            return None
        server = self.process.server
        return f"{server.base_url}/v1", server.api_key, self.served_model

    @Slot()
    def unload(self) -> None:
        self._unload()

    def _unload(self) -> None:
        if not self.is_loaded:
            return
        try:
            if self.process is not None:
                self.process.close()  # the child exits: all of its memory goes back at once
            elif self.remote is not None:
                self.remote.close()  # only the connection: the server keeps its model
            else:
                self.engine.close()
        finally:
            self.engine, self.process, self.tokenizer = None, None, None
            self.remote = self.remote_model = self.serving = None
            release_freed_memory()
            self.unloaded.emit()

    @Slot(object)
    def chat(self, request: ChatRequest) -> None:
        cid = request.conversation_id
        if not self.is_loaded:
            self.reply_failed.emit(cid, "No model is loaded. Pick a model and press Load.")
            return
        try:
            if request.completion:  # completion mode (a base model): the chat's text continued as written
                r = self._reply_completion(cid, request)
            else:
                r = self._reply_to_chat(cid, request)
        except context_policy.ContextFullError as e:
            if isinstance(e, context_policy.ConversationFullError):
                self.conversation_full.emit(cid)  # delivered before reply_failed: both queued from this thread
            self.reply_failed.emit(cid, str(e))
            return
        except EngineCrashedError as e:  # the child is gone; the window, the chat and the partial reply stay
            death = describe_error(e)
            self.reply_failed.emit(cid, f"{death[:1].upper()}{death[1:]}. Press Load to start the engine again.")
            self._crashed(e)
            return
        except Exception as e:
            log_unexpected(e)
            # A child that unloaded its model answers every message with an error: the reason, once, instead.
            gone = self._model_gone() if self.process is not None and isinstance(e, StowageError) else None
            self.reply_failed.emit(cid, gone or describe_error(e))
            return
        self.reply_finished.emit(Reply(cid, r))

    def _reply_to_chat(self, cid: int, request: ChatRequest):
        sampling = request.sampling
        tools = list(request.options.tools) or None  # the template writes them into the prompt: they count
        count = self.estimate.count if self.remote is not None else lambda m: self._count_tokens(m, tools)
        fitted = context_policy.fit(
            request.system, request.messages, count, self._prompt_budget(sampling), request.policy
        )
        self.reply_started.emit(ReplyStarted(cid, fitted.prompt_tokens, fitted.first_kept, fitted.kept_head))
        options = request.options
        fields = {"response_format": options.response_format, "tools": list(options.tools),
                  "tool_choice": options.tool_choice,
                  "on_call": lambda calls: self.tool_calls.emit(cid, copy.deepcopy(calls))}
        if self.remote is not None:
            r = self._reply_from_remote(cid, fitted.messages, sampling, request.cancel, fields)
            self.estimate.learn(fitted.messages, r.prompt_tokens)
            return r
        if self.process is not None:
            return self._reply_from_process(cid, fitted.messages, sampling, request.cancel, fields)
        if options.tools:
            raise InvalidArgumentError("tools need the engine in its own process (STOWAGE_ENGINE_PROCESS=0 is set): "
                                       "unset it, or choose No tools for this chat")
        if options.response_format is not None:  # held to it as the engine's server would hold a request
            try:
                text = parse_chat({"messages": [{"role": "user", "content": "?"}],
                                   "response_format": options.response_format}).grammar
            except ApiError as e:
                raise InvalidArgumentError(e.message) from None
            bound = grammar.bind(text, self.engine.tokenizer, self.engine.config.vocab_size, self.engine.eos_ids)
            sampling = replace(sampling, grammar=bound)
        return self._reply_in_process(cid, fitted.messages, sampling, request.cancel)

    def _prompt_budget(self, sampling) -> int:
        """The prompt's share of the context: room is left for a reply, the whole max_tokens when the context allows,
        else a quarter of it."""
        return self.context_tokens - min(sampling.max_tokens, self.context_tokens // 4)

    def _reply_completion(self, cid: int, request: ChatRequest):
        """The chat's text continued as written: no chat template (a base model was never taught one). A text that
        outgrows the context is fitted as a chat is, by the chat's policy: whole turns go, oldest first."""
        if self.remote is not None:
            raise InvalidArgumentError("completion mode is for models loaded here; the server formats its chats")
        messages, sampling, cancel = request.messages, request.sampling, request.cancel

        def count(sent: list[dict]) -> int:
            return len(self.tokenizer.encode("".join(m["content"] for m in sent)))

        fitted = context_policy.fit([], messages, count, self._prompt_budget(sampling), request.policy)
        ids = self.tokenizer.encode("".join(messages[i]["content"] for i in fitted.kept))
        self.reply_started.emit(ReplyStarted(cid, len(ids), fitted.first_kept, fitted.kept_head))
        progress = lambda done, total: self.prefill_progress.emit(cid, done, total)  # noqa: E731
        if self.process is not None:
            stream = self.process.complete(ids, sampling, cancel=cancel, progress=progress)
            for piece in stream:
                self.token.emit(cid, piece)
            return stream.result
        gen = self.engine.generate(ids, sampling, cancel=cancel, progress=progress)
        for event in gen:
            if event.text:
                self.token.emit(cid, event.text)
        return gen.result

    def _reply_in_process(self, cid: int, messages: list[dict], sampling, cancel: threading.Event):
        # switching back to a chat reuses what the engine still caches of its history (found by its tokens)
        gen = self.engine.chat(messages, sampling, cancel=cancel,
                               progress=lambda done, total: self.prefill_progress.emit(cid, done, total))
        for event in gen:
            if event.text:
                self.token.emit(cid, event.text)
        return gen.result

    def _reply_from_process(self, cid: int, messages: list[dict], sampling, cancel: threading.Event, fields: dict):
        stream = self.process.chat(messages, sampling, cancel=cancel,
                                   progress=lambda done, total: self.prefill_progress.emit(cid, done, total), **fields)
        for text in stream:
            self.token.emit(cid, text)
        return stream.result

    def _reply_from_remote(self, cid: int, messages: list[dict], sampling, cancel: threading.Event, fields: dict):
        # the server applies the model's chat template (it has the model; this app does not)
        stream = self.remote.chat(messages, sampling, model=self.remote_model.model_id, cancel=cancel,
                                  progress=lambda done, total: self.prefill_progress.emit(cid, done, total), **fields)
        for text in stream:
            self.token.emit(cid, text)
        return stream.result

    def _count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        if isinstance(ids, str):
            ids = self.tokenizer.encode(ids)
        return len(ids)


class EngineClient(QObject):
    """GUI-thread handle on the worker: methods here queue calls into the engine thread."""

    _inspect = Signal(str, object)
    _load = Signal(str, object, object)
    _threads = Signal(int)
    _serve = Signal(object)
    _unload = Signal()
    _chat = Signal(object)
    _connect_remote = Signal(object, object, object)

    def __init__(self, parent=None, *, use_process: bool | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("stowage-engine")
        self.worker = EngineWorker(use_process)
        self.worker.moveToThread(self.thread)
        self.thread.started.connect(self.worker.lower_priority)
        self._inspect.connect(self.worker.inspect)
        self._load.connect(self.worker.load)
        self._threads.connect(self.worker.set_threads)
        self._serve.connect(self.worker.set_serve)
        self._unload.connect(self.worker.unload)
        self._chat.connect(self.worker.chat)
        self._connect_remote.connect(self.worker.connect_remote)
        # `finished` is sent from the engine thread as it ends: its timer is stopped there, as Qt requires
        self.thread.finished.connect(self.worker.stop_health, Qt.ConnectionType.DirectConnection)
        self.thread.start()
        self._load_cancel: threading.Event | None = None
        self._chat_request: ChatRequest | None = None
        self.worker.reply_finished.connect(self._reply_done)
        self.worker.reply_failed.connect(self._reply_done)

    def inspect(self, model_dir: str, **budget_args) -> None:
        self._inspect.emit(model_dir, budget_args)

    def load(self, model_dir: str, plan, *, threads: int = 0, serve: ServeSettings | None = None) -> None:
        """Load with `threads` CPU threads (0: the cores the engine may use, less one for the window), the engine
        listening as `serve` says (default: for the app alone)."""
        self._load_cancel = threading.Event()
        self._threads.emit(threads)
        self._serve.emit(serve or ServeSettings())
        self._load.emit(model_dir, plan, self._load_cancel)

    def connect_remote(self, model: RemoteModel, api_key: str | None) -> None:
        """Chat with a server's model from now on (what is loaded here is unloaded)."""
        self._load_cancel = threading.Event()
        self._connect_remote.emit(model, api_key, self._load_cancel)

    def cancel_load(self) -> None:
        if self._load_cancel is not None:
            self._load_cancel.set()

    def unload(self) -> None:
        self._unload.emit()

    def chat(self, request: ChatRequest) -> None:
        self._chat_request = request
        self._chat.emit(request)

    def stop(self) -> None:
        """Stop the reply being generated; the worker finishes it with finish_reason 'cancelled'."""
        if self._chat_request is not None:
            self._chat_request.cancel.set()

    @property
    def is_generating(self) -> bool:
        return self._chat_request is not None

    def _reply_done(self, *args) -> None:
        self._chat_request = None

    def shutdown(self) -> None:
        """Cancel what runs, free the model and stop the thread (called when the window closes)."""
        self.cancel_load()
        self.stop()
        self._unload.emit()
        self.thread.quit()
        self.thread.wait()
