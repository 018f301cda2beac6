"""Chat templates rendered as Hugging Face does, in jinja2's immutable sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ModelFormatError

# Used when a model ships no template: plain role-prefixed turns (a warning says so).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class TemplateError(ModelFormatError):
    """The chat template failed to render (or raised on purpose through raise_exception)."""


def _raise_exception(message: str):
    raise TemplateError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template does not compile: {e}") from e


def render(source: str, messages: list[dict], *, add_generation_prompt: bool = True, **special_tokens) -> str:
    try:
        return compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed: {e}") from e
