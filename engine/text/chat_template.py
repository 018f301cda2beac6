"""Chat templates rendered as Hugging Face does, in jinja2's immutable sandbox (engine/text/template_sandbox.py), under
limits on time and size (engine/text/template_limits.py); the built-in formats for models that bring none."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import jinja2

from ..errors import TemplateError, TemplateLimitError  # noqa: F401 (callers catch them from here)
from .template_limits import ADVICE, LIMITS, TemplateLimits, budget_for  # noqa: F401 (TemplateLimits: read here)
from .template_sandbox import LimitedEnvironment

# Used when a model ships no template: plain role-prefixed turns (a warning says so).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# Built-in formats, by architecture, for models that bring no template (GGUF files often carry none).
# Gemma's published one: the `model` role, the system message folded into the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    template: str
    stop_tokens: tuple[str, ...] = ()  # the end of a turn, which the model's own eos ids may not include


BUILTIN = {"gemma": BuiltinTemplate("gemma", GEMMA_TEMPLATE, ("<end_of_turn>",))}


def builtin_for(model_type: str) -> BuiltinTemplate | None:
    """The built-in chat format of an architecture ("gemma2", "gemma3_text", ...), if it has one."""
    return next((t for family, t in BUILTIN.items() if model_type.startswith(family)), None)


@lru_cache(maxsize=16)
def compile_template(source: str, name: str = "chat template") -> jinja2.Template:
    try:
        return LimitedEnvironment().from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"{name} does not compile: {e}") from e
    except (RecursionError, MemoryError, SyntaxError) as e:  # nesting too deep for the parser or for Python
        raise TemplateError(f"{name} does not compile: {type(e).__name__}: {e}") from e


def render(
    source: str, messages: list[dict], *, add_generation_prompt: bool = True, name: str = "chat template",
    tools: list[dict] | None = None, **special_tokens,
) -> str:
    """The template's text for `messages` (and `tools`, OpenAI's tool objects, for templates that offer them);
    TemplateError (TemplateLimitError past LIMITS) on any failure."""
    if not isinstance(source, str):
        raise TemplateError(f"{name} is a {type(source).__name__}, not text; use the model's published template")
    if not source.strip():
        raise TemplateError(f"{name} is empty; the model folder's template is missing its text — "
                            "use the model's published template")
    template = compile_template(source, name)
    with budget_for(name) as budget:
        try:
            chunks, size = [], 0
            variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                             **special_tokens)  # tools None when none are offered, as transformers renders
            for chunk in template.generate(**variables):
                size += len(chunk)
                if size > LIMITS.max_output_chars:
                    raise budget.refuse(
                        f"wrote over {LIMITS.max_output_chars:,} characters (about a million tokens)",
                        "if the conversation is not that long, the template repeats text without end; "
                        "use the model's published template, or start a new conversation",
                    )
                chunks.append(chunk)
            return "".join(chunks)
        except TemplateError:
            raise
        except RecursionError as e:
            raise TemplateError(f"{name} recursed too deeply ({e}); {ADVICE}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"{name} failed: {e}") from e
        except Exception as e:  # TypeError, ZeroDivisionError, ... raised by the template's own expressions
            raise TemplateError(f"{name} failed: {type(e).__name__}: {e}") from e
