"""The server under hostile clients (issue 31): idle and slow sockets, web pages in a browser, bodies that break
the JSON parser, clients that hang up, and the bearer scheme in any case. In-process uvicorn on a tiny model."""

import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from factory import cpu_plan, make_model
from processes import running
from starlette.testclient import TestClient

from stowage.engine.cli import build_parser
from stowage.engine.runtime.engine import Engine
from stowage.engine.server import deadlines
from stowage.engine.server.app import create_app
from stowage.engine.server.listener import http_server, listen, listen_unix
from stowage.engine.serving.scheduler import Scheduler

TIMEOUT = 60  # seconds a test waits for the server before failing instead of hanging
ANSWER_S = 5  # the issue's bound: with idle sockets open, a request is answered within this
LOOPBACK = "http://127.0.0.1:8080"  # a TestClient's server address: a loopback bind, as `stowage serve`'s default


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hostile") / "model", "llama", initializer_range=0.2)


def load(model_dir, parallel=1):
    return Engine.load(model_dir, cpu_plan(model_dir, 256, num_seqs=parallel))


def chat_body(**fields):
    return {"messages": [{"role": "user", "content": "Stowage plans memory"}], "temperature": 0, "max_tokens": 4,
            **fields}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def noisy(self) -> list[str]:
        """What a hostile client made the server log at warning or above, with its traceback if any."""
        return [self.format(r) for r in self.records if r.levelno >= logging.WARNING]


@contextmanager
def live_server(engine, *, parallel=1, max_queue=0, unix=None):
    """uvicorn on a thread over a scheduler of `engine`: the base URL (or socket path), the uvicorn Server, and
    what uvicorn and the app logged."""
    scheduler = Scheduler(engine, max_running=parallel, max_waiting=max_queue).start()
    sock = listen_unix(unix) if unix is not None else listen("127.0.0.1", 0, has_key=False)
    server = http_server(scheduler, api_key=None)
    records = _Records()  # after http_server: uvicorn's Config sets its loggers up anew
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "stowage")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        with running(server, sock):
            yield (str(unix) if unix is not None else f"http://127.0.0.1:{sock.getsockname()[1]}"), server, records
    finally:
        scheduler.close()
        sock.close()
        for logger in loggers:
            logger.removeHandler(records)


def address(url):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def wait_until(condition, what):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def wait_idle(server):
    """Until the server runs no request (each hostile one has ended, and logged what it logs)."""
    wait_until(lambda: not server.server_state.tasks, "a request never ended")


def closed_by_server(sock, within):
    """Whether the server closed sock within `within` seconds (what it sent before is skipped)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


# -- 3: idle and slow sockets --------------------------------------------------------------------------------
def test_idle_and_slow_header_sockets_leave_room_for_health_and_a_chat(model_dir):
    # uvicorn counted every open connection against its limit (4 x (1 + 0) + 32 = 36 here): 200 sockets that send
    # nothing, or headers that never end, got everyone else a 503 until they left
    with live_server(load(model_dir)) as (url, server, records):
        idle = []
        try:
            for i in range(200):
                s = socket.create_connection(address(url), timeout=TIMEOUT)
                if i % 4 == 0:  # a slowloris: headers begun, never finished
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                idle.append(s)
            wait_until(lambda: len(server.server_state.connections) >= 200, "the server took in the sockets")
            with httpx.Client(base_url=url, timeout=ANSWER_S) as http:
                assert http.get("/health").status_code == 200
                reply = http.post("/v1/chat/completions", json=chat_body())
                assert reply.status_code == 200, reply.text
        finally:
            for s in idle:
                s.close()


def test_a_request_past_the_limit_gets_an_openai_503_and_health_still_answers(model_dir):
    # the limit counts requests being served, not sockets: bodies that do not arrive hold their slots
    with live_server(load(model_dir)) as (url, server, _):
        waiting = []
        try:
            for _ in range(4 * 1 + 32):
                s = socket.create_connection(address(url), timeout=TIMEOUT)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{")
                waiting.append(s)
            wait_until(lambda: len(server.server_state.tasks) >= len(waiting), "the requests began")
            with httpx.Client(base_url=url, timeout=ANSWER_S) as http:
                busy = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
                assert busy.headers["retry-after"] == "1"
                assert http.get("/health").status_code == 200
        finally:
            for s in waiting:
                s.close()
        wait_idle(server)
        with httpx.Client(base_url=url, timeout=ANSWER_S) as http:
            assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_socket_that_never_finishes_its_head_or_its_body_is_closed(model_dir, monkeypatch):
    monkeypatch.setattr(deadlines, "HEAD_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(deadlines, "BODY_TIMEOUT_SECONDS", 0.5)
    with live_server(load(model_dir)) as (url, server, records):
        silent = socket.create_connection(address(url), timeout=TIMEOUT)
        dripping = socket.create_connection(address(url), timeout=TIMEOUT)
        half_body = socket.create_connection(address(url), timeout=TIMEOUT)
        kept_alive = socket.create_connection(address(url), timeout=TIMEOUT)
        try:
            half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                              b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert b"200 OK" in kept_alive.recv(65536)
            kept_alive.sendall(b"GET /health HTTP/1.1\r\n")  # then the next request's head, never finished
            start = time.monotonic()
            dripping.sendall(b"GET /health HTTP/1.1\r\n")
            while time.monotonic() - start < 3:  # a byte each 0.1 s: every read resets uvicorn's keep-alive timer
                try:
                    dripping.sendall(b"X")
                except OSError:
                    break
                time.sleep(0.1)
            for s in (silent, dripping, half_body, kept_alive):
                assert closed_by_server(s, within=10)
        finally:
            for s in (silent, dripping, half_body, kept_alive):
                s.close()
        wait_idle(server)
        assert records.noisy() == []
        with httpx.Client(base_url=url, timeout=ANSWER_S) as http:  # a client that sends at once is served
            assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


# -- 9: bodies that broke the JSON parser or the error itself --------------------------------------------------
@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000, "nested"),  # RecursionError in json.loads
    (b'{"' + b"\\ud800" + b'": 1}', "\\ud800"),  # a lone surrogate, echoed in the 400: UnicodeEncodeError
    (b'{"messages": [{"role": "user", "content": "x", "\\udfff": 1}]}', "\\udfff"),
])
def test_bodies_that_break_the_parser_or_the_error_are_400s_and_log_nothing(model_dir, body, words):
    with live_server(load(model_dir)) as (url, server, records):
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and words in error["message"]
            assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200
        wait_idle(server)
        assert records.noisy() == []


# -- 10: clients that hang up ------------------------------------------------------------------------------------
def test_a_client_that_hangs_up_waiting_for_a_whole_reply_logs_nothing(model_dir):
    engine = load(model_dir)
    engine.eos_ids.clear()
    gate, decode_step, calls = threading.Event(), engine.model.decode_step, []

    def held(*args):  # the request is still generating when its client leaves
        calls.append(1)
        if len(calls) >= 2:
            assert gate.wait(TIMEOUT)
        return decode_step(*args)

    engine.model.decode_step = held
    allocator = engine.cache.allocator
    with live_server(engine) as (url, server, records):
        try:
            body = json.dumps(chat_body(max_tokens=200)).encode()
            with socket.create_connection(address(url), timeout=TIMEOUT) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                          b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                wait_until(lambda: allocator.num_free < allocator.num_blocks, "the request never ran")
            wait_idle(server)
        finally:
            gate.set()
        assert records.noisy() == []


def test_a_client_that_hangs_up_mid_body_logs_nothing(model_dir):
    with live_server(load(model_dir)) as (url, server, records):
        with socket.create_connection(address(url), timeout=TIMEOUT) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"messages\": ")
            wait_until(lambda: server.server_state.tasks, "the request never began")
        wait_idle(server)
        assert records.noisy() == []


# -- 4: web pages ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scheduler(model_dir):
    scheduler = Scheduler(load(model_dir), max_running=1, max_waiting=2).start()
    yield scheduler
    scheduler.close()


def test_a_foreign_host_on_a_loopback_bind_is_refused(scheduler):
    # DNS rebinding: a page at http://evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example
    client = TestClient(create_app(scheduler), base_url=LOOPBACK)
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil.example:8080"):
        r = client.get("/v1/models", headers={"Host": host})
        assert r.status_code == 403, host
        assert r.json()["error"]["code"] == "host_not_allowed"
    for host in ("127.0.0.1:8080", "localhost:8080", "LocalHost", "127.0.0.1", "[::1]:8080", "[::1]", "localhost:1"):
        assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_a_foreign_host_is_taken_by_a_server_bound_beyond_loopback(scheduler):
    # a bind other than loopback needs a key, which a page does not have; the Host is then the machine's name, also
    # where that name resolves to a loopback address (Debian's 127.0.1.1)
    client = TestClient(create_app(scheduler), base_url="http://192.168.1.20:8080")
    assert client.get("/v1/models", headers={"Host": "my-box.lan:8080"}).status_code == 200
    client = TestClient(create_app(scheduler, loopback_bind=False), base_url="http://127.0.1.1:8080")
    assert client.get("/v1/models", headers={"Host": "my-box:8080"}).status_code == 200


def test_a_page_cannot_unload_or_load_or_chat_with_text_plain_or_a_foreign_origin(scheduler):
    unloads = []
    client = TestClient(create_app(scheduler, on_unload=lambda: unloads.append(True)), base_url=LOOPBACK)
    page = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    for path, body in (("/stowage/unload", ""), ("/stowage/load", '{"model": "other"}'),
                       ("/v1/chat/completions", json.dumps(chat_body()))):
        r = client.post(path, content=body, headers=page)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", path
        r = client.post(path, content=body, headers={**page, "Content-Type": "application/json"})
        assert r.status_code == 403, path
        r = client.post(path, content=body, headers={"Content-Type": "text/plain"})  # no Origin: an older browser
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", path
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert client.post("/v1/chat/completions", content="a=1", headers=form).status_code == 415
    assert client.get("/v1/models", headers={"Origin": "null"}).status_code == 403  # a sandboxed page
    assert unloads == []
    # the server's own origin, JSON with a charset, and an unload without a body stay fine
    own = client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": LOOPBACK})
    assert own.status_code == 200, own.text
    charset = client.post("/v1/chat/completions", content=json.dumps(chat_body()),
                          headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert charset.status_code == 200, charset.text
    assert client.post("/stowage/unload").status_code == 202 and unloads == [True]


def test_an_origin_given_with_cors_origin_may_call_it_and_gets_cors_headers(scheduler):
    page = "https://chat.example:8443"
    client = TestClient(create_app(scheduler, cors_origins=(page,)), base_url=LOOPBACK)
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == page
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    r = client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": page})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    for other in ("https://evil.example", "http://chat.example:8443", "https://chat.example"):
        assert client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": other}).status_code == 403
        assert client.options("/v1/chat/completions", headers={
            "Origin": other, "Access-Control-Request-Method": "POST"}).status_code == 403


def test_a_unix_socket_takes_any_host(model_dir, tmp_path):
    # no browser connects to a socket file; its clients name it as they like (RemoteServer: localhost)
    path = tmp_path / "s.sock"
    with live_server(load(model_dir), unix=path) as (_, _, _):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://evil.example",
                          timeout=TIMEOUT) as http:
            assert http.get("/v1/models").status_code == 200


def test_a_live_loopback_server_refuses_a_rebound_host(model_dir):
    with live_server(load(model_dir)) as (url, _, _), httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert http.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403
        assert http.get("/v1/models").status_code == 200


def test_cors_origin_is_repeatable_and_must_be_an_origin(model_dir, capsys):
    parse = build_parser().parse_args
    args = parse(["serve", str(model_dir), "--cors-origin", "https://Chat.Example:8443", "--cors-origin",
                  "http://localhost:5173/"])
    assert args.cors_origins == ["https://chat.example:8443", "http://localhost:5173"]
    assert parse(["serve", str(model_dir)]).cors_origins == []
    for bad in ("*", "chat.example", "https://chat.example/app", "ftp://chat.example", "https://user@chat.example"):
        with pytest.raises(SystemExit):
            parse(["serve", str(model_dir), "--cors-origin", bad])
        assert "--cors-origin" in capsys.readouterr().err


# -- the bearer scheme is case-insensitive (RFC 7235) ------------------------------------------------------------
def test_the_bearer_scheme_is_taken_in_any_case(scheduler):
    client = TestClient(create_app(scheduler, api_key="s3cret"))
    for header in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR  s3cret"):
        assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
    for header in ("Basic s3cret", "bearer s3cre", "bearers3cret", "s3cret", "bearer", "bearer s3cret x"):
        assert client.get("/v1/models", headers={"Authorization": header}).status_code == 401, header


# -- review: a tool_choice naming no string ----------------------------------------------------------------------
@pytest.mark.parametrize("name", [["f"], {"a": 1}, 3, None])
def test_a_tool_choice_whose_name_is_not_a_string_is_a_400(scheduler, name):
    # before: a list or object as the function name raised TypeError (unhashable) inside the check: a 500
    client = TestClient(create_app(scheduler), base_url=LOOPBACK, raise_server_exceptions=False)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = client.post("/v1/chat/completions", json=chat_body(tools=[tool], tool_choice={
        "type": "function", "function": {"name": name}}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice"
