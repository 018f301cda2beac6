"""The prompt bar's estimate; the engine's prefill progress it reads is tested in tests/engine/test_generation.py."""

from stowage.app.prompt_progress import format_seconds


def test_time_left_is_said_as_an_estimate():
    assert (format_seconds(0.2), format_seconds(12.4), format_seconds(150)) == ("about 1 s", "about 12 s", "about 2 min")
