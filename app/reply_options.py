"""A chat's reply options: JSON replies (any object, or valid under a schema file the user chose) and tools the model
may call (a file of OpenAI tool objects), kept with the chat and sent with each of its requests.

The files are read and checked when chosen, by the engine's own checks (the grammar compiles the schema; the
server's request parser checks the tools), so a bad file is refused then with the reason, not at the next message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from stowage.engine.errors import InvalidArgumentError
from stowage.engine.server.schemas import ApiError, parse_chat
from stowage.engine.text import grammar

JSON_OBJECT = {"type": "json_object"}
MAX_FILE_BYTES = 1 << 20  # a schema or a tool list is a few KiB; a larger file is a wrong choice


@dataclass(frozen=True)
class ReplyOptions:
    """response_format, tools and tool_choice as OpenAI's API takes them; None / () where the chat sets none."""

    response_format: dict | None = None
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict | None = None  # None: the server's default ("auto" where there are tools)
    schema_file: str = ""  # the names of the files chosen, for the chat's bar
    tools_file: str = ""

    @property
    def is_json(self) -> bool:
        return self.response_format is not None

    def to_dict(self) -> dict:
        """What the store keeps ({}: free text, no tools)."""
        out = {"response_format": self.response_format, "tools": list(self.tools) or None,
               "tool_choice": self.tool_choice, "schema_file": self.schema_file, "tools_file": self.tools_file}
        return {key: value for key, value in out.items() if value}

    @classmethod
    def from_dict(cls, stored: dict) -> "ReplyOptions":
        """The options the store kept; a hand-edited value of the wrong shape is dropped."""
        if not isinstance(stored, dict):
            return cls()
        format_, tools = stored.get("response_format"), stored.get("tools") or ()
        return cls(response_format=format_ if isinstance(format_, dict) else None,
                   tools=tuple(t for t in tools if isinstance(t, dict)) if isinstance(tools, list) else (),
                   tool_choice=stored.get("tool_choice") if isinstance(stored.get("tool_choice"), (str, dict)) else None,
                   schema_file=str(stored.get("schema_file", "")), tools_file=str(stored.get("tools_file", "")))

    def describe(self) -> str:
        """'JSON (weather.json) · 2 tools (tools.json)': what the chat's replies are held to."""
        parts = []
        if self.response_format is not None:
            parts.append(f"JSON ({self.schema_file})" if self.schema_file else "JSON")
        if self.tools:
            tools = f"{len(self.tools)} tool{'s' if len(self.tools) != 1 else ''}"
            parts.append(f"{tools} ({self.tools_file})" if self.tools_file else tools)
        return " · ".join(parts)


def _read_json(path: Path):
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise InvalidArgumentError(f"{path.name} is {path.stat().st_size:,} bytes: a schema or a tool list is a "
                                       f"few KiB (at most {MAX_FILE_BYTES:,} bytes here)")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read {path.name}: {e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidArgumentError(f"{path.name} is not JSON: {e}") from None
    except RecursionError:
        raise InvalidArgumentError(f"{path.name} is nested too deeply to be a schema or a tool list") from None


def schema_format(path: str | Path) -> dict:
    """The response_format of replies valid under the JSON Schema in the file at `path`; InvalidArgumentError naming
    what is wrong (not JSON, not a schema, a keyword the grammar cannot hold replies to)."""
    path = Path(path)
    schema = _read_json(path)
    grammar.json_schema_grammar(schema, path.name)  # compiled as the engine will: refused now, not at the reply
    name = re.sub(r"[^A-Za-z0-9_-]", "_", path.stem)[:64] or "schema"  # OpenAI's rule for the name
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def tools_of(path: str | Path) -> tuple[tuple[dict, ...], str | dict | None]:
    """The tools (and tool_choice) in the file at `path`: a list of OpenAI tool objects, or {"tools": [...],
    "tool_choice": ...}; InvalidArgumentError naming what is wrong, as a server would refuse it."""
    path = Path(path)
    value = _read_json(path)
    tools, choice = (value.get("tools"), value.get("tool_choice")) if isinstance(value, dict) else (value, None)
    if not isinstance(tools, list) or not tools:
        raise InvalidArgumentError(f"{path.name} holds no tools: give a list of {{\"type\": \"function\", "
                                   "\"function\": {\"name\", \"parameters\"}} objects, or {\"tools\": [...]}")
    body = {"messages": [{"role": "user", "content": "?"}], "tools": tools,
            **({"tool_choice": choice} if choice is not None else {})}
    try:
        parse_chat(body)  # the server's own checks: names, parameters' schemas compiled, tool_choice
    except (ApiError, InvalidArgumentError) as e:
        raise InvalidArgumentError(f"{path.name}: {e}") from None
    return tuple(tools), choice

