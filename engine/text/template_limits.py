"""What one chat-template render may spend (TemplateLimits), and the checks that keep it within: sizes of the
values it builds, judged before they are built, and a Budget of time, loop iterations, printed text and depth.

engine/text/template_sandbox.py wires these into jinja2's sandbox; engine/text/chat_template.py renders under a Budget.
"""

from __future__ import annotations

import contextvars
import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from jinja2.utils import Namespace

from ..errors import TemplateLimitError


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

ADVICE = "a chat prompt needs far less, so the template is faulty or hostile; use the model's published template"


class Budget:
    """One render's spending against LIMITS; hooks reach it through a context variable."""

    __slots__ = ("name", "deadline", "printed_chars", "num_iterations", "depth")

    def __init__(self, name: str):
        self.name = name
        self.deadline = time.monotonic() + LIMITS.max_seconds
        self.printed_chars = self.num_iterations = self.depth = 0

    def refuse(self, detail: str, advice: str = ADVICE) -> TemplateLimitError:
        return TemplateLimitError(f"{self.name} {detail}; {advice}")

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.refuse(f"ran longer than {LIMITS.max_seconds:g} s")


_current: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("template_budget", default=None)


@contextmanager
def budget_for(name: str) -> Iterator[Budget]:
    """A fresh Budget for one render of the template `name`, which every hook below spends from."""
    token = _current.set(Budget(name))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def current_budget() -> Budget:
    # Outside render() (jinja folds constants at compile time) the size checks still hold.
    return _current.get() or Budget("chat template")


def str_size(value, limit: int) -> int:
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


def check_text_size(value, what: str) -> int:
    size = str_size(value, LIMITS.max_output_chars)
    if size > LIMITS.max_output_chars:
        raise current_budget().refuse(f"{what} of over {LIMITS.max_output_chars:,} characters (the limit)")
    return size


def check_result(value):
    """Refuse a result past the size limits; a guarded operation never builds one much larger."""
    if isinstance(value, (str, bytes)):
        if len(value) > LIMITS.max_output_chars:
            limit = LIMITS.max_output_chars
            raise current_budget().refuse(f"built a string of {len(value):,} characters (limit {limit:,})")
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        if len(value) > LIMITS.max_items:
            raise current_budget().refuse(f"built a collection of {len(value):,} items (limit {LIMITS.max_items:,})")
    elif isinstance(value, int) and value.bit_length() > LIMITS.max_int_bits:
        bits = value.bit_length()
        raise current_budget().refuse(f"built an integer of {bits:,} bits (limit {LIMITS.max_int_bits:,})")
    return value


def check_width(width, what: str) -> None:
    if isinstance(width, int) and width > LIMITS.max_output_chars:
        raise current_budget().refuse(f"asked {what} for a width of {width:,} (limit {LIMITS.max_output_chars:,})")


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")


def check_printf(fmt, args) -> None:
    """`fmt % args` stays under the limit: no huge widths, literal or `*`, and no huge arguments."""
    values = args if isinstance(args, tuple) else (args,)
    text = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
    for field in _PRINTF_FIELD.finditer(text):
        for width in field.groups():
            if width == "*":
                for value in values:
                    check_width(value, "'%*' formatting")
            elif width is not None and (len(width) > 9 or int(width) > LIMITS.max_output_chars):
                raise current_budget().refuse(f"asked '%' formatting for a width of {width}")
    check_text_size((fmt, values), "formatted text")


def _check_str_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """str.format / format_map stays under the limit: no huge widths, literal or nested, no huge arguments."""
    literal = re.search(r"\{[^{}]*:[^{}]*?(\d{8,})", fmt)
    if literal:
        raise current_budget().refuse(f"asked format() for a width of {literal.group(1)}")
    if re.search(r"\{[^{}]*:[^{}]*\{", fmt):  # a width taken from the arguments
        for value in (*args, *kwargs.values()):
            check_width(value, "format()")
    check_text_size((fmt, args, kwargs), "formatted text")


def check_replace(text, old, new, count) -> None:
    if not (isinstance(old, type(text)) and isinstance(new, type(text))):
        return  # the method raises TypeError itself
    found = len(text) + 1 if not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    size = len(text) + found * (len(new) - len(old))
    if size > LIMITS.max_output_chars:
        raise current_budget().refuse(f"asked replace() for {size:,} characters (limit {LIMITS.max_output_chars:,})")


def check_text_method(text, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str/bytes method whose result would be far larger than its inputs; returns the arguments to use."""
    limit = LIMITS.max_output_chars
    if name in ("ljust", "rjust", "center", "zfill"):
        check_width(args[0] if args else kwargs.get("width"), f"{name}()")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        tab = "\t" if isinstance(text, str) else b"\t"
        if isinstance(tabsize, int) and len(text) + text.count(tab) * tabsize > limit:
            raise current_budget().refuse(f"asked expandtabs({tabsize:,}) for over {limit:,} characters")
    elif name == "replace" and len(args) >= 2:
        check_replace(text, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    elif name == "join" and args:
        items = list(args[0])  # a generator is read once, here
        if str_size(items, limit) + len(text) * len(items) > limit:
            raise current_budget().refuse(f"asked join() for over {limit:,} characters")
        args = (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        if len(text) * longest > limit:
            raise current_budget().refuse(f"asked translate() for over {limit:,} characters")
    elif name in ("format", "format_map") and isinstance(text, str):
        _check_str_format(text, args, kwargs)
    return args


def check_binop(operator: str, left, right) -> None:
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if math.log2(abs(left)) * right > LIMITS.max_int_bits:
                raise current_budget().refuse(f"asked for {left} ** {right:,} (over {LIMITS.max_int_bits:,} bits)")
    elif operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                limit = LIMITS.max_output_chars if isinstance(seq, (str, bytes)) else LIMITS.max_items
                if len(seq) * times > limit:
                    unit = "characters" if isinstance(seq, (str, bytes)) else "items"
                    raise current_budget().refuse(f"asked * for {len(seq) * times:,} {unit} (limit {limit:,})")
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > LIMITS.max_int_bits + 1:
                raise current_budget().refuse(f"asked for a product over {LIMITS.max_int_bits:,} bits")
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
            limit = LIMITS.max_output_chars if isinstance(left, (str, bytes)) else LIMITS.max_items
            if len(left) + len(right) > limit:
                unit = "characters" if isinstance(left, (str, bytes)) else "items"
                raise current_budget().refuse(f"asked + for {len(left) + len(right):,} {unit} (limit {limit:,})")
    elif operator == "%" and isinstance(left, (str, bytes)):
        check_printf(left, right)
