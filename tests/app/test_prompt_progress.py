"""The engine's prefill progress, as the prompt bar reads it: (tokens computed, tokens to compute) per chunk."""

from engine.engine import Engine
from engine.planning import plan_for
from engine.sampler import SamplingParams
from app.prompt_progress import format_seconds


def test_progress_comes_after_each_chunk_and_leaves_out_the_cached_prefix(tiny_model_dir):
    engine = Engine.load(tiny_model_dir, plan_for(tiny_model_dir, 512, prefill_chunk=16))
    try:
        conv, calls = engine.new_conversation(), []
        prompt = list(range(3, 60))  # 57 tokens: chunks of 16, 16, 16, 9
        gen = engine.generate(conv, prompt, SamplingParams(temperature=0.0, max_tokens=1))
        gen.progress = lambda done, total: calls.append((done, total))
        gen.run()
        assert calls == [(16, 57), (32, 57), (48, 57), (57, 57)]
        calls.clear()
        longer = conv.seq.token_ids + list(range(60, 80))
        gen = engine.generate(conv, longer, SamplingParams(temperature=0.0, max_tokens=1))
        gen.progress = lambda done, total: calls.append((done, total))
        gen.run()
        assert calls[-1][0] == calls[-1][1] == gen.result.prefilled_tokens < len(longer)
    finally:
        engine.close()


def test_time_left_is_said_as_an_estimate():
    assert (format_seconds(0.2), format_seconds(12.4), format_seconds(150)) == ("about 1 s", "about 12 s", "about 2 min")
