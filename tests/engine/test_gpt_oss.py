"""gpt-oss from a Hugging Face folder against transformers (docs/moe.md, "gpt-oss"): attention sinks, alternating
sliding-window layers, biased routers and experts with the clamped SwiGLU, YaRN."""

import json
import math

import pytest
import torch
from factory import compare_logits_and_tokens, cpu_plan, edited_copy, greedy_reference, refused
from moe_factory import make_moe_model
from transformers import AutoModelForCausalLM

from stowage.engine.formats.config import ModelConfig
from stowage.engine.planning import inspect
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.runtime.rope import inverse_frequencies
from stowage.engine.runtime.sampler import SamplingParams

# longer than the sliding window (8 tokens): the sliding layers' masks and recycled blocks are exercised
PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "Stowage plans memory: weights, KV cache, workspace and headroom. Pick a context size with the slider;"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_the_config_is_read_as_transformers_reads_it(model_dir):
    config = ModelConfig.from_dir(model_dir)
    assert config.layer_windows == (8, None, 8, None)
    assert config.attention_sinks and config.moe_bias and config.softmax_after_topk
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    assert config.qkv_bias and config.o_bias and config.expert_intermediate_size == 64
    assert (config.rope.kind, config.rope.factor, config.rope.theta) == ("yarn", 32.0, 150000.0)
    assert config.rope.attention_factor == pytest.approx(0.1 * math.log(32) + 1)


def test_logits_match_transformers(model_dir, reference):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=5))
    assert engine.model.native(engine.cache) is None  # sinks and biased experts: the torch path runs it
    for prompt in PROMPTS:
        compare_logits_and_tokens(engine, reference, prompt, 1e-4, generate=False)


def test_greedy_tokens_identical_one_and_two_at_a_time(model_dir, reference):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=16, num_seqs=3))  # generate keeps one
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    expected = [greedy_reference(reference, ids, engine.eos_ids, 24) for ids in prompts]
    assert engine.generate(prompts[0], SamplingParams(temperature=0, max_tokens=24)).run().token_ids == expected[0]
    seqs = [Sequence(), Sequence()]
    last = [engine.model.forward(ids, s, engine.cache)[-1].argmax().item() for ids, s in zip(prompts, seqs)]
    got = [[t] for t in last]
    for _ in range(11):  # past the window: the sliding layers' oldest blocks are recycled under the batch
        last = engine.model.decode_step(last, seqs, engine.cache).argmax(-1).tolist()
        for g, t in zip(got, last):
            g.append(t)
    assert got == [e[:12] for e in expected]


def test_yarn_frequencies_are_transformers(model_dir):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        raw = json.loads((model_dir / "config.json").read_text())
        raw["rope_parameters"] = raw["rope_parameters"] | {"truncate": truncate, "factor": 8.0}
        theirs, scaling = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**{k: v for k, v in raw.items()
                                                                       if k != "model_type"}))
        rope = ModelConfig.from_dict(raw).rope
        assert torch.equal(inverse_frequencies(rope, 16), theirs)
        assert rope.attention_factor == scaling


def test_the_plan_counts_sinks_and_biases_where_they_run(model_dir):
    info = inspect(model_dir)
    names0 = info.layout.layers[0]
    assert names0["sinks"] == "model.layers.0.self_attn.sinks"
    assert names0["router_bias"] == "model.layers.0.mlp.router.bias"
    assert set(info.layout.experts[0]) == {"gate_up", "gate_up_bias", "down", "down_bias"}
    h, heads, kv, d, e, inter = 64, 4, 2, 16, 8, 64
    attention = h * heads * d * 2 + h * kv * d * 2 + heads * d + 2 * kv * d + h + heads  # q, o, k, v, biases, sinks
    layer = attention + 2 * h + e * h + e  # two norms, the router and its bias
    experts = e * (h * 2 * inter + 2 * inter + inter * h + h)
    assert info.layer_bytes() == (4 * layer,) * 4
    assert info.expert_bytes() == (4 * experts,) * 4
    # the sliding layers' cache holds their window (and a prefill chunk), not the context: what the cache allocates
    plan = cpu_plan(model_dir, 256, prefill_chunk=16)
    engine = Engine.load(model_dir, plan)
    assert engine.cache.num_bytes == plan.kv_bytes < 4 * 256 * 2 * kv * d * 4
    # the sinks run in the native attention where its library is (the reference elsewhere): planned as it runs
    assert plan.device("cpu").attention == engine.model.attention_kernels()["cpu"]


def test_the_load_maps_what_the_plan_counted(model_dir):
    plan = cpu_plan(model_dir, 64)
    report = Engine.load(model_dir, plan).memory_report()["cpu"]
    assert report["weights_copied"] == 0
    assert report["weights_mapped"] == plan.device("cpu").weights_bytes == inspect(model_dir).weights_bytes()


# -- bad input: typed errors naming the tensor, before anything is loaded --

def edited(model_dir, tmp_path, edit_tensors=None, **config):
    return edited_copy(model_dir, tmp_path / "bad", edit_tensors, **config)


def test_missing_sinks_are_named(model_dir, tmp_path):
    assert "model.layers.2.self_attn.sinks" in refused(
        edited(model_dir, tmp_path, lambda t: t.pop("model.layers.2.self_attn.sinks")))


def test_a_misshapen_fused_expert_tensor_is_named(model_dir, tmp_path):
    name = "model.layers.1.mlp.experts.gate_up_proj"

    def edit(t):
        t[name] = t[name][:, :, :100].clone()
    text = refused(edited(model_dir, tmp_path, edit))
    assert name in text and "[8, 64, 100]" in text and "2*intermediate_size" in text


def test_a_router_bias_that_disagrees_with_num_experts_is_named(model_dir, tmp_path):
    name = "model.layers.0.mlp.router.bias"

    def edit(t):
        t[name] = t[name][:6].clone()
    assert name in refused(edited(model_dir, tmp_path, edit))


def test_a_bad_swiglu_limit_is_refused(model_dir, tmp_path):
    assert "swiglu_limit" in refused(edited(model_dir, tmp_path, swiglu_limit=-1.0))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_new", [1, 7])
def test_native_attention_with_sinks_matches_the_reference(window, num_new):
    """kernels/csrc/prefill_attention.h starts each head's online softmax from its sink: the reference's numbers."""
    from stowage.kernels import cpu_attention, cpu_decode, reference

    if cpu_decode.current() is None:
        pytest.skip("no native library here")
    g = torch.Generator().manual_seed(num_new)
    num_blocks, block_size, kv_heads, heads, d = 6, 4, 2, 4, 16
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, d, generator=g) for _ in range(2))
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)
    start = 20 - num_new
    query = torch.randn(num_new, heads, d, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    kind = dict(window=window, sinks=sinks)
    ours = cpu_attention.prefill_attention(query, k_cache, v_cache, table, start, 0.25, **kind)
    theirs = reference.prefill_attention(query, k_cache, v_cache, table, start, 0.25, **kind)
    without = reference.prefill_attention(query, k_cache, v_cache, table, start, 0.25, window=window)
    assert (ours - theirs).abs().max() <= 1e-5 < (theirs - without).abs().max()
    lens = torch.tensor([start + 1], dtype=torch.int32)
    ours = cpu_attention.decode_attention(query[:1], k_cache, v_cache, table[None], lens, 0.25, **kind)
    theirs = reference.decode_attention(query[:1], k_cache, v_cache, table[None], lens, 0.25, **kind)
    assert (ours - theirs).abs().max() <= 1e-5
