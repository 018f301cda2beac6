"""Gemma 2, Gemma 3 (text) and sliding-window Mistral against Hugging Face transformers on tiny random models.

Windows of 8 tokens, so every prompt crosses them; chunks of 5 (inside the window) and 64 (past it)."""

import pytest
import torch
from factory import cpu_plan, make_model
from transformers import AutoModelForCausalLM

from stowage.engine.formats.config import ModelConfig
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import UnsupportedModelError
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.runtime.sampler import SamplingParams

TOLERANCE = 1e-4  # fp32 logits, max abs difference (measured: <= 1.1e-5, logits up to ~7)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, initializer_range=0.2)
MODELS = {
    "gemma2": ("gemma2", GEMMA),
    "gemma3": ("gemma3_text", GEMMA | {"sliding_window_pattern": 3, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    "gemma3-tied": ("gemma3_text", GEMMA | {"tie_word_embeddings": True, "final_logit_softcapping": 20.0,
                                            "attn_logit_softcapping": 30.0}),
    "mistral-window": ("mistral", {"sliding_window": 8, "initializer_range": 0.2}),
}
PROMPT = list(range(3, 43))  # 40 tokens: five windows


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    return make_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_layer_kinds_are_read(model_dir):
    config = ModelConfig.from_dir(model_dir)
    assert config.window(0) == 8
    if config.model_type == "gemma2":
        assert config.layer_windows == (8, None, 8) and config.attn_softcap == 50.0 and config.final_softcap == 30.0
    if config.model_type == "gemma3_text":
        assert config.qk_norm and config.local_rope.theta == 10000.0 and config.attention_scale == 24**-0.5


@pytest.mark.parametrize("chunk", [5, 64])
def test_logits_match_with_chunks_inside_and_past_the_window(model_dir, reference, chunk):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=chunk))
    seq = Sequence()
    ours = []
    for i in range(0, len(PROMPT), chunk):  # chunked as the generation path chunks
        ours.append(engine.model.forward(PROMPT[i : i + chunk], seq, engine.cache, all_logits=True))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    assert theirs.abs().max() > 1.0
    assert (torch.cat(ours) - theirs).abs().max().item() <= TOLERANCE


def test_32_greedy_tokens_identical(model_dir, reference):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=16))
    result = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32)).run()
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, eos_token_id=sorted(engine.eos_ids),
                                 pad_token_id=sorted(engine.eos_ids)[0])
    expected = [t for t in out[0, len(PROMPT):].tolist() if t not in engine.eos_ids]
    assert result.token_ids == expected


def test_multi_turn_across_the_window_reuses_the_prefix(model_dir):
    engine = Engine.load(model_dir, cpu_plan(model_dir, 512))
    greedy = SamplingParams(temperature=0, max_tokens=12)
    history = [{"role": "user", "content": "Stowage plans memory: weights, KV cache, workspace and headroom."}]
    first = engine.chat(history, greedy).run()
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "The quick brown fox."}]
    second = engine.chat(history, greedy).run()
    fresh = Engine.load(model_dir, cpu_plan(model_dir, 512)).chat(history, greedy).run()  # nothing cached
    assert second.token_ids == fresh.token_ids
    assert second.reused_tokens >= first.prompt_tokens > 8


# -- with the recycling cache: window layers keep only what a window and a prefill chunk reach -------------------
LONG_PROMPT = [3 + (7 * i) % 500 for i in range(150)]  # 150 tokens: ~19 windows of 8


def recycling(engine):
    """The engine as loaded: Engine.load builds its cache with the model's windows and the plan's chunk, so the
    window layers have a group of their own that recycles blocks."""
    assert any(group.window is not None for group in engine.cache.groups), "the load gave the windows no group"
    return engine


def recycled(engine, seq) -> int:
    return sum(b < 0 for table in seq.window_tables.values() for b in table)


def last_sequence(engine):
    """The sequence of the reply that ran last: the one conversation the engine keeps cached."""
    (conv,) = engine.pool._idle
    return conv.seq


@pytest.mark.parametrize("chunk", [3, 8, 20, 64])
def test_recycling_cache_logits_match_with_chunks_smaller_and_larger_than_the_window(model_dir, reference, chunk):
    engine = recycling(Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=chunk)))
    seq = Sequence()
    ours = [engine.model.forward(LONG_PROMPT[i : i + chunk], seq, engine.cache, all_logits=True)
            for i in range(0, len(LONG_PROMPT), chunk)]
    assert recycled(engine, seq) >= 4  # blocks past every window were handed back
    window_group = engine.cache.groups[-1]
    assert window_group.window == 8 and window_group.allocator.num_blocks < 256 // 16
    with torch.no_grad():
        theirs = reference(torch.tensor([LONG_PROMPT])).logits[0]
    assert (torch.cat(ours) - theirs).abs().max().item() <= TOLERANCE


def test_recycling_cache_greedy_tokens_identical(model_dir, reference):
    engine = recycling(Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=16)))
    result = engine.generate(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=40)).run()
    assert recycled(engine, last_sequence(engine)) > 0
    with torch.no_grad():
        out = reference.generate(torch.tensor([LONG_PROMPT]), attention_mask=torch.ones(1, len(LONG_PROMPT),
                                 dtype=torch.long), max_new_tokens=40, do_sample=False,
                                 eos_token_id=sorted(engine.eos_ids), pad_token_id=sorted(engine.eos_ids)[0])
    assert result.token_ids == [t for t in out[0, len(LONG_PROMPT):].tolist() if t not in engine.eos_ids]


def test_recycling_cache_multi_turn_reuses_the_prefix_across_the_window(model_dir):
    engine = recycling(Engine.load(model_dir, cpu_plan(model_dir, 512, prefill_chunk=16)))
    greedy = SamplingParams(temperature=0, max_tokens=24)
    history = [{"role": "user", "content": "Stowage plans memory: weights, KV cache, workspace and headroom. " * 2}]
    first = engine.chat(history, greedy).run()
    assert recycled(engine, last_sequence(engine)) > 0
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "The quick brown fox."}]
    second = engine.chat(history, greedy).run()
    fresh = recycling(Engine.load(model_dir, cpu_plan(model_dir, 512, prefill_chunk=16))).chat(history, greedy).run()
    assert second.token_ids == fresh.token_ids
    assert second.reused_tokens >= first.prompt_tokens > 8


def test_truncate_past_a_recycled_window_prefills_again_and_matches(model_dir, reference):
    # an edited early turn: the window layers' K/V there are gone, so truncate keeps nothing and the caller
    # prefills from 0 (the global layers' K/V are rewritten with the same values)
    engine = recycling(Engine.load(model_dir, cpu_plan(model_dir, 256, prefill_chunk=16)))
    cache, seq = engine.cache, Sequence()
    engine.model.forward(LONG_PROMPT, seq, cache)
    assert cache.num_reusable(seq, 140) == 140  # a few tokens back: still held
    edited = LONG_PROMPT[:60] + [9, 10, 11] + LONG_PROMPT[60:100]
    kept = cache.truncate(seq, 60)
    assert kept == 0 and seq.num_tokens == 0
    ours = engine.model.forward(edited[kept:], seq, cache, all_logits=True)
    with torch.no_grad():
        theirs = reference(torch.tensor([edited])).logits[0]
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    # and a truncate a few tokens back keeps them, then continues exactly
    assert cache.truncate(seq, 100) == 100
    ours = engine.model.forward(edited[100:], seq, cache, all_logits=True)
    assert (ours - theirs[100:]).abs().max().item() <= TOLERANCE


def test_gemma3_with_vision_is_refused_with_a_reason():
    raw = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}}
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        ModelConfig.from_dict(raw)


def test_windows_as_transformers_derives_them():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2}
    mistral = ModelConfig.from_dict(base | {"model_type": "mistral", "sliding_window": 4096})
    assert mistral.layer_windows == (4096,) * 4
    assert ModelConfig.from_dict(base | {"model_type": "mistral", "sliding_window": None}).layer_windows == ()
    assert ModelConfig.from_dict(base | {"model_type": "llama", "sliding_window": 16}).layer_windows == ()
    qwen = base | {"model_type": "qwen2", "sliding_window": 32, "max_window_layers": 2}
    assert ModelConfig.from_dict(qwen).layer_windows == ()  # use_sliding_window false: full attention
    assert ModelConfig.from_dict(qwen | {"use_sliding_window": True}).layer_windows == (None, None, 32, 32)
    gemma3 = ModelConfig.from_dict(base | {"model_type": "gemma3_text", "num_hidden_layers": 12, "head_dim": 4,
                                           "sliding_window": 512, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                           "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert [w is None for w in gemma3.layer_windows] == [False] * 5 + [True] + [False] * 5 + [True]
    assert (gemma3.rope.kind, gemma3.rope.factor, gemma3.rope.theta) == ("linear", 8.0, 1e6)
    assert (gemma3.local_rope.kind, gemma3.local_rope.theta) == ("default", 1e4)
    assert gemma3.tie_word_embeddings and gemma3.embed_scale == 8**0.5 and gemma3.hidden_act == "gelu_pytorch_tanh"


def test_gemma_without_a_template_gets_the_gemma_format(tmp_path):
    from factory import save_tokenizer

    model_dir = make_model(tmp_path, "gemma2", **GEMMA)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    save_tokenizer(model_dir, chat_template=None)
    engine = Engine.load(model_dir, cpu_plan(model_dir, 128))
    assert engine.tokenizer.template_source == "gemma (built in)"
    text = engine.tokenizer.render_chat([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello. "}, {"role": "user", "content": "Bye"}])
    assert text == ("<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
