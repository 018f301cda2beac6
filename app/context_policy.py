"""What to send when a conversation outgrows the context: stop, drop the oldest turns, or cut the middle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

STOP = "stop"
DROP_OLDEST = "drop_oldest"
TRUNCATE_MIDDLE = "truncate_middle"
POLICIES = {
    STOP: "Stop and say so",
    DROP_OLDEST: "Drop the oldest turns",
    TRUNCATE_MIDDLE: "Truncate the middle",
}


class ContextFullError(Exception):
    """The conversation does not fit the context and the policy says stop (or nothing more can go)."""


class ConversationFullError(ContextFullError):
    """The conversation as a whole outgrew the context under "stop": a new chat, or forgetting old turns, makes room
    (not so when the last message alone is too long)."""


@dataclass(frozen=True)
class Fitted:
    messages: list[dict]  # what to send, system prompt first
    kept: list[int]  # indices into the conversation's messages that are sent
    prompt_tokens: int

    @property
    def first_kept(self) -> int:
        """Index of the first conversation message in the model's memory after a gap (0: no gap)."""
        for expected, index in enumerate(self.kept):
            if index != expected:
                return index
        return 0

    @property
    def kept_head(self) -> int:
        """How many messages are sent from before the gap (the first turn, for 'truncate the middle'); 0: no gap."""
        first = self.first_kept
        return sum(1 for i in self.kept if i < first) if first else 0


def fit(
    system: list[dict],
    messages: list[dict],
    count_tokens: Callable[[list[dict]], int],
    budget_tokens: int,
    policy: str,
) -> Fitted:
    """Choose the messages to send so the prompt is at most `budget_tokens`.

    `system` is kept always; whole user/assistant turns are dropped, never half a turn, and the last
    turn (the message being answered) is never dropped. `count_tokens` renders through the chat
    template, so the count includes the template's own tokens. Replies before the first user message
    are left out (templates such as Gemma's and Mistral's refuse a chat that starts with one).
    """
    first_user = next((i for i, m in enumerate(messages) if m["role"] != "assistant"), 0)
    kept = list(range(first_user, len(messages)))

    def render(indices):
        return system + alternating([messages[i] for i in indices])

    tokens = count_tokens(render(kept))
    if tokens <= budget_tokens:
        return Fitted(render(kept), kept, tokens)
    if policy == STOP:
        raise ConversationFullError(
            f"The conversation needs {tokens:,} tokens but the context holds {budget_tokens:,} "
            f"(with room for the reply). Start a new conversation, load with a larger context, or choose "
            f"'{POLICIES[DROP_OLDEST]}' in the settings."
        )
    turns = _turns(kept, messages)
    # For 'truncate middle' the first turn stays while it can (it usually sets up the task), and goes last:
    # a first turn too long to keep beside the new message must not leave the chat stuck.
    if policy == DROP_OLDEST:
        droppable = turns[:-1]
    else:
        droppable = turns[1:-1] + (turns[:1] if len(turns) > 1 else [])
    for turn in droppable:
        kept = [i for i in kept if i not in turn]
        tokens = count_tokens(render(kept))
        if tokens <= budget_tokens:
            return Fitted(render(kept), kept, tokens)
    raise ContextFullError(
        f"Even the last message alone needs {tokens:,} tokens and the context holds {budget_tokens:,}. "
        f"Shorten the message or load with a larger context."
    )


def alternating(messages: list[dict]) -> list[dict]:
    """The messages with same-role neighbours sent as one, their texts a blank line apart: a deleted message, or a
    reply that failed before its first word, leaves two questions (or two replies) in a row, which the templates of
    Gemma and Mistral (and our built-in Gemma one) refuse. Tool calls and results are never merged."""
    out: list[dict] = []
    for m in messages:
        prev = out[-1] if out else None
        if (prev is not None and m["role"] == prev["role"] and m["role"] in ("user", "assistant")
                and not prev.get("tool_calls") and not m.get("tool_calls")):
            out[-1] = {**prev, "content": f"{prev['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


def context_full_text(context_tokens: int, policy: str) -> str:
    """What a chat says when a reply stopped at the end of its context: how to go on."""
    text = (f"The reply stopped at the end of the {context_tokens:,}-token context. Start a new conversation "
            "or load the model with a larger context to go on")
    if policy == STOP:
        # The other policies already make room for the next message; naming them again would not help.
        return (text + f", or set 'When full' to '{POLICIES[DROP_OLDEST]}' "
                "so the next message makes room by forgetting the oldest turns.")
    return text + "."


def _turns(indices: list[int], messages: list[dict]) -> list[list[int]]:
    """Group message indices into turns, each starting at a user message."""
    turns: list[list[int]] = []
    for i in indices:
        if messages[i]["role"] == "user" or not turns:
            turns.append([i])
        else:
            turns[-1].append(i)
    return turns
