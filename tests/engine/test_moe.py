"""Mixture-of-experts models from Hugging Face folders (Qwen3-MoE, Mixtral) against transformers (docs/moe.md)."""

import pytest
import torch
from factory import compare_logits_and_tokens, cpu_plan, edited_copy, greedy_reference, refused
from moe_factory import make_moe_model
from transformers import AutoModelForCausalLM

from stowage.engine.errors import ModelFormatError
from stowage.engine.planning import inspect
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.runtime.sampler import SamplingParams
from stowage.kernels import cpu_decode

PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "Stowage plans memory: weights, KV cache, workspace and headroom. Pick a context size with the slider;"]
VARIANTS = {
    "qwen3_moe": {},
    # renormalized top-k weights, a dense layer among the routed ones, 3 of 8 experts
    "qwen3_moe-norm-dense": {"norm_topk_prob": True, "mlp_only_layers": [1], "num_experts_per_tok": 3},
    "mixtral": {},
    "qwen2_moe": {},  # Q/K/V biases, a shared expert beside the routed ones (the torch path runs it)
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_dir(request, tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp(request.param), request.param.split("-")[0],
                          **VARIANTS[request.param])


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_logits_match_transformers(model_dir, reference):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=5))
    for prompt in PROMPTS:
        compare_logits_and_tokens(engine, reference, prompt, 1e-4, generate=False)


def test_greedy_tokens_identical_one_and_two_at_a_time(model_dir, reference):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=16, num_seqs=2))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    expected = [greedy_reference(reference, ids, engine.eos_ids, 32) for ids in prompts]
    assert engine.generate(prompts[0], SamplingParams(temperature=0, max_tokens=32)).run().token_ids == expected[0]
    # two sequences decoded in one step: each token's experts routed on its own
    seqs = [Sequence(), Sequence()]
    last = [engine.model.forward(ids, s, engine.cache)[-1].argmax().item() for ids, s in zip(prompts, seqs)]
    got = [[t] for t in last]
    for _ in range(7):
        last = engine.model.decode_step(last, seqs, engine.cache).argmax(-1).tolist()
        for g, t in zip(got, last):
            g.append(t)
    assert got == [e[:8] for e in expected]


def test_the_native_decode_step_routes_as_the_torch_path(model_dir):
    """Three sequences decoded together by decode_layer.c (each expert's rows read once for the lanes that chose it)
    give the logits the torch path gives them, step after step."""
    if cpu_decode.current() is None:
        pytest.skip("no native decode library here")
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, num_seqs=6))
    native = engine.model.native(engine.cache)
    if engine.config.shared_expert_intermediate_size:
        assert native is None  # decode_layer.c has no shared expert
        return
    assert native is not None and native.first == 0
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS + ["Café 東京 🚀"]]
    runs = {}
    for path in ("native", "torch"):
        engine.model._native_for = (engine.cache, native if path == "native" else None)
        seqs = [Sequence() for _ in prompts]
        tokens = [engine.model.forward(ids, s, engine.cache)[-1].argmax().item() for ids, s in zip(prompts, seqs)]
        steps = []
        for _ in range(4):
            logits = engine.model.decode_step(tokens, seqs, engine.cache)
            steps.append(logits)
            tokens = runs["native"][len(steps) - 1].argmax(-1).tolist() if path == "torch" else logits.argmax(-1).tolist()
        runs[path] = steps
    for ours, theirs in zip(runs["native"], runs["torch"]):
        assert (ours - theirs).abs().max().item() <= 1e-4


def test_load_progress_runs_through_the_experts_by_bytes(model_dir):
    seen = []
    plan = cpu_plan(model_dir, 64)
    Engine.load(model_dir, plan, progress=lambda fraction, message: seen.append((fraction, message)))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    # the layers' share of the bar is their share of the bytes; the experts fill the rest
    cpu = plan.device("cpu")
    last_layer = max(f for f, m in seen if m.startswith("layer "))
    assert last_layer == pytest.approx(1 - cpu.expert_bytes / cpu.weights_bytes)
    assert any(m.startswith("experts of layer 3/3") for _, m in seen)


def test_the_load_maps_what_the_plan_counted(model_dir):
    info = inspect(model_dir)
    assert sum(info.expert_bytes()) > sum(info.layer_bytes())  # most of an MoE model is its experts
    plan = cpu_plan(model_dir, 64)
    report = Engine.load(model_dir, plan).memory_report()["cpu"]
    assert report["weights_copied"] == 0
    assert report["weights_mapped"] == plan.device("cpu").weights_bytes == info.weights_bytes()


# -- bad input: typed errors naming the tensor, from inspect (what plan reads), before anything is loaded --

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("good"), "qwen3_moe", num_hidden_layers=2)


def edited(good, tmp_path, edit_tensors=None, **config):
    return edited_copy(good, tmp_path / "bad", edit_tensors, **config)


EXPERT = "model.layers.1.mlp.experts.5.up_proj.weight"


def test_a_missing_expert_is_named(good, tmp_path):
    assert EXPERT in refused(edited(good, tmp_path, lambda t: t.pop(EXPERT)))


def test_an_expert_of_the_wrong_shape_is_named(good, tmp_path):
    def edit(t):
        t[EXPERT] = t[EXPERT][:40].clone()
    text = refused(edited(good, tmp_path, edit))
    assert EXPERT in text and "[40, 64]" in text and "moe_intermediate_size=64" in text


def test_a_router_that_disagrees_with_num_experts_is_named(good, tmp_path):
    text = refused(edited(good, tmp_path, num_local_experts=6))  # the router has 8 rows
    assert "model.layers.0.mlp.gate.weight" in text and "num_experts=6" in text


def test_more_active_experts_than_experts_is_refused(good, tmp_path):
    text = refused(edited(good, tmp_path, num_experts_per_tok=9))
    assert "num_experts_per_tok (9)" in text and "8 experts" in text


# -- config.json as transformers reads it --

QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2}


def test_qwen3_moe_dense_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    from stowage.engine.formats.config import ModelConfig

    config = ModelConfig.from_dict(QWEN3_MOE | {"decoder_sparse_step": 2, "mlp_only_layers": [3]})
    # Qwen3MoeDecoderLayer: experts where (i + 1) % step == 0 and i not in mlp_only_layers
    assert config.dense_layers == (0, 2, 3, 4) and [config.is_moe_layer(i) for i in range(6)] == \
        [False, True, False, False, False, True]
    assert ModelConfig.from_dict(QWEN3_MOE | {"num_local_experts": 16, "num_experts": 8}).num_experts == 8
    windows = ModelConfig.from_dict(QWEN3_MOE | {"use_sliding_window": True, "sliding_window": 128}).layer_windows
    assert windows == (128,) * 6
    mixtral = ModelConfig.from_dict(QWEN3_MOE | {"model_type": "mixtral", "num_local_experts": 8,
                                                 "sliding_window": 256})
    assert mixtral.expert_intermediate_size == 96 and mixtral.norm_topk_prob and mixtral.layer_windows == (256,) * 6


@pytest.mark.parametrize("bad, message", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"mlp_only_layers": [6]}, "mlp_only_layers must list layer indices below 6"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok (0)"),
])
def test_a_bad_experts_config_is_named(bad, message):
    from stowage.engine.formats.config import ModelConfig

    with pytest.raises(ModelFormatError) as e:
        ModelConfig.from_dict(QWEN3_MOE | bad)
    assert message in str(e.value)
