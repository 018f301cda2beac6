"""`stowage serve` as a user runs it: a live server in a subprocess, driven by the official openai client."""

import io
import json
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from factory import cpu_plan, make_model
from processes import SERVE_ENV, SERVE_KEY, TIMEOUT_S, read_line, stowage

from stowage.engine.cli import build_parser, main
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.sampler import SamplingParams

TIMEOUT = TIMEOUT_S  # seconds to wait for the server before failing instead of hanging
KEY, ENV = SERVE_KEY, SERVE_ENV


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("serve") / "model", "llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def server(model_dir):
    """A live `stowage serve` (4 sequences; the key from $STOWAGE_API_KEY) and its base URL."""
    proc = stowage("serve", model_dir, "--port", 0, "--parallel", 4, "--context", 256)
    url = read_line(proc)
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        pytest.fail(f"no URL on stdout ({url!r}): {proc.communicate()[1]}")
    yield url
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err  # Ctrl-C is a clean stop
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def reference(model_dir):
    return Engine.load(model_dir, cpu_plan(model_dir, 256))


def client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def greedy_chat(engine, content, max_tokens):
    messages = [{"role": "user", "content": content}]
    return engine.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens)).run()


def test_the_openai_client_chats_streams_and_completes(server, reference):
    c = client(server)
    assert [m.id for m in c.models.list()] == ["model"]
    expected = greedy_chat(reference, "Stowage plans memory", 12)
    reply = c.chat.completions.create(model="model", messages=[{"role": "user", "content": "Stowage plans memory"}],
                                      temperature=0, max_tokens=12)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    stream = c.chat.completions.create(model="model", messages=[{"role": "user", "content": "Stowage plans memory"}],
                                       temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected.text
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    text = c.completions.create(model="model", prompt="The quick brown fox", temperature=0, max_tokens=8)
    ids = reference.tokenizer.encode("The quick brown fox")
    alone = reference.generate(ids, SamplingParams(temperature=0, max_tokens=8)).run()
    assert text.choices[0].text == alone.text


def test_eight_concurrent_clients_each_get_the_reply_they_get_alone(server, reference):
    prompts = [f"{w} plans memory: weights, KV cache" for w in
               ("Stowage", "Nobody", "The app", "Pick", "A fox", "Café", "Tokyo", "Everyone")]
    expected = [greedy_chat(reference, p, 16).text for p in prompts]
    c = client(server)

    def ask(prompt):
        r = c.chat.completions.create(model="model", messages=[{"role": "user", "content": prompt}], temperature=0,
                                      max_tokens=16, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == expected


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}], n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert e.value.param == "temperature"
    assert c.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_serve_refuses_in_one_line_what_it_cannot_do(model_dir, capsys, monkeypatch):
    monkeypatch.delenv("STOWAGE_API_KEY", raising=False)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = [
        (["--context", 5000, "--port", 0], "1,024"),  # longer than the model's positions: the planner's error
        (["--host", "0.0.0.0", "--port", 0], "--api-key"),  # reachable from other machines without a key
        (["--port", taken.getsockname()[1]], "another --port"),
        (["--parallel", 0], "--parallel must be at least 1"),
    ]
    try:
        for args, words in cases:  # each fails before anything loads, so in this process
            assert main(["serve", str(model_dir), *map(str, args)]) == 2
            out, err = capsys.readouterr()
            assert out == "" and words in err and "Traceback" not in err
            assert [line for line in err.splitlines() if line] == [err.strip()] and err.strip().startswith("stowage: ")
    finally:
        taken.close()


def test_plan_counts_the_kv_cache_of_every_parallel_sequence(model_dir):
    def kv_bytes(*extra):
        args = build_parser().parse_args(["plan", str(model_dir), "--context", "256", "--ram-budget", "8GiB",
                                          "--json", *extra])
        out = io.StringIO()
        assert args.func(args, out=out) == 0
        return json.loads(out.getvalue())["devices"][-1]["kv_bytes"]

    assert kv_bytes("--parallel", "3") == 3 * kv_bytes() > 0


def test_sigterm_is_a_clean_stop(model_dir, tmp_path):
    # uvicorn re-raised SIGTERM after its graceful shutdown: `serve` died with -15, its conversations were not
    # written to the KV store and its --unix socket file stayed. What the app's --exit-with-parent relies on too.
    kv_dir, sock = tmp_path / "kv", tmp_path / "s.sock"
    proc = stowage("serve", model_dir, "--unix", sock, "--context", 256, env={**ENV, "STOWAGE_KV_DIR": str(kv_dir)})
    url = read_line(proc)
    assert url == f"unix:{sock}" and sock.exists(), proc.stderr.read() if proc.poll() is not None else url
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://localhost", timeout=TIMEOUT) as c:
        reply = c.post("/v1/completions", json={"prompt": "Stowage keeps the context " * 4, "max_tokens": 4,
                                                "temperature": 0}, headers={"Authorization": f"Bearer {KEY}"})
        assert reply.status_code == 200, reply.text
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert not sock.exists()  # the socket file went with the server
    assert list(kv_dir.rglob("*.kv")), "the cached conversation was not written to the KV store"


def test_serve_unloads_a_model_whose_file_is_truncated_and_keeps_answering(tmp_path):
    # before: `serve` died with SIGBUS mid-stream (or, truncated between steps, failed every request while /health
    # said ok)
    model_dir = make_model(tmp_path / "m", "llama", eos_token_id=None)
    proc = stowage("serve", model_dir, "--port", 0, "--context", 512,
                   env={**ENV, "STOWAGE_KV_DIR": str(tmp_path / "kv")})
    url = read_line(proc)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.Client(base_url=url, headers=auth, timeout=TIMEOUT) as client:
            body = {"model": "m", "prompt": "a b c", "max_tokens": 400, "temperature": 0, "stream": True}
            events = []
            with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line.removeprefix("data: ")))
                    if len(events) == 3:
                        os.truncate(model_dir / "model.safetensors", 4096)
            assert len(events) < 400, "the stream went on past the truncation"
            error = events[-1].get("error")
            assert error and error["code"] == "model_unloaded", events[-1]
            assert "model.safetensors changed on disk" in error["message"]

            health = client.get("/health")
            assert health.status_code == 503
            assert health.json()["status"] == "no model is loaded"
            assert "m was unloaded" in health.json()["reason"]
            again = client.post("/v1/completions", json={**body, "stream": False})
            assert again.status_code == 503 and "was unloaded" in again.json()["error"]["message"]
            assert proc.poll() is None, "the server exited"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    unloaded = [line for line in err.splitlines() if "unloaded" in line]
    assert len(unloaded) == 1 and "model.safetensors changed on disk" in unloaded[0], err
