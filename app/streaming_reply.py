"""The reply streaming now, kept in the store as it grows, so a crash or kill loses at most SAVE_INTERVAL_S of it."""

from __future__ import annotations

import time

from stowage.engine.runtime.generation import GenerationResult

from .store import ConversationStore, Message

# A streamed reply is written at least this often, so a crash or kill loses at most this much of it.
SAVE_INTERVAL_S = 2.0
# The finish reason a reply carries while it streams: what a crash leaves in the file.
INTERRUPTED = "interrupted"


class StreamingReply:
    """One reply from its request to its end: its text and counts so far, and its row in the store (made at the first
    token, written at most every SAVE_INTERVAL_S, finished with its text and figures)."""

    def __init__(self, store: ConversationStore, conversation_id: int, message_ids: list[int], sampling: dict,
                 model: str):
        self.store = store
        self.conversation_id = conversation_id
        self.message_ids = message_ids  # the branch sent, up to the message answered
        self.sampling, self.model = sampling, model  # as sent: the panel may change while the reply runs
        self.text = ""
        self.id: int | None = None  # its row, from its first token on
        self.orphaned = False  # its chat was deleted: nothing more is written for it
        self.prompt_tokens = 0  # as the worker counted them before sending
        self.num_tokens = 0  # streamed so far
        self.kept_head = 0  # messages still sent from before a gap in the model's memory
        self.started_at = time.perf_counter()
        self._saved_at = 0.0

    @property
    def answered_id(self) -> int:
        """The message it answers (its parent)."""
        return self.message_ids[-1]

    def meta(self, finish_reason: str, **figures) -> dict:
        meta = {"finish_reason": finish_reason, **figures, "model": self.model, "sampling": self.sampling}
        if self.kept_head:  # the memory line's wording when the chat is shown again
            meta["kept_head"] = self.kept_head
        return meta

    def add(self, text: str) -> None:
        """A token's text: kept, and written (its row at the first token, then at most every SAVE_INTERVAL_S)."""
        self.num_tokens += 1
        self.text += text
        if self.orphaned:
            return
        now = time.monotonic()
        if self.id is None:
            self.id = self.store.add_message(self.conversation_id, "assistant", self.text,
                                             self.meta(INTERRUPTED, prompt_tokens=self.prompt_tokens),
                                             parent_id=self.answered_id)
        elif now - self._saved_at >= SAVE_INTERVAL_S:
            self.store.update_message(self.id, self.text)
        else:
            return
        self._saved_at = now

    def end(self, result: GenerationResult) -> tuple[Message | None, int]:
        """The engine's record of the finished reply kept with it (finish): its text, tool calls and figures; and the
        tokens the context holds after it."""
        r = result
        # A reply stopped mid-stream ends before the engine's usage arrives (0 tokens): what was counted here stands
        # in, so the counter and the stored figures still say what the context holds.
        prompt_tokens = r.prompt_tokens or self.prompt_tokens
        completion_tokens = r.completion_tokens or (self.num_tokens if not r.prompt_tokens else 0)
        meta = self.meta(
            r.finish_reason, tokens_per_s=round(r.decode_tokens_per_s, 2), prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, first_token_s=round(r.first_token_seconds, 3),
            prompt_tokens_per_s=round(r.prefill_tokens_per_s, 1), **({"tool_calls": r.tool_calls} if r.tool_calls else {}))
        return self.finish(r.text, meta), prompt_tokens + completion_tokens

    def finish(self, text: str, meta: dict) -> Message | None:
        """The reply's final text and meta in its row (made now if no token came); None when nothing is kept."""
        # Nothing to keep for a reply stopped before its first token, or whose conversation was deleted.
        if (not text and not meta.get("tool_calls")) or self.orphaned:
            return None
        if self.id is None:
            self.id = self.store.add_message(self.conversation_id, "assistant", text, meta, parent_id=self.answered_id)
        else:
            self.store.update_message(self.id, text, meta)
        # As stored, with its versions (a regenerated reply shows "2/2").
        return next(m for m in self.store.messages(self.conversation_id) if m.id == self.id)
