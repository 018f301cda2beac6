"""The jinja2 environment chat templates render in: the immutable sandbox, with every operation that can grow
without bound (filters, operators, str methods, loops, macros, range) checked against engine/text/template_limits.py."""

from __future__ import annotations

import json
import types
from datetime import datetime
from functools import wraps

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import LoopContext, Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import TemplateError
from .template_limits import (
    LIMITS, check_binop, check_printf, check_replace, check_result, check_text_method, check_text_size, check_width, current_budget, str_size,
)

_MAX_DATE_FORMAT_CHARS = 1024


# Filter checks take the filter's own parameters and return its input (a generator read once, here).
def _as_text(value, *args, **kwargs):
    check_text_size(value, "gave a filter text")
    return value


def _filter_replace(s, old, new, count=None):
    text = str(_as_text(s))
    check_replace(text, str(_as_text(old)), str(_as_text(new)), count)
    return s


def _filter_join(value, d="", attribute=None):
    items = list(value)
    if str_size(items, LIMITS.max_output_chars) + len(str(_as_text(d))) * len(items) > LIMITS.max_output_chars:
        raise current_budget().refuse(f"asked join for over {LIMITS.max_output_chars:,} characters")
    return items


def _filter_indent(s, width=4, first=False, blank=False):
    text = str(_as_text(s))
    step = width if isinstance(width, int) else len(str(_as_text(width)))
    if len(text) + (text.count("\n") + 1) * step > LIMITS.max_output_chars:
        raise current_budget().refuse(f"asked indent({step:,}) for over {LIMITS.max_output_chars:,} characters")
    return s


def _filter_wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    text = str(_as_text(s))
    # At most a line per `width` characters plus one per space or newline; each line adds `wrapstring`.
    num_lines = (len(text) // max(width, 1) if isinstance(width, int) else 0) + text.count(" ") + text.count("\n") + 1
    if len(text) + num_lines * len(str(_as_text(wrapstring or "\n"))) > LIMITS.max_output_chars:
        raise current_budget().refuse(f"asked wordwrap for over {LIMITS.max_output_chars:,} characters")
    return s


def _filter_center(value, width=80):
    check_width(width, "center")
    return _as_text(value)


def _filter_format(value, *args, **kwargs):
    check_printf(str(_as_text(value)), kwargs or args)
    return value


def _filter_sum(iterable, attribute=None, start=0):
    if not isinstance(start, (int, float)):
        raise current_budget().refuse("asked sum to add lists or strings, which can grow without bound (numbers only)")
    return iterable


def _filter_slices(value, count, fill_with=None):
    if isinstance(count, int) and count > LIMITS.max_items:
        raise current_budget().refuse(f"asked for {count:,} slices or batch items (limit {LIMITS.max_items:,})")
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
        current_budget().tick()
        if check is not None and len(args) > num_passed:
            args = (*args[:num_passed], check(*args[num_passed:], **kwargs), *args[num_passed + 1:])
        return check_result(f(*args, **kwargs))

    return guarded


def _range(*args) -> range:
    numbers = range(*args)
    try:
        size = len(numbers)
    except OverflowError:  # more than sys.maxsize numbers
        raise current_budget().refuse(f"asked for range{args} (limit {LIMITS.max_range:,} numbers)") from None
    if size > LIMITS.max_range:
        raise current_budget().refuse(f"asked for range() of {size:,} numbers (limit {LIMITS.max_range:,})")
    return numbers


def _lipsum(n=5, html=True, min=20, max=100):
    if isinstance(n, int) and isinstance(max, int) and n * max > LIMITS.max_range:
        raise current_budget().refuse(
            f"asked lipsum for {n:,} paragraphs of {max:,} words (limit {LIMITS.max_range:,})")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _iterate(iterable):
    """Every for-loop runs through here, so a loop that prints nothing still counts against time and iterations."""
    budget = current_budget()
    for item in iterable:
        budget.num_iterations += 1
        if budget.num_iterations > LIMITS.max_iterations:
            raise budget.refuse(f"ran over {LIMITS.max_iterations:,} loop iterations")
        budget.tick()
        yield item


def _print(value):
    """Counts what every {{ }} prints (finalize hook), including text captured by macros and {% set %}."""
    budget = current_budget()
    budget.tick()
    budget.printed_chars += check_text_size(value, "printed a value")
    if budget.printed_chars > LIMITS.max_printed_chars:
        raise budget.refuse(f"printed over {LIMITS.max_printed_chars:,} characters in all")
    return value


def _strftime_now(fmt: str) -> str:
    # strftime cannot be stopped midway and writes up to ~25 characters per directive.
    if len(fmt) > _MAX_DATE_FORMAT_CHARS:
        limit = _MAX_DATE_FORMAT_CHARS
        raise current_budget().refuse(f"asked strftime_now for a {len(fmt):,}-character format (limit {limit:,})")
    return datetime.now().strftime(fmt)


def _raise_exception(message: str):
    raise TemplateError(f"{current_budget().name}: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    check_text_size(value, "asked tojson for a value")
    if indent is None:
        return encoder.encode(value)
    # Indentation multiplies with nesting, so the text is counted as it is written.
    chunks, size = [], 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        if size > LIMITS.max_output_chars:
            raise current_budget().refuse(f"asked tojson for over {LIMITS.max_output_chars:,} characters")
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


class LimitedEnvironment(ImmutableSandboxedEnvironment):
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
            raise current_budget().refuse(f"built a block of {size:,} characters (limit {LIMITS.max_output_chars:,})")
        return "".join(parts)

    @staticmethod
    def join(eval_ctx, values: tuple) -> str:
        """The `~` operator, sized before the string is built."""
        check_text_size(values, "joined with ~ a text")
        return markup_join(values) if eval_ctx.autoescape else str_join(values)

    def call_binop(self, context, operator, left, right):
        current_budget().tick()
        check_binop(operator, left, right)
        return check_result(self.binop_table[operator](left, right))

    def call(self, context, obj, /, *args, **kwargs):
        budget = current_budget()
        budget.tick()
        if not self.is_safe_callable(obj):
            raise SecurityError(f"{obj!r} is not safely callable")
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format in a function
        if isinstance(method, types.BuiltinMethodType) and isinstance(method.__self__, (str, bytes)):
            own_kwargs = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            args = check_text_method(method.__self__, method.__name__, args, own_kwargs)
        if not isinstance(obj, (Macro, LoopContext)):
            return check_result(context.call(obj, *args, **kwargs))
        budget.depth += 1  # a macro calling itself, or a recursive loop
        try:
            if budget.depth > LIMITS.max_depth:
                raise budget.refuse(f"nested macro calls or recursive loops over {LIMITS.max_depth} deep")
            return check_result(context.call(obj, *args, **kwargs))
        finally:
            budget.depth -= 1
