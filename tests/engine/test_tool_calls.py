"""Tool calling through the official openai client against a live server on the bundled demo model: a named or
required tool choice is forced by the grammar (its arguments validate against the tool's parameters), the same call
streamed and not; a tool's result goes back through the chat template and is answered; and the families' own
call formats are read back from a reply's text, whole and streamed."""

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
from safetensors.torch import load_file, save_file
from factory import cpu_plan, make_model, save_tokenizer
from processes import served

from stowage.engine.runtime.engine import Engine
from stowage.engine.text import grammar
from stowage.engine.text.chat_template import render
from stowage.engine.text.tokenizer import Tokenizer
from stowage.engine.text.tool_calls import (HERMES, JSON, LLAMA3, MISTRAL, MISTRAL_ARGS, ReplyStream, ToolCall,
                                            ToolFormat, format_of, parse)

DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo-model"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "list_models", "description": "The models on this machine",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "properties": {"limit": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}},
                                                          "required": ["limit"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client():
    with served(Engine.load(DEMO, cpu_plan(DEMO, 512, num_seqs=2))) as client:
        yield client


def test_a_named_tool_choice_gives_the_same_valid_call_streamed_and_not(client):
    whole = client.chat.completions.create(model="demo-model", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=120)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(client.chat.completions.create(model="demo-model", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                 temperature=0, max_tokens=120, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert len(rest) > 3 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools_with_valid_arguments(client):
    for seed in range(3):
        reply = client.chat.completions.create(model="demo-model", messages=ASK, tools=TOOLS, tool_choice="required",
                                               temperature=1.0, seed=seed, max_tokens=120)
        (call,) = reply.choices[0].message.tool_calls
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), parameters)
        assert reply.choices[0].finish_reason == "tool_calls"


def test_a_tool_result_round_trip_is_answered(client):
    first = client.chat.completions.create(model="demo-model", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=120).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"forecast": "sunny, 21 C"}'}]
    reply = client.chat.completions.create(model="demo-model", messages=history, tools=TOOLS, temperature=0,
                                           max_tokens=30)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
    assert reply.usage.prompt_tokens > client.chat.completions.create(
        model="demo-model", messages=ASK, max_tokens=1).usage.prompt_tokens + 10  # the call and result are in it


def test_tool_choice_none_and_auto_answer_in_text_on_a_model_without_tools(client):
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model="demo-model", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               temperature=0, max_tokens=20)
        assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 3,
                                                                              "maximum": 1}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-model", messages=ASK, max_tokens=4, **body)
    assert e.value.body["param"] == param


# -- the families' formats, read back ----------------------------------------------------------------------
def test_each_family_format_is_read_from_a_whole_reply():
    names = {"get_weather", "list_models"}
    hermes = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "list_models", "arguments": {"limit": 2}}\n</tool_call>')
    assert parse(hermes, HERMES, names) == ("Let me check.", [ToolCall("get_weather", '{"city": "Paris"}'),
                                                              ToolCall("list_models", '{"limit": 2}')])
    mistral = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert parse(mistral, MISTRAL, names) == ("", [ToolCall("get_weather", '{"city": "Oslo"}')])
    newer = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]list_models[ARGS]{"limit": 2}'
    assert parse("Checking. " + newer, MISTRAL_ARGS, names) == (
        "Checking.", [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("list_models", '{"limit": 2}')])
    llama = '{"name": "list_models", "parameters": {"limit": 3}}'
    assert parse(llama, JSON, names) == ("", [ToolCall("list_models", '{"limit": 3}')])
    # not a call: an unknown tool, broken JSON, plain text
    for text, fmt in (('{"name": "rm_rf", "parameters": {}}', JSON), ("<tool_call>\n{oops\n</tool_call>", HERMES),
                      ("It is sunny.", HERMES)):
        assert parse(text, fmt, names) == (text, [])


def test_a_streamed_reply_holds_back_a_split_start_marker_and_reads_the_calls_at_the_end():
    stream = ReplyStream(HERMES, {"get_weather"})
    shown = [stream.feed(piece) for piece in ["Sure", ". <tool", "_ca", "ll>\n{\"name\": \"get_weather\", ",
                                              "\"arguments\": {}}\n</tool_call>"]]
    assert shown == ["Sure", ". ", "", "", ""]
    assert stream.finish() == ("", [ToolCall("get_weather", "{}")])
    plain = ReplyStream(HERMES, {"get_weather"})
    assert plain.feed("a <to") == "a " and plain.feed("day") == "<today" and plain.finish() == ("", [])


def test_the_format_follows_the_chat_template_and_templates_receive_tools():
    assert format_of("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert format_of("[AVAILABLE_TOOLS][TOOL_CALLS]") is MISTRAL and format_of(None) is JSON
    assert format_of("[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}") is MISTRAL_ARGS
    template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert render(template, ASK, tools=TOOLS) == "get_weather;list_models;" + ASK[0]["content"]


def test_auto_calls_in_the_hermes_format_are_constrained_once_started():
    """Free text, until the model writes <tool_call>: from there on only a call of an offered tool with valid
    arguments, and the closing tag, may follow."""
    tokenizer = Tokenizer(DEMO)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    bound = grammar.bind(grammar.auto_call_grammar(parameters, HERMES, {}), tokenizer, 1408, {2})

    def run(text):
        constraint = bound.constraint()
        for token in tokenizer.encode(text, add_special_tokens=False):
            if constraint.disallowed()[token]:
                return False
            constraint.consume(token)
        return True

    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}\n'
            "</tool_call>")
    assert run("Let me look that up. " + call + " Done.")
    assert parse("Let me look that up. " + call, HERMES, set(parameters)) == (
        "Let me look that up.", [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius", "days": 2}')])
    assert not run('<tool_call>\n{"name": "rm_rf"')  # not a tool offered
    assert not run('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"')
    assert not run('<tool_call>\n{"name": "list_models", "arguments": {"limit": 3}} and more')


def test_a_model_whose_template_offers_tools_sees_them_and_answers_auto_and_named(tmp_path):
    model_dir = tmp_path / "hermes"  # the demo model with a template in Hermes' format (read before the config's)
    shutil.copytree(DEMO, model_dir)
    (model_dir / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with served(Engine.load(model_dir, cpu_plan(model_dir, 1024)), max_running=1, max_waiting=2) as client:
        plain = client.chat.completions.create(model="hermes", messages=ASK, max_tokens=8, temperature=0)
        auto = client.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS[:1], max_tokens=8,
                                              temperature=0)
        assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools are in the prompt
        assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
        named = client.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS[:1], tool_choice=NAMED,
                                               temperature=0, max_tokens=200)
        (call,) = named.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|end|>\n{%- endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("fmt, call, bad", [
    (ToolFormat("list", "<s>", is_list=True), ["<s>", '[{"name": "list_models", "arguments": {"limit": 2}}]'],
     ["<s>", '[{"name": "list_models", "arguments": {"limit": 99}}]']),
    (ToolFormat("args", "<s>", args="<pad>"),
     ["<s>", "list_models", "<pad>", '{"limit": 2}', "<s>", "get_weather", "<pad>", '{"city": "Oslo", "unit": '
      '"celsius", "days": 1}'],
     ["<s>", "get_weather", "<pad>", '{"city": "Oslo", "unit": "kelvin"']),
])
def test_auto_calls_after_a_special_token_are_constrained(fmt, call, bad):
    """Mistral's formats, with the demo tokenizer's <s> and <pad> standing in for [TOOL_CALLS] and [ARGS]: free
    text, then after the special token only calls of offered tools with valid arguments."""
    tokenizer = Tokenizer(DEMO)
    special = {"<s>": 1, "<pad>": 0}
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    bound = grammar.bind(grammar.auto_call_grammar(parameters, fmt, special), tokenizer, 1408, {2})

    def run(pieces):
        constraint = bound.constraint()
        for piece in pieces:
            for token in [special[piece]] if piece in special else tokenizer.encode(piece, add_special_tokens=False):
                if constraint.disallowed()[token]:
                    return False
                constraint.consume(token)
        return not constraint.disallowed()[2]  # and may end here

    assert run(["Let me see. "]) and run(["Let me see. ", *call])
    assert not run(["Let me see. ", call[0], call[1].replace("list_models", "rm_rf")])
    assert not run(["Let me see. ", *bad])  # arguments outside the tool's parameters
    assert grammar.auto_call_grammar(parameters, fmt, {}) is None  # markers that are not special tokens: free text


def test_a_forced_call_cut_short_streams_the_arguments_it_got(client):
    """max_tokens ends the call mid-arguments: finish_reason length, and the pieces streamed are what the whole
    answer holds."""
    kwargs = dict(model="demo-model", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=30)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pieces = "".join(d.function.arguments for c in chunks for d in (c.choices[0].delta.tool_calls or []))
    assert pieces == whole.message.tool_calls[0].function.arguments and pieces.startswith("{")
    assert chunks[-1].choices[0].finish_reason == "length"


# Llama 3.1's way of teaching calls, cut down: the tools in the prompt, a call written back as bare JSON
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|system|>\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}\nRespond with "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value} (or <|python_tag|> "
    "first).<|end|>\n{%- endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_llama3_calls_are_constrained_once_started():
    """Llama 3's bare JSON: a reply that starts as JSON (or with the tag token, here the demo tokenizer's <s>) must be
    a call of an offered tool with valid arguments; any other reply is free text, which cannot turn into JSON after
    white space either."""
    tokenizer = Tokenizer(DEMO)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    fmt = format_of(LLAMA3_TEMPLATE)
    assert fmt is LLAMA3 and fmt.markers == ("<|python_tag|>",)
    bound = grammar.bind(grammar.auto_call_grammar(parameters, fmt, {fmt.tag: 1}), tokenizer, 1408, {2})

    def run(*pieces):
        constraint = bound.constraint()
        for piece in pieces:
            for token in [1] if piece == fmt.tag else tokenizer.encode(piece, add_special_tokens=False):
                if constraint.disallowed()[token]:
                    return False
                constraint.consume(token)
        return not constraint.disallowed()[2]  # and may end here

    call = '{"name": "list_models", "parameters": {"limit": 3}}'
    assert run("Paris is sunny.") and run(call) and run(fmt.tag, call) and run(f"[{call}]")
    assert not run('{"name": "rm_rf"') and not run('{"name": "list_models", "parameters": {"limit": 99}}')
    assert not run('{"name": "list_models", "arguments": {"limit": 3}}')  # Llama's key is "parameters"
    assert not run(call + " and more") and not run("\n{") and not run(fmt.tag, "Hi")
    assert parse(call, fmt, set(parameters)) == ("", [ToolCall("list_models", '{"limit": 3}')])
    assert parse(fmt.tag + call, fmt, set(parameters))[1] == [ToolCall("list_models", '{"limit": 3}')]


def test_a_llama3_model_that_starts_a_call_finishes_a_valid_one(tmp_path):
    """A tiny Llama whose every likeliest token is `{` (its head rigged so): alone it writes braces without end; with
    tools offered in `auto`, the grammar takes over once it starts, and the reply is a valid call."""
    model_dir = make_model(tmp_path / "llama3", "llama", num_hidden_layers=1)
    save_tokenizer(model_dir, LLAMA3_TEMPLATE)
    weights = load_file(model_dir / "model.safetensors")
    brace = Tokenizer(model_dir).encode("{", add_special_tokens=False)[0]
    # one hidden dimension carries a constant from the embeddings to the head, which reads it as `{`
    weights["model.embed_tokens.weight"][:, 0] = 8.0
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[0] = 0.0  # no layer writes into it
    weights["model.norm.weight"].zero_()
    weights["model.norm.weight"][0] = 1.0
    weights["lm_head.weight"].zero_()
    weights["lm_head.weight"][brace, 0] = 10.0
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with served(Engine.load(model_dir, cpu_plan(model_dir, 1024)), max_running=1, max_waiting=2) as client:
        ask = dict(model="llama3", messages=ASK, temperature=0, max_tokens=200)
        alone = client.chat.completions.create(**ask).choices[0]
        assert alone.message.content.startswith("{{{") and alone.finish_reason == "length"
        for stream in (False, True):
            reply = client.chat.completions.create(**ask, tools=TOOLS, stream=stream)
            if stream:
                deltas = [d for c in reply for d in (c.choices[0].delta.tool_calls or [])]
                name, arguments = deltas[0].function.name, "".join(d.function.arguments for d in deltas)
            else:
                assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
                (call,) = reply.choices[0].message.tool_calls
                name, arguments = call.function.name, call.function.arguments
            parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
            jsonschema.validate(json.loads(arguments), parameters)
