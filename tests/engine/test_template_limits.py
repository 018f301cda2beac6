"""A chat template cannot hang, exhaust memory or crash: every failure is a TemplateError, fast."""

import json
import time

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stowage.engine.text.chat_template import FALLBACK_TEMPLATE, LIMITS, TemplateError, TemplateLimitError, render
from stowage.engine.errors import ModelFormatError

HANG_GUARD_S = 5.0  # generous: these guard against hangs, they are not benchmarks

BIG = "{% set big = 'x' * 4000000 %}"  # just under the string limit; the attacks below multiply it
HOSTILE = {
    "nested ranges": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                      "1,000,000 loop iterations"),
    "huge power": ("{{ 10 ** 100000000 }}", "4,096 bits"),
    "repeated squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                          "{% endfor %}", "4,096 bits"),
    "gigabyte string": ("{{ 'A' * 10**9 }}", "4,194,304"),
    "gigabyte list": ("{{ [0] * 10**9 }}", "1,000,000"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "64 deep"),
    "recursive loop": ("{% for m in [[1]] recursive %}{{ loop([[1]]) }}{% endfor %}", "64 deep"),
    "range of 10**12": ("{{ range(10**12) }}", "range() of 1,000,000,000,000"),
    "range past sys.maxsize": ("{% for i in range(10**30) %}{% endfor %}", "100,000"),
    "doubling with ~": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "4,194,304"),
    "doubling with +": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}", "4,194,304"),
    "doubling in a macro": ("{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='a') %}"
                            "{% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}", "4,194,304"),
    "doubling in a set block": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set x %}{{ ns.s }}"
                                "{{ ns.s }}{% endset %}{% set ns.s = x %}{% endfor %}", "4,194,304"),
    "macro buffering gigabytes": (BIG + "{% macro m() %}{% for i in range(100000) %}{{ big ~ i }}{% endfor %}"
                                  "{% endmacro %}{{ m()|length }}", "33,554,432"),
    "one string many times, joined": (BIG + "{{ ([big] * 100000)|join }}", "4,194,304"),
    "one string many times, printed": (BIG + "{{ [big] * 100000 }}", "4,194,304"),
    "one string many times, str.join": (BIG + "{{ ''.join([big] * 100000) }}", "4,194,304"),
    "replace with empty pattern": ("{% set s = 'x' * 100000 %}{{ s.replace('', s) }}", "replace()"),
    "replace filter": ("{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}", "replace()"),
    "center width": ("{{ 'a'|center(1000000000) }}", "1,000,000,000"),
    "ljust width": ("{{ 'a'.ljust(1000000000) }}", "1,000,000,000"),
    "printf width": ("{{ '%0999999999d' % 1 }}", "999999999"),
    "printf star width": ("{{ '%*d' % (999999999, 1) }}", "999,999,999"),
    "format filter width": ("{{ '%999999999s'|format('a') }}", "999999999"),
    "str.format width": ("{{ '{:>999999999}'.format('a') }}", "999999999"),
    "str.format nested width": ("{{ '{:>{}}'.format('a', 999999999) }}", "999,999,999"),
    "indent every line": ("{% set s = '\n' * 1000000 %}{{ s|indent(1000) }}", "indent"),
    "tojson indent": ("{{ range(100000)|list|tojson(indent=100000) }}", "tojson"),
    "expandtabs": ("{% set s = '\t' * 1000000 %}{{ s.expandtabs(1000) }}", "expandtabs"),
    "lipsum": ("{{ lipsum(1000000) }}", "lipsum"),
    "sum of lists": ("{{ ([[1] * 100000] * 1000)|sum(start=[]) }}", "sum"),
    "slices": ("{{ 'abc'|slice(100000000)|list }}", "100,000,000"),
    "strftime format": ("{{ strftime_now('%c' * 1000000) }}", "strftime_now"),
}


@pytest.mark.parametrize("source, limit", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_stops_with_a_typed_error(source, limit):
    start = time.monotonic()
    with pytest.raises(TemplateLimitError) as caught:
        render(source, [{"role": "user", "content": "hi"}], name="Evil-7B's chat template")
    assert time.monotonic() - start < HANG_GUARD_S
    message = str(caught.value)
    assert message.startswith("Evil-7B's chat template ")  # names the template's source
    assert limit in message  # and the limit it ran into


def test_limit_errors_are_template_errors():
    assert issubclass(TemplateLimitError, TemplateError) and issubclass(TemplateError, ModelFormatError)


def test_output_is_limited_as_it_is_written():
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=f"wrote over {LIMITS.max_output_chars:,} characters"):
        render("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", [])
    with pytest.raises(TemplateLimitError, match="wrote over"):
        render("{% for i in range(100000) %}" + "y" * 100 + "{% endfor %}", [])  # template text alone
    assert time.monotonic() - start < HANG_GUARD_S
    assert len(render("{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}", [])) == 1_000_000  # under it


def test_cpu_bound_loop_stops_at_the_time_limit():
    source = "{% set xs = range(100000)|list %}{% for i in range(1000) %}{% set ys = xs|sort %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=f"ran longer than {LIMITS.max_seconds:g} s"):
        render(source, [])
    assert LIMITS.max_seconds <= time.monotonic() - start < HANG_GUARD_S


@pytest.mark.parametrize("source", ["", "  \n\t "], ids=["empty", "whitespace"])
def test_empty_template_is_a_clear_error(source):
    with pytest.raises(TemplateError, match="my template is empty"):
        render(source, [{"role": "user", "content": "hi"}], name="my template")


DEEP: list = []
for _ in range(100_000):
    DEEP = [DEEP]


@pytest.mark.parametrize(
    "source, shown",
    [
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ 'a' + 1 }}", "TypeError"),
        ("{{ messages[0]['content'].index('z') }}", "ValueError"),
        ("{{ missing() }}", "'missing' is undefined"),
        ("{% for a, b in [1] %}{% endfor %}", "TypeError"),
        ("{{ messages | tojson }}", "recursed too deeply"),  # in Python code the template calls
        ("{% include 'other.jinja' %}", "no loader"),
        ("{% for %}", "does not compile"),
    ],
)
def test_any_failure_inside_the_template_is_a_template_error(source, shown):
    messages = [{"role": "user", "content": "12", "deep": DEEP}]
    with pytest.raises(TemplateError, match=shown) as caught:
        render(source, messages, name="the test template")
    assert "the test template" in str(caught.value)
    assert not isinstance(caught.value, TemplateLimitError)


# Real templates render exactly as before: the reference is the plain sandbox with the filters transformers adds.
QWEN_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
LLAMA_STYLE = """{{- bos_token }}
{%- set ns = namespace(system='', count=0) %}
{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] | trim %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y")[:0] + "\\n" ~ ns.system ~ "<|eot_id|>" }}
{%- if tools is not none %}{{- tools | tojson(indent=4) }}{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{- raise_exception('roles must alternate') }}{%- endif %}
    {%- set ns.count = ns.count + 1 %}
    {{- '<|start_header_id|>%s<|end_header_id|>\\n\\n' % message['role'] }}
    {{- message['content'] | trim }}{{- '<|eot_id|>' if not loop.last else '<|eot_id|>\\n' }}
{%- endfor %}
{{- '(%d turns, %d from the user)' | format(ns.count, loop_messages | selectattr('role', 'equalto', 'user') | list | length) }}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Looks things up. " * 10,
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for i in range(8)]


def conversation(num_turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse. Café 東京 🚀"}]
    for i in range(num_turns):
        messages.append({"role": "user", "content": f"question {i} " + "how big is the KV cache? " * 20})
        calls = [{"function": {"name": "tool_1", "arguments": {"q": f"kv {i}"}}}] if i % 7 == 0 else None
        messages.append({"role": "assistant", "content": f"answer {i} " + "about this big. " * 30, "tool_calls": calls})
    return messages


def reference_render(source: str, messages: list[dict], **variables) -> str:
    """How the template rendered before the limits: the immutable sandbox with tojson and friends."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source).render(messages=messages, **variables)


@pytest.mark.parametrize("source", [QWEN_TOOLS, LLAMA_STYLE, FALLBACK_TEMPLATE], ids=["qwen", "llama", "fallback"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_real_templates_render_as_before(source, tools):
    for num_turns in (0, 1, 40):
        messages = conversation(num_turns)
        for add in (True, False):
            variables = dict(add_generation_prompt=add, bos_token="<s>", eos_token="</s>", tools=tools)
            assert render(source, messages, **variables) == reference_render(source, messages, **variables)


def test_long_conversation_renders_fast():
    messages = conversation(1000)  # 2,001 messages, about 1 MB of prompt
    start = time.monotonic()
    text = render(QWEN_TOOLS, messages, tools=TOOLS)
    elapsed = time.monotonic() - start
    assert text == reference_render(QWEN_TOOLS, messages, tools=TOOLS, add_generation_prompt=True)
    assert elapsed < 1.0  # about 40 ms on one core; the plain sandbox takes about half that


def test_raise_exception_keeps_its_message_and_the_template_name():
    with pytest.raises(TemplateError, match="Llama's template: roles must alternate"):
        render(LLAMA_STYLE, [{"role": "assistant", "content": "hi"}], name="Llama's template", tools=None)
