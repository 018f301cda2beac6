"""Tool calls in a reply's text: the families' own formats (Qwen/Hermes `<tool_call>`, Mistral `[TOOL_CALLS]`, as a
JSON list or as `name[ARGS]{...}`, Llama 3.x's bare JSON, after `<|python_tag|>` or not) read back into calls, whole or as the text streams, and
the forced call a grammar writes (engine/text/grammar.py tool_call_schema: `{"name": ..., "arguments": {...}}`, one
line).

A call is `ToolCall(name, arguments)` with arguments as JSON text, as OpenAI's API carries them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ToolFormat:
    """How a family's template writes a call: after `start` (None: the reply itself is the JSON), until `end`."""

    name: str
    start: str | None
    end: str | None = None
    is_list: bool = False  # the text after start is a JSON list of calls (Mistral)
    args: str | None = None  # start, the name, this marker, the arguments' JSON: one call (Mistral's newer format)
    tag: str | None = None  # a special token the model may write before a bare JSON call (Llama 3's <|python_tag|>)
    key: str = "arguments"  # the call object's key for its arguments

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker texts of the format, which may be special tokens of a tokenizer."""
        return tuple(m for m in (self.start, self.args, self.end, self.tag) if m)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")  # Qwen 2.5/3, Hermes, many fine-tunes
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, is_list=True)  # Mistral 7B v0.3, Nemo
MISTRAL_ARGS = ToolFormat("mistral-args", "[TOOL_CALLS]", None, args="[ARGS]")  # Mistral Small 3.2, Devstral
# Llama 3.1-3.3: the reply is the call, `{"name": ..., "parameters": {...}}`, after <|python_tag|> or not
LLAMA3 = ToolFormat("llama3", None, tag="<|python_tag|>", key="parameters")
JSON = ToolFormat("json", None)  # templates that know no tools: a reply that is a call's JSON is read as one


def format_of(template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches its model."""
    template = template or ""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL_ARGS if "[ARGS]" in template else MISTRAL
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return LLAMA3
    return JSON


def _call(value) -> ToolCall | None:
    """A call from a parsed {"name", "arguments" | "parameters"} object; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as the API carries them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _calls(text: str, many: bool) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    values = value if many and isinstance(value, list) else [value]
    calls = [_call(v) for v in values]
    return calls if calls and all(calls) else None


def parse(text: str, fmt: ToolFormat, names: set[str]) -> tuple[str, list[ToolCall]]:
    """The reply's content and its calls (of tools in `names`); text that does not parse as calls stays content."""
    if fmt.start is None:
        body = text.strip().removeprefix(fmt.tag or "").lstrip()  # a tag decoded as text, where it is not special
        calls = _calls(body, many=True) if body.startswith(("{", "[")) else None
        if calls and all(c.name in names for c in calls):
            return "", calls
        return text, []
    at = text.find(fmt.start)
    if at < 0:
        return text, []
    content, rest, calls = text[:at], text[at:], []
    if fmt.args is not None:
        for piece in rest.split(fmt.start)[1:]:
            name, sep, arguments = piece.partition(fmt.args)
            call = _call({"name": name.strip(), "arguments": arguments.strip()}) if sep else None
            if call is None or call.name not in names:
                return text, []
            calls.append(call)
        return content.rstrip(), calls
    while rest.startswith(fmt.start):
        body = rest[len(fmt.start):]
        cut = body.find(fmt.end) if fmt.end else -1
        found = _calls(body[:cut] if cut >= 0 else body, fmt.is_list)
        if not found or not all(c.name in names for c in found):
            return text, []
        calls += found
        rest = body[cut + len(fmt.end):].lstrip() if cut >= 0 else ""
    return (content.rstrip(), calls) if not rest else (text, [])


class ReplyStream:
    """A streamed reply split into content and tool calls: `feed` each text delta, `finish` at the end. Content
    is passed on as it comes, but for a tail that may begin a call, held until it is clear."""

    def __init__(self, fmt: ToolFormat, names: set[str]):
        self.fmt, self.names = fmt, names
        self.text = ""  # all of the reply
        self.sent = 0  # characters of text passed on as content
        self.in_call = False  # a call has begun: the rest is held, and parsed at the end

    def feed(self, delta: str) -> str:
        """The content safe to show now."""
        self.text += delta
        if self.in_call:
            return ""
        start = self.fmt.start
        if start is None:
            stripped = self.text.lstrip()
            if stripped.startswith(("{", "[", *([self.fmt.tag] if self.fmt.tag else []))):
                self.in_call = True
                return ""
            if not stripped or self.fmt.tag and self.fmt.tag.startswith(stripped):  # may yet be a call
                return ""
            return self._send(len(self.text))
        at = self.text.find(start, self.sent)
        if at >= 0:
            self.in_call = True
            return self._send(at)
        # hold back the longest tail that is a prefix of the start marker
        keep = next((k for k in range(min(len(start) - 1, len(self.text)), 0, -1)
                     if self.text.endswith(start[:k])), 0)
        return self._send(len(self.text) - keep)

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out

    def finish(self, whole: str | None = None) -> tuple[str, list[ToolCall]]:
        """The content not yet passed on, and the calls, once the reply has ended; `whole`: the reply's text with
        the special tokens that decoding drops (Mistral's [ARGS]), to read the calls from."""
        _, calls = parse(self.text if whole is None else whole, self.fmt, self.names)
        if not calls:
            return self.text[self.sent:], []
        at = self.text.find(self.fmt.start) if self.fmt.start else 0
        return self.text[self.sent:max(at, self.sent)].rstrip(), calls


class ForcedCallStream:
    """A forced call's text, `{"name": "N", "arguments": {...}}` as the grammar writes it, streamed as OpenAI does:
    the name once it is complete, then the arguments in pieces (the closing brace of the call held back)."""

    PREFIX = '{"name": '
    ARGUMENTS = ', "arguments": '

    def __init__(self):
        self.text = ""
        self.name: str | None = None
        self.sent = 0  # characters of the arguments passed on

    def feed(self, delta: str) -> tuple[str | None, str]:
        """(the name, the first time it is known; else None) and the arguments' new text."""
        self.text += delta
        name = None
        if self.name is None:
            at = self.text.find(self.ARGUMENTS)
            if at < 0:
                return None, ""
            self.name = name = json.loads(self.text[len(self.PREFIX):at])
        body = self.text[self.text.find(self.ARGUMENTS) + len(self.ARGUMENTS):]
        piece, self.sent = body[self.sent:max(self.sent, len(body) - 1)], max(self.sent, len(body) - 1)
        return name, piece

    def held(self) -> str:
        """The arguments' text not passed on yet: the last character, held in case it closes the call."""
        at = self.text.find(self.ARGUMENTS)
        return "" if at < 0 else self.text[at + len(self.ARGUMENTS):][self.sent:]

    @property
    def is_complete(self) -> bool:
        """The call's JSON is whole (not cut by max_tokens or a stop string): its last brace closes the call."""
        try:
            json.loads(self.text)
        except ValueError:
            return False
        return True

    def call(self) -> ToolCall | None:
        """The call in all the text fed, its arguments the very text streamed (cut short, as far as it got); None
        before its name is complete."""
        at = self.text.find(self.ARGUMENTS)
        if at < 0:
            return None
        body = self.text[at + len(self.ARGUMENTS):]
        return ToolCall(json.loads(self.text[len(self.PREFIX):at]), body[:-1] if self.is_complete else body)
