"""The context slider's scale: logarithmic positions mapped to token counts in whole KV blocks."""

from __future__ import annotations

import math

SLIDER_STEPS = 1000
MIN_CONTEXT = 512


def snap(tokens: int, block_size: int, lo: int, hi: int, *, up: bool = False) -> int:
    """Round to whole blocks (a partial block costs as much as a full one) and clamp to [lo, hi].

    Nearest (halves up) for slider positions; `up` for a typed number, which asks for at least that many.
    """
    tokens = max(lo, min(hi, tokens))
    blocks = -(-tokens // block_size) if up else (2 * tokens + block_size) // (2 * block_size)
    snapped = max(block_size, blocks * block_size)
    # `hi` may itself not be whole blocks (a model's max position); the clamp wins over the snap.
    return max(lo, min(hi, snapped))


def position_to_tokens(position: int, lo: int, hi: int, block_size: int, steps: int = SLIDER_STEPS) -> int:
    """Slider position in [0, steps] -> tokens, log-spaced between lo and hi; the ends map exactly."""
    if hi <= lo or position >= steps:
        return hi
    if position <= 0:
        return lo
    tokens = lo * math.exp(math.log(hi / lo) * position / steps)
    return snap(int(round(tokens)), block_size, lo, hi)


def tokens_to_position(tokens: int, lo: int, hi: int, steps: int = SLIDER_STEPS) -> int:
    """Inverse of `position_to_tokens` (to the nearest position); beyond `hi` pins to the top."""
    if hi <= lo or tokens >= hi:
        return steps
    if tokens <= lo:
        return 0
    return int(round(steps * math.log(tokens / lo) / math.log(hi / lo)))
