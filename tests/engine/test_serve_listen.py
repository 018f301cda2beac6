"""Where `stowage serve` listens: a chosen port with a key that the caller gives, sequences served at once, and a
Unix socket for the app's own engine. Real children on a tiny model; the official openai client and httpx."""

import os
import socket
import stat
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from processes import free_port, openai_client
from factory import make_model

from stowage.engine.process.client import RemoteServer
from stowage.engine.planning.plan import PlanRequest
from stowage.engine.process.engine_process import EngineProcess, client_url, serve_command
from stowage.engine.errors import EngineStartError, InvalidArgumentError, StowageError
from stowage.engine.planning import plan_for
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.server.listener import listen_unix

TIMEOUT = 60
KEY = "a-key-that-lasts"
GREEDY = SamplingParams(temperature=0, max_tokens=8)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("listen") / "model", "llama", initializer_range=0.2)


# -- a chosen port, a key given by the caller ----------------------------------------------------
def test_a_fixed_port_with_the_given_key_and_a_wrong_key_refused(model_dir):
    port = free_port()
    with EngineProcess.start(model_dir, PlanRequest(128), port=port, api_key=KEY) as engine:
        assert engine.server.base_url == f"http://127.0.0.1:{port}"
        assert KEY not in open(f"/proc/{engine.pid}/cmdline", "rb").read().decode()  # in the environment only
        url = f"http://127.0.0.1:{port}/v1"
        reply = openai_client(url, KEY).chat.completions.create(model="model", messages=HELLO, max_tokens=4,
                                                                temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):  # 401
            openai_client(url, "not-the-key").models.list()


def test_a_taken_port_is_a_start_error_with_the_childs_message(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineStartError, match=f"cannot listen on 127.0.0.1:{port}: .*choose another") as e:
            EngineProcess.start(model_dir, PlanRequest(128), port=port, api_key=KEY)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_every_address_with_a_key_is_reached_here_on_loopback(model_dir):
    port = free_port()
    with EngineProcess.start(model_dir, PlanRequest(128), host="0.0.0.0", port=port, api_key=KEY) as engine:
        assert engine.server.base_url == f"http://127.0.0.1:{port}"  # the child printed http://0.0.0.0:PORT
        assert engine.server.models()[0]["id"] == "model"
        with httpx.Client(trust_env=False) as plain:
            assert plain.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401


def test_two_sequences_serve_two_requests_at_once(model_dir):
    with EngineProcess.start(model_dir, PlanRequest(128, num_seqs=2)) as engine:
        kv_bytes = sum(device["kv_bytes"] for device in engine.server.plan()["devices"])
        assert kv_bytes == 2 * plan_for(model_dir, 128).kv_bytes > 0  # planned for two sequences
        key = engine.server.api_key
        base = engine.server.base_url + "/v1"
        prompts = ["Stowage plans memory", "The KV cache holds"]

        def ask(prompt):
            reply = openai_client(base, key).chat.completions.create(
                model="model", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
            return reply.choices[0].finish_reason, reply.usage.completion_tokens

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(ask, prompts))
        assert all(reason in ("stop", "length") and tokens >= 1 for reason, tokens in results)


def test_the_command_line_carries_the_listening_settings_but_no_key():
    command = serve_command("M", PlanRequest(64, num_seqs=3), port=8080, host="0.0.0.0")
    assert command[command.index("--port") + 1] == "8080" and command[command.index("--host") + 1] == "0.0.0.0"
    # the plan request itself crosses, not flags rebuilt from it
    assert PlanRequest.from_json(command[command.index("--plan-request") + 1]) == PlanRequest(64, num_seqs=3)
    assert "--api-key" not in command and "--context" not in command and "--parallel" not in command
    unix = serve_command("M", PlanRequest(64), unix="/tmp/x/engine.sock")
    assert unix[unix.index("--unix") + 1] == "/tmp/x/engine.sock" and "--port" not in unix and "--host" not in unix
    assert client_url("http://0.0.0.0:8080") == "http://127.0.0.1:8080"
    assert client_url("http://[::]:8080") == "http://[::1]:8080"
    assert client_url("http://192.168.1.5:8080") == "http://192.168.1.5:8080"
    assert client_url("unix:/tmp/x.sock") == "unix:/tmp/x.sock"


# -- a Unix socket ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def unix_engine(model_dir):
    with EngineProcess.start(model_dir, PlanRequest(256), unix=True) as engine:
        yield engine


def test_the_socket_is_private_and_gone_after_close(model_dir):
    engine = EngineProcess.start(model_dir, PlanRequest(64), unix=True)
    url = engine.server.base_url
    assert url.startswith("unix:") and url.endswith("/engine.sock")
    path = url.removeprefix("unix:")
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(engine.socket_dir).st_mode) == 0o700
    assert engine.server.health()
    engine.close()
    assert engine.proc.returncode == 0 and not os.path.exists(path) and not os.path.exists(engine.socket_dir)


def test_a_killed_childs_socket_folder_is_removed_too(model_dir):
    engine = EngineProcess.start(model_dir, PlanRequest(64), unix=True)
    engine.proc.kill()
    engine.proc.wait()
    engine.close()
    assert not os.path.exists(engine.socket_dir)


def test_chat_over_the_unix_socket_streaming_and_not(unix_engine):
    server = unix_engine.server
    (model,) = server.models()
    assert model["id"] == "model" and model["max_model_len"] == 256
    stream = server.chat(HELLO, GREEDY)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text and stream.result.completion_tokens == 8
    # not streaming: the official client over the same socket (its URLs only name the Host header)
    path = server.base_url.removeprefix("unix:")
    client = openai_client("http://localhost/v1", server.api_key, transport=httpx.HTTPTransport(uds=path))
    reply = client.chat.completions.create(model="model", messages=HELLO, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == stream.result.text
    with pytest.raises(openai.AuthenticationError):  # the key still counts on the socket
        openai_client("http://localhost/v1", "wrong", transport=httpx.HTTPTransport(uds=path)).models.list()


def test_cancel_mid_stream_over_the_socket_frees_the_request(unix_engine):
    server = unix_engine.server
    messages = [{"role": "user", "content": "Tell a long story about the memory planner and its KV cache blocks"}]
    cancel = threading.Event()
    stream = server.chat(messages, SamplingParams(temperature=0, max_tokens=200), cancel=cancel)
    for i, _ in enumerate(stream):
        if i == 2:
            cancel.set()
    assert stream.result.finish_reason == "cancelled" and stream.result.text
    # One sequence: this reply runs only once the cancelled one left, and a cancelled conversation is freed, not
    # kept for reuse (a finished one would give this identical prompt its cached tokens)
    again = server.chat(messages, SamplingParams(temperature=0, max_tokens=4))
    assert "".join(again)
    finished = server.chat(messages, SamplingParams(temperature=0, max_tokens=4))
    list(finished)
    # the control: a finished request's blocks are kept, so the same prompt reuses them; after the cancelled one
    # only what an earlier test's chat shares with it, if anything (its template's opening: flaky as == 0)
    assert finished.result.reused_tokens > 0 and again.result.reused_tokens < finished.result.reused_tokens


def test_a_unix_url_without_a_path_is_refused():
    with pytest.raises(InvalidArgumentError, match="unix:/path"):
        RemoteServer("unix:")


# -- serve --unix: the socket file ------------------------------------------------------------------
def test_listen_unix_removes_a_stale_socket_and_refuses_a_live_one_or_another_file(tmp_path):
    path = tmp_path / "s.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # the file stays, nothing listens: what a killed server leaves
    sock = listen_unix(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(StowageError, match="a server listens there already"):
        listen_unix(path)
    sock.close()
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    with pytest.raises(InvalidArgumentError, match="not a socket"):
        listen_unix(plain)
    assert plain.read_text() == "keep me"
    with pytest.raises(InvalidArgumentError, match="at most"):
        listen_unix(tmp_path / ("x" * 120))


def test_serve_refuses_unix_with_a_tcp_address(model_dir, capsys):
    from stowage.engine.cli import main

    for extra in (["--port", "9000"], ["--host", "127.0.0.1"]):
        assert main(["serve", str(model_dir), "--unix", "/tmp/never.sock", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("stowage: --unix") and "\n" not in err
    assert not os.path.exists("/tmp/never.sock")
