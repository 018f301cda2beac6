"""What the API answers, shaped as OpenAI's: completion objects, stream chunks, usage, the model lists."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ..runtime.generation import GenerationResult, TokenEvent
from ..text import harmony
from ..text.tool_calls import ForcedCallStream, ReplyStream, ToolCall, ToolFormat, parse

# The engine's reasons, in OpenAI's words: a reply cut by the context is cut for length, as by max_tokens.
FINISH_REASONS = {"stop": "stop", "length": "length", "context_full": "length", "cancelled": "stop"}


def usage(result: GenerationResult) -> dict:
    completion = result.completion_tokens
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": result.reused_tokens}}


def engine_stats(result: GenerationResult) -> dict:
    """What the engine measured of a reply, under the extension field "stowage" of the last chunk (as llama.cpp's
    server adds "timings"): OpenAI clients ignore it; Stowage's own client reads the token ids and rates from it."""
    return {"token_ids": result.token_ids, "finish_reason": result.finish_reason,  # the engine's: "context_full" too
            "prefilled_tokens": result.prefilled_tokens,
            "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
            "first_token_seconds": result.first_token_seconds}


def sse(data: dict | str) -> str:
    """One server-sent event: `data: {...}` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class ToolReplies:
    """How a chat reply with tools is read: a forced call (the grammar's `{"name", "arguments"}`), or in `auto` the
    model's own format, whose start marker may be a special token that decoding drops (marker_id)."""

    names: frozenset[str]
    is_forced: bool
    format: ToolFormat
    special: dict[str, int] = field(default_factory=dict)  # the format's markers that are special tokens -> id
    decode_all: Callable[[list[int]], str] | None = None  # token ids to text, special tokens kept

    @property
    def marker_id(self) -> int | None:
        """The token that starts a call, when decoding drops it."""
        return self.special.get(self.format.start)

    def whole(self, result: GenerationResult) -> str:
        """The reply's text, with the special tokens of the format that decoding dropped."""
        if self.special and self.decode_all is not None and set(self.special.values()) & set(result.token_ids):
            return self.decode_all(result.token_ids)
        return result.text


@dataclass(frozen=True)
class HarmonyReplies:
    """How a gpt-oss chat reply is read (engine/text/harmony.py): its channels' markers are special tokens, which
    decoding drops, so each is put back by its id; the analysis channel is `reasoning_content`, the final one
    `content`, a commentary message to `functions.NAME` a tool call."""

    markers: dict[int, str]  # token id -> marker text
    decode_all: Callable[[list[int]], str]  # token ids to text, special tokens kept
    tools: frozenset[str] = frozenset()  # the functions offered (none under tool_choice "none"): other calls are text

    def text(self, event: TokenEvent) -> str:
        return self.markers.get(event.token_id, event.text)

    def whole_text(self, result: GenerationResult) -> str:
        """The reply with its markers, cut where result.text was (a stop string ends it mid-token)."""
        full, kept, at = self.decode_all(result.token_ids), 0, 0
        for m in harmony.MARKER_RE.finditer(full):
            if kept + m.start() - at >= len(result.text):
                break
            kept, at = kept + m.start() - at, m.end()
        return full[:at + len(result.text) - kept]

    def kind(self, message: harmony.HarmonyMessage) -> str:
        """Where a message's text goes: "reasoning", "call" (a function offered), or "content"."""
        if message.channel == harmony.REASONING:
            return "reasoning"
        if message.is_tool_call and message.recipient.removeprefix("functions.") in self.tools:
            return "call"
        return "content"


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class Reply:
    """The objects of one reply, for chat (`chat.completion`) or text (`text_completion`); with tools, the reply's
    text read as content and tool calls."""

    def __init__(self, model: str, *, chat: bool, include_usage: bool = False, tools: ToolReplies | None = None,
                 channels: HarmonyReplies | None = None):
        self.model, self.chat, self.include_usage = model, chat, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tools = tools if tools is not None and tools.names else None
        self.forced = ForcedCallStream() if self.tools is not None and self.tools.is_forced else None
        # a gpt-oss reply's channels (a forced call or a schema leaves none: the grammar writes the reply alone)
        self.channels = channels if chat and channels is not None and self.forced is None else None
        self.harmony = harmony.HarmonyStream() if self.channels is not None else None
        self.auto = ReplyStream(tools.format, set(tools.names)) if self.tools and not self.forced \
            and self.harmony is None else None
        self.forced_id: str | None = None
        self.num_calls = 0  # tool calls streamed
        self._call_ids: dict[int, str] = {}  # a harmony message's index -> the id of the call it is

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, result: GenerationResult) -> dict:
        """The non-streaming answer."""
        finish = FINISH_REASONS[result.finish_reason]
        if self.chat:
            content, calls = self._read(result)
            message = {"role": "assistant", "content": content}
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [_call_object(call_id(), c) for c in calls]}
                finish = "tool_calls" if finish == "stop" else finish
            if self.harmony is not None:
                message["reasoning_content"] = "".join(
                    m.content for m in self._parsed(result).messages if self.channels.kind(m) == "reasoning")
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            return self._object("chat.completion", [choice], usage=usage(result))
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        return self._object("text_completion", [choice], usage=usage(result))

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *, first: bool = False) -> dict:
        """A stream chunk: text, or the finish reason (the chat's first chunk carries the role)."""
        finish = FINISH_REASONS[finish_reason] if finish_reason else None
        extra = {"usage": None} if self.include_usage else {}
        if not self.chat:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return self._object("text_completion", [choice], **extra)
        delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._object("chat.completion.chunk", [choice], **extra)

    def last_chunk(self, result: GenerationResult) -> dict:
        """The chunk with the finish reason, and the engine's figures under "stowage"."""
        chunk = {**self.chunk(finish_reason=result.finish_reason), "stowage": engine_stats(result)}
        if self.num_calls and chunk["choices"][0]["finish_reason"] == "stop":
            chunk["choices"][0]["finish_reason"] = "tool_calls"
        return chunk

    # -- tool calls ------------------------------------------------------------------------------
    def _read(self, result: GenerationResult) -> tuple[str, list[ToolCall]]:
        """A whole reply's content and tool calls."""
        if self.forced is not None:
            forced = ForcedCallStream()
            forced.feed(result.text)
            call = forced.call()
            return ("", [call]) if call is not None else (result.text, [])
        if self.harmony is not None:
            messages = self._parsed(result).messages
            return ("".join(m.content for m in messages if self.channels.kind(m) == "content"),
                    [ToolCall(m.recipient.removeprefix("functions."), m.content) for m in messages
                     if self.channels.kind(m) == "call"])
        if self.auto is not None:
            return parse(self.tools.whole(result), self.tools.format, set(self.tools.names))
        return result.text, []

    def token_chunks(self, event: TokenEvent) -> list[dict]:
        """The stream chunks of one token's text: content, or with tools the pieces of a call."""
        if self.forced is not None:
            name, arguments = self.forced.feed(event.text)
            out = []
            if name is not None:
                self.forced_id, self.num_calls = call_id(), 1
                out.append(self._call_chunk({"index": 0, "id": self.forced_id, "type": "function",
                                             "function": {"name": name, "arguments": ""}}))
            if arguments:
                out.append(self._call_chunk({"index": 0, "function": {"arguments": arguments}}))
            return out
        if self.harmony is not None:
            return self._channel_chunks(self.harmony.feed(self.channels.text(event)))
        if self.auto is not None:
            text = event.text
            if event.token_id == self.tools.marker_id and self.tools.format.start not in text:
                text = self.tools.format.start + text  # a special token, which decoding drops
            content = self.auto.feed(text)
            return [self.chunk(content)] if content else []
        return [self.chunk(event.text)] if event.text else []

    def end_chunks(self, result: GenerationResult) -> list[dict]:
        """The chunks that close a stream: a call's held tail or the calls of `auto`, then the finish chunk."""
        out = []
        if self.harmony is not None:
            out = self._channel_chunks(self.harmony.close())
        elif self.auto is not None:
            content, calls = self.auto.finish(self.tools.whole(result))
            if content:
                out.append(self.chunk(content))
            for i, c in enumerate(calls):
                out.append(self._call_chunk({"index": i, "id": call_id(), "type": "function",
                                             "function": {"name": c.name, "arguments": c.arguments}}))
            self.num_calls = len(calls)
        elif self.forced is not None and self.forced_id is not None and not self.forced.is_complete:
            tail = self.forced.held()  # cut short: the held character is an argument's, not the call's
            if tail:
                out.append(self._call_chunk({"index": 0, "function": {"arguments": tail}}))
        return [*out, self.last_chunk(result)]

    def _parsed(self, result: GenerationResult) -> harmony.HarmonyReply:
        return harmony.parse(self.channels.whole_text(result))

    def _channel_chunks(self, deltas: list[harmony.Delta]) -> list[dict]:
        """A gpt-oss reply's new text, by channel: reasoning, content, or the pieces of a tool call."""
        out = []
        for d in deltas:
            message = self.harmony.reply.messages[d.index]
            kind = self.channels.kind(message)
            if kind == "call":
                call = {"index": self._call_index(d.index), "function": {"arguments": d.text}}
                if d.index not in self._call_ids:  # its first piece: the id and the name, as OpenAI streams them
                    self._call_ids[d.index] = call_id()
                    call = {**call, "id": self._call_ids[d.index], "type": "function",
                            "function": {"name": message.recipient.removeprefix("functions."), "arguments": d.text}}
                    self.num_calls = len(self._call_ids)
                out.append(self._call_chunk(call))
            elif kind == "reasoning":
                out.append(self._delta_chunk({"reasoning_content": d.text}))
            else:
                out.append(self.chunk(d.text))
        return out

    def _call_index(self, message_index: int) -> int:
        return list(self._call_ids).index(message_index) if message_index in self._call_ids else len(self._call_ids)

    def _delta_chunk(self, delta: dict) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._object("chat.completion.chunk", [choice], **extra)

    def _call_chunk(self, call: dict) -> dict:
        return self._delta_chunk({"tool_calls": [call]})

    def progress_chunk(self, done_tokens: int, prompt_tokens: int) -> dict:
        """An empty chunk that says how much of a long prompt is read, under "stowage" (clients ignore it)."""
        return {**self.chunk(), "stowage": {"prefill": {"done_tokens": done_tokens, "prompt_tokens": prompt_tokens}}}

    def usage_chunk(self, result: GenerationResult) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage of the whole reply."""
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(result))


def _call_object(id_: str, call: ToolCall) -> dict:
    return {"id": id_, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def model_object(name: str, created: int, context_tokens: int) -> dict:
    # max_model_len as vLLM names it: clients read the context from it
    return {"id": name, "object": "model", "created": created, "owned_by": "stowage", "max_model_len": context_tokens}


def listed_model(model) -> dict:
    """A model this machine lists (a discovery.FoundModel), as GET /stowage/models shows it: its id, never its path."""
    return {"id": model.name, "object": "model", "format": model.format, "size_bytes": model.size_bytes,
            "quant": model.quant, "source": model.source}
