"""What the chat asks the engine worker for, and what the worker answers: plain records passed in signals, and
the sentence an error becomes."""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field

from stowage.engine.errors import StowageError
from stowage.engine.runtime.generation import GenerationResult
from stowage.engine.runtime.sampler import SamplingParams

from . import context_policy
from .reply_options import ReplyOptions


@dataclass
class ChatRequest:
    conversation_id: int
    system: list[dict]  # [] or [{"role": "system", "content": ...}]
    messages: list[dict]  # the conversation, oldest first
    sampling: SamplingParams
    policy: str = context_policy.STOP
    completion: bool = False  # continue the messages' text as written, without the chat template (a base model)
    options: ReplyOptions = field(default_factory=ReplyOptions)  # JSON replies, tools
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class ReplyStarted:
    conversation_id: int
    prompt_tokens: int
    first_kept: int  # index of the first conversation message still in the model's memory after a gap
    kept_head: int = 0  # messages still sent from before the gap (the first turn, under "truncate the middle")


@dataclass(frozen=True)
class Reply:
    """A finished reply: the engine's own record of it (in process, from the engine's child or a server)."""

    conversation_id: int
    result: GenerationResult

    @property
    def context_tokens(self) -> int:
        """The tokens of the context this reply filled: its prompt and its own."""
        return self.result.prompt_tokens + self.result.completion_tokens


def describe_error(error: BaseException) -> str:
    """A sentence for the user; our own errors already say what to do, others get their type named."""
    if isinstance(error, StowageError):
        return str(error)
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return f"Out of memory: {error or 'the system refused an allocation'}. Choose a smaller context or fewer GPU layers."
    return f"{type(error).__name__}: {error}"


def log_unexpected(error: BaseException) -> None:
    """Our own errors are for the user and shown to them; anything else is a bug worth a traceback."""
    if not isinstance(error, StowageError):
        traceback.print_exception(error)
