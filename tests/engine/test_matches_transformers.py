"""Our forward, greedy decoding and prefix reuse against Hugging Face transformers on the same files."""

import pytest
import torch
from factory import make_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from stowage.engine.runtime.engine import Engine
from factory import cpu_plan
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.runtime.kv_cache import Sequence

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stowage plans memory: weights, KV cache, workspace and headroom. Pick a context size with the slider;",
    "Café 東京 🚀",
]
ARCH_OVERRIDES = {
    "llama": {"initializer_range": 0.2},
    "llama-rope3": {"initializer_range": 0.2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                    "rope_theta": 500000.0},
    "llama-tied": {"initializer_range": 0.2, "tie_word_embeddings": True, "num_key_value_heads": 1},
    "mistral": {"initializer_range": 0.2},
    "qwen2": {"initializer_range": 0.2},
    "qwen3": {"initializer_range": 0.2},
}


@pytest.fixture(scope="module", params=list(ARCH_OVERRIDES))
def model_dir(request, tmp_path_factory):
    arch = request.param.split("-")[0]
    return make_model(tmp_path_factory.mktemp(request.param), arch, **ARCH_OVERRIDES[request.param])


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_logits_match_for_a_batch_of_prompts(model_dir, reference):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 512, prefill_chunk=5))
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        assert ids == hf_tok(prompt)["input_ids"]  # same tokens, BOS post-processing included
        seq = Sequence()
        ours = engine.model.forward(ids, seq, engine.cache, all_logits=True)
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0]
        assert theirs.abs().max() > 1.0  # the comparison is not between near-zero numbers
        assert (ours - theirs).abs().max().item() <= 1e-4
        engine.cache.release(seq)


def test_64_greedy_tokens_identical(model_dir, reference):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=16))
    ids = engine.tokenizer.encode(PROMPTS[1])
    result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=64)).run()
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=64, do_sample=False, eos_token_id=sorted(engine.eos_ids),
                                 pad_token_id=sorted(engine.eos_ids)[0])
    expected = [t for t in out[0, len(ids):].tolist() if t not in engine.eos_ids]
    assert result.token_ids == expected
    assert len(result.token_ids) == 64 or result.finish_reason == "stop"


def test_prefix_reuse_gives_the_same_tokens_as_recomputing(model_dir):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 512))
    greedy = SamplingParams(temperature=0, max_tokens=24)
    history = [{"role": "user", "content": PROMPTS[1]}]
    first = engine.chat(history, greedy).run()
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": PROMPTS[0]}]

    second = engine.chat(history, greedy).run()
    fresh = Engine.load(model_dir, cpu_plan(model_dir, 512)).chat(history, greedy).run()  # nothing cached

    assert second.token_ids == fresh.token_ids
    # turn 2 computed only what turn 1 had not cached: most of the prompt was reused
    assert second.reused_tokens >= first.prompt_tokens
    assert second.prefilled_tokens == second.prompt_tokens - second.reused_tokens
    assert second.prefilled_tokens < fresh.prefilled_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_prefill_matches_transformers_in_16_bits(tmp_path, monkeypatch, dtype):
    # A chunk of 16-bit weights multiplied on widened fp32 tiles (kernels/cpu_matmul.py, what CPUs without fast
    # 16-bit products run): the logits of transformers on the same weights in the same dtype, and torch's own.
    from stowage.kernels import cpu_matmul

    model_dir = make_model(tmp_path / "m", "llama", dtype=dtype, initializer_range=0.2)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = Engine.load(model_dir, cpu_plan(model_dir, 256)).tokenizer.encode(PROMPTS[1])
    assert len(ids) >= cpu_matmul.MIN_ROWS
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].float()
    logits = {}
    for widen in ("1", "0"):
        monkeypatch.setenv(cpu_matmul.WIDEN_ENV, widen)
        engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=64))
        logits[widen] = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
    scale, eps = theirs.abs().max(), torch.finfo(dtype).eps
    assert scale > 1.0
    err = {k: ((v - theirs).abs().max() / scale).item() for k, v in logits.items()}  # bf16 ~0.07, f16 ~0.009
    # 16-bit activations round at every op, in another order than transformers' (engine: fp32 attention): the
    # widened product stays as close to transformers as torch's own, and within a few units of its last place of it
    assert err["1"] <= err["0"] + 4 * eps
    assert ((logits["1"] - logits["0"]).abs().max() / scale).item() < 4 * eps  # bf16 ~0.009, f16 ~0.0009
    assert (logits["1"].argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
