"""The OpenAI-compatible API over real HTTP: Starlette's TestClient, and a real uvicorn on 127.0.0.1 where
requests must overlap (a full queue, a client that hangs up)."""

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from factory import cpu_plan, make_model
from processes import running
from starlette.testclient import TestClient

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.generation import GenerationResult
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.server.app import create_app
from stowage.engine.server.guards import MAX_HEAD_BYTES
from stowage.engine.server.listener import http_server, listen
from stowage.engine.serving.scheduler import Scheduler

TIMEOUT = 60  # seconds a test waits for the server before failing instead of hanging
SYSTEM = "Stowage plans memory: weights, KV cache, workspace and headroom. " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("server") / "model", "llama", initializer_range=0.2)


def load(model_dir, *, parallel=2, context=256):
    return Engine.load(model_dir, cpu_plan(model_dir, context, num_seqs=parallel))


@pytest.fixture(scope="module")
def served(model_dir):
    """A TestClient on a server of two sequences, and the engine behind it."""
    engine = load(model_dir)
    scheduler = Scheduler(engine, max_running=2, max_waiting=4).start()
    yield TestClient(create_app(scheduler)), engine
    scheduler.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    """Another engine on the same model: what a reply is when computed alone."""
    return load(model_dir, parallel=1)


def chat_body(content="Stowage plans memory", **fields):
    return {"model": "model", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 10,
            **fields}


def events(lines) -> list:
    """The data of each server-sent event: dicts, and the closing "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return out


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def test_chat_completion_is_the_engines_greedy_reply(served, reference):
    client, _ = served
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    body = r.json()
    messages = [{"role": "user", "content": "Stowage plans memory"}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=10)).run()
    assert body["object"] == "chat.completion" and body["model"] == "model" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == {"length": "length", "stop": "stop"}[expected.finish_reason]
    ids = reference.tokenizer.apply_chat_template(messages)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    assert body["usage"]["total_tokens"] == len(ids) + len(expected.token_ids)


def test_streaming_chat_sends_the_role_the_text_the_finish_and_the_usage(served):
    client, _ = served
    whole = client.post("/v1/chat/completions", json=chat_body(max_tokens=12)).json()
    with client.stream("POST", "/v1/chat/completions",
                       json=chat_body(max_tokens=12, stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = events(r.iter_lines())
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole["choices"][0]["message"]["content"]
    finish, usage = chunks[-2], chunks[-1]
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == \
        whole["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completions_take_text_or_token_ids_and_stream_the_same(served, reference):
    client, _ = served
    ids = reference.tokenizer.encode("Stowage plans memory")
    by_text = client.post("/v1/completions", json={"prompt": "Stowage plans memory", "temperature": 0}).json()
    by_ids = client.post("/v1/completions", json={"prompt": ids, "temperature": 0}).json()
    expected = reference.generate(ids, SamplingParams(temperature=0, max_tokens=16)).run()
    assert by_text["object"] == "text_completion"
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"] == expected.text
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_text["usage"]["completion_tokens"] == len(expected.token_ids) <= 16  # OpenAI's default max_tokens
    with client.stream("POST", "/v1/completions", json={"prompt": ids, "temperature": 0, "stream": True}) as r:
        data = events(r.iter_lines())
    assert data[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in data[:-1]) == expected.text


def test_models_and_health(served):
    client, engine = served
    assert client.get("/health").json() == {"status": "ok"}
    (model,) = client.get("/v1/models").json()["data"]
    assert model["id"] == "model" and model["object"] == "model" and model["max_model_len"] == 256
    assert client.get("/v1/models/model").json()["id"] == "model"
    assert_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"logprobs": True}, "logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ({"messages": []}, "messages"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"stop": [1, 2]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_what_is_not_supported_is_refused_never_ignored(served, fields, param):
    client, _ = served
    error = assert_error(client.post("/v1/chat/completions", json=chat_body(**fields)), 400, param)
    assert error["type"] == "invalid_request_error"


def test_neutral_values_and_text_parts_are_accepted(served):
    client, _ = served
    parts = [{"type": "text", "text": "Stowage plans "}, {"type": "text", "text": "memory"}]
    echoed = {"role": "assistant", "content": "Hi", "refusal": None, "tool_calls": []}
    r = client.post("/v1/chat/completions", json=chat_body(
        n=1, tools=[], logprobs=False, frequency_penalty=0, user="me", stop="never-said",
        messages=[{"role": "user", "content": "Hello"}, echoed, {"role": "user", "content": parts}]))
    assert r.status_code == 200, r.text


def test_malformed_requests_get_openai_errors_and_the_server_goes_on(served):
    client, _ = served
    as_json = {"Content-Type": "application/json"}
    assert_error(client.post("/v1/chat/completions", content=b"{not json", headers=as_json), 400, code="invalid_json")
    assert_error(client.post("/v1/chat/completions", json=[1, 2]), 400)
    assert_error(client.post("/v1/chat/completions", json=chat_body(model="gpt-4")), 404, "model", "model_not_found")
    assert_error(client.post("/v1/completions", json={"prompt": [1, 10**6]}), 400, "prompt")
    assert_error(client.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, "prompt")
    assert_error(client.post("/v1/chat/completions", content=b" " * (9 << 20), headers=as_json), 413,
                 code="request_too_large")
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_api_key_is_required_everywhere_but_health(model_dir):
    scheduler = Scheduler(load(model_dir, parallel=1), max_running=1, max_waiting=0).start()
    try:
        client = TestClient(create_app(scheduler, api_key="s3cret"))
        assert_error(client.get("/v1/models"), 401, code="invalid_api_key")
        assert_error(client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"}),
                     401, code="invalid_api_key")
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        ok = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200
    finally:
        scheduler.close()


def test_a_prompt_longer_than_the_context_is_refused_with_its_count(model_dir):
    engine = load(model_dir, parallel=1, context=64)
    engine.eos_ids.clear()
    scheduler = Scheduler(engine, max_running=1, max_waiting=0).start()
    try:
        client = TestClient(create_app(scheduler))
        ids = list(range(10, 80))
        error = assert_error(client.post("/v1/completions", json={"prompt": ids}), 400, "prompt",
                             "context_length_exceeded")
        assert "64 tokens" in error["message"] and "70 tokens" in error["message"]
        # max_tokens past the context is cut to what is left of it
        r = client.post("/v1/completions", json={"prompt": ids[:50], "max_tokens": 500, "temperature": 0}).json()
        assert r["usage"]["completion_tokens"] == 14 and r["choices"][0]["finish_reason"] == "length"
    finally:
        scheduler.close()


def test_a_shared_system_prompt_and_a_growing_history_are_not_prefilled_again(served):
    client, engine = served
    tokenizer = engine.tokenizer
    system = {"role": "system", "content": SYSTEM}
    first = [system, {"role": "user", "content": "What does the bar show?"}]
    r1 = client.post("/v1/chat/completions", json=chat_body(messages=first)).json()
    before = engine.stats.reused_tokens
    other = [system, {"role": "user", "content": "Pick a context size"}]
    r2 = client.post("/v1/chat/completions", json=chat_body(messages=other)).json()
    shared = len(tokenizer.apply_chat_template([system], add_generation_prompt=False))
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared > 16
    # the first conversation was taken for the second request (one request per conversation): ask again
    r1 = client.post("/v1/chat/completions", json=chat_body(messages=first)).json()
    history = [*first, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
               {"role": "user", "content": "And the slider?"}]
    r3 = client.post("/v1/chat/completions", json=chat_body(messages=history)).json()
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(tokenizer.apply_chat_template(first))
    reported = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (r2, r1, r3))
    assert engine.stats.reused_tokens - before == reported


# -- overlapping requests, on a real server --------------------------------------------------------------
@contextmanager
def live_server(engine, *, parallel, max_queue):
    scheduler = Scheduler(engine, max_running=parallel, max_waiting=max_queue).start()
    sock = listen("127.0.0.1", 0, has_key=False)
    server = http_server(scheduler, api_key=None)
    try:
        with running(server, sock):
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", scheduler
    finally:
        scheduler.close()
        sock.close()


def hold_decode_steps(engine, from_call: int) -> threading.Event:
    """Make the scheduler wait inside its from_call-th decode step until the returned gate is set."""
    gate, calls, decode_step = threading.Event(), [], engine.model.decode_step

    def held(*args):
        calls.append(1)
        if len(calls) >= from_call:
            assert gate.wait(TIMEOUT)
        return decode_step(*args)

    engine.model.decode_step = held
    return gate


def watch_requests(scheduler):
    """Each submitted request's cancel event, and an event set with its last answer (kept in `last`)."""
    seen, submit = [], scheduler.submit

    def watched(prompt_ids, sampling, emit, cancel):
        done, entry = threading.Event(), {"cancel": cancel}
        entry["done"] = done

        def emit_and_note(event):
            emit(event)
            if not hasattr(event, "token_id"):
                entry["last"] = event
                done.set()
        seen.append(entry)
        submit(prompt_ids, sampling, emit_and_note, cancel)

    scheduler.submit = watched
    return seen


def test_a_full_queue_answers_503_and_the_server_keeps_serving(model_dir):
    engine = load(model_dir, parallel=1)
    gate = hold_decode_steps(engine, from_call=1)
    body = chat_body(max_tokens=6, stream=True)
    with live_server(engine, parallel=1, max_queue=1) as (url, scheduler), httpx.Client(base_url=url,
                                                                                       timeout=TIMEOUT) as http:
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as running, \
                    http.stream("POST", "/v1/chat/completions", json=body) as waiting:
                busy = http.post("/v1/chat/completions", json=chat_body())
                error = assert_error(busy, 503, code="server_busy")
                assert error["type"] == "server_error" and busy.headers["retry-after"] == "1"
                gate.set()
                for r in (running, waiting):
                    assert r.status_code == 200 and events(r.iter_lines())[-1] == "[DONE]"
        finally:
            gate.set()
        assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_cancels_its_request_and_frees_its_blocks(model_dir, stream):
    engine = load(model_dir, parallel=1)
    engine.eos_ids.clear()
    gate = hold_decode_steps(engine, from_call=3)  # the request is still generating when the client leaves
    allocator = engine.cache.allocator
    with live_server(engine, parallel=1, max_queue=0) as (url, scheduler):
        requests = watch_requests(scheduler)
        try:
            body = json.dumps(chat_body(max_tokens=200, stream=stream)).encode()
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=TIMEOUT) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
                received = b""
                while stream and received.count(b"data: ") < 2:  # the role, then the first token
                    received += s.recv(65536)
                deadline = time.monotonic() + TIMEOUT
                while allocator.num_free == allocator.num_blocks:  # until the request holds blocks
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            (request,) = requests
            assert request["cancel"].wait(TIMEOUT)
        finally:
            gate.set()
        assert request["done"].wait(TIMEOUT)
        assert isinstance(request["last"], GenerationResult) and request["last"].finish_reason == "cancelled"
        assert allocator.num_free == allocator.num_blocks and scheduler.pool.num_idle == 0
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:  # and the server goes on
            assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_a_request_head_past_the_limit_is_refused(model_dir):
    with live_server(load(model_dir, parallel=1), parallel=1, max_queue=0) as (url, _), \
            httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        for size in (MAX_HEAD_BYTES, 4 * MAX_HEAD_BYTES):
            assert_error(http.get("/health", headers={"X-Big": "x" * size}), 431,
                         code="request_header_fields_too_large")
        assert http.get("/health", headers={"X-Fine": "x" * 1000}).status_code == 200
