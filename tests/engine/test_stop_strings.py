"""Stop strings (engine/runtime/generation.py StopMatcher, bounded by engine/runtime/sampler.py SamplingParams):
matched incrementally, at a cost linear in the text fed whatever their length, and at most 4 of 512 characters
(issue 31)."""

import random
import time

import pytest

from stowage.engine.errors import InvalidArgumentError
from stowage.engine.runtime.generation import StopMatcher
from stowage.engine.runtime.sampler import SamplingParams


def reference_feed(stops, pending, text):
    """The matcher's contract, computed the obvious (quadratic) way: the earliest stop string in the held text and
    the new, else everything but the longest tail that could start one."""
    pending += text
    hits = [i for i in (pending.find(s) for s in stops) if i >= 0]
    if hits:
        return pending[: min(hits)], True, ""
    hold = max((k for s in stops for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
    return pending[: len(pending) - hold], False, pending[len(pending) - hold:]


def test_the_stop_matcher_agrees_with_the_obvious_rule_on_random_text():
    rng = random.Random(31)
    for _ in range(2000):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
        matcher, pending = StopMatcher(stops), ""
        for _ in range(rng.randint(1, 12)):
            text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            want, met, pending = reference_feed(stops, pending, text)
            assert matcher.feed(text) == (want, met), (stops, text)
            if met:
                break
        else:
            assert matcher.flush() == pending


def test_the_stop_matchers_cost_does_not_grow_with_the_square_of_the_stop_length():
    # Four stop strings of 40,000 characters, each one character short of matching the text: the tail held back
    # grows to 39,999 characters. Comparing every prefix of every stop at every token (O(sum of len^2) a token)
    # took ~5 s for these 30 tokens; matching incrementally, ~0.1 s (the work of 4 stops x 1,400 new characters a
    # token), so the bound holds on a loaded machine.
    n = 40_000
    matcher = StopMatcher(tuple("a" * (n - 1) + c for c in "bcde"))
    start = time.perf_counter()
    shown = [matcher.feed("a" * 1400) for _ in range(30)]
    assert all(not met for _, met in shown)
    assert sum(len(text) for text, _ in shown) == 30 * 1400 - (n - 1)  # all but the tail that could start a stop
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("stop,message", [
    (("x",) * 5, r"at most 4 stop strings, got 5"),
    (("a" * 10_000,), r"stop string 1 has 10,000 characters; at most \d+"),
])
def test_stop_strings_are_bounded_in_count_and_length(stop, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(stop=stop)


def test_the_servers_400_says_the_stop_bounds():
    from stowage.engine.server.schemas import ApiError, parse_chat

    body = {"messages": [{"role": "user", "content": "hi"}]}
    for stop in (["x"] * 5, ["a" * 10_000]):
        with pytest.raises(ApiError) as e:
            parse_chat(body | {"stop": stop})
        assert e.value.status == 400 and e.value.param == "stop"
        assert "at most 4 strings of at most" in e.value.message
    assert parse_chat(body | {"stop": ["x"] * 4}).params.stop == ("x",) * 4
