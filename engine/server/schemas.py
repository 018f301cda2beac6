"""What the OpenAI-compatible API accepts, checked field by field, and OpenAI's error object.

Every field a request may carry is either supported, or accepted only at its neutral value (`n: 1`,
`logprobs: false`, ...) and refused otherwise: nothing a client asks for is silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

from ..dtypes import COMPUTE, KV, kv_name
from ..errors import InvalidArgumentError
from ..runtime.sampler import MAX_SEED, MAX_STOP_CHARS, MAX_STOPS, SamplingParams
from ..text import grammar

ROLES = ("system", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
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
class Tools:
    """A chat request's tools: what the chat template is shown, and whether and which call the grammar forces."""

    specs: tuple[dict, ...]  # OpenAI's tool objects, as chat templates receive them
    parameters: dict[str, dict] = field(default_factory=dict)  # each tool's name -> its parameters' JSON Schema
    choice: str = "auto"  # "auto", "none", "required", or the name of the tool that must be called

    @property
    def is_forced(self) -> bool:
        """A call is forced (required, or a named tool): the reply is that call."""
        return self.choice not in ("auto", "none")


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
    grammar: str | None = None  # llguidance's grammar the reply must match (response_format, a forced tool call)
    tools: Tools | None = None  # chat: the tools offered

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
    "functions": (([], None), "functions (function calling) are not supported"),
    "function_call": (("none", None), "function_call is not supported"),
    "echo": ((False, None), "echo is not supported"),
    "suffix": (("", None), "suffix (insertion) is not supported"),
    "best_of": ((1, None), "best_of must be 1"),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
           "stream", "stream_options", "n", "frequency_penalty", "presence_penalty", "logit_bias", "user"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "functions", "function_call", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of", "response_format"}
# Keys a message may carry at an empty value (clients echo the assistant message back as they received it).
_MESSAGE_EMPTY = {"name": (None,), "function_call": (None,), "refusal": (None,), "audio": (None,),
                  "annotations": (None, [])}


def parse_chat(body: dict) -> CompletionRequest:
    """A /v1/chat/completions body, validated; ApiError (400) naming the first field that is wrong."""
    _check_fields(body, CHAT_FIELDS)
    max_tokens = _max_tokens(body, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    tools = _tools(body)
    fields = _common(body)
    if tools is not None and tools.is_forced:
        if fields["grammar"] is not None:
            raise _bad("response_format", "response_format and a forced tool call (tool_choice required or named) "
                                          "cannot both shape one reply; give one")
        fields["grammar"] = grammar.json_schema_grammar(grammar.tool_call_schema(
            tools.parameters, None if tools.choice == "required" else tools.choice), "tools")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    return CompletionRequest(messages=parsed, max_tokens=max_tokens, tools=tools, **fields)


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
    dtype, kv = body.get("dtype"), body.get("kv_dtype")
    if dtype is not None and not (isinstance(dtype, str) and dtype in COMPUTE):
        raise _bad("dtype", f"dtype must be one of {', '.join(COMPUTE)}; got {dtype!r:.40}")
    if kv is not None:  # one type for K and V, or two as "K/V" ("q8_0/q4_0"), aliases as the CLI takes them
        kv = _kv_name(kv)
    return LoadRequest(model, **counts, dtype=dtype, kv_dtype=kv)


def _kv_name(value: object) -> str:
    try:
        if isinstance(value, str) and value != "auto":
            return kv_name(value)
    except ValueError:
        pass
    raise _bad("kv_dtype", f"kv_dtype must be one of {', '.join(KV)}, or K/V such as q8_0/q4_0; got {value!r:.40}")


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
    return dict(model=model, stream=stream, include_usage=include_usage, params=params,
                grammar=_response_format(body.get("response_format")))


def _response_format(value) -> str | None:
    """The grammar response_format asks for: None for text; any JSON object; JSON valid under a schema."""
    where = "response_format"
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object" and set(value) == {"type"}:
        return grammar.json_schema_grammar(grammar.ANY_OBJECT, where)
    if kind == "json_schema" and set(value) <= {"type", "json_schema"}:
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
            raise _bad(where, f"{where}.json_schema must be {{\"name\", \"schema\", \"strict\", \"description\"}}")
        if not isinstance(spec.get("name"), str) or not TOOL_NAME.fullmatch(spec["name"]):
            raise _bad(where, f"{where}.json_schema.name must be 1-64 letters, digits, _ or -")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise _bad(where, f"{where}.json_schema.strict must be true or false")
        return _compiled(spec.get("schema", grammar.ANY_OBJECT), where, f"{where}.json_schema.schema")
    raise _bad(where, f"{where} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or {{\"type\": "
                      f"\"json_schema\", \"json_schema\": {{\"name\", \"schema\"}}}}; got {value!r:.80}")


def _compiled(schema, param: str, what: str) -> str:
    try:
        return grammar.json_schema_grammar(schema, what)
    except InvalidArgumentError as e:
        raise _bad(param, str(e), code="invalid_schema") from None


def _tools(body: dict) -> Tools | None:
    """The request's tools and tool_choice (parallel_tool_calls is accepted: a forced call is one call)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    _bool(body, "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    specs, parameters = [], {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and set(tool) <= {"type", "function"}
                and isinstance(function, dict)):
            raise _bad(where, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}} "
                              "(only functions are supported)")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, _ or -")
        if name in parameters:
            raise _bad(f"{where}.function.name", f"{where}.function.name {name!r} is given twice")
        if set(function) - {"name", "description", "parameters", "strict"}:
            raise _bad(where, f"{where}.function takes name, description, parameters and strict")
        if not isinstance(function.get("description", ""), str):
            raise _bad(f"{where}.function.description", f"{where}.function.description must be a string")
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        _compiled(schema, f"{where}.function.parameters", f"{where}.function.parameters")  # refused now, not later
        parameters[name] = schema
        specs.append({"type": "function", "function": {**function, "parameters": schema}})
    if choice is None or choice in ("auto", "none", "required"):
        return Tools(tuple(specs), parameters, choice or "auto")
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(named, str) or named not in parameters:
        raise _bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ...}}}} naming one of the tools; got {choice!r:.80}")
    return Tools(tuple(specs), parameters, named)


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
    role = m.get("role")
    if role == "assistant" and m.get("tool_calls"):
        return _assistant_calls(m, where)
    if role == "tool":
        return _tool_result(m, where)
    for key, value in m.items():
        if key in ("role", "content") or (key == "tool_calls" and value in (None, [])):
            continue
        if key not in _MESSAGE_EMPTY:
            raise _bad(f"{where}.{key}", f"{where}.{key} is not supported (a message has role and content)")
        if not _is_one_of(value, _MESSAGE_EMPTY[key]):
            raise _bad(f"{where}.{key}", f"{where}.{key} is not supported (names and audio are not)")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r:.40}")
    return {"role": role, "content": _content(m.get("content"), f"{where}.content")}


def _assistant_calls(m: dict, where: str) -> dict:
    """An assistant message with tool_calls, as chat templates read it: each call's arguments as an object."""
    for key in m:
        if key not in ("role", "content", "tool_calls") and not _is_one_of(m[key], _MESSAGE_EMPTY.get(key, ())):
            raise _bad(f"{where}.{key}", f"{where}.{key} is not supported")
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str) and isinstance(call.get("id", ""), str)):
            raise _bad(at, f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\": a JSON object's text}}}}")
        try:
            arguments = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            raise _bad(at, f"{at}.function.arguments is not JSON (or nests too deeply)") from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    content = m.get("content")
    text = "" if content is None else _content(content, f"{where}.content")
    return {"role": "assistant", "content": text, "tool_calls": out}


def _tool_result(m: dict, where: str) -> dict:
    """A tool's answer to a call: its text, and the id of the call it answers."""
    if set(m) - {"role", "content", "tool_call_id", "name"}:
        raise _bad(where, f"{where}: a tool message has role, content, tool_call_id (and name)")
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str):
        raise _bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be the id of the call it answers")
    out = {"role": "tool", "content": _content(m.get("content"), f"{where}.content"), "tool_call_id": call_id}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


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
