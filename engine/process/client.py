"""A client of any OpenAI-compatible server: Stowage's own engine process, another `stowage serve`, vLLM,
llama.cpp's server, Ollama. Models, and streaming chat or completions as an iterator of text deltas.

A Stowage server adds what OpenAI's API lacks under the extension field "stowage" of its chunks (prefill
progress, the reply's token ids and timings; engine/server/responses.py) and under /stowage/ (plan, memory,
the models it may load and the load itself, unload); other servers simply lack them, and the figures are then measured here.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from ..errors import GenerationCancelled, InsufficientMemoryError, InvalidArgumentError, RemoteError, StowageError
from ..runtime.generation import GenerationResult
from ..runtime.sampling_params import SamplingParams
from ..protocol import UNIX_SCHEME

Progress = Callable[[int, int], None]  # prompt tokens read so far, of the whole prompt
LoadProgress = Callable[[str, int, int], None]  # a load's stage, and bytes of the model loaded of all of them
ToolCalls = Callable[[list[dict]], None]  # a reply's tool calls so far, as they stream (GenerationResult.tool_calls)
CONNECT_SECONDS = 10.0
CANCEL_POLL_SECONDS = 0.1  # how soon a cancel ends a read that waits on a silent server


def sampling_fields(sampling: SamplingParams) -> dict:
    """The request fields of the sampling settings; those at their neutral value are left out, so a server that
    knows only OpenAI's fields (top_k, min_p and repetition_penalty are vLLM's) accepts the request."""
    fields = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
    optional = {"top_k": (sampling.top_k, 0), "min_p": (sampling.min_p, 0.0),
                "repetition_penalty": (sampling.repetition_penalty, 1.0), "seed": (sampling.seed, None),
                "stop": (list(sampling.stop), [])}
    fields.update({name: value for name, (value, neutral) in optional.items() if value != neutral})
    return fields


def _check_url(url: str) -> None:
    """InvalidArgumentError unless url is an http(s) URL with a host and a port in range (httpx takes
    "localhost:8000" as a scheme and a path, and raises its own error for "http://[::1")."""
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError) as e:
        reason = str(e)
    else:
        if parsed.scheme not in ("http", "https"):
            reason = "it starts with neither http:// nor https://"
        elif not parsed.host:
            reason = "it names no host"
        elif port is not None and not 0 < port < 65536:
            reason = f"port {port} is not in 1-65535"
        else:
            return
    raise InvalidArgumentError(f"{url!r:.200} is not a server URL ({reason}); give http://HOST:PORT, as "
                               f"http://127.0.0.1:8000 or http://[::1]:8000, or unix:/path/to.sock")


class RemoteServer:
    """An OpenAI-compatible server at base_url (with or without its /v1), or on a Unix socket at `unix:/path`
    (what `stowage serve --unix PATH` prints); api_key goes in a bearer header."""

    def __init__(self, base_url: str, api_key: str | None = None, *, trust_env: bool = True):
        url = base_url.rstrip("/")
        self.base_url = url.removesuffix("/v1")  # in messages, and what a GUI shows
        self.api_key = api_key  # what a GUI shows to copy (the app's Serve switch)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no read timeout: a long prompt on a slow machine may take minutes before its first token
        timeout = httpx.Timeout(CONNECT_SECONDS, read=None)
        if self.base_url.startswith(UNIX_SCHEME):
            path = self.base_url.removeprefix(UNIX_SCHEME)
            if not path:
                raise InvalidArgumentError(f"{base_url!r}: a Unix socket's URL is unix:/path/to.sock")
            # the requests' URLs only fill the Host header; no proxy can stand on a socket file (trust_env off)
            self._http = httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=path),
                                      headers=headers, trust_env=False, timeout=timeout)
        else:
            _check_url(base_url)
            self._http = httpx.Client(base_url=self.base_url, headers=headers, trust_env=trust_env, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def health(self) -> bool:
        """Whether the server answers GET /health (Stowage, vLLM and llama.cpp's server have it)."""
        try:
            return self._http.get("/health", timeout=CONNECT_SECONDS).status_code == 200
        except httpx.TransportError:
            return False

    def unloaded_reason(self, *, timeout: float = CONNECT_SECONDS) -> str | None:
        """Why a server that is up serves no model any more (Stowage's /health: 503 with a `reason`, as after a
        weights file changed under it); None while it serves one, loads one, or does not answer."""
        try:
            response = self._http.get("/health", timeout=timeout)
            body = response.json() if response.status_code == 503 else None
        except (httpx.TransportError, ValueError):
            return None
        reason = body.get("reason") if isinstance(body, dict) else None
        return reason if isinstance(reason, str) and reason else None

    def models(self, *, timeout: float | None = None) -> list[dict]:
        """The model objects of GET /v1/models (each has an "id"; Stowage's and vLLM's a "max_model_len").

        timeout: seconds to wait for the answer (default: no limit), so a server that accepts the connection and
        never answers does not hold a GUI's worker for ever."""
        kwargs = {} if timeout is None else {"timeout": timeout}
        return self._get("/v1/models", **kwargs)["data"]

    def plan(self) -> dict:
        """A Stowage server's memory plan (engine.planning.report.to_dict)."""
        return self._get("/stowage/plan")

    def memory(self) -> dict:
        """A Stowage server's memory report per plan device, and its process id."""
        return self._get("/stowage/memory")

    def available_models(self) -> list[dict]:
        """The models a Stowage server may load (GET /stowage/models): each "id", "format", "size_bytes"."""
        return self._get("/stowage/models")["data"]

    def load(self, model: str, *, context_tokens: int | None = None, parallel: int | None = None, dtype: str | None = None,
             kv_dtype: str | None = None, progress: LoadProgress | None = None,
             cancel: threading.Event | None = None) -> dict:
        """Have a Stowage server serve `model` (an id of available_models()) instead of its model; the model object
        it serves then, with "parallel" and "plan" (its summary). progress(stage, done, total) follows the load.

        cancel.set() closes the stream, which cancels the load: the server then serves no model, and this raises
        GenerationCancelled. A plan that does not fit is InsufficientMemoryError, with the planner's message."""
        fields = {"context_tokens": context_tokens, "parallel": parallel, "dtype": dtype, "kv_dtype": kv_dtype}
        body = {"model": model, **{k: v for k, v in fields.items() if v is not None}}
        try:
            with self._http.stream("POST", "/stowage/load", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise self.refused(response)
                with _shut_on(cancel, response):
                    for event in _chunks(response.iter_lines()):
                        if cancel is not None and cancel.is_set():
                            break
                        if "loaded" in event:
                            return event["loaded"]
                        if "error" in event:
                            raise self._load_failed(event["error"])
                        if progress is not None:
                            progress(event["stage"], event["done"], event["total"])
        except httpx.TransportError as e:
            if cancel is None or not cancel.is_set():
                raise self.unreachable(e) from None
        if cancel is not None and cancel.is_set():
            raise GenerationCancelled(f"loading {model} was cancelled; {self.base_url} serves no model now")
        raise RemoteError(f"{self.base_url} ended the load of {model} without saying whether it loaded")

    @staticmethod
    def _load_failed(error) -> StowageError:
        message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        code = error.get("code") if isinstance(error, dict) else None
        if code == "insufficient_memory":
            return InsufficientMemoryError(message)
        if code == "cancelled":
            return GenerationCancelled(message)
        invalid = isinstance(error, dict) and error.get("type") == "invalid_request_error"
        return InvalidArgumentError(message) if invalid else RemoteError(message)

    def unload(self) -> None:
        """Ask a Stowage server to stop; its process then exits and returns all its memory."""
        self._check(self._request("POST", "/stowage/unload"))

    def chat(self, messages: list[dict], sampling: SamplingParams, *, model: str | None = None,
             cancel: threading.Event | None = None, progress: Progress | None = None,
             response_format: dict | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, on_call: ToolCalls | None = None) -> "RemoteStream":
        """A streaming chat reply: iterate for text deltas; `.result` once finished, with the tool calls the reply
        made (result.tool_calls; on_call(calls so far) as each piece of one arrives). response_format, tools and
        tool_choice as OpenAI's API takes them."""
        extra = {"response_format": response_format, "tools": tools or None, "tool_choice": tool_choice}
        body = {"messages": messages, **sampling_fields(sampling),
                **{key: value for key, value in extra.items() if value is not None}}
        return RemoteStream(self, "/v1/chat/completions", body, model, cancel, progress, on_call)

    def complete(self, prompt: str | list[int], sampling: SamplingParams, *, model: str | None = None,
                 cancel: threading.Event | None = None, progress: Progress | None = None,
                 response_format: dict | None = None) -> "RemoteStream":
        """A streaming completion of a text or of token ids (the prompt exactly as tokenized here); response_format
        as OpenAI's API takes it (a JSON schema the reply must match)."""
        body = {"prompt": prompt, **sampling_fields(sampling),
                **({"response_format": response_format} if response_format is not None else {})}
        return RemoteStream(self, "/v1/completions", body, model, cancel, progress)

    # -- the parts -----------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self.unreachable(e) from None

    def _get(self, path: str, **kwargs) -> dict:
        response = self._check(self._request("GET", path, **kwargs))
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"{self.base_url}{path} did not answer JSON: is it an OpenAI-compatible server?") from None

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            raise self.refused(response)
        return response

    def unreachable(self, error: httpx.TransportError) -> RemoteError:
        if isinstance(error, httpx.ConnectError):
            return RemoteError(f"cannot reach {self.base_url} ({error}); is the server running at that address?")
        return RemoteError(f"the connection to {self.base_url} broke ({error or type(error).__name__})")

    def refused(self, response: httpx.Response) -> StowageError:
        """The typed error of an error answer (OpenAI's error object, or whatever the server sent)."""
        try:
            error = response.json()["error"]
            message, code = error["message"], error.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = response.text[:300] or response.reason_phrase, None
        status = response.status_code
        if code == "context_length_exceeded":
            return InsufficientMemoryError(message)
        if status in (401, 403):
            return RemoteError(f"{self.base_url} refused the API key ({message}); give the server's key with --api-key")
        if status in (400, 404, 422):
            return InvalidArgumentError(message)
        return RemoteError(f"{self.base_url} answered {status}: {message}")


class RemoteStream:
    """One streaming reply; like engine.generation.Generation, iterate once, then read `result`.

    cancel.set() ends the stream within CANCEL_POLL_SECONDS even while the server sends nothing (a long prompt
    read by a server that reports no progress): the connection is shut, which cancels the request on the server
    and frees its blocks."""

    def __init__(self, server: RemoteServer, path: str, body: dict, model: str | None,
                 cancel: threading.Event | None, progress: Progress | None, on_call: ToolCalls | None = None):
        self.server, self.path, self.cancel, self.progress, self.on_call = server, path, cancel, progress, on_call
        self.body = {**body, **({"model": model} if model else {}), "stream": True,
                     "stream_options": {"include_usage": True}}
        self.chat = path.endswith("/chat/completions")
        self.result = GenerationResult()  # token_ids only from a Stowage server; completion_tokens from any usage

    def __iter__(self) -> Iterator[str]:
        return self._run()

    def _run(self) -> Iterator[str]:
        r, start = self.result, time.perf_counter()
        first = last = None  # when the first and the last text arrived, measured here for servers that do not say
        try:
            with self.server._http.stream("POST", self.path, json=self.body) as response:
                if response.status_code != 200:
                    response.read()
                    raise self.server.refused(response)
                with _shut_on(self.cancel, response):
                    for chunk in _chunks(response.iter_lines()):
                        if self._cancelled():
                            return
                        text = self._take(chunk)
                        if text:
                            first, last = first or time.perf_counter(), time.perf_counter()
                            r.text += text
                            yield text
        except httpx.TransportError as e:
            if self._cancelled():  # the read that the cancel cut short
                return
            raise self.server.unreachable(e) from None
        if r.finish_reason is None and self._cancelled():  # shut between two reads: the body just ended
            return
        if r.finish_reason is None:
            raise RemoteError(f"{self.server.base_url} ended the reply without a finish reason")
        if first is not None and not r.decode_seconds:
            r.first_token_seconds, r.prefill_seconds, r.decode_seconds = first - start, first - start, last - first
            r.prefilled_tokens = r.prompt_tokens - r.reused_tokens

    def _cancelled(self) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            self.result.finish_reason = "cancelled"
            return True
        return False

    def _take(self, chunk: dict) -> str:
        """Record what a chunk says; return its text."""
        if "error" in chunk:
            error = chunk["error"]
            raise RemoteError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        r, stowage = self.result, chunk.get("stowage") or {}
        if "prefill" in stowage and self.progress is not None:
            self.progress(stowage["prefill"]["done_tokens"], stowage["prefill"]["prompt_tokens"])
        if "token_ids" in stowage:
            r.token_ids = list(stowage["token_ids"])
            r.completion_tokens = len(r.token_ids)
            for name in ("prefilled_tokens", "prefill_seconds", "decode_seconds", "first_token_seconds"):
                setattr(r, name, stowage[name])
        if chunk.get("usage"):
            usage = chunk["usage"]
            r.prompt_tokens, r.completion_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
            r.reused_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        text = ""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") if self.chat else choice.get("text")
            text += piece or ""
            for call in delta.get("tool_calls") or []:
                self._take_call(call)
            r.finish_reason = choice.get("finish_reason") or r.finish_reason
        if r.finish_reason != "tool_calls":  # OpenAI's "length" may be "context_full"; a call stays a call
            r.finish_reason = stowage.get("finish_reason") or r.finish_reason
        return text


    def _take_call(self, piece: dict) -> None:
        """A tool call's piece, as OpenAI streams them: its index, id and name first, its arguments in parts."""
        calls = self.result.tool_calls
        index = piece.get("index", len(calls))
        if not isinstance(index, int) or not 0 <= index <= len(calls):
            raise RemoteError(f"{self.server.base_url} sent a tool call out of order (index {index!r:.20})")
        if index == len(calls):
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call, function = calls[index], piece.get("function") or {}
        call["id"] = piece.get("id") or call["id"]
        call["function"]["name"] = function.get("name") or call["function"]["name"]  # sent whole, once
        call["function"]["arguments"] += function.get("arguments") or ""
        if self.on_call is not None:
            self.on_call(calls)


@contextmanager
def _shut_on(cancel: threading.Event | None, response: httpx.Response):
    """While the body is read: once `cancel` is set, shut the connection's socket, which wakes a read blocked on
    a silent server (closing the response from another thread would not: a blocked recv outlives close)."""
    if cancel is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(CANCEL_POLL_SECONDS):
            if cancel.is_set():
                stream = response.extensions.get("network_stream")
                sock = stream.get_extra_info("socket") if stream is not None else None
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:  # already closed
                        pass
                return

    watcher = threading.Thread(target=watch, name="stowage-remote-cancel", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def _chunks(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise RemoteError(f"the server sent an event that is not JSON: {data[:200]!r}") from None
