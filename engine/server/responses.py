"""What the API answers, shaped as OpenAI's: completion objects, stream chunks, usage, the model lists."""

from __future__ import annotations

import json
import time
import uuid

from ..runtime.generation import GenerationResult

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


class Reply:
    """The objects of one reply, for chat (`chat.completion`) or text (`text_completion`)."""

    def __init__(self, model: str, *, chat: bool, include_usage: bool = False):
        self.model, self.chat, self.include_usage = model, chat, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, result: GenerationResult) -> dict:
        """The non-streaming answer."""
        finish = FINISH_REASONS[result.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                      "finish_reason": finish}
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
        return {**self.chunk(finish_reason=result.finish_reason), "stowage": engine_stats(result)}

    def progress_chunk(self, done_tokens: int, prompt_tokens: int) -> dict:
        """An empty chunk that says how much of a long prompt is read, under "stowage" (clients ignore it)."""
        return {**self.chunk(), "stowage": {"prefill": {"done_tokens": done_tokens, "prompt_tokens": prompt_tokens}}}

    def usage_chunk(self, result: GenerationResult) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage of the whole reply."""
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(result))


def model_object(name: str, created: int, context_tokens: int) -> dict:
    # max_model_len as vLLM names it: clients read the context from it
    return {"id": name, "object": "model", "created": created, "owned_by": "stowage", "max_model_len": context_tokens}


def listed_model(model) -> dict:
    """A model this machine lists (a discovery.FoundModel), as GET /stowage/models shows it: its id, never its path."""
    return {"id": model.name, "object": "model", "format": model.format, "size_bytes": model.size_bytes,
            "quant": model.quant, "source": model.source}
