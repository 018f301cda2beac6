"""Continuous batching on a real tiny model: the scheduler thread, the batched decode step, chunked prefill, cancel."""

import threading

import pytest
import torch
from factory import cpu_plan, make_model
from scheduler_log import Log

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.generation import GenerationResult
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.serving.scheduler import Scheduler



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("batching"), "llama", initializer_range=0.2)


def load(model_dir, *, parallel=2, context=256, **request):
    engine = Engine.load(model_dir, cpu_plan(model_dir, context, num_seqs=parallel, **request))
    engine.eos_ids.clear()  # replies run to max_tokens: lengths known in advance
    return engine


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n)


def alone(engine, prompt_ids, n):
    """Token ids of a greedy reply by the engine's own single-sequence path (engine.generate)."""
    return engine.generate(prompt_ids, greedy(n)).run().token_ids


def record_calls(engine):
    """Wrap the model: a list of ("prefill", seq, n) and ("decode", seqs) in call order."""
    calls, model = [], engine.model
    forward, decode_step = model.forward, model.decode_step

    def recording_forward(token_ids, seq, cache, *a, **k):
        calls.append(("prefill", seq, len(token_ids)))
        return forward(token_ids, seq, cache, *a, **k)

    def recording_decode(token_ids, seqs, cache):
        calls.append(("decode", list(seqs)))
        return decode_step(token_ids, seqs, cache)

    model.forward, model.decode_step = recording_forward, recording_decode
    return calls


def test_decode_step_matches_one_sequence_at_a_time(model_dir):
    engine = load(model_dir, parallel=3)
    model, cache = engine.model, engine.cache
    prompts = [[1, 5, 9, 22, 31], list(range(40, 60)), [1, 3]]  # different lengths: block tables of different sizes
    batched, single = [Sequence() for _ in prompts], [Sequence() for _ in prompts]
    for p, b, s in zip(prompts, batched, single):
        model.forward(p, b, cache)
        model.forward(p, s, cache)
    tokens = [70, 71, 72]
    for _ in range(20):  # past a block boundary (16) for the shortest
        logits = model.decode_step(tokens, batched, cache)
        reference = torch.cat([model.forward([t], s, cache) for t, s in zip(tokens, single)])
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        assert logits.shape == (3, engine.config.vocab_size)
        tokens = reference.argmax(-1).tolist()
    assert [s.token_ids for s in batched] == [s.token_ids for s in single]


def test_requests_share_decode_steps_join_and_leave_and_match_alone(model_dir):
    engine = load(model_dir)
    a_ids, b_ids = engine.tokenizer.encode("Stowage plans memory"), engine.tokenizer.encode("The quick brown fox")
    expected = {"A": alone(load(model_dir), a_ids, 8), "B": alone(load(model_dir), b_ids, 14)}
    scheduler = Scheduler(engine, max_running=2, max_waiting=0)
    calls, log = record_calls(engine), Log()
    seen_a = []

    def b_joins_after_three(event):  # on the scheduler thread, between two steps' tokens
        seen_a.append(event)
        if len(seen_a) == 3:
            scheduler.submit(b_ids, greedy(14), log.emitter("B"), threading.Event())

    scheduler.submit(a_ids, greedy(8), log.emitter("A", then=b_joins_after_three), threading.Event())
    scheduler.start()
    try:
        a, b = log.wait("A", "B")
    finally:
        scheduler.close()
    assert a.token_ids == expected["A"] and b.token_ids == expected["B"]
    assert a.finish_reason == b.finish_reason == "length"
    sizes = [len(c[1]) for c in calls if c[0] == "decode"]
    # A alone, then A and B in one step each, then B alone once A has left
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1
    assert sizes.count(2) >= 3
    order = log.order()
    first_b, last_a = order.index("B"), len(order) - 1 - order[::-1].index("A")
    assert first_b < last_a  # B streamed while A was still streaming
    assert "A" in order[first_b:last_a] and "B" in order[first_b:last_a]


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_decode_steps(model_dir):
    engine = load(model_dir, prefill_chunk=8)
    short = engine.tokenizer.encode("Hi")
    long = engine.tokenizer.encode(" ".join(["Pick a context size with the slider"] * 6))
    assert len(long) > 5 * 8
    expected = alone(load(model_dir, prefill_chunk=8), long, 4)
    scheduler = Scheduler(engine, max_running=2, max_waiting=0)
    calls, log = record_calls(engine), Log()
    started = []

    def long_joins(event):
        started.append(event)
        if len(started) == 1:
            scheduler.submit(long, greedy(4), log.emitter("long"), threading.Event())

    scheduler.submit(short, greedy(30), log.emitter("short", then=long_joins), threading.Event())
    scheduler.start()
    try:
        _, result = log.wait("short", "long")
    finally:
        scheduler.close()
    assert result.token_ids == expected and result.prefilled_tokens == len(long)
    long_seq = next(c[1] for c in calls if c[0] == "prefill" and c[2] == 8)
    chunks = [i for i, c in enumerate(calls) if c[0] == "prefill" and c[1] is long_seq]
    assert len(chunks) == -(-len(long) // 8)
    # between every two chunks of the long prompt, the short reply took a decode step
    for i, j in zip(chunks, chunks[1:]):
        assert any(c[0] == "decode" for c in calls[i + 1 : j]), calls[i:j]


def test_cancel_stops_a_request_and_frees_its_blocks(model_dir):
    engine = load(model_dir)
    cancel = threading.Event()
    log = Log()
    count = []

    def cancel_after_three(event):
        count.append(event)
        if len(count) == 3:
            cancel.set()

    scheduler = Scheduler(engine, max_running=2, max_waiting=0).start()
    try:
        scheduler.submit(engine.tokenizer.encode("Stowage plans memory"), greedy(200),
                         log.emitter("A", then=cancel_after_three), cancel)
        (result,) = log.wait("A")
    finally:
        scheduler.close()
    assert isinstance(result, GenerationResult) and result.finish_reason == "cancelled"
    assert len(result.token_ids) < 10
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks
    assert scheduler.pool.num_idle == 0


def test_cached_conversations_are_reused_and_evicted_least_recently_used_first(model_dir):
    # room for two sequences of 64 tokens: 8 blocks of 16
    engine = load(model_dir, context=64)
    scheduler = Scheduler(engine, max_running=2, max_waiting=0).start()
    log = Log()
    # 31 tokens each, nothing in common but the first: with 8 more tokens, 3 blocks each
    prompts = {"a": [1, *range(10, 40)], "b": [1, *range(50, 80)], "c": [1, *range(90, 120)]}

    def run(name, key):
        scheduler.submit(prompts[key], greedy(8), log.emitter(name), threading.Event())
        return log.wait(name)[0]

    try:
        first = [run("a1", "a"), run("b1", "b")]  # both stay cached: 6 of the 8 blocks
        again_b = run("b2", "b")
        c = run("c1", "c")  # needs blocks that only evicting one idle conversation gives: a's (least recent)
        again_b2, again_a = run("b3", "b"), run("a2", "a")
    finally:
        scheduler.close()
    assert [r.reused_tokens for r in first] == [0, 0] and c.reused_tokens == 0
    assert again_b.reused_tokens == len(prompts["b"]) - 1  # the whole prompt but the token whose logits are needed
    assert again_b2.reused_tokens == len(prompts["b"]) - 1  # still cached after c
    assert again_a.reused_tokens == 0  # evicted for c
    assert again_b.token_ids == first[1].token_ids  # reuse changes nothing in the reply
    assert engine.stats.reused_tokens == 2 * (len(prompts["b"]) - 1)
