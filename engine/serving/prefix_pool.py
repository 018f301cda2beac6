"""Conversations whose K/V stay cached after their request, found again by their longest common token prefix."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..runtime.generation import common_prefix
from ..runtime.kv_cache import Sequence
from .kv_store import KVStore


@dataclass
class Conversation:
    """A sequence whose K/V stay cached between requests: a chat's history, a shared system prompt."""

    seq: Sequence = field(default_factory=Sequence)
    last_used: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens


class PrefixPool:
    """Idle cached conversations of an engine; a request starts from the longest prefix of its prompt cached anywhere.

    A shared system prompt or a chat's growing history is then prefilled only past what is cached: a chat's next turn,
    whose prompt starts with the history, continues the history's conversation. Two ways to start from a cached
    prefix:
    - continue an idle conversation (truncated to the prefix): a conversation serves one request at a time, and one
      that shares less than half of what it holds with the prompt is left alone;
    - share the whole blocks of the prefix with any cached sequence, idle or running (KVCache.share): both hold
      them read-only, and the new request computes its own blocks from the first one not in common.
    When running sequences need blocks, the least recently used idle ones are evicted: written to the plan's disk
    store first (engine/serving/kv_store.py) when it has one, from where a later request reads back what it shares instead
    of prefilling it. An evicted conversation frees only the blocks no running sequence shares. The server's end
    (clear) writes the idle ones too, so a restart resumes them.
    """

    def __init__(self, engine):
        self.engine = engine  # runtime/engine.py Engine: cache, plan (and model_dir for the store)
        self.store = KVStore.of(engine)  # None: the plan spills nothing to disk
        self._idle: list[Conversation] = []

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def take(self, prompt_ids: list[int], running: list[Sequence]) -> tuple[Conversation, int]:
        """A conversation for prompt_ids, holding as much of it cached as there is, and that many tokens.

        `running`: the sequences of the requests running now; what they hold (prompt tokens prefilled, tokens fed)
        can be shared."""
        # at least one prompt token is computed: its logits give the first token of the reply
        wanted = len(prompt_ids) - 1
        best, reuse, source, shared = self._in_memory(prompt_ids, running, wanted)
        # A file on disk loses nothing by being read in part; a block in common is worth reading rather than computing.
        entry, on_disk = self.store.best(prompt_ids) if self.store else (None, 0)
        if on_disk > max(reuse, shared) and on_disk >= self.engine.cache.spec.block_size:
            conv = Conversation()
            self.store.touch(entry)  # the conversations evicted to make room for it are written without deleting it
            self.make_room([(conv.seq, on_disk)])
            if self.store.load(entry, on_disk, conv.seq):
                return conv, on_disk
            self.release(conv)
            best, reuse, source, shared = self._in_memory(prompt_ids, running, wanted)  # some were evicted for it
        # on a tie, sharing keeps what the idle conversation holds past the prefix, which continuing it would drop
        if shared > reuse or (shared and shared == reuse and best.num_tokens > reuse):
            conv = Conversation()
            return conv, self.engine.cache.share(conv.seq, source, shared)
        if best is None:
            return Conversation(), 0
        self._idle.remove(best)
        return best, self.engine.cache.truncate(best.seq, reuse)

    def _in_memory(self, prompt_ids: list[int], running: list[Sequence], wanted: int):
        """(the idle conversation to continue, its tokens kept; the sequence to share with, its tokens shared)."""
        cache = self.engine.cache
        best, reuse = None, 0
        for conv in self._idle:
            # a prefix whose sliding-window K/V were recycled is not reusable (KVCache.num_reusable)
            n = cache.num_reusable(conv.seq, min(common_prefix(conv.seq.token_ids, prompt_ids), wanted))
            if n > reuse:
                best, reuse = conv, n
        # Continuing a conversation drops what it holds past the shared prefix: only when the prefix is at least half
        # of it (a chat continued). A system prompt in common is shared instead, its whole blocks, and the other
        # chat's history stays cached (the app's chats share their system prompt).
        if best is not None and 2 * reuse < best.num_tokens:
            best, reuse = None, 0
        source, shared = None, 0
        for seq in [*(conv.seq for conv in self._idle), *running]:
            n = cache.num_shareable(seq, min(common_prefix(seq.token_ids, prompt_ids), wanted))
            if n > shared:
                source, shared = seq, n
        return best, reuse, source, shared

    def give_back(self, conv: Conversation) -> None:
        """Keep a finished request's conversation cached for the requests that follow."""
        conv.last_used = time.monotonic()
        if conv.num_tokens:
            self._idle.append(conv)
        else:
            self.release(conv)

    def release(self, conv: Conversation) -> None:
        """Free a conversation's blocks (those no other sequence shares), cached no more."""
        self.engine.cache.release(conv.seq)

    def make_room(self, growth: list[tuple[Sequence, int]]) -> None:
        """Evict idle conversations, least recently used first, until each sequence can grow by its tokens.

        The plan holds a whole context for every running sequence, so evicting idle ones is always enough: a block
        that running sequences share is held once, which only lowers their use (an evicted conversation frees the
        blocks no other sequence holds)."""
        cache = self.engine.cache
        if cache.can_fit(growth):
            return
        self._idle.sort(key=lambda c: c.last_used)
        while self._idle and not cache.can_fit(growth):
            self._evict(self._idle.pop(0))

    def clear(self) -> None:
        self._idle.sort(key=lambda c: c.last_used)  # written oldest first: the budget keeps the recent ones
        while self._idle:
            self._evict(self._idle.pop(0))

    def _evict(self, conv: Conversation) -> None:
        try:
            if self.store is not None:
                self.store.save(conv.seq)  # never raises for the disk's sake (a store that cannot write turns off)
        finally:
            self.release(conv)  # whatever happened on the way to the disk, the blocks come back
