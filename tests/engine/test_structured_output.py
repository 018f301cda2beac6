"""response_format json_object / json_schema through the official openai client against a live server on the bundled
demo model: every reply parses and validates (the grammar, not the model, guarantees it); a schema llguidance cannot
compile is a 400 and the server goes on; and in one batched step a constrained and a free request each get what they
get alone."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from factory import cpu_plan
from gguf_factory import gemma_vocab
from processes import served
from schemas import SCHEMAS
from scheduler_log import Log

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.serving.scheduler import Scheduler
from stowage.engine.text import grammar
from stowage.engine.text.gguf_tokenizer import tokenizer_from_gguf

DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo-model"
ASK = [{"role": "user", "content": "Describe the model you would pick as JSON."}]


@pytest.fixture(scope="module")
def engine():
    return Engine.load(DEMO, cpu_plan(DEMO, 512, num_seqs=2))


@pytest.fixture(scope="module")
def client(engine):
    with served(engine) as client:
        yield client


def schema_format(schema, name="reply"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_replies_parse_and_validate(client, name, temperature):
    schema = SCHEMAS[name]
    reply = client.chat.completions.create(model="demo-model", messages=ASK, temperature=temperature, seed=7,
                                           max_tokens=200, response_format=schema_format(schema))
    (choice,) = reply.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_on_completions_and_a_schema_streamed(client):
    text = client.completions.create(model="demo-model", prompt="Stowage plans", max_tokens=60, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert text.finish_reason == "stop" and isinstance(json.loads(text.text), dict)
    schema = SCHEMAS["arrays with min and max items"]
    stream = client.chat.completions.create(model="demo-model", messages=ASK, max_tokens=100, temperature=0,
                                            response_format=schema_format(schema), stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(model="demo-model", messages=ASK, max_tokens=100, temperature=0,
                                           response_format=schema_format(schema)).choices[0].message.content
    assert len([p for p in pieces if p]) > 5 and "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), schema)


def test_a_schema_that_cannot_finish_in_max_tokens_ends_for_length(client):
    schema = {"type": "array", "minItems": 50, "items": {"type": "integer"}}
    reply = client.chat.completions.create(model="demo-model", messages=ASK, max_tokens=12, temperature=0,
                                           response_format=schema_format(schema))
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
    assert reply.choices[0].message.content.startswith("[")


@pytest.mark.parametrize("schema, says", [
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "string", "pattern": "(unclosed"}, "unclosed"),
    ({"type": "frobnicate"}, "frobnicate"),
])
def test_an_invalid_schema_is_a_400_naming_the_problem_and_the_server_goes_on(client, schema, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-model", messages=ASK, max_tokens=8,
                                       response_format=schema_format(schema))
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == "response_format" and error["code"] == "invalid_schema"
    assert says in error["message"]
    assert client.chat.completions.create(model="demo-model", messages=ASK, max_tokens=4).choices[0].message.content


def test_a_schema_or_call_nested_too_deeply_is_a_400(client):
    for depth in (100, 300, 450):  # past llguidance's limit; past Python's stack for our own walk; near the body's
        schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth
        body = ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": '
                '{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + schema + "}}}")
        r = httpx.post(f"{client.base_url}chat/completions", content=body, timeout=60, trust_env=False,
                       headers={"content-type": "application/json"})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and ("nested too deeply" in message or "recursion limit" in message), r.text
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-model", max_tokens=4, messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert e.value.body["param"] == "messages[1].tool_calls[0]"


def test_a_malformed_response_format_is_a_400(client):
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {}}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo-model", messages=ASK, max_tokens=4, response_format=bad)
        assert e.value.body["param"] == "response_format"


def test_a_batched_step_mixes_constrained_and_free_requests_each_as_alone(engine):
    """Two greedy requests in the same decode steps, one under a schema: each reply is the one it gets alone."""
    schema = SCHEMAS["enums and ranges"]
    bound = grammar.bind(grammar.json_schema_grammar(schema), engine.tokenizer, engine.config.vocab_size,
                         engine.eos_ids)
    prompt = engine.tokenizer.apply_chat_template(ASK)
    constrained = SamplingParams(temperature=0, max_tokens=60, grammar=bound)
    free = SamplingParams(temperature=0, max_tokens=60)
    alone = {name: engine.generate(prompt, params).run() for name, params in (("json", constrained), ("free", free))}
    assert alone["json"].text != alone["free"].text
    jsonschema.validate(json.loads(alone["json"].text), schema)

    scheduler = Scheduler(engine, max_running=2, max_waiting=2)  # stepped here: both are admitted in the first step
    batch_sizes = []
    decode_step = engine.model.decode_step
    engine.model.decode_step = lambda tokens, *a: batch_sizes.append(len(tokens)) or decode_step(tokens, *a)
    try:
        log = Log()
        for name, params in (("json", constrained), ("free", free)):
            scheduler.submit(prompt, params, log.emitter(name), threading.Event())
        while len(log.done) < 2:
            scheduler.step()
    finally:
        del engine.model.decode_step
    together = dict(zip(("json", "free"), log.wait("json", "free")))
    assert batch_sizes.count(2) >= 5  # they shared decode steps
    for name in ("json", "free"):
        assert together[name].token_ids == alone[name].token_ids
        assert together[name].finish_reason == alone[name].finish_reason


def test_stowage_generate_json_schema_prints_the_parsed_value(tmp_path):
    schema = SCHEMAS["enums and ranges"]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    command = [sys.executable, "-P", "-m", "stowage.engine.cli", "generate", str(DEMO), "--prompt", "Describe a model",
               "--chat", "--threads", "1"]
    done = subprocess.run([*command, "--json-schema", str(tmp_path / "schema.json"), "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["finish_reason"] == "stop" and out["value"] == json.loads(out["text"])
    jsonschema.validate(out["value"], schema)
    # before: a --stop string that cut the JSON short was a JSONDecodeError traceback; now the value is null
    cut = subprocess.run([*command, "--json-schema", str(tmp_path / "schema.json"), "--json", "--stop", '"size"'],
                         capture_output=True, text=True, timeout=120)
    assert cut.returncode == 0 and "Traceback" not in cut.stderr, cut.stderr
    assert json.loads(cut.stdout)["value"] is None
    (tmp_path / "bad.json").write_text('{"type": "integer", "minimum": 5, "maximum": 1}')
    refused = subprocess.run([*command, "--json-schema", str(tmp_path / "bad.json")], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"stowage: --json-schema {tmp_path / 'bad.json'} is not supported: Unsatisfiable schema: minimum (5) is "
        "greater than maximum (1)"]


def test_numbers_take_six_fraction_digits_and_listed_objects_no_other_keys(engine):
    """The two limits that keep a weak model's reply finite; what they allow stays valid under the schema."""
    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "object"}}}
    bound = grammar.bind(grammar.json_schema_grammar(schema), engine.tokenizer, engine.config.vocab_size,
                         engine.eos_ids)

    def accepts(text):
        constraint = bound.constraint()
        for token in engine.tokenizer.encode(text, add_special_tokens=False):
            if constraint.disallowed()[token]:
                return False
            constraint.consume(token)
        return constraint.is_finished

    assert accepts('{"a": 0.125, "b": {"free": [1, 2]}}') and accepts('{"a": 1.000001}')
    assert not accepts('{"a": 1.0000001}')  # a seventh fraction digit
    assert not accepts('{"a": 1, "c": 2}')  # a key the object does not list


def test_a_gguf_sentencepiece_vocabulary_serves_a_grammar():
    """llguidance reads the tokenizer built from a GGUF file's metadata (engine/text/gguf_tokenizer.py), not only a
    tokenizer.json: a Gemma-style SentencePiece vocabulary with byte tokens."""
    corpus = ['{"name": "Paris", "size": 12, "ok": true}', "Stowage plans memory: weights, KV cache, headroom."] * 5
    tokens, scores, types = gemma_vocab(600, corpus)
    tokenizer = tokenizer_from_gguf({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.bos_token_id": tokens.index("<bos>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<eos>"), "tokenizer.ggml.add_space_prefix": False}, "t.gguf")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name", "size"]}
    constraint = grammar.bind(grammar.json_schema_grammar(schema), tokenizer, len(tokens),
                              {tokens.index("<eos>")}).constraint()
    for token in tokenizer.encode('{"name": "Paris é", "size": 12}', add_special_tokens=False):
        assert not constraint.disallowed()[token], tokenizer.decode([token])
        constraint.consume(token)
    assert constraint.is_finished
    assert constraint.disallowed().sum() == len(tokens) - 1  # the EOS alone
