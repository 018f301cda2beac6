"""Sampling, stop conditions, streaming and cancel on a real tiny model."""

import threading

import pytest
import torch
from factory import make_model

from stowage.engine.runtime.engine import Engine
from factory import cpu_plan
from stowage.engine.runtime.generation import StopMatcher
from stowage.engine.runtime.sampler import Sampler, SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = make_model(tmp_path_factory.mktemp("gen"), "llama", initializer_range=0.2)
    return Engine.load(d, cpu_plan(d, 512))


def prompt(engine):
    return engine.tokenizer.encode("Stowage plans memory")


def test_seed_makes_sampling_reproducible(engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=7)
    a = engine.generate(prompt(engine), p).run().token_ids
    b = engine.generate(prompt(engine), p).run().token_ids
    c = engine.generate(prompt(engine), SamplingParams(temperature=1.0, max_tokens=20, seed=8)).run().token_ids
    assert a == b and a != c


def test_sampler_filters():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    assert Sampler(SamplingParams(temperature=0))(logits) == 4
    draws = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits) for s in range(60)}
    assert draws == {3, 4}
    # p(4) = 0.64, p(3) = 0.24: top_p 0.5 keeps only the most likely token
    assert {Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s))(logits) for s in range(30)} == {4}
    # min_p 0.3: tokens with p < 0.3 * 0.64 (that is, 0 .. 2) are dropped
    assert {Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=s))(logits) for s in range(60)} == {3, 4}
    # a penalty of 10 on token 4 makes token 3 the greedy choice
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=10.0))(logits, torch.tensor([4])) == 3


def test_eos_stops_generation(engine):
    greedy = SamplingParams(temperature=0, max_tokens=5)
    first = engine.generate(prompt(engine), greedy).run().token_ids[0]
    engine.eos_ids.add(first)
    try:
        r = engine.generate(prompt(engine), greedy).run()
    finally:
        engine.eos_ids.discard(first)
    assert r.finish_reason == "stop" and r.token_ids == []


def test_stop_string_truncates_and_streams_consistently(engine):
    free = engine.generate(prompt(engine), SamplingParams(temperature=0, max_tokens=30)).run()
    stop = free.text[5:8]
    assert len(stop) == 3
    gen = engine.generate(prompt(engine),
                          SamplingParams(temperature=0, max_tokens=30, stop=(stop,)))
    streamed = "".join(e.text for e in gen)
    assert gen.result.finish_reason == "stop"
    assert streamed == gen.result.text == free.text[: free.text.find(stop)]


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(("END",))
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)
    assert m.feed("yEND tail") == ("y", True)


def test_cancel_stops_mid_generation(engine):
    cancel = threading.Event()
    gen = engine.generate(prompt(engine),
                          SamplingParams(temperature=1.0, max_tokens=200, seed=1), cancel=cancel)
    count = 0
    for _ in gen:
        count += 1
        if count == 3:
            cancel.set()
    assert gen.result.finish_reason == "cancelled"
    assert len(gen.result.token_ids) < 10


def test_context_full_ends_the_reply(tmp_path):
    d = make_model(tmp_path, "llama", initializer_range=0.2)
    engine = Engine.load(d, cpu_plan(d, 20, block_size=4))
    r = engine.generate(engine.tokenizer.encode("Stowage plans memory"),
                        SamplingParams(temperature=0, max_tokens=100)).run()
    assert r.finish_reason == "context_full"
    # the prompt and the reply fill the context's 20 tokens: the next turn can feed the whole reply back
    assert r.prompt_tokens + len(r.token_ids) == 20


def test_second_turn_prefills_only_new_tokens(engine):
    history = [{"role": "user", "content": "word " * 200}]
    first = engine.chat(history, SamplingParams(temperature=0, max_tokens=8)).run()
    before = engine.stats.prefilled_tokens
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and?"}]
    second = engine.chat(history, SamplingParams(temperature=0, max_tokens=8)).run()
    assert first.prefilled_tokens > 200
    assert second.prefilled_tokens < 30
    assert engine.stats.prefilled_tokens - before == second.prefilled_tokens


def test_prefill_progress_comes_after_each_chunk_and_leaves_out_the_cached_prefix(tmp_path):
    model_dir = make_model(tmp_path / "m", "llama")
    engine = Engine.load(model_dir, cpu_plan(model_dir, 512, prefill_chunk=16))
    calls = []
    prompt = list(range(3, 60))  # 57 tokens: chunks of 16, 16, 16, 9
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    gen = engine.generate(prompt, greedy, progress=lambda done, total: calls.append((done, total)))
    gen.run()
    assert calls == [(16, 57), (32, 57), (48, 57), (57, 57)]
    calls.clear()
    longer = prompt + list(range(60, 80))  # what the cache holds (the one token sampled was not fed), and more
    gen = engine.generate(longer, greedy, progress=lambda done, total: calls.append((done, total)))
    gen.run()
    assert calls[-1][0] == calls[-1][1] == gen.result.prefilled_tokens < len(longer)
    calls.clear()
    engine.chat([{"role": "user", "content": "hello " * 20}], greedy,
                progress=lambda done, total: calls.append((done, total))).run()
    assert calls and calls[-1][0] == calls[-1][1]


@pytest.mark.parametrize("spread", [0.01, 1.0, 8.0])  # flat (the candidates hold < top_p: the full sort), to peaked
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_keeps_the_same_set_as_a_full_sort(spread, top_p):
    from stowage.engine.runtime.sampler import _nucleus

    probs = torch.softmax(torch.randn(50_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
                          * spread, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    expected = probs.scatter(0, order, sorted_probs.masked_fill(sorted_probs.cumsum(0) - sorted_probs >= top_p, 0.0))
    assert torch.equal(_nucleus(probs, top_p), expected)
