"""decode_layer.c's experts for one lane, then several (a request alone, then a batch): the per-pair buffers
(ensure_pairs, the process's) grow between the calls, and every lane still gets the torch path's logits."""

import pytest
from factory import cpu_plan
from moe_factory import make_moe_model

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.kernels import cpu_decode

PROMPTS = ["The quick brown fox", "Stowage plans memory: weights, KV cache", "Café 東京 🚀", "one two three four"]


@pytest.mark.parametrize("top_k", [2, 5])
def test_one_lane_then_four_route_as_the_torch_path(tmp_path, top_k):
    if cpu_decode.current() is None:
        pytest.skip("no native decode library here")
    model_dir = make_moe_model(tmp_path, "qwen3_moe", num_experts_per_tok=top_k)
    engine = Engine.load(model_dir, cpu_plan(model_dir, 128, num_seqs=4))
    native = engine.model.native(engine.cache)
    assert native is not None
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    runs = {}
    for path in ("native", "torch"):
        engine.model._native_for = (engine.cache, native if path == "native" else None)
        seqs = [Sequence() for _ in prompts]
        tokens = [engine.model.forward(ids, s, engine.cache)[-1].argmax().item() for ids, s in zip(prompts, seqs)]
        # one lane alone, then all four: the same tokens on both paths (the native path's choices)
        steps = [engine.model.decode_step(tokens[:1], seqs[:1], engine.cache)]
        tokens[0] = (runs["native"] if path == "torch" else steps)[0].argmax(-1).item()
        steps.append(engine.model.decode_step(tokens, seqs, engine.cache))
        runs[path] = steps
    for ours, theirs in zip(runs["native"], runs["torch"], strict=True):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= 1e-4
