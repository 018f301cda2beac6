"""Chat templates rendered as Hugging Face does, in jinja2's immutable sandbox, under limits on time and size."""

from __future__ import annotations

import contextvars
import json
import math
import re
import time
import types
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import LoopContext, Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from .errors import ModelFormatError

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



@dataclass(frozen=True)
class TemplateLimits:
    """What one render may spend; a real chat template needs a small fraction of each."""

    max_output_chars: int = 4 * 1024 * 1024  # the prompt, and any one string built on the way (~1M tokens)
    max_printed_chars: int = 32 * 1024 * 1024  # every {{ }} together, macro and {% set %} bodies included
    max_seconds: float = 2.0
    max_range: int = 100_000  # one range(), as jinja's own sandbox
    max_iterations: int = 1_000_000  # all for-loops of a render together
    max_items: int = 1_000_000  # one list, tuple or dict built by the template
    max_int_bits: int = 4096  # one integer (about 1,233 digits)
    max_depth: int = 64  # macro calls and recursive loops inside each other


LIMITS = TemplateLimits()
_MAX_DATE_FORMAT_CHARS = 1024

_ADVICE = "a chat prompt needs far less, so the template is faulty or hostile; use the model's published template"


class TemplateError(ModelFormatError):
    """The chat template failed to render (or raised on purpose through raise_exception)."""


class TemplateLimitError(TemplateError):
    """The chat template ran past a limit on time, size, loops or nesting (see TemplateLimits)."""


class _Budget:
    """One render's spending against LIMITS; hooks reach it through a context variable."""

    __slots__ = ("name", "deadline", "printed_chars", "num_iterations", "depth")

    def __init__(self, name: str):
        self.name = name
        self.deadline = time.monotonic() + LIMITS.max_seconds
        self.printed_chars = self.num_iterations = self.depth = 0

    def refuse(self, detail: str, advice: str = _ADVICE) -> TemplateLimitError:
        return TemplateLimitError(f"{self.name} {detail}; {advice}")

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.refuse(f"ran longer than {LIMITS.max_seconds:g} s")


_current: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("template_budget", default=None)


def _budget() -> _Budget:
    # Outside render() (jinja folds constants at compile time) the size checks still hold.
    return _current.get() or _Budget("chat template")


def _str_size(value, limit: int) -> int:
    """About len(str(value)), counted without building the string; stops soon after `limit`."""
    if isinstance(value, (str, bytes)):
        return len(value)
    size, stack = 0, [value]
    while stack and size <= limit:
        v = stack.pop()
        if isinstance(v, Namespace):
            v = v._Namespace__attrs  # its repr prints every attribute
        if isinstance(v, (str, bytes)):
            size += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset)):
            size += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            size += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            size += 1
    return size


def _check_text(value, what: str) -> int:
    size = _str_size(value, LIMITS.max_output_chars)
    if size > LIMITS.max_output_chars:
        raise _budget().refuse(f"{what} of over {LIMITS.max_output_chars:,} characters (the limit)")
    return size


def _check_value(value):
    """Refuse a result past the size limits; a guarded operation never builds one much larger."""
    if isinstance(value, (str, bytes)):
        if len(value) > LIMITS.max_output_chars:
            raise _budget().refuse(f"built a string of {len(value):,} characters (limit {LIMITS.max_output_chars:,})")
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        if len(value) > LIMITS.max_items:
            raise _budget().refuse(f"built a collection of {len(value):,} items (limit {LIMITS.max_items:,})")
    elif isinstance(value, int) and value.bit_length() > LIMITS.max_int_bits:
        raise _budget().refuse(f"built an integer of {value.bit_length():,} bits (limit {LIMITS.max_int_bits:,})")
    return value


def _check_width(width, what: str) -> None:
    if isinstance(width, int) and width > LIMITS.max_output_chars:
        raise _budget().refuse(f"asked {what} for a width of {width:,} (limit {LIMITS.max_output_chars:,})")


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt, args) -> None:
    """`fmt % args` stays under the limit: no huge widths, literal or `*`, and no huge arguments."""
    values = args if isinstance(args, tuple) else (args,)
    text = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
    for field in _PRINTF_FIELD.finditer(text):
        for width in field.groups():
            if width == "*":
                for value in values:
                    _check_width(value, "'%*' formatting")
            elif width is not None and (len(width) > 9 or int(width) > LIMITS.max_output_chars):
                raise _budget().refuse(f"asked '%' formatting for a width of {width}")
    _check_text((fmt, values), "formatted text")


def _check_str_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """str.format / format_map stays under the limit: no huge widths, literal or nested, no huge arguments."""
    literal = re.search(r"\{[^{}]*:[^{}]*?(\d{8,})", fmt)
    if literal:
        raise _budget().refuse(f"asked format() for a width of {literal.group(1)}")
    if re.search(r"\{[^{}]*:[^{}]*\{", fmt):  # a width taken from the arguments
        for value in (*args, *kwargs.values()):
            _check_width(value, "format()")
    _check_text((fmt, args, kwargs), "formatted text")


def _check_replace(text, old, new, count) -> None:
    if not (isinstance(old, type(text)) and isinstance(new, type(text))):
        return  # the method raises TypeError itself
    found = len(text) + 1 if not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    size = len(text) + found * (len(new) - len(old))
    if size > LIMITS.max_output_chars:
        raise _budget().refuse(f"asked replace() for {size:,} characters (limit {LIMITS.max_output_chars:,})")


def _check_text_method(text, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str/bytes method whose result would be far larger than its inputs; returns the arguments to use."""
    limit = LIMITS.max_output_chars
    if name in ("ljust", "rjust", "center", "zfill"):
        _check_width(args[0] if args else kwargs.get("width"), f"{name}()")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        tab = "\t" if isinstance(text, str) else b"\t"
        if isinstance(tabsize, int) and len(text) + text.count(tab) * tabsize > limit:
            raise _budget().refuse(f"asked expandtabs({tabsize:,}) for over {limit:,} characters")
    elif name == "replace" and len(args) >= 2:
        _check_replace(text, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    elif name == "join" and args:
        items = list(args[0])  # a generator is read once, here
        if _str_size(items, limit) + len(text) * len(items) > limit:
            raise _budget().refuse(f"asked join() for over {limit:,} characters")
        args = (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        if len(text) * longest > limit:
            raise _budget().refuse(f"asked translate() for over {limit:,} characters")
    elif name in ("format", "format_map") and isinstance(text, str):
        _check_str_format(text, args, kwargs)
    return args


def _check_binop(operator: str, left, right) -> None:
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if math.log2(abs(left)) * right > LIMITS.max_int_bits:
                raise _budget().refuse(f"asked for {left} ** {right:,} (over {LIMITS.max_int_bits:,} bits)")
    elif operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                limit = LIMITS.max_output_chars if isinstance(seq, (str, bytes)) else LIMITS.max_items
                if len(seq) * times > limit:
                    unit = "characters" if isinstance(seq, (str, bytes)) else "items"
                    raise _budget().refuse(f"asked * for {len(seq) * times:,} {unit} (limit {limit:,})")
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > LIMITS.max_int_bits + 1:
                raise _budget().refuse(f"asked for a product over {LIMITS.max_int_bits:,} bits")
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
            limit = LIMITS.max_output_chars if isinstance(left, (str, bytes)) else LIMITS.max_items
            if len(left) + len(right) > limit:
                unit = "characters" if isinstance(left, (str, bytes)) else "items"
                raise _budget().refuse(f"asked + for {len(left) + len(right):,} {unit} (limit {limit:,})")
    elif operator == "%" and isinstance(left, (str, bytes)):
        _check_printf(left, right)


# Filter checks take the filter's own parameters and return its input (a generator read once, here).
def _as_text(value, *args, **kwargs):
    _check_text(value, "gave a filter text")
    return value


def _filter_replace(s, old, new, count=None):
    text = str(_as_text(s))
    _check_replace(text, str(_as_text(old)), str(_as_text(new)), count)
    return s


def _filter_join(value, d="", attribute=None):
    items = list(value)
    if _str_size(items, LIMITS.max_output_chars) + len(str(_as_text(d))) * len(items) > LIMITS.max_output_chars:
        raise _budget().refuse(f"asked join for over {LIMITS.max_output_chars:,} characters")
    return items


def _filter_indent(s, width=4, first=False, blank=False):
    text = str(_as_text(s))
    step = width if isinstance(width, int) else len(str(_as_text(width)))
    if len(text) + (text.count("\n") + 1) * step > LIMITS.max_output_chars:
        raise _budget().refuse(f"asked indent({step:,}) for over {LIMITS.max_output_chars:,} characters")
    return s


def _filter_wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    text = str(_as_text(s))
    # At most a line per `width` characters plus one per space or newline; each line adds `wrapstring`.
    num_lines = (len(text) // max(width, 1) if isinstance(width, int) else 0) + text.count(" ") + text.count("\n") + 1
    if len(text) + num_lines * len(str(_as_text(wrapstring or "\n"))) > LIMITS.max_output_chars:
        raise _budget().refuse(f"asked wordwrap for over {LIMITS.max_output_chars:,} characters")
    return s


def _filter_center(value, width=80):
    _check_width(width, "center")
    return _as_text(value)


def _filter_format(value, *args, **kwargs):
    _check_printf(str(_as_text(value)), kwargs or args)
    return value


def _filter_sum(iterable, attribute=None, start=0):
    if not isinstance(start, (int, float)):
        raise _budget().refuse("asked sum to add lists or strings, which can grow without bound (numbers only)")
    return iterable


def _filter_slices(value, count, fill_with=None):
    if isinstance(count, int) and count > LIMITS.max_items:
        raise _budget().refuse(f"asked for {count:,} slices or batch items (limit {LIMITS.max_items:,})")
    return value


_FILTER_CHECKS = {
    "replace": _filter_replace, "join": _filter_join, "indent": _filter_indent, "wordwrap": _filter_wordwrap,
    "center": _filter_center, "format": _filter_format, "sum": _filter_sum, "slice": _filter_slices,
    "batch": _filter_slices,
}
# Filters that print their whole input: a list holding one long string many times would be gigabytes.
_PRINTING_FILTERS = {
    "string", "pprint", "e", "escape", "forceescape", "safe", "urlencode", "urlize", "lower", "upper",
    "capitalize", "title", "trim", "striptags", "truncate", "wordcount", "xmlattr", "reverse", "filesizeformat",
}


def _guard_filter(name: str, f):
    check = _FILTER_CHECKS.get(name) or (_as_text if name in _PRINTING_FILTERS else None)
    num_passed = 1 if hasattr(f, "jinja_pass_arg") else 0  # the context, eval context or environment comes first

    @wraps(f)
    def guarded(*args, **kwargs):
        _budget().tick()
        if check is not None and len(args) > num_passed:
            args = (*args[:num_passed], check(*args[num_passed:], **kwargs), *args[num_passed + 1:])
        return _check_value(f(*args, **kwargs))

    return guarded


def _range(*args) -> range:
    numbers = range(*args)
    try:
        size = len(numbers)
    except OverflowError:  # more than sys.maxsize numbers
        raise _budget().refuse(f"asked for range{args} (limit {LIMITS.max_range:,} numbers)") from None
    if size > LIMITS.max_range:
        raise _budget().refuse(f"asked for range() of {size:,} numbers (limit {LIMITS.max_range:,})")
    return numbers


def _lipsum(n=5, html=True, min=20, max=100):
    if isinstance(n, int) and isinstance(max, int) and n * max > LIMITS.max_range:
        raise _budget().refuse(f"asked lipsum for {n:,} paragraphs of {max:,} words (limit {LIMITS.max_range:,})")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _iterate(iterable):
    """Every for-loop runs through here, so a loop that prints nothing still counts against time and iterations."""
    budget = _budget()
    for item in iterable:
        budget.num_iterations += 1
        if budget.num_iterations > LIMITS.max_iterations:
            raise budget.refuse(f"ran over {LIMITS.max_iterations:,} loop iterations")
        budget.tick()
        yield item


def _print(value):
    """Counts what every {{ }} prints (finalize hook), including text captured by macros and {% set %}."""
    budget = _budget()
    budget.tick()
    budget.printed_chars += _check_text(value, "printed a value")
    if budget.printed_chars > LIMITS.max_printed_chars:
        raise budget.refuse(f"printed over {LIMITS.max_printed_chars:,} characters in all")
    return value


def _strftime_now(fmt: str) -> str:
    # strftime cannot be stopped midway and writes up to ~25 characters per directive.
    if len(fmt) > _MAX_DATE_FORMAT_CHARS:
        limit = _MAX_DATE_FORMAT_CHARS
        raise _budget().refuse(f"asked strftime_now for a {len(fmt):,}-character format (limit {limit:,})")
    return datetime.now().strftime(fmt)


def _raise_exception(message: str):
    raise TemplateError(f"{_budget().name}: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    _check_text(value, "asked tojson for a value")
    if indent is None:
        return encoder.encode(value)
    # Indentation multiplies with nesting, so the text is counted as it is written.
    chunks, size = [], 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        if size > LIMITS.max_output_chars:
            raise _budget().refuse(f"asked tojson for over {LIMITS.max_output_chars:,} characters")
        chunks.append(chunk)
    return "".join(chunks)


class _LimitedCodeGenerator(CodeGenerator):
    """Compiles for-loops and `~` so that they go through the environment's limits."""

    def visit_Template(self, node, frame=None):
        for loop in list(node.find_all(nodes.For)):
            iterate = nodes.EnvironmentAttribute("iterate", lineno=loop.lineno)
            loop.iter = nodes.Call(iterate, [loop.iter], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)

    @optimizeconst
    def visit_Concat(self, node, frame):
        self.write("environment.join(context.eval_ctx, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every operation that can grow without bound checked against LIMITS."""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    iterate = staticmethod(_iterate)

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=_print)
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(
            range=_range, lipsum=_lipsum, raise_exception=_raise_exception, strftime_now=_strftime_now,
        )

    @staticmethod
    def concat(parts) -> str:
        """Joins a macro's, a {% set %} block's or a filter block's text (the generated code calls it)."""
        parts = list(parts)
        size = sum(map(len, parts))
        if size > LIMITS.max_output_chars:
            raise _budget().refuse(f"built a block of {size:,} characters (limit {LIMITS.max_output_chars:,})")
        return "".join(parts)

    @staticmethod
    def join(eval_ctx, values: tuple) -> str:
        """The `~` operator, sized before the string is built."""
        _check_text(values, "joined with ~ a text")
        return markup_join(values) if eval_ctx.autoescape else str_join(values)

    def call_binop(self, context, operator, left, right):
        _budget().tick()
        _check_binop(operator, left, right)
        return _check_value(self.binop_table[operator](left, right))

    def call(self, context, obj, /, *args, **kwargs):
        budget = _budget()
        budget.tick()
        if not self.is_safe_callable(obj):
            raise SecurityError(f"{obj!r} is not safely callable")
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format in a function
        if isinstance(method, types.BuiltinMethodType) and isinstance(method.__self__, (str, bytes)):
            own_kwargs = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            args = _check_text_method(method.__self__, method.__name__, args, own_kwargs)
        if not isinstance(obj, (Macro, LoopContext)):
            return _check_value(context.call(obj, *args, **kwargs))
        budget.depth += 1  # a macro calling itself, or a recursive loop
        try:
            if budget.depth > LIMITS.max_depth:
                raise budget.refuse(f"nested macro calls or recursive loops over {LIMITS.max_depth} deep")
            return _check_value(context.call(obj, *args, **kwargs))
        finally:
            budget.depth -= 1


@lru_cache(maxsize=16)
def compile_template(source: str, name: str = "chat template") -> jinja2.Template:
    try:
        return _LimitedEnvironment().from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"{name} does not compile: {e}") from e
    except (RecursionError, MemoryError, SyntaxError) as e:  # nesting too deep for the parser or for Python
        raise TemplateError(f"{name} does not compile: {type(e).__name__}: {e}") from e


def render(
    source: str, messages: list[dict], *, add_generation_prompt: bool = True, name: str = "chat template",
    **special_tokens,
) -> str:
    """The template's text for `messages`; TemplateError (TemplateLimitError past LIMITS) on any failure."""
    if not isinstance(source, str):
        raise TemplateError(f"{name} is a {type(source).__name__}, not text; use the model's published template")
    if not source.strip():
        raise TemplateError(f"{name} is empty; the model folder's template is missing its text — "
                            "use the model's published template")
    template = compile_template(source, name)
    budget = _Budget(name)
    token = _current.set(budget)
    try:
        chunks, size = [], 0
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
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
        raise TemplateError(f"{name} recursed too deeply ({e}); {_ADVICE}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"{name} failed: {e}") from e
    except Exception as e:  # TypeError, ZeroDivisionError, ... raised by the template's own expressions
        raise TemplateError(f"{name} failed: {type(e).__name__}: {e}") from e
    finally:
        _current.reset(token)
