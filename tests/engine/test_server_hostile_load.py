"""POST /stowage/load asked for what cannot be served (issue 31): it is refused before the model served is unloaded,
and a file that cannot be read is the client's 400. In-process, on a fake machine whose free RAM is what the
engines loaded leave of it."""

import json
import struct

import pytest
from factory import cpu_plan, make_model
from starlette.testclient import TestClient

from stowage.engine.formats.discovery import Places
from stowage.engine.planning import PlanRequest, inspect, plan
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.runtime.engine import Engine
from stowage.engine.server import serving as serving_module
from stowage.engine.server.app import create_app
from stowage.engine.server.serving import LoadDefaults, Served, Serving
from stowage.engine.serving.scheduler import Scheduler

CONTEXT = 128  # alpha as served at first
GiB = 1 << 30


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-load") / "models"
    make_model(root / "alpha", "llama", initializer_range=0.2)
    (root / "empty.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # a header of no keys, no tensors
    return root


def cpu_bytes(planned) -> int:
    return planned.device("cpu").total_bytes


@pytest.fixture
def machine(monkeypatch):
    """This machine as the server sees it: `ram` bytes of RAM, less what the model served holds."""
    state = {"ram": 64 * GiB, "serving": None}

    def budgets():
        served = state["serving"].current if state["serving"] is not None else None
        held = cpu_bytes(served.engine.plan) if served is not None else 0
        return given_budgets([], state["ram"] - held, ram_reserve_bytes=0)

    monkeypatch.setattr(serving_module, "detect_budgets", budgets)
    return state


@pytest.fixture
def server(models, machine):
    """A TestClient on a Serving of alpha (128 tokens) that may load what `models` holds; and the Serving."""
    engine = Engine.load(models / "alpha", cpu_plan(models / "alpha", CONTEXT))
    serving = Serving(Served("alpha", Scheduler(engine, max_running=1, max_waiting=2).start()),
                      LoadDefaults(Places(stowage_models=models), parallel=1, max_queue=2))
    machine["serving"] = serving
    yield TestClient(create_app(serving)), serving
    serving.close()


def events(response) -> list:
    assert response.status_code == 200, response.text
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def assert_still_served(client, context_tokens=CONTEXT):
    (model,) = client.get("/v1/models").json()["data"]
    assert model["id"] == "alpha" and model["max_model_len"] == context_tokens
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("body, words", [
    ({"context_tokens": 10**12}, "positions"),  # longer than the model's 1,024 positions
    ({"context_tokens": 2048}, "positions"),
    ({"context_tokens": 256, "parallel": 4096}, "prefill chunk"),
])
def test_what_no_memory_makes_fit_is_a_400_and_the_model_stays(server, body, words):
    client, serving = server
    r = client.post("/stowage/load", json={"model": "alpha", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    assert_still_served(client)
    assert serving.loading is None  # the load is over: another may begin


def test_a_plan_that_does_not_fit_even_once_the_model_is_gone_leaves_it_served(server, machine, models):
    client, _ = server
    wanted = cpu_bytes(plan(inspect(models / "alpha"), PlanRequest(1024), given_budgets([], 64 * GiB)))
    machine["ram"] = wanted - 1  # one byte short with alpha unloaded
    (error,) = events(client.post("/stowage/load", json={"model": "alpha", "context_tokens": 1024}))
    assert error["error"]["code"] == "insufficient_memory"
    assert "alpha" in error["error"]["message"] and "still served" in error["error"]["message"]
    assert_still_served(client)


def test_a_plan_that_fits_once_the_model_is_gone_loads(server, machine, models):
    client, serving = server
    wanted = cpu_bytes(plan(inspect(models / "alpha"), PlanRequest(1024), given_budgets([], 64 * GiB)))
    machine["ram"] = wanted  # fits exactly, once alpha's 128 tokens are unloaded; not beside them
    assert wanted > machine["ram"] - cpu_bytes(serving.current.engine.plan)
    stream = events(client.post("/stowage/load", json={"model": "alpha", "context_tokens": 1024}))
    assert stream[0]["stage"] == "unloading alpha" and "loaded" in stream[-1], stream[-1]
    assert_still_served(client, context_tokens=1024)


def test_a_gguf_with_an_empty_header_is_the_clients_400_with_the_reason(server):
    client, serving = server
    assert "empty" in [m["id"] for m in client.get("/stowage/models").json()["data"]]
    r = client.post("/stowage/load", json={"model": "empty"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "architecture" in error["message"]
    assert_still_served(client)
    assert serving.loading is None
