"""One generation loop: a reply in process (Engine.generate) and a reply served over HTTP run the same scheduler step,
so they give the same tokens and end for the same reason, at every stop condition and at a full context."""

import json
import threading

import pytest
from factory import cpu_plan, make_model
from scheduler_log import Log
from starlette.testclient import TestClient

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.generation import TokenEvent
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.server.app import create_app
from stowage.engine.serving.scheduler import Scheduler

CONTEXT = 64  # tokens: small enough that a reply reaches its end
PROMPT = [3 + (7 * i) % 500 for i in range(20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("one-loop"), "llama", initializer_range=0.2)


def load(model_dir):
    engine = Engine.load(model_dir, cpu_plan(model_dir, CONTEXT))
    engine.eos_ids.clear()  # a random model: EOS only where a test puts it
    return engine


@pytest.fixture(scope="module")
def engine(model_dir):
    """The in-process engine."""
    return load(model_dir)


@pytest.fixture(scope="module")
def served(model_dir):
    """A server over another engine of the same plan: its TestClient, its scheduler and its engine."""
    engine = load(model_dir)
    scheduler = Scheduler(engine, max_running=1, max_waiting=2).start()
    yield TestClient(create_app(scheduler)), scheduler, engine
    scheduler.close()


def in_process(engine, prompt_ids, **sampling):
    """(streamed text, result) of a greedy reply in process."""
    gen = engine.generate(prompt_ids, SamplingParams(temperature=0, **sampling))
    return "".join(e.text for e in gen), gen.result


def over_http(client, prompt_ids, **fields):
    """(streamed text, the engine's figures of the last chunk: token_ids, finish_reason) of a greedy served reply."""
    body = {"prompt": prompt_ids, "temperature": 0, "stream": True, **fields}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks[-1]["stowage"]


def assert_same(engine, served, prompt_ids, **sampling):
    """The reply in process and over HTTP: the same tokens, text and reason; returns the in-process result."""
    client, _, _ = served
    text, result = in_process(engine, prompt_ids, **sampling)
    served_text, figures = over_http(client, prompt_ids, **sampling)
    assert figures["token_ids"] == result.token_ids
    assert figures["finish_reason"] == result.finish_reason
    assert served_text == text == result.text
    return result


def test_max_tokens(engine, served):
    result = assert_same(engine, served, PROMPT, max_tokens=8)
    assert result.finish_reason == "length" and len(result.token_ids) == 8


@pytest.mark.parametrize("prompt_tokens", [20, CONTEXT - 2, CONTEXT - 1])
def test_a_reply_that_reaches_the_context_end_fills_it_exactly(engine, served, prompt_tokens):
    # The prompt and the reply fill the context: every token shown fits when a chat feeds the reply back next turn
    # (a prompt one short of the context still gets its one token).
    prompt = [3 + (7 * i) % 500 for i in range(prompt_tokens)]
    result = assert_same(engine, served, prompt, max_tokens=1000)
    assert result.finish_reason == "context_full"
    assert result.prompt_tokens + len(result.token_ids) == CONTEXT


def test_max_tokens_that_also_fills_the_context_says_length(engine, served):
    result = assert_same(engine, served, PROMPT, max_tokens=CONTEXT - len(PROMPT))
    assert result.finish_reason == "length" and len(PROMPT) + len(result.token_ids) == CONTEXT


def test_eos(engine, served):
    _, free = in_process(engine, PROMPT, max_tokens=12)
    k = next(i for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i])
    eos = free.token_ids[k]
    for e in (engine, served[2]):
        e.eos_ids.add(eos)
    try:
        result = assert_same(engine, served, PROMPT, max_tokens=12)
    finally:
        for e in (engine, served[2]):
            e.eos_ids.discard(eos)
    assert result.finish_reason == "stop" and result.token_ids == free.token_ids[:k]


def test_stop_string(engine, served):
    _, free = in_process(engine, PROMPT, max_tokens=30)
    stop = free.text[5:8]
    assert len(stop) == 3
    result = assert_same(engine, served, PROMPT, max_tokens=30, stop=(stop,))
    assert result.finish_reason == "stop" and result.text == free.text[: free.text.find(stop)]


def test_cancel_after_three_tokens(engine, served):
    # Over HTTP a request is cancelled when its client hangs up; here the server's scheduler, as its handlers submit
    # to it, is cancelled at the third token, as the in-process reply is.
    _, scheduler, _ = served
    _, free = in_process(engine, PROMPT, max_tokens=40)
    cancel = threading.Event()
    gen = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), cancel=cancel)
    for i, _ in enumerate(gen):
        if i == 2:
            cancel.set()
    log, server_cancel, seen = Log(), threading.Event(), []

    def cancel_at_the_third(event):
        seen.append(event)
        if sum(isinstance(e, TokenEvent) for e in seen) == 3:
            server_cancel.set()

    scheduler.submit(PROMPT, SamplingParams(temperature=0, max_tokens=40), log.emitter("served", cancel_at_the_third),
                     server_cancel)
    (served_result,) = log.wait("served")
    assert gen.result.finish_reason == served_result.finish_reason == "cancelled"
    # (a token whose text is not complete yet sends no event: more tokens than events)
    assert gen.result.token_ids == served_result.token_ids == free.token_ids[: len(served_result.token_ids)]
    assert gen.result.text == served_result.text and len(served_result.token_ids) < 40


def test_leaving_an_in_process_reply_early_cancels_it(engine):
    _, free = in_process(engine, PROMPT, max_tokens=6)
    gen = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    events = iter(gen)
    next(events)
    events.close()  # the caller stops iterating: the reply ends, and the next one runs at once
    assert gen.result.finish_reason == "cancelled" and engine.scheduler.num_running == 0
    assert gen.result.token_ids == free.token_ids[: len(gen.result.token_ids)] and len(gen.result.token_ids) < 6
    _, again = in_process(engine, PROMPT, max_tokens=6)
    assert again.token_ids == free.token_ids
