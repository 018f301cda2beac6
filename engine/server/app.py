"""The OpenAI-compatible HTTP API (Starlette): routes, the body's limits, streaming over server-sent events; what a
request passes before a route (its head, browsers, the key, the request limit) is guards.py's.

Handlers only validate, tokenize and wait: the scheduler thread does all the engine's work and hands events
back through the event loop. Nothing a request says can reach the filesystem: a load names a model by the id
this machine lists it under (engine/formats/discovery.py), never by a path.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import (GenerationCancelled, InsufficientMemoryError, InvalidArgumentError, ModelFormatError,
                      StowageError, UnsupportedModelError, WeightsChangedError)
from ..runtime.generation import GenerationResult, TokenEvent
from ..planning.report import summary, to_dict
from ..text import grammar, harmony
from ..text.tool_calls import format_of
from .responses import HarmonyReplies, Reply, ToolReplies, listed_model, model_object, sse
from .schemas import ApiError, CompletionRequest, LoadRequest, parse_chat, parse_completion, parse_load
from ..serving.scheduler import PrefillProgress, Scheduler, ServerBusyError
from .guards import RETRY_AFTER_SECONDS, stack
from .serving import LoadPlan, Served, Serving

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a full 128k-token context is ~0.5 MB of text; JSON escapes may double it


def create_app(serving: Serving | Scheduler, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               on_unload: Callable[[], None] | None = None, cors_origins: Iterable[str] = (),
               loopback_bind: bool = True):
    """The ASGI app over what a server serves (or one started scheduler, which owns its engine, served without
    loads), behind guards.py's checks; `POST /stowage/unload` calls on_unload. cors_origins: the web pages' origins
    (parse_origin's form) that may call it from a browser. loopback_bind False: the server listens beyond loopback
    too (which takes a key), and a request reaching it at a loopback address may name the machine as it likes."""
    serving = serving if isinstance(serving, Serving) else Serving.of(serving)
    api = _Api(serving, max_body_bytes, on_unload)
    routes = [
        Route("/health", api.health),
        Route("/v1/models", api.models),
        Route("/v1/models/{model_id:path}", api.model),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        # Stowage's own, for what OpenAI's API lacks (docs/server.md)
        Route("/stowage/plan", api.plan),
        Route("/stowage/memory", api.memory),
        Route("/stowage/unload", api.unload, methods=["POST"]),
        Route("/stowage/models", api.listed_models),
        Route("/stowage/load", api.load, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error})
    return stack(app, serving, api_key=api_key, cors_origins=cors_origins, loopback_bind=loopback_bind)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Starlette's own 404 and 405, in OpenAI's shape
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code)


class _Events:
    """The scheduler's events for one request, carried into the event loop that waits for them."""

    def __init__(self, keep_tokens: bool):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.keep_tokens = keep_tokens

    def emit(self, event) -> None:  # on the scheduler thread
        if self.keep_tokens or not isinstance(event, (TokenEvent, PrefillProgress)):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class _CancelWhenDone(StreamingResponse):
    """A stream that cancels its request however it ends: finished, failed, or the client gone."""

    def __init__(self, content, cancel: threading.Event, on_end: Callable[[], None] = lambda: None):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.cancel, self.on_end = cancel, on_end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cancel.set()
            self.on_end()


class _Api:
    def __init__(self, serving: Serving, max_body_bytes: int, on_unload: Callable[[], None] | None):
        self.serving = serving
        self.max_body_bytes = max_body_bytes
        self.on_unload = on_unload

    def _served(self) -> Served:
        """The model served now; 503 while none is (a load runs, or the last one failed or was cancelled)."""
        served = self.serving.current
        if served is not None:
            return served
        loading = self.serving.loading
        if loading is not None:
            raise ApiError(503, f"no model is loaded: {loading!r:.80} is loading (POST /stowage/load); retry once it "
                                "is loaded", type="server_error", code="model_not_loaded",
                           headers={"Retry-After": RETRY_AFTER_SECONDS})
        why = f" ({self.serving.unloaded})" if self.serving.unloaded else ""
        raise ApiError(503, f"no model is loaded{why}: load one with POST /stowage/load (GET /stowage/models lists "
                            "them)", type="server_error", code="model_not_loaded")

    async def health(self, request: Request) -> JSONResponse:
        if self.serving.current is not None:
            return JSONResponse({"status": "ok"})
        # up, but nothing to serve: 503 as llama.cpp's server says while it loads
        status = "loading" if self.serving.loading is not None else "no model is loaded"
        why = {"reason": self.serving.unloaded} if self.serving.unloaded and status != "loading" else {}
        return JSONResponse({"status": status, **why}, status_code=503)

    async def models(self, request: Request) -> JSONResponse:
        served = self.serving.current
        data = [model_object(served.name, served.created, served.context_tokens)] if served is not None else []
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> JSONResponse:
        served = self._served()
        self._check_model(served, request.path_params["model_id"])
        return JSONResponse(model_object(served.name, served.created, served.context_tokens))

    async def plan(self, request: Request) -> JSONResponse:
        return JSONResponse(to_dict(self._served().engine.plan))

    async def memory(self, request: Request) -> JSONResponse:
        # the process id: the app's graphs measure this process, where the engine's memory is
        served = self.serving.current
        return JSONResponse({"pid": os.getpid(), "devices": served.memory_report if served is not None else {}})

    async def unload(self, request: Request) -> JSONResponse:
        if self.on_unload is None:
            raise ApiError(404, "this server cannot be unloaded over HTTP (it was not started by `stowage serve`)",
                           code="not_found")
        self.on_unload()  # the server stops after answering; the process's exit returns all its memory
        return JSONResponse({"status": "unloading"}, status_code=202)

    async def listed_models(self, request: Request) -> JSONResponse:
        self._check_loads()
        models = await run_in_threadpool(self.serving.models)  # reads the models folders and GGUF headers
        return JSONResponse({"object": "list", "data": [listed_model(m) for m in models]})

    async def load(self, request: Request):
        self._check_loads()
        req = parse_load(await self._body(request))
        cancel = threading.Event()
        if not self.serving.begin_load(req.model, cancel):
            raise ApiError(409, f"a load is running already ({self.serving.loading!r:.80}); wait for its stream to "
                                "end, or close that stream to cancel it", code="load_in_progress")
        try:  # what the request asks for is checked before the stream begins and before anything changes
            prepared = await run_in_threadpool(self._prepare, req)
        except BaseException:
            self.serving.end_load()
            raise
        events = _Events(keep_tokens=True)
        threading.Thread(target=self._load, args=(prepared, events.emit, cancel), name="stowage-load",
                         daemon=True).start()
        return _CancelWhenDone(self._load_stream(events), cancel)

    def _prepare(self, req: LoadRequest) -> LoadPlan:
        """On a worker thread: the listed model and its plan (Serving.prepare); ApiError for what the client asked."""
        found = self.serving.find(req.model)
        if found is None:
            raise ApiError(404, f"The model {req.model!r:.80} is not one this machine lists (GET /stowage/models "
                                "lists them: the Stowage models folder, the Hugging Face cache, LM Studio, Ollama)",
                           param="model", code="model_not_found")
        try:
            return self.serving.prepare(found, req)
        except (ModelFormatError, UnsupportedModelError) as e:  # the client's choice of file: its reason
            raise ApiError(400, str(e), param="model", code="unsupported_model") from None
        except InvalidArgumentError as e:  # what no memory would change: a context past the model's, ...
            raise ApiError(400, str(e)) from None

    def _load(self, prepared: LoadPlan, emit: Callable[[object], None], cancel: threading.Event) -> None:
        """The load's worker thread: its progress, then the model loaded or the error, as events."""
        found = prepared.found
        total = found.size_bytes

        def send(event: dict) -> None:
            try:
                emit(event)
            except RuntimeError:  # the event loop is closed: the server is stopping
                cancel.set()

        def report(fraction: float, stage: str) -> None:
            send({"stage": stage, "done": round(fraction * total), "total": total})

        try:
            served = self.serving.load(prepared, report, cancel)
            send({"loaded": {**model_object(served.name, served.created, served.context_tokens),
                             "parallel": served.scheduler.max_running, "plan": summary(served.engine.plan)}})
        except GenerationCancelled as e:
            send(ApiError(499, str(e), code="cancelled").body())
        except (InsufficientMemoryError, InvalidArgumentError, ModelFormatError, UnsupportedModelError) as e:
            # the planner's or the loader's own message
            send(ApiError(400, str(e), code="insufficient_memory" if isinstance(e, InsufficientMemoryError)
                          else None).body())
        except Exception as e:  # a bug, or a StowageError of a kind above none of these
            if not isinstance(e, StowageError):
                log.exception("loading %s failed", found.name)
            send(ApiError(500, f"loading {found.name} failed: {e}", type="server_error").body())
        finally:
            gc.collect()  # what a failed load had allocated, held in cycles through its traceback

    @staticmethod
    async def _load_stream(events: _Events):
        while True:
            event = await events.queue.get()
            yield sse(event)
            if "stage" not in event:
                yield sse("[DONE]")
                return

    def _check_loads(self) -> None:
        if self.serving.defaults is None:
            raise ApiError(404, "this server does not load models over HTTP (it was not started by `stowage serve`)",
                           code="not_found")

    async def chat_completions(self, request: Request):
        # off the loop: a JSON schema or a tool's parameters are compiled (llguidance) while they are checked
        req = await run_in_threadpool(parse_chat, await self._body(request))
        served = self._served()
        self._check_model(served, req.model)
        tokenizer = served.engine.tokenizer
        tools = list(req.tools.specs) if req.tools is not None else None
        ids = await run_in_threadpool(self._tokenize, partial(tokenizer.apply_chat_template, tools=tools),
                                      list(req.messages))
        return await self._complete(request, served, req, ids, chat=True)

    async def completions(self, request: Request):
        req = await run_in_threadpool(parse_completion, await self._body(request))
        served = self._served()
        self._check_model(served, req.model)
        if isinstance(req.prompt, str):
            ids = await run_in_threadpool(self._tokenize, served.engine.tokenizer.encode, req.prompt)
        else:
            ids = list(req.prompt)
            vocab = served.engine.config.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        return await self._complete(request, served, req, ids, chat=False)

    # -- the parts -----------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        too_large = ApiError(413, f"the request body is larger than {self.max_body_bytes:,} bytes",
                             code="request_too_large")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise too_large
        except ClientDisconnect:  # gone mid-body (or closed by listener.py's deadline): nobody to answer
            raise ApiError(499, "the client closed the connection before its request's body arrived",
                           code="client_closed") from None
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply to parse", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    @staticmethod
    def _check_model(served: Served, model: str | None) -> None:
        if model is not None and model != served.name:
            raise ApiError(404, f"The model {model!r:.80} does not exist: this server serves {served.name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")

    @staticmethod
    def _tokenize(fn, arg) -> list[int]:
        try:
            return fn(arg)
        except (InvalidArgumentError, ModelFormatError) as e:  # text that is not UTF-8; the template refusing
            raise ApiError(400, str(e), param="messages" if isinstance(arg, list) else "prompt") from None

    async def _complete(self, request: Request, served: Served, req: CompletionRequest, ids: list[int], *,
                        chat: bool):
        context_tokens = served.context_tokens
        room = context_tokens - len(ids)
        if not ids or room < 1:
            raise ApiError(400, f"This model's maximum context length is {context_tokens:,} tokens, and your "
                                f"{'messages take' if chat else 'prompt takes'} {len(ids):,} tokens (at least one must be "
                                "left for the reply); shorten them, or serve with a larger --context",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        # max_tokens past the context is not cut to it: the reply ends where the context is full, with the engine's
        # "context_full" (OpenAI's "length"), and a reply of exactly max_tokens that also fills it says "length"
        sampling = req.sampling(req.max_tokens or room)
        tools, channels = _tool_replies(req, served), _channels(served.engine.tokenizer) if chat else None
        if channels is not None and tools is not None and not tools.is_forced:
            # gpt-oss writes its calls on a channel of its own: read from there, not constrained
            channels, tools = replace(channels, tools=tools.names), None
        if req.grammar is not None or tools is not None:
            # the tokenizer's view for llguidance is built once per model; a call grammar compiled: off the loop
            try:
                bound = await run_in_threadpool(_grammar, req, served, tools)
            except InvalidArgumentError as e:  # a tokenizer llguidance cannot read
                raise ApiError(400, str(e), param="response_format" if req.tools is None else "tools") from None
            sampling = replace(sampling, grammar=bound)
        events, cancel = _Events(keep_tokens=req.stream), threading.Event()
        served.track(cancel)  # a swap cancels it; it then ends with its final event
        try:
            served.scheduler.submit(ids, sampling, events.emit, cancel)
        except ServerBusyError as e:
            served.untrack(cancel)
            raise ApiError(503, str(e), type="server_error", code="server_busy",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
        except StowageError as e:  # shutting down, or the model is being replaced
            served.untrack(cancel)
            raise ApiError(503, str(e), type="server_error") from None
        reply = Reply(served.name, chat=chat, include_usage=req.include_usage, tools=tools, channels=channels)
        if req.stream:
            return _CancelWhenDone(self._stream(reply, events), cancel, lambda: served.untrack(cancel))
        try:
            result = await self._wait(request, events, cancel)
        finally:
            served.untrack(cancel)
        if result is None:  # nobody is listening; 499 as nginx logs a client that closed its request
            return Response(status_code=499)
        return JSONResponse(reply.whole(result))

    async def _wait(self, request: Request, events: _Events, cancel: threading.Event) -> GenerationResult | None:
        """The final result; None (and the request cancelled) when the client hangs up first."""
        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = asyncio.ensure_future(events.queue.get())
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            finished = result.done()
            if not finished:  # a cancelled task is not done until it runs again: no result to read
                result.cancel()
                cancel.set()
        if not finished:
            return None
        last = result.result()
        if isinstance(last, Exception):
            raise _failed(last) from None
        return last

    async def _stream(self, reply: Reply, events: _Events):
        if reply.chat:
            yield sse(reply.chunk(first=True))
        while True:
            event = await events.queue.get()
            if isinstance(event, TokenEvent):
                for chunk in reply.token_chunks(event):
                    yield sse(chunk)
                continue
            if isinstance(event, PrefillProgress):
                yield sse(reply.progress_chunk(event.done_tokens, event.prompt_tokens))
                continue
            if isinstance(event, Exception):
                yield sse(_failed(event).body())
            else:
                for chunk in reply.end_chunks(event):
                    yield sse(chunk)
                if reply.include_usage:
                    yield sse(reply.usage_chunk(event))
            yield sse("[DONE]")
            return


def _tool_replies(req: CompletionRequest, served: Served) -> ToolReplies | None:
    """How the reply's text is read as tool calls: None without tools, or when tool_choice is none."""
    tools = req.tools
    if tools is None or tools.choice == "none":
        return None
    tokenizer = served.engine.tokenizer
    fmt = format_of(tokenizer.chat_template)
    ids = {marker: tokenizer.token_id(marker) for marker in fmt.markers if marker}
    # special tokens, which decoding drops (Mistral's [TOOL_CALLS]); a token of text (Qwen's <tool_call>) is not one
    special = {marker: i for marker, i in ids.items() if i is not None and not tokenizer.decode([i])}
    return ToolReplies(frozenset(tools.parameters), tools.is_forced, fmt, special=special,
                       decode_all=partial(tokenizer.decode, skip_special_tokens=False))


def _channels(tokenizer) -> HarmonyReplies | None:
    """How a gpt-oss reply's channels are read: its template writes harmony's markers, special tokens of its
    vocabulary; None for every other model."""
    if harmony.CHANNEL not in (tokenizer.chat_template or ""):
        return None
    markers = {tokenizer.token_id(m): m for m in harmony.MARKERS}
    if None in markers or len(markers) != len(harmony.MARKERS):
        return None
    return HarmonyReplies(markers, partial(tokenizer.decode, skip_special_tokens=False))


def _grammar(req: CompletionRequest, served: Served, tools: ToolReplies | None) -> grammar.Grammar | None:
    """The reply's grammar bound to the model: the request's own (response_format, a forced call), or for tools in
    `auto` free text whose calls, once begun in the model's format, are constrained; None: free text."""
    text = req.grammar
    if text is None and tools is not None and not tools.is_forced:
        text = grammar.auto_call_grammar(req.tools.parameters, tools.format, tools.special)
    if text is None:
        return None
    engine = served.engine
    return grammar.bind(text, engine.tokenizer, engine.config.vocab_size, engine.eos_ids)


def _failed(error: Exception) -> ApiError:
    """What a request that ended with an error answers: 503 when its model is gone (a weights file changed under it:
    the server unloaded it), else 500."""
    if isinstance(error, WeightsChangedError):
        return ApiError(503, f"the model was unloaded: {error}", type="server_error", code="model_unloaded")
    return ApiError(500, f"generation failed: {error}", type="server_error")
