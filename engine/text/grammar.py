"""Constrained decoding with llguidance: a grammar (a JSON schema, any JSON object, a forced tool call, free text whose
tool calls are constrained once begun) compiled once per request, bound to the model's tokenizer, and per reply a
`Constraint` that says which tokens may not come next.

The mask for the next token is computed on a worker thread as soon as the last token is consumed, so it is ready
when the model's forward pass (which it overlaps) ends: llguidance drops the GIL while it computes.
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from ..errors import InvalidArgumentError
from .tool_calls import ToolFormat

# One line of JSON, spaced as json.dumps writes it: no whitespace of the model's choosing, so a weak model cannot
# fill the reply with newlines, and every reply is the same text however it is sampled.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
# Two limits keep a weak model from running a reply to max_tokens and leaving the JSON unfinished, and every value
# they allow is still valid under the schema given: a number's fraction has at most FRACTION_DIGITS digits (a greedy
# "0.000000..."), and an object that lists its properties takes only those unless it says otherwise (as OpenAI's
# strict mode requires; a model would otherwise add keys of its own without end).
FRACTION_DIGITS = 6
_LITERALS = ("enum", "const", "default", "examples")  # values, not schemas: left as they are
_ADDS_KEYS = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")  # beside properties: may allow more keys
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema

_masks = ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 1))), thread_name_prefix="stowage-mask")


def json_schema_grammar(schema, what: str = "response_format.json_schema.schema") -> str:
    """The grammar of replies that are JSON values valid under `schema`; InvalidArgumentError naming what is wrong
    (an unsatisfiable range, a $ref that points nowhere, a keyword llguidance does not implement)."""
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"{what} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_bounded(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"{what} is not a JSON Schema: {e}") from None
    except RecursionError:  # llguidance itself refuses past 128 levels; ours is Python's stack
        raise InvalidArgumentError(f"{what} is nested too deeply") from None
    return check(grammar, what)


def _bounded(node, *, close: bool = True):
    """The schema with each number that sets no multipleOf made a multiple of 10**-FRACTION_DIGITS (where its range
    holds one), and each object that lists properties and says nothing of others closed to others (not the
    branches of an allOf: each lists only its share of the keys the value must have; nor an object whose allOf,
    anyOf, oneOf, $ref or if beside its properties may add keys)."""
    if isinstance(node, list):
        return [_bounded(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _MAPS and isinstance(value, dict):  # a definition may be an allOf's share: left open
            out[key] = {name: _bounded(v, close=key not in ("$defs", "definitions")) for name, v in value.items()}
        elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
            # an allOf branch lists only its share of the keys; so does an anyOf/oneOf branch beside properties
            share = key == "allOf" or "properties" in node
            out[key] = [_bounded(v, close=not share) for v in value]
        else:
            out[key] = value if key in _LITERALS else _bounded(value)
    kind = node.get("type")
    step = 10.0 ** -FRACTION_DIGITS
    if (kind == "number" or isinstance(kind, list) and "number" in kind) and "multipleOf" not in node \
            and _holds_a_multiple(node, step):
        out["multipleOf"] = step
    if close and isinstance(node.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                                   "unevaluatedProperties", *_ADDS_KEYS} & set(node):
        out["additionalProperties"] = False
    return out


def _holds_a_multiple(node: dict, step: float) -> bool:
    """Whether a number schema's range (minimum/maximum, exclusive or not) holds a multiple of step."""
    def bound(key):
        value = node.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    low, high = bound("minimum"), bound("maximum")
    low_x, high_x = bound("exclusiveMinimum"), bound("exclusiveMaximum")
    firsts = [v / step for v in (low, low_x) if v is not None]
    lasts = [v / step for v in (high, high_x) if v is not None]
    if not all(math.isfinite(v) for v in (*firsts, *lasts)):
        return False  # a bound past float's range (1e308 / step): no limit added
    firsts = ([math.ceil(low / step - 1e-9)] if low is not None else []) + \
        ([math.floor(low_x / step + 1e-9) + 1] if low_x is not None else [])
    lasts = ([math.floor(high / step + 1e-9)] if high is not None else []) + \
        ([math.ceil(high_x / step - 1e-9) - 1] if high_x is not None else [])
    first, last = max(firsts, default=None), min(lasts, default=None)
    return first is None or last is None or first <= last


def check(grammar: str, what: str) -> str:
    """grammar, once llguidance has compiled it; InvalidArgumentError with its reason otherwise."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        reason = " ".join(messages).strip() or "it does not compile"
        raise InvalidArgumentError(f"{what} is not supported: {reason:.500}")
    return grammar


def tool_call_schema(tools: dict[str, dict], name: str | None = None, key: str = "arguments") -> dict:
    """The JSON Schema of one call `{"name": ..., "arguments": {...}}` of the tool `name` (None: any of `tools`,
    name -> its parameters' schema), its arguments valid under the tool's parameters; `key`: the arguments' key
    (Llama 3 writes "parameters")."""
    chosen = [name] if name is not None else list(tools)
    branches = [{"type": "object", "properties": {"name": {"const": n}, key: tools[n]},
                 "required": ["name", key], "additionalProperties": False} for n in chosen]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def auto_call_grammar(tools: dict[str, dict], fmt: ToolFormat, special: dict[str, int]) -> str | None:
    """Free text in which a call, once the model starts one in its family's format, must go on as a call of a tool
    offered with arguments valid under its parameters; None where nothing says a call starts (bare JSON in a
    template that teaches no calls), or a marker the format needs is not a special token of this tokenizer.
    special: marker text -> its token id."""
    if fmt.start is None:
        return _bare_call_grammar(tools, fmt, special) if fmt.tag is not None else None
    if (fmt.end is None and fmt.start not in special) or (fmt.args and fmt.args not in special):
        return None
    if fmt.end is not None:  # Hermes: a lazy trigger on the text, or on the token
        schema = {**_bounded(tool_call_schema(tools)), "x-guidance": JSON_OPTIONS}
        tag = llguidance.StructTag(trigger=fmt.start, begin=fmt.start + "\n", grammar=schema, end="\n" + fmt.end)
        return check(llguidance.StructTag.to_grammar([tag], assume_special=fmt.start in special), "tools")

    def token(marker: str) -> str:
        return f"<[{special[marker]}]>"

    if fmt.args is not None:  # Mistral's newer format: [TOOL_CALLS]name[ARGS]{...}, one or more
        calls = " | ".join(f"{token(fmt.start)} {json.dumps(name)} {token(fmt.args)} {_json_rule(parameters)}"
                           for name, parameters in tools.items())
    else:  # [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
        calls = f"{token(fmt.start)} {_json_rule({'type': 'array', 'minItems': 1, 'items': tool_call_schema(tools)})}"
    lark = f"%llguidance {{}}\nstart: TEXT | TEXT call+\ncall: {calls}\nTEXT: /(.|\\n)*/\n"
    return check(lark, "tools")


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**_bounded(schema), "x-guidance": JSON_OPTIONS})


def _bare_call_grammar(tools: dict[str, dict], fmt: ToolFormat, special: dict[str, int]) -> str:
    """Llama 3's calls: a reply that begins as JSON does (`{`, or a list's `[`), or with the format's tag token, is a
    call of a tool offered (or a list of them) with valid arguments; any other reply is free text, which then may not
    begin with JSON after white space either (tool_calls.parse would read that as a call, unconstrained)."""
    call = tool_call_schema(tools, key=fmt.key)
    calls = f"call: {_json_rule(call)}\ncalls: {_json_rule({'type': 'array', 'minItems': 1, 'items': call})}\n"
    tagged = f" | <[{special[fmt.tag]}]> call" if fmt.tag in special else ""
    lark = f"%llguidance {{}}\nstart: TEXT? | call | calls{tagged}\n{calls}TEXT: /\\s*[^{{\\[\\s](.|\\n)*/\n"
    return check(lark, "tools")


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar bound to a model's tokenizer: what SamplingParams carries for a constrained reply."""

    text: str  # llguidance's grammar
    tokenizer: llguidance.LLTokenizer
    num_logits: int  # the model's vocabulary: the length of a logits row

    def constraint(self) -> "Constraint":
        return Constraint(self)


_tokenizers: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()  # requests bind on worker threads: one builds a model's view, once


def bind(grammar: str, tokenizer, num_logits: int, eos_ids) -> Grammar:
    """grammar bound to `tokenizer` (engine/text/tokenizer.py), whose llguidance view is built once and cached."""
    key = (num_logits, tuple(sorted(eos_ids)))
    with _tokenizers_lock:
        cached = _tokenizers.setdefault(tokenizer, {})
        if key not in cached:
            try:
                cached[key] = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=num_logits, eos_token=list(key[1]))
            except (ValueError, RuntimeError) as e:
                raise InvalidArgumentError(f"constrained output is not available for this model's tokenizer: {e}") \
                    from e
        return Grammar(grammar, cached[key], num_logits)


class Constraint:
    """One reply's place in its grammar: `disallowed()` the tokens it may not take next, `consume(token)` the one
    taken."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._matcher: llguidance.LLMatcher | None = None  # used by one thread at a time: the mask's, then ours
        self.is_finished = False  # the grammar is complete and takes no more tokens (only an EOS)
        self._words = np.zeros(((grammar.tokenizer.vocab_size + 31) // 32,), dtype=np.int32)
        # built off the caller's thread (a server's event loop): a large schema takes milliseconds to build
        self._work = self._start
        self._next: Future = _masks.submit(self._start)

    def _start(self) -> None:
        matcher = llguidance.LLMatcher(self.grammar.tokenizer, self.grammar.text, log_level=0)
        if matcher.is_error():  # checked when compiled: only a tokenizer it cannot serve gets here
            raise InvalidArgumentError(f"the grammar cannot be used with this model: {matcher.get_error():.300}")
        self._matcher = matcher
        self._fill()

    def _fill(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)

    def disallowed(self) -> torch.Tensor:
        """[num_logits] bool: the tokens the grammar refuses next (all but an EOS once it is complete)."""
        if self._next.cancel():  # no worker has begun it (the CPUs are busy): do it here rather than wait for one
            self._work()
        else:
            self._next.result()
        # token 32 * w + b is bit b of word w; unpacked from the words inverted, into the tensor's own memory
        refused = np.unpackbits(~self._words.view(np.uint8), count=self.grammar.num_logits, bitorder="little")
        return torch.from_numpy(refused.view(np.bool_))

    def consume(self, token: int) -> None:
        """Advance past token (one disallowed() did not refuse), and start the next mask."""
        if not self._matcher.consume_token(token):
            raise InvalidArgumentError(f"the grammar refused token {token}: {self._matcher.get_error():.300}")
        self.is_finished = self._matcher.is_stopped()  # read before the next mask's thread takes the matcher
        self._work = self._fill
        self._next = _masks.submit(self._fill)  # once complete, the mask holds the EOS tokens alone

