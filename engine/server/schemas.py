"""What the OpenAI-compatible API accepts, checked field by field, and OpenAI's error object.

Every field a request may carry is either supported, or accepted only at its neutral value (`n: 1`,
`tools: []`, `logprobs: false`, ...) and refused otherwise: nothing a client asks for is silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..dtypes import COMPUTE, KV
from ..errors import InvalidArgumentError
from ..runtime.sampler import MAX_SEED, MAX_STOP_CHARS, MAX_STOPS, SamplingParams

ROLES = ("system", "user", "assistant")
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ApiError(Exception):
    """An error the client receives as OpenAI's error object, with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        message, param = _encodable(message), _encodable(param)  # they may quote the request: a lone surrogate
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _encodable(text: str | None) -> str | None:
    """text with what UTF-8 cannot encode (a lone surrogate, which JSON's \\udXXX escapes make) written as its
    escape: the error that quotes it must still be sent."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class CompletionRequest:
    """One validated request of either endpoint: what to continue, and how to sample."""

    model: str | None
    messages: tuple[dict, ...] = ()  # chat: {"role", "content"} with content as text
    prompt: str | tuple[int, ...] | None = None  # completions: text, or token ids
    max_tokens: int | None = None  # None: the rest of the context (chat), COMPLETION_MAX_TOKENS (completions)
    # the engine's own record; its max_tokens is set per request by sampling(), once the room left is known
    params: SamplingParams = SamplingParams(temperature=1.0)  # OpenAI's default temperature
    stream: bool = False
    include_usage: bool = False

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling settings, with the reply capped at max_tokens."""
        return replace(self.params, max_tokens=max_tokens)


# Fields accepted only at a value that asks for nothing: the value(s) allowed, and what to say otherwise.
_NEUTRAL = {
    "n": ((1, None), "n must be 1: one choice per request"),
    "frequency_penalty": ((0, 0.0, None), "frequency_penalty is not supported (use repetition_penalty)"),
    "presence_penalty": ((0, 0.0, None), "presence_penalty is not supported (use repetition_penalty)"),
    "logit_bias": (({}, None), "logit_bias is not supported"),
    "logprobs": ((False, None), "logprobs are not supported"),
    "top_logprobs": ((0, None), "top_logprobs are not supported"),
    "tools": (([], None), "tools (function calling) are not supported"),
    "tool_choice": (("none", None), "tool_choice is not supported (no tools)"),
    "parallel_tool_calls": ((True, False, None), "parallel_tool_calls needs tools, which are not supported"),
    "functions": (([], None), "functions (function calling) are not supported"),
    "function_call": (("none", None), "function_call is not supported"),
    "response_format": (({"type": "text"}, None), "response_format other than text is not supported"),
    "echo": ((False, None), "echo is not supported"),
    "suffix": (("", None), "suffix (insertion) is not supported"),
    "best_of": ((1, None), "best_of must be 1"),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
           "stream", "stream_options", "n", "frequency_penalty", "presence_penalty", "logit_bias", "user"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "functions", "function_call", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
# Keys a message may carry at an empty value (clients echo the assistant message back as they received it).
_MESSAGE_EMPTY = {"name": (None,), "tool_calls": (None, []), "function_call": (None,), "refusal": (None,),
                  "audio": (None,), "annotations": (None, [])}


def parse_chat(body: dict) -> CompletionRequest:
    """A /v1/chat/completions body, validated; ApiError (400) naming the first field that is wrong."""
    _check_fields(body, CHAT_FIELDS)
    max_tokens = _max_tokens(body, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    return CompletionRequest(messages=tuple(_message(m, i) for i, m in enumerate(messages)), max_tokens=max_tokens,
                             **_common(body))


def parse_completion(body: dict) -> CompletionRequest:
    """A /v1/completions body, validated; ApiError (400) naming the first field that is wrong."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise _bad("prompt", "prompt must be a string or a list of token ids (one prompt per request)")
    max_tokens = _max_tokens(body, None)
    return CompletionRequest(prompt=prompt, max_tokens=COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
                             **_common(body))


@dataclass(frozen=True)
class LoadRequest:
    """A validated POST /stowage/load: a model this machine lists (its id, never a path) and how to plan it."""

    model: str
    context_tokens: int | None = None  # None: DEFAULT_CONTEXT or the model's maximum, as at start
    parallel: int | None = None  # None: the server's --parallel
    dtype: str | None = None
    kv_dtype: str | None = None


LOAD_FIELDS = {"model", "context_tokens", "parallel", "dtype", "kv_dtype"}


def parse_load(body: dict) -> LoadRequest:
    """A /stowage/load body, validated; ApiError (400) naming the first field that is wrong."""
    _check_fields(body, LOAD_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model must be the id of a model this machine lists (GET /stowage/models)")
    counts = {key: _number(body, key, None, lambda v: v >= 1, "an integer >= 1", integer=True)
              for key in ("context_tokens", "parallel")}
    for key, names in (("dtype", COMPUTE), ("kv_dtype", KV)):
        value = body.get(key)
        if value is not None and not (isinstance(value, str) and value in names):
            raise _bad(key, f"{key} must be one of {', '.join(names)}; got {value!r:.40}")
    return LoadRequest(model, **counts, dtype=body.get("dtype"), kv_dtype=body.get("kv_dtype"))


def _check_fields(body: dict, known: set[str]) -> None:
    for key, value in body.items():
        if key not in known:
            raise _bad(key, f"Unrecognized request argument supplied: {key}")
        if key in _NEUTRAL and not _is_one_of(value, _NEUTRAL[key][0]):
            raise _bad(key, f"{_NEUTRAL[key][1]}; got {key}={value!r:.80}")
    # `user` is an end-user id for the provider's abuse monitoring: any string, with nothing to do locally
    if not isinstance(body.get("user", ""), str):
        raise _bad("user", "user must be a string")


def _common(body: dict) -> dict:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "model must be a string")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options", "stream_options supports only {\"include_usage\": true|false}")
        include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    if stops is None:
        stops = ()
    if (not isinstance(stops, tuple) or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)
            or len(stops) > MAX_STOPS):
        raise _bad("stop", f"stop must be a string or a list of at most {MAX_STOPS} strings of at most "
                           f"{MAX_STOP_CHARS} characters each")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed <= MAX_SEED):
        raise _bad("seed", f"seed must be an integer in [0, 2**64), got {seed!r:.40}")
    top_k = _number(body, "top_k", 0, lambda v: v == -1 or v >= 0, "an integer >= 0 (0 or -1: off)", integer=True)
    fields = dict(
        temperature=_number(body, "temperature", 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2] (0 is greedy)"),
        top_p=_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=max(top_k, 0),
        min_p=_number(body, "min_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, lambda v: v > 0, "a number > 0 (1 is off)"),
    )
    try:
        params = SamplingParams(**fields, stop=stops, seed=seed)
    except InvalidArgumentError as e:  # the fields were checked one by one; this is the last guard
        raise _bad(None, str(e)) from None
    return dict(model=model, stream=stream, include_usage=include_usage, params=params)


def _max_tokens(body: dict, alias: str | None) -> int | None:
    values = {k: body[k] for k in ("max_tokens", alias) if k and body.get(k) is not None}
    for key, value in values.items():
        if not _is_int(value) or value < 1:
            raise _bad(key, f"{key} must be an integer >= 1, got {value!r:.40}")
    if len(set(values.values())) > 1:
        raise _bad(alias, f"max_tokens ({values['max_tokens']}) and {alias} ({values[alias]}) disagree; give one")
    return next(iter(values.values()), None)


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(where, f"{where} must be an object with role and content")
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        if key not in _MESSAGE_EMPTY:
            raise _bad(f"{where}.{key}", f"{where}.{key} is not supported (a message has role and content)")
        if not _is_one_of(value, _MESSAGE_EMPTY[key]):
            raise _bad(f"{where}.{key}", f"{where}.{key} is not supported (tools, names and audio are not)")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r:.40}")
    return {"role": role, "content": _content(m.get("content"), f"{where}.content")}


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    # a list of text parts is the same text, written in parts; images, audio and files are not text
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
            and isinstance(p["text"], str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(where, f"{where} must be a string (or a list of {{\"type\": \"text\", \"text\"}} parts); "
                      "images, audio and files are not supported")


def _number(body: dict, key: str, default, ok, what: str, integer: bool = False):
    value = body.get(key)
    if value is None:
        return default
    is_number = _is_int(value) if integer else (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    if not is_number or not ok(value):
        raise _bad(key, f"{key} must be {what}, got {value!r:.40}")
    return value


def _bool(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(name or key, f"{name or key} must be true or false, got {value!r:.40}")
    return bool(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_one_of(value, allowed) -> bool:
    # type-exact: False is not 0, and 1.0 is not a count of 1
    return any(type(value) is type(a) and value == a for a in allowed if a is not None) or (
        value is None and None in allowed)
