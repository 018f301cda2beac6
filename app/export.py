"""A conversation's branch on screen written out as Markdown or JSON: each message with its time and which
version of it this is, each reply with its model and sampling."""

from __future__ import annotations

import json
import time

from . import tool_messages
from .store import Message

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}
SAMPLING_NAMES = (("temperature", "temperature"), ("top_p", "top-p"), ("top_k", "top-k"), ("min_p", "min-p"),
                  ("repetition_penalty", "repetition penalty"), ("seed", "seed"))


def _stamp(created: float, fmt: str = "%Y-%m-%d %H:%M") -> str:
    return time.strftime(fmt, time.localtime(created)) if created else ""


def _version(message: Message) -> str:
    """'version 2 of 3' for a message with other versions (regenerated, edited); '' otherwise."""
    versions = message.siblings
    return f"version {versions.index(message.id) + 1} of {len(versions)}" if len(versions) > 1 else ""


def _about(message: Message) -> str:
    """'demo-model · 2026-03-14 15:09 · temperature 0.3, ...': what is known of how a message came about."""
    sampling = message.meta.get("sampling") or {}
    settings = ", ".join(f"{label} {sampling[key]}" for key, label in SAMPLING_NAMES if sampling.get(key) is not None)
    return " · ".join(filter(None, [message.meta.get("model", ""), _stamp(message.created), settings,
                                    _version(message)]))


def to_markdown(title: str, messages: list[Message]) -> str:
    parts = [f"# {title}\n"]
    for message in messages:
        about = _about(message)
        header = f"## {ROLE_TITLES.get(message.role, message.role)}\n\n" + (f"*{about}*\n\n" if about else "")
        parts.append(f"{header}{tool_messages.markdown(message).strip()}\n")
    return "\n".join(parts)


def to_json(title: str, messages: list[Message]) -> str:
    def entry(m: Message) -> dict:
        stamp = {"created": _stamp(m.created, "%Y-%m-%dT%H:%M:%S")} if m.created else {}
        version = {"version": m.siblings.index(m.id) + 1, "num_versions": len(m.siblings)} if len(m.siblings) > 1 else {}
        # a reply's calls and a result's call id as OpenAI's API writes them: the file reads back as a chat request
        return {**tool_messages.api_message(m), **stamp, **version, **({"meta": m.meta} if m.meta else {})}

    return json.dumps({"title": title, "messages": [entry(m) for m in messages]}, indent=2, ensure_ascii=False)
