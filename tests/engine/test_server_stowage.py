"""Stowage's own endpoints beside the OpenAI-compatible ones: the plan, the memory report, unload, and the
extension fields of a stream (prefill progress, the engine's figures) that OpenAI clients ignore."""

import json
import os

import pytest
from factory import cpu_plan, make_model
from starlette.testclient import TestClient

from stowage.engine.runtime.engine import Engine
from stowage.engine.planning.report import to_dict
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.server.app import create_app
from stowage.engine.protocol import parse_progress, write_progress
from stowage.engine.serving.scheduler import Scheduler

KEY = "secret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("stowage-api") / "model", "llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def served(model_dir):
    """A server whose prefill chunk is 16 tokens (a long prompt takes several), with a key; and its unload calls."""
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=16))
    scheduler = Scheduler(engine, max_running=1, max_waiting=2).start()
    unloads = []
    client = TestClient(create_app(scheduler, api_key=KEY, on_unload=lambda: unloads.append(True)),
                        headers={"Authorization": f"Bearer {KEY}"})
    yield client, engine, unloads
    scheduler.close()


def stream(client, body) -> list:
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_plan_and_memory_are_the_engines_own(served):
    client, engine, _ = served
    assert client.get("/stowage/plan").json() == to_dict(engine.plan)
    memory = client.get("/stowage/memory").json()
    assert memory == {"pid": os.getpid(), "devices": engine.memory_report()}
    assert memory["devices"]["cpu"]["kv_cache"] == engine.plan.kv_bytes


def test_stowage_paths_need_the_key(served):
    client, _, unloads = served
    for method, path in (("GET", "/stowage/plan"), ("GET", "/stowage/memory"), ("POST", "/stowage/unload")):
        r = client.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert unloads == []


def test_a_long_prompt_streams_its_prefill_progress_and_the_last_chunk_the_engines_figures(served):
    client, engine, _ = served
    content = "Stowage plans memory: weights, KV cache and workspace. " * 6
    prompt_ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    assert len(prompt_ids) > 3 * 16
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8, "stream": True}
    chunks = stream(client, body)
    progress = [c["stowage"]["prefill"] for c in chunks if "prefill" in c.get("stowage", {})]
    # one after each 16-token chunk but the last (whose logits give the first token)
    expected = list(range(16, len(prompt_ids), 16))
    assert [p["done_tokens"] for p in progress] == expected
    assert all(p["prompt_tokens"] == len(prompt_ids) for p in progress)
    for c in chunks:  # still OpenAI's chunk: an empty delta that clients read as no text
        if "prefill" in c.get("stowage", {}):
            assert c["choices"][0]["delta"] == {} and c["choices"][0]["finish_reason"] is None
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    alone = Engine.load(engine.model_dir, cpu_plan(engine.model_dir, 256, prefill_chunk=16))
    expected = alone.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=8)).run()
    figures = last["stowage"]
    assert figures["token_ids"] == expected.token_ids
    assert figures["prefilled_tokens"] == len(prompt_ids)
    assert figures["prefill_seconds"] > 0 and figures["decode_seconds"] > 0 and figures["first_token_seconds"] > 0
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected.text


def test_a_prompt_of_one_chunk_sends_no_progress(served):
    client, _, _ = served
    chunks = stream(client, {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 2,
                             "stream": True})
    assert [c for c in chunks if "prefill" in c.get("stowage", {})] == []


def test_unload_answers_then_calls_the_server_back(served):
    client, _, unloads = served
    r = client.post("/stowage/unload")
    assert r.status_code == 202 and r.json() == {"status": "unloading"}
    assert unloads == [True]


def test_progress_lines_are_read_back(capsys):
    write_progress(0.5, "layer 2/4")
    line = capsys.readouterr().err
    assert line == "[ 50.0%] layer 2/4\n"  # not a terminal: one line each, no redraw
    assert parse_progress(line) == (0.5, "layer 2/4")
    assert parse_progress("loading model: 3/3 layers on CPU") is None
