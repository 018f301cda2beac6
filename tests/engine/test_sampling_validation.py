"""Sampling values are checked when they are made, finite numbers only; the sampler never turns scores into NaN."""

import math

import pytest
import torch

from stowage.engine.errors import InvalidArgumentError, ModelFormatError
from stowage.engine.runtime.sampler import Sampler, SamplingParams


@pytest.mark.parametrize("values,message", [
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"temperature": math.nan}, "temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, "temperature must be a finite number, got inf"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 2.0}, r"top_p must be in \(0, 1\], got 2.0"),
    ({"top_p": math.nan}, "top_p must be a finite number"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": math.nan}, "repetition_penalty must be a finite number, got nan"),
    ({"repetition_penalty": -math.inf}, "repetition_penalty must be a finite number"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"seed": -1}, "seed must be an integer"),
    ({"seed": 2**64}, "seed must be an integer"),
    ({"stop": ["x"]}, "stop must be a tuple of strings"),
])
def test_out_of_range_values_are_refused(values, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(**values)


def test_the_error_is_still_a_value_error():
    # callers that caught ValueError before (the app's settings) keep working
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def test_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1, min_p=1.0, top_k=0, max_tokens=1, seed=2**64 - 1)


def test_a_tiny_temperature_picks_the_best_token_instead_of_nan():
    logits = torch.tensor([1.0, 3.0, 2.0, -50.0])
    # logits / 1e-300 overflows to inf, and softmax of inf is NaN; shifting by the maximum first cannot overflow
    picks = {Sampler(SamplingParams(temperature=1e-300, seed=s))(logits) for s in range(5)}
    assert picks == {1}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_scores_are_a_typed_error(bad):
    logits = torch.tensor([1.0, bad, 2.0])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=0)):
        with pytest.raises(ModelFormatError, match="NaN or infinite scores"):
            Sampler(params)(logits)


def test_draws_follow_the_probabilities_and_never_pick_a_zero():
    # engine.sampler.draw replaces torch.multinomial: 40,000 draws land on each token in proportion (within 5
    # standard deviations), and the zeros (first, inside, last) are never drawn
    from stowage.engine.runtime.sampler import draw

    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.25, 0.05, 0.0], dtype=torch.float64) * 3.0  # not normalized
    generator, n = torch.Generator().manual_seed(0), 40_000
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(n)]), minlength=probs.numel())
    p = probs / probs.sum()
    assert counts[p == 0].sum() == 0
    sigma = (n * p * (1 - p)).sqrt()
    assert bool(((counts - n * p).abs() <= 5 * sigma + 1).all()), counts.tolist()


def test_a_huge_integer_is_a_float_or_a_typed_error():
    # found by the server fuzz: repetition_penalty 2**64 passed the checks and overflowed in torch (a 500)
    import torch

    from stowage.engine.runtime.sampler import Sampler

    params = SamplingParams(repetition_penalty=2**64, temperature=0)
    assert params.repetition_penalty == float(2**64) and isinstance(params.repetition_penalty, float)
    assert Sampler(params)(torch.tensor([0.5, 2.0, -1.0]), torch.tensor([1])) in (0, 1, 2)
    with pytest.raises(InvalidArgumentError, match="finite number"):
        SamplingParams(repetition_penalty=10**400)
