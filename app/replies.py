"""What the chat asks the engine worker for, and what the worker answers (plain records, passed in signals)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from . import context_policy


@dataclass
class ChatRequest:
    conversation_id: int
    system: list[dict]  # [] or [{"role": "system", "content": ...}]
    messages: list[dict]  # the conversation, oldest first
    sampling: object  # engine.sampler.SamplingParams
    policy: str = context_policy.STOP
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class ReplyStarted:
    conversation_id: int
    prompt_tokens: int
    first_kept: int  # index of the first conversation message still in the model's memory after a gap
    kept_head: int = 0  # messages still sent from before the gap (the first turn, under "truncate the middle")


@dataclass(frozen=True)
class Reply:
    conversation_id: int
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | ...
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    first_token_seconds: float = 0.0  # from the start of the prompt's prefill

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
