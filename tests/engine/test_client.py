"""engine/process/client.py against a live `stowage serve` child (real HTTP), and `stowage chat --remote URL`."""

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest
from factory import ROOT, make_model

from stowage.engine.process.client import RemoteServer, sampling_fields
from stowage.engine.planning.plan import PlanRequest
from stowage.engine.process.engine_process import EngineProcess
from stowage.engine.errors import InsufficientMemoryError, InvalidArgumentError, RemoteError
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.protocol import API_KEY_ENV

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("client") / "model", "llama", initializer_range=0.2)
    with EngineProcess.start(model, PlanRequest(128)) as process:
        yield process


@pytest.fixture(scope="module")
def key(engine):
    return engine.server._http.headers["Authorization"].removeprefix("Bearer ")


def test_models_and_a_streamed_chat_with_its_usage(engine):
    server = engine.server
    (model,) = server.models()
    assert model["id"] == "model" and model["max_model_len"] == 128
    messages = [{"role": "user", "content": "Stowage plans memory: weights, KV cache, workspace and headroom."}]
    stream = server.chat(messages, GREEDY, model="model")
    deltas = list(stream)
    r = stream.result
    assert "".join(deltas) == r.text and len(deltas) >= 1
    assert r.finish_reason == "length" and r.completion_tokens == len(r.token_ids) == 8
    assert r.prompt_tokens > 0 and r.decode_tokens_per_s > 0
    again = server.chat(messages + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "More"}],
                        GREEDY)
    list(again)
    assert again.result.reused_tokens >= 16  # the history came from the server's cache


def test_a_completion_of_token_ids(engine):
    stream = engine.server.complete([1, 2, 3, 4], GREEDY)
    assert "".join(stream) == stream.result.text and stream.result.prompt_tokens == 4


def test_errors_are_typed_with_the_servers_message(engine, key):
    server = engine.server
    with pytest.raises(InsufficientMemoryError, match="maximum context length is 128 tokens"):
        list(server.chat([{"role": "user", "content": "memory " * 200}], GREEDY))
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        list(server.chat([{"role": "user", "content": "Hi"}], GREEDY, model="other"))
    wrong = RemoteServer(server.base_url, "wrong", trust_env=False)
    with pytest.raises(RemoteError, match="refused the API key"):
        wrong.models()
    with pytest.raises(RemoteError, match="cannot reach http://127.0.0.1:9"):
        RemoteServer("http://127.0.0.1:9/v1").models()
    assert RemoteServer(server.base_url + "/v1/", key).models()[0]["id"] == "model"  # with or without /v1


def test_cancel_stops_the_stream_and_the_server_goes_on(engine):
    cancel = threading.Event()
    stream = engine.server.chat([{"role": "user", "content": "A long story"}],
                                SamplingParams(temperature=0, max_tokens=100), cancel=cancel)
    for i, _ in enumerate(stream):
        if i == 2:
            cancel.set()
    assert stream.result.finish_reason == "cancelled" and stream.result.text
    assert "".join(engine.server.chat([{"role": "user", "content": "Hi"}], GREEDY))


def test_a_server_that_sends_no_token_ids_counts_the_reply_by_its_usage():
    # vLLM, llama.cpp's server, Ollama: OpenAI's chunks and usage, no "stowage" field; the times are measured here
    chunks = [{"choices": [{"delta": {"content": "One"}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": " two"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    server = RemoteServer("http://other.test", trust_env=False)
    server._http = httpx.Client(base_url=server.base_url,
                                transport=httpx.MockTransport(lambda request: httpx.Response(200, text=body)))
    stream = server.chat([{"role": "user", "content": "Count"}], GREEDY)
    assert "".join(stream) == "One two"
    r = stream.result
    assert r.token_ids == [] and (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (5, 2, "length")
    assert r.decode_seconds > 0 and r.decode_tokens_per_s == 1 / r.decode_seconds  # one step after prefill's token


def test_only_the_fields_that_ask_for_something_are_sent():
    assert sampling_fields(SamplingParams(temperature=0.5, max_tokens=10)) == {
        "max_tokens": 10, "temperature": 0.5, "top_p": 1.0}
    fields = sampling_fields(SamplingParams(top_k=5, min_p=0.1, repetition_penalty=1.1, seed=3, stop=("x",)))
    assert {k: fields[k] for k in ("top_k", "min_p", "repetition_penalty", "seed", "stop")} == {
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "seed": 3, "stop": ["x"]}


def test_terminal_chat_with_a_remote_server(engine, key):
    env = {**os.environ, API_KEY_ENV: key}
    out = subprocess.run([sys.executable, "-P", "-m", "stowage.engine.cli", "chat", "--remote", engine.server.base_url + "/v1",
                          "--model", "model", "--max-tokens", "4", "--temperature", "0"], input="Hello\nAgain\n",
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Chatting with model (128-token context)" in out.stderr
    assert len([line for line in out.stderr.splitlines() if "tokens reused" in line]) == 2
    wrong = subprocess.run([sys.executable, "-P", "-m", "stowage.engine.cli", "chat", "--remote", engine.server.base_url,
                            "--model", "nope"], input="", capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=120)
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines()[-1] == (
        f"stowage: {engine.server.base_url} has no model 'nope'; it serves 'model'")


def test_cancel_ends_a_stream_while_the_server_sends_nothing():
    # A server that answers the headers, then is silent (a long prompt read by a server that reports no
    # progress): Stop must not wait for its next event.
    import socket
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve():
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        conn.recv(1)  # until the client goes away

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    server = RemoteServer(f"http://127.0.0.1:{listener.getsockname()[1]}", trust_env=False)
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    started = time.monotonic()
    stream = server.chat([{"role": "user", "content": "Hi"}], GREEDY, cancel=cancel)
    assert list(stream) == [] and stream.result.finish_reason == "cancelled"
    assert time.monotonic() - started < 30  # not a read that waits for ever (the limit is far from the 0.1 s poll)
    thread.join(timeout=10)
    assert not thread.is_alive()  # the server saw the connection end
    listener.close()
    accepted[0].close()
