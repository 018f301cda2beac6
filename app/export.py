"""A conversation written out as Markdown or JSON."""

from __future__ import annotations

import json

from .store import Message

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


def to_markdown(title: str, messages: list[Message]) -> str:
    parts = [f"# {title}\n"]
    for message in messages:
        parts.append(f"## {ROLE_TITLES.get(message.role, message.role)}\n\n{message.content.strip()}\n")
    return "\n".join(parts)


def to_json(title: str, messages: list[Message]) -> str:
    return json.dumps(
        {
            "title": title,
            "messages": [{"role": m.role, "content": m.content, **({"meta": m.meta} if m.meta else {})} for m in messages],
        },
        indent=2,
        ensure_ascii=False,
    )
