"""Tool calls in a chat: a reply's calls (kept in its meta as OpenAI's API writes them) and the tool results that
answer them (role "tool"), shown readably, sent back to the model in the API's shape, and written out by export."""

from __future__ import annotations

import json

from .store import Message


def calls(message: Message) -> list[dict]:
    """The tool calls a reply made ({"id", "type", "function": {"name", "arguments"}}); [] for any other message."""
    found = message.meta.get("tool_calls") if message.role == "assistant" else None
    return [c for c in found if isinstance(c, dict) and isinstance(c.get("function"), dict)] if isinstance(
        found, list) else []


def pretty(text: str) -> tuple[str, str]:
    """(the text, its code fence's language): JSON indented, anything else as it is."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False), "json"
    except (ValueError, TypeError):
        return text, ""


def _block(title: str, text: str) -> str:
    body, language = pretty(text)
    fence = "````" if "```" in body else "```"
    return f"{title}\n\n{fence}{language}\n{body}\n{fence}"


def markdown(message: Message) -> str:
    """The message as the chat shows it (and export writes it): a reply's text, then each call, its function's name
    and its arguments indented; a tool's result under the name of the call it answers."""
    if message.role == "tool":
        name = message.meta.get("name") or "a tool"
        return _block(f"**Result of `{name}`**", message.content)
    parts = [message.content.strip()] if message.content.strip() else []
    for call in calls(message):
        function = call["function"]
        parts.append(_block(f"**Calls `{function.get('name', '?')}`**", str(function.get("arguments", ""))))
    return "\n\n".join(parts)


def api_message(message: Message) -> dict:
    """The message as a chat request sends it: a reply with its tool_calls, a result with its tool_call_id."""
    out = {"role": message.role, "content": message.content}
    if message.role == "assistant" and calls(message):
        out["tool_calls"] = calls(message)
    if message.role == "tool":
        out["tool_call_id"] = message.meta.get("tool_call_id", "")
    return out


def pending_call(messages: list[Message]) -> dict | None:
    """The first call of the branch's last reply that no tool result after it answers yet (None: none waits)."""
    answered, i = set(), len(messages) - 1
    while i >= 0 and messages[i].role == "tool":
        answered.add(messages[i].meta.get("tool_call_id"))
        i -= 1
    if i < 0:
        return None
    return next((c for c in calls(messages[i]) if c.get("id") not in answered), None)
