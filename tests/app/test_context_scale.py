from stowage.app.context_scale import SLIDER_STEPS, position_to_tokens, snap, tokens_to_position


def test_ends_map_exactly_and_steps_are_whole_blocks():
    lo, hi, block = 512, 20_000, 16
    assert position_to_tokens(0, lo, hi, block) == lo
    assert position_to_tokens(SLIDER_STEPS, lo, hi, block) == hi
    values = [position_to_tokens(p, lo, hi, block) for p in range(SLIDER_STEPS + 1)]
    assert values == sorted(values)
    assert all(v % block == 0 for v in values[:-1])


def test_log_feel_middle_is_the_geometric_mean():
    # Half way along the slider is sqrt(512 * 131072) = 8192 tokens, not the arithmetic middle.
    assert position_to_tokens(SLIDER_STEPS // 2, 512, 131_072, 16) == 8192


def test_roundtrip_and_clamp():
    lo, hi = 512, 32_768
    for tokens in (512, 1024, 4096, 16_384, 32_768):
        assert abs(position_to_tokens(tokens_to_position(tokens, lo, hi), lo, hi, 16) - tokens) <= tokens * 0.01
    assert tokens_to_position(100_000, lo, hi) == SLIDER_STEPS
    assert snap(1001, 16, 512, 4096) == 1008 == snap(1000, 16, 512, 4096)  # 62.5 blocks: halves go up
    assert snap(1009, 16, 512, 4096) == 1008 and snap(1009, 16, 512, 4096, up=True) == 1024
    assert snap(5000, 16, 512, 4090) == 4090
