"""Conversations whose K/V stay cached after their request, found again by their longest common token prefix."""

from __future__ import annotations

import time

from ..generation import Conversation, common_prefix
from ..kv_cache import Sequence


class PrefixPool:
    """Idle cached conversations of an engine; a request takes the one that shares most of its prompt.

    A shared system prompt or a chat's growing history is then prefilled only past what is cached (the
    per-conversation prefix reuse of engine/generation.py, across requests). A conversation serves one
    request at a time; one that shares less than half of what it holds with the prompt is left alone. When running sequences need blocks, the least recently used idle ones are evicted.
    """

    def __init__(self, engine):
        self.engine = engine  # engine/engine.py Engine: new_conversation, release, cache
        self._idle: list[Conversation] = []

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def take(self, prompt_ids: list[int]) -> tuple[Conversation, int]:
        """A conversation for prompt_ids, holding as much of it cached as there is, and that many tokens."""
        cache = self.engine.cache
        best, reuse = None, 0
        for conv in self._idle:
            # at least one prompt token is computed: its logits give the first token of the reply; and a prefix
            # whose sliding-window K/V were recycled is not reusable (KVCache.num_reusable)
            n = cache.num_reusable(conv.seq, min(common_prefix(conv.seq.token_ids, prompt_ids), len(prompt_ids) - 1))
            if n > reuse:
                best, reuse = conv, n
        # Taking a conversation drops what it holds past the shared prefix: only when the prefix is at least half
        # of it (a chat continued; a long shared system prompt). A start token or a short system prompt in common
        # is cheaper to prefill again than another chat's history (the app's chats share their system prompt).
        if best is None or 2 * reuse < best.num_tokens:
            return self.engine.new_conversation(), 0
        self._idle.remove(best)
        return best, cache.truncate(best.seq, reuse)

    def give_back(self, conv: Conversation) -> None:
        """Keep a finished request's conversation cached for the requests that follow."""
        conv.last_used = time.monotonic()
        if conv.num_tokens:
            self._idle.append(conv)
        else:
            self.engine.release(conv)

    def make_room(self, growth: list[tuple[Sequence, int]]) -> None:
        """Evict idle conversations, least recently used first, until each sequence can grow by its tokens.

        The plan holds a whole context for every running sequence, so evicting idle ones is always enough."""
        cache = self.engine.cache
        if cache.can_fit(growth):
            return
        self._idle.sort(key=lambda c: c.last_used)
        while self._idle and not cache.can_fit(growth):
            self.engine.release(self._idle.pop(0))

    def clear(self) -> None:
        while self._idle:
            self.engine.release(self._idle.pop())
