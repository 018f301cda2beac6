"""POST /stowage/load against a live `stowage serve`: models by the id this machine lists them under, progress as
server-sent events, a swap that ends running requests, and a cancel that leaves the server up with no model."""

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from factory import ROOT, cpu_plan, make_model, save_tokenizer
from sparse_models import LLAMA_3_1_8B, write_sparse_model

from stowage.engine.process.client import RemoteServer
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import GenerationCancelled, InvalidArgumentError, RemoteError
from stowage.engine.runtime.sampler import SamplingParams

TIMEOUT = 60  # seconds to wait for the server before failing instead of hanging
KEY = "load-key"
PROMPT = [5, 17, 42, 99, 7]
# a model whose load takes a while: 24 layers converted from float32 to bfloat16 (its weights are holes: no disk)
SLOW = {**LLAMA_3_1_8B, "vocab_size": 512, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024,
        "rope_scaling": None, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    models = root / "models"
    make_model(models / "alpha", "llama", initializer_range=0.2, seed=0)
    make_model(models / "beta", "llama", initializer_range=0.2, seed=1)
    write_sparse_model(models / "slow", SLOW, dtype="F32")
    save_tokenizer(models / "slow")
    make_model(root / "outside", "llama", seed=2)  # loadable, but not where this machine lists models
    (root / "home").mkdir()
    return root


@pytest.fixture(scope="module")
def server(places):
    """A live `stowage serve` of alpha whose models folder holds alpha, beta and slow; its base URL."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS")}
    env |= {"OMP_NUM_THREADS": "1", "STOWAGE_API_KEY": KEY, "HOME": str(places / "home")}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "stowage.engine.cli", "serve", str(places / "models" / "alpha"),
                             "--port", "0", "--context", "1024", "--models-dir", str(places / "models")],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(TIMEOUT)
    url = proc.stdout.readline().strip() if ready else ""
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        pytest.fail(f"no URL on stdout ({url!r}): {proc.communicate()[1]}")
    yield url
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err


@pytest.fixture
def remote(server):
    r = RemoteServer(server, KEY)
    yield r
    r.close()


def greedy_ids(model_dir, max_tokens=12):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 1024))
    try:
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens)
        return engine.generate(PROMPT, sampling).run()
    finally:
        engine.close()


def served_ids(remote, model, max_tokens=12):
    stream = remote.complete(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens), model=model)
    list(stream)
    return stream.result.token_ids


def wait_health(url, status):
    """Poll /health until its status is `status` (bounded: a hang fails, nothing is timed)."""
    for _ in range(TIMEOUT * 20):
        body = httpx.get(f"{url}/health").json()
        if body["status"] == status:
            return
        time.sleep(0.05)
    pytest.fail(f"/health never said {status!r}; last {body}")


def test_lists_the_models_of_this_machine_by_id(remote, places):
    listed = {m["id"]: m for m in remote.available_models()}
    assert set(listed) == {"alpha", "beta", "slow"}
    beta = places / "models" / "beta"
    assert listed["beta"]["format"] == "safetensors"
    assert listed["beta"]["size_bytes"] == sum(p.stat().st_size for p in beta.glob("*.safetensors"))
    assert "path" not in listed["beta"]  # where the files are is not the client's business


def test_switching_models_answers_with_the_new_models_tokens(remote, places):
    models = places / "models"
    events = []
    loaded = remote.load("beta", context_tokens=128, progress=lambda *e: events.append(e))
    assert loaded["id"] == "beta" and loaded["max_model_len"] == 128 and loaded["parallel"] == 1
    assert "layers on CPU" in loaded["plan"]
    assert [m["id"] for m in remote.models()] == ["beta"]
    assert served_ids(remote, "beta") == greedy_ids(models / "beta").token_ids
    done = [d for _, d, _ in events]
    total = {t for *_, t in events}
    assert done == sorted(done) and done[-1] == total.pop() and not total  # one total, done rising to it
    assert any(stage.startswith("layer ") for stage, *_ in events)
    assert events[0][0] == "unloading alpha"

    remote.load("alpha", context_tokens=128)
    assert served_ids(remote, "alpha") == greedy_ids(models / "alpha").token_ids
    with pytest.raises(InvalidArgumentError, match="does not exist"):  # the old model's name is gone
        served_ids(remote, "beta")


@pytest.mark.parametrize("model_id", ["../outside", "/etc", "/etc/passwd", "alpha/../beta", "outside", "~/x"])
def test_a_model_not_listed_is_refused_before_anything_changes(server, remote, places, model_id):
    remote.load("alpha", context_tokens=128)
    response = httpx.post(f"{server}/stowage/load", json={"model": str(places / "outside") if model_id == "outside"
                                                          else model_id}, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"  # refused before any stream began
    assert response.json()["error"]["code"] == "model_not_found"
    assert [m["id"] for m in remote.models()] == ["alpha"]  # still served


def test_a_bad_load_body_is_a_400_naming_the_field(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    for body, param in [({}, "model"), ({"model": 3}, "model"), ({"model": "beta", "context_tokens": 0}, "context_tokens"),
                        ({"model": "beta", "parallel": "2"}, "parallel"), ({"model": "beta", "dtype": "int4"}, "dtype"),
                        ({"model": "beta", "path": "/etc"}, "path"), ({"model": "beta", "kv_dtype": "q8_0/q3"}, "kv_dtype"),
                        ({"model": "beta", "kv_dtype": ["q8_0"]}, "kv_dtype"), ({"model": "beta", "kv_dtype": "auto"}, "kv_dtype")]:
        response = httpx.post(f"{server}/stowage/load", json=body, headers=headers)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


def test_a_load_takes_separate_k_and_v_cache_types_as_the_cli_does(remote, places):
    # before: /stowage/load refused "q8_0/q4_0" (and the aliases) that `stowage serve --kv-dtype` takes
    with pytest.raises(InvalidArgumentError, match="head_dim to be a multiple of 32"):  # parsed, then planned
        remote.load("beta", context_tokens=128, kv_dtype="q8_0/q4_0")
    loaded = remote.load("beta", context_tokens=128, kv_dtype="fp8/bf16")
    assert "fp8/bfloat16" in loaded["plan"], loaded["plan"]
    assert len(served_ids(remote, "beta")) == 12
    remote.load("alpha", context_tokens=128, kv_dtype="bf16")  # an alias the CLI takes
    assert [m["id"] for m in remote.models()] == ["alpha"]


def test_the_key_is_required(server):
    for method, path in [("POST", "/stowage/load"), ("GET", "/stowage/models")]:
        response = httpx.request(method, f"{server}{path}", json={"model": "beta"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_load_no_memory_would_fit_is_refused_and_the_model_stays(server, remote):
    remote.load("alpha", context_tokens=128)
    with pytest.raises(InvalidArgumentError, match="prefill chunk"):  # a 400 before the stream: nothing changed
        remote.load("beta", context_tokens=128, parallel=4096)
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert [m["id"] for m in remote.models()] == ["alpha"]


def test_a_disconnect_mid_load_leaves_no_model_and_the_next_load_works(server, remote, places):
    remote.load("alpha", context_tokens=128)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/stowage/load", json={"model": "slow", "context_tokens": 64, "dtype": "bfloat16"},
                      headers=headers, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data:"))
        assert "stage" in json.loads(first.removeprefix("data:"))
    # the load ends cancelled; until a load succeeds there is no model
    wait_health(server, "no model is loaded")
    chat = httpx.post(f"{server}/v1/chat/completions", headers=headers,
                      json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 503
    assert chat.json()["error"]["code"] == "model_not_loaded"
    assert remote.models() == []
    remote.load("alpha", context_tokens=128)
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert served_ids(remote, "alpha") == greedy_ids(places / "models" / "alpha").token_ids


def test_cancel_through_the_client(server, remote):
    remote.load("alpha", context_tokens=128)
    cancel = threading.Event()

    def progress(stage, done, total):
        cancel.set()  # at the first event

    with pytest.raises(GenerationCancelled):
        remote.load("slow", context_tokens=64, dtype="bfloat16", progress=progress, cancel=cancel)
    wait_health(server, "no model is loaded")
    remote.load("alpha", context_tokens=128)


def test_a_second_load_while_one_runs_is_a_409(server, remote):
    remote.load("alpha", context_tokens=128)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/stowage/load", json={"model": "slow", "context_tokens": 64, "dtype": "bfloat16"},
                      headers=headers, timeout=TIMEOUT) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        second = httpx.post(f"{server}/stowage/load", json={"model": "beta"}, headers=headers)
        assert second.status_code == 409
        assert second.json()["error"]["code"] == "load_in_progress"
        health = httpx.get(f"{server}/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}, list(lines)
    wait_health(server, "no model is loaded")
    remote.load("alpha", context_tokens=128)


def test_a_request_running_during_a_load_ends_with_its_final_event(remote, places):
    remote.load("alpha", context_tokens=1024)
    expected = greedy_ids(places / "models" / "alpha", max_tokens=900)
    assert expected.finish_reason == "length"  # alone it would run all 900 tokens
    stream = remote.complete(PROMPT, SamplingParams(temperature=0, max_tokens=900), model="alpha")
    texts = iter(stream)
    next(texts)
    remote.load("beta", context_tokens=128)
    list(texts)  # it ends: the last chunk, then [DONE]
    assert stream.result.finish_reason == "cancelled"  # the engine's reason, in the last chunk's figures
    assert 0 < len(stream.result.token_ids) < 900
    assert stream.result.token_ids == expected.token_ids[:len(stream.result.token_ids)]


def test_no_model_is_a_503_on_every_model_endpoint(server, remote):
    cancel = threading.Event()
    with pytest.raises(GenerationCancelled):  # cancelled at its first event: the load leaves no model
        remote.load("slow", context_tokens=64, dtype="bfloat16", progress=lambda *_: cancel.set(), cancel=cancel)
    wait_health(server, "no model is loaded")
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        response = httpx.post(f"{server}{path}", headers=headers, json=body)
        assert response.status_code == 503, path
        assert response.json()["error"]["message"].startswith("no model is loaded")
    assert httpx.get(f"{server}/stowage/plan", headers=headers).status_code == 503
    with pytest.raises(RemoteError, match="503"):
        remote.plan()
    remote.load("alpha", context_tokens=128)


def test_the_request_limit_follows_a_load_with_more_sequences(server, remote):
    # past 4 x (running + waiting) + 32 requests at once the server answers 503 server_busy: 100 for --parallel 1
    # and the default queue of 16, 128 once a load serves 8 sequences. Requests whose bodies have not arrived count.
    import socket
    from urllib.parse import urlsplit

    from stowage.engine.cli.serve import DEFAULT_MAX_QUEUE

    address = (urlsplit(server).hostname, urlsplit(server).port)
    headers = {"Authorization": f"Bearer {KEY}"}
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode()

    def models_with_requests_waiting_for_their_bodies(count):
        waiting = [socket.create_connection(address, timeout=TIMEOUT) for _ in range(count)]
        try:
            for s in waiting:
                s.sendall(head)
            time.sleep(0.5)  # the server takes them in before the request below
            return httpx.get(f"{server}/v1/models", headers=headers, timeout=TIMEOUT).status_code
        finally:
            for s in waiting:
                s.close()
            for _ in range(TIMEOUT * 20):  # until the server has seen them go
                if httpx.get(f"{server}/v1/models", headers=headers, timeout=TIMEOUT).status_code == 200:
                    break
                time.sleep(0.05)

    remote.load("alpha", context_tokens=128)
    first = 4 * (1 + DEFAULT_MAX_QUEUE) + 32
    assert models_with_requests_waiting_for_their_bodies(first) == 503
    assert remote.load("alpha", context_tokens=128, parallel=8)["parallel"] == 8
    assert models_with_requests_waiting_for_their_bodies(first) == 200
    remote.load("alpha", context_tokens=128)  # back to one sequence, as the other tests expect
