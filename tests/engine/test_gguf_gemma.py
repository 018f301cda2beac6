"""Gemma 2 and Gemma 3 (text) from GGUF files, against transformers on the same (dequantized) weights.

The files are written from tiny random models the way llama.cpp's convert_hf_to_gguf.py writes Gemma
(gguf_factory.py: gguf-py's tensor names, the 1 added to every norm weight, Gemma2Model/Gemma3Model's keys), so
what the file does not say (the window pattern, Gemma 3's local rotary base, the attention scale) must come out
as llama.cpp hard-codes it. Windows of 8 tokens: every prompt crosses them.
"""

import json
import math

import pytest
import torch

gguf = pytest.importorskip("gguf")
from factory import CORPUS, cpu_plan, greedy_reference, make_model  # noqa: E402
from gguf_factory import dequantized_copy, gemma_vocab, hf_tensors, write_gguf  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from stowage.engine import cli  # noqa: E402
from stowage.engine.formats.config import ModelConfig  # noqa: E402
from stowage.engine.runtime.engine import Engine  # noqa: E402
from stowage.engine.errors import ModelFormatError  # noqa: E402
from stowage.engine.formats.source import read_config, read_tokenizer  # noqa: E402
from stowage.engine.formats.gguf import GGUFFile  # noqa: E402
from stowage.engine.formats.gguf_model import GGUFModel, gguf_name, hf_name, swa_layers  # noqa: E402
from stowage.engine.text.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from stowage.engine.formats.layout import layer_tensor_names  # noqa: E402
from stowage.engine.runtime.sampler import SamplingParams  # noqa: E402
from stowage.engine.units import GiB  # noqa: E402
from stowage.engine.runtime.kv_cache import Sequence  # noqa: E402

TOLERANCE = 1e-4  # fp32 logits, max abs difference, as for the HF path (tests/engine/test_gemma.py)
PROMPT = "Stowage plans memory: weights, KV cache, workspace and headroom. Pick a context size with the slider;"
# query_pre_attn_scalar = head_dim: what llama.cpp assumes for every Gemma but the 27B ones (head_dim 32 is not
# hidden / heads = 16, so the two rules differ here)
GEMMA = dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8, initializer_range=0.2)
# Gemma 3 in 6 layers: llama.cpp's fixed pattern makes layers 0-4 sliding and 5 global
GEMMA3 = GEMMA | {"num_hidden_layers": 6, "rope_parameters": {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
MODELS = {
    "gemma2": ("gemma2", GEMMA | {"tie_word_embeddings": True}),  # Gemma2Model always ties (it drops lm_head)
    "gemma3": ("gemma3_text", GEMMA3),  # its own head, linear-scaled global rope
    "gemma3-tied": ("gemma3_text", GEMMA3 | {"tie_word_embeddings": True, "final_logit_softcapping": 20.0}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_model(root / name, arch, **overrides) for name, (arch, overrides) in MODELS.items()}


@pytest.fixture(scope="module")
def files(models, tmp_path_factory):
    """(model, qtype) -> (the GGUF file, the HF folder holding the weights that file holds)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, hf in models.items():
        for qtype in ("f32", "q8_0"):
            path = write_gguf(hf, root / f"{name}-{qtype}.gguf", qtype)
            out[name, qtype] = path, hf if qtype == "f32" else dequantized_copy(hf, root / f"{name}-{qtype}-hf", qtype)
    return out


def reference_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


# -- names, norms, config -------------------------------------------------------------------------------


def test_the_four_norms_map_to_llama_cpps_names_and_back(models):
    config = ModelConfig.from_dir(models["gemma3"])
    for arch in ("gemma2", "gemma3"):
        for name in layer_tensor_names(config, 4).values():
            assert hf_name(gguf_name(name, arch), arch) == name != gguf_name(name, arch)
    assert gguf_name("model.layers.2.pre_feedforward_layernorm.weight", "gemma3") == "blk.2.ffn_norm.weight"
    assert gguf_name("model.layers.2.post_attention_layernorm.weight", "gemma2") == "blk.2.post_attention_norm.weight"
    assert hf_name("blk.2.post_ffw_norm.weight", "gemma2") == "model.layers.2.post_feedforward_layernorm.weight"
    assert hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"  # Llama's


def test_the_file_holds_the_norms_plus_one_and_the_config_says_so(files, models):
    path, _ = files["gemma3", "q8_0"]
    stored = GGUFModel(path).file
    hf = hf_tensors(models["gemma3"])
    for gguf_key, hf_key in [("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                             ("blk.5.attn_k_norm.weight", "model.layers.5.self_attn.k_norm.weight"),
                             ("output_norm.weight", "model.norm.weight")]:
        assert torch.equal(torch.from_numpy(stored.raw(gguf_key).copy()), hf[hf_key] + 1)
    assert not read_config(path).norm_plus_one  # the norms multiply by the stored weight as it is


@pytest.mark.parametrize("name", list(MODELS))
def test_config_from_metadata_is_the_config_json(files, models, name):
    ours, theirs = read_config(files[name, "q8_0"][0]), ModelConfig.from_dir(models[name])
    assert ours == ModelConfig(**{**theirs.__dict__, "torch_dtype": None, "norm_plus_one": False})
    assert ours.window(0) == 8 and ours.attention_scale == 32**-0.5
    if name == "gemma2":
        assert ours.layer_windows == (8, None, 8) and (ours.attn_softcap, ours.final_softcap) == (50.0, 30.0)
    else:
        assert ours.layer_windows == (8,) * 5 + (None,) and ours.local_rope.theta == 10000.0
        assert (ours.rope.kind, ours.rope.factor, ours.rope.theta) == ("linear", 8.0, 1e6)


def test_the_window_pattern_is_llama_cpps():
    assert swa_layers("gemma2", 5) == [True, False, True, False, True]
    assert swa_layers("gemma3", 13) == [True] * 5 + [False] + [True] * 5 + [False, True]


def test_a_gemma3_file_without_a_window_is_all_global(tmp_path):
    # sliding_window_pattern 1: the converter writes no window, and llama.cpp then runs every layer in full
    hf = make_model(tmp_path / "hf", "gemma3_text", **GEMMA | {"num_hidden_layers": 2, "sliding_window_pattern": 1})
    path = write_gguf(hf, tmp_path / "m.gguf")
    assert "gemma3.attention.sliding_window" not in GGUFFile(path).metadata
    assert read_config(path).layer_windows == (None, None) == ModelConfig.from_dir(hf).layer_windows
    # a window of 0 is llama.cpp's "none" too
    windowed = write_gguf(make_model(tmp_path / "w", "gemma3_text", **GEMMA | {"num_hidden_layers": 2}),
                          tmp_path / "w.gguf")
    data = bytearray(windowed.read_bytes())
    at = data.index(b"gemma3.attention.sliding_window") + len("gemma3.attention.sliding_window") + 4  # past the type
    assert data[at : at + 4] == (8).to_bytes(4, "little")
    data[at : at + 4] = bytes(4)
    zero = tmp_path / "zero.gguf"
    zero.write_bytes(data)
    assert read_config(windowed).layer_windows == (8, 8) and read_config(zero).layer_windows == (None, None)


# -- same logits and tokens as transformers ---------------------------------------------------------------


# f32: prefill chunks inside the window (5) and past it (64). Q8_0: chunks of 16, past the window and past the 8
# rows up to which the CPU's block kernels quantize x to 16 bits (kernels/csrc/quant_dots.h: ~1e-5 relative, 3e-4
# on these logits); 16 rows take the tiles' float32 product, the reference's to the order of sums.
@pytest.mark.parametrize("qtype, chunk", [("f32", 5), ("f32", 64), ("q8_0", 16)])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_greedy_tokens_match_transformers(files, name, qtype, chunk):
    path, hf = files[name, qtype]
    reference = reference_model(hf)
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32", prefill_chunk=chunk))
    ids = engine.tokenizer.encode(PROMPT)
    assert ids == AutoTokenizer.from_pretrained(hf)(PROMPT)["input_ids"] and len(ids) > 3 * 8
    seq = Sequence()
    ours = engine.model.forward(ids, seq, engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    engine.cache.release(seq)
    if chunk == 5:
        return  # the greedy run below does not depend on the chunk
    result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=24)).run()
    assert result.token_ids == greedy_reference(reference, ids, engine.eos_ids, 24)
    assert engine.memory_report()["cpu"]["weights_copied"] == 0  # the norms too: the +1 is in the file


@pytest.mark.parametrize("arch, layers", [("gemma2", 46), ("gemma3_text", 62)])
def test_the_27b_models_scale_by_hidden_over_heads(arch, layers, tmp_path):
    # llama.cpp knows the 27B models by their layer count and scales their scores by (hidden / heads) ** -0.5
    # (Gemma 2 27B: 4608 / 32 = 144, the query_pre_attn_scalar of its config.json); here 64 / 4 = 16
    hf = make_model(tmp_path / "hf", arch, **GEMMA | {"num_hidden_layers": layers, "query_pre_attn_scalar": 16,
                                                      "intermediate_size": 32, "tie_word_embeddings": True})
    path = write_gguf(hf, tmp_path / "m.gguf")
    config = read_config(path)
    assert config.attention_scale == 16**-0.5 and config.head_dim == 32
    engine = Engine.load(path, cpu_plan(path, 128, dtype="float32", prefill_chunk=64))
    ids = list(range(3, 23))
    ours = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = reference_model(hf)(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_a_quantized_file_computes_in_bfloat16_by_default(files):
    path, hf = files["gemma3", "q8_0"]
    engine = Engine.load(path, cpu_plan(path, 256, prefill_chunk=16))
    assert engine.plan.dtype == "bfloat16"
    ids = engine.tokenizer.encode(PROMPT)
    ours = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = reference_model(hf)(torch.tensor([ids])).logits[0]
    # bf16 activations (the f32 norm weights rounded to bf16 per call, as for every GGUF model): close, not equal
    assert (ours - theirs).abs().max().item() <= 0.1 * theirs.abs().max().item()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_a_missing_gemma_tensor_is_named_as_llama_cpp_names_it(models, tmp_path):
    path = write_gguf(models["gemma2"], tmp_path / "m.gguf", drop=("blk.1.post_ffw_norm.weight",))
    with pytest.raises(ModelFormatError, match=r"gemma2 architecture needs tensor\(s\) blk.1.post_ffw_norm.weight"):
        GGUFModel(path)


# -- planning ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_stowage_plan_charges_window_layers_as_for_the_hf_folder(files, models, name, capsys):
    shown = {}
    for source in (files[name, "f32"][0], models[name]):
        assert cli.main(["plan", str(source), "--context", "1024", "--ram-budget", "8GiB", "--json"]) == 0
        shown[source] = json.loads(capsys.readouterr().out)
    gguf_plan, hf_plan = shown.values()
    assert gguf_plan["dtype"] == hf_plan["dtype"] == "float32"
    kv = [[d["kv_bytes"] for d in p["devices"]] for p in (gguf_plan, hf_plan)]
    assert kv[0] == kv[1]
    # by hand (docs/planner.md): a block of 16 tokens is 16 x 2 (K, V) x 2 KV heads x 32 dims x 4 bytes; a full
    # layer keeps ceil(1024 / 16) blocks, a window layer ceil((8 + chunk - 2) / 16) + 1 of them
    config, chunk = read_config(files[name, "f32"][0]), gguf_plan["prefill_chunk"]
    block = 16 * 2 * 2 * 32 * 4
    full, window = math.ceil(1024 / 16), math.ceil((8 + chunk - 2) / 16) + 1
    assert window < full
    num_window = sum(w is not None for w in config.layer_windows)
    assert sum(kv[0]) == block * (num_window * window + (config.num_layers - num_window) * full)


# Gemma 3 1B (the shape of tests/engine/test_gemma_plan.py, whose window-layer charge is 65 blocks of 16 tokens)
GEMMA_3_1B = {"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 512}
WINDOW_LAYER = 65 * 16 * 1024  # ceil((512 + 512 - 2) / 16) + 1 blocks at the default prefill chunk of 512


def test_a_gemma_3_1b_shaped_q8_0_file_plans_its_windows_by_hand(tmp_path):
    from gguf_factory import write_sparse_gemma3_gguf

    from stowage.engine.planning import inspect
    from stowage.engine.planning.budgets import given_budgets
    from stowage.engine.planning.plan import PlanRequest, plan

    path = tmp_path / "gemma-3-1b-it-Q8_0.gguf"
    written = write_sparse_gemma3_gguf(path, GEMMA_3_1B)
    info = inspect(path)
    assert [i for i, w in enumerate(info.config.layer_windows) if w is None] == [5, 11, 17, 23]
    # by hand: a layer's 26,836,992 matrix weights at 34 bytes per 32 (q8_0), six norms in f32 (4 x 1152, 2 x 256);
    # the tied embeddings 262,144 x 1,152 in q8_0, the final norm f32
    layer = 26_836_992 * 34 // 32 + (4 * 1152 + 2 * 256) * 4
    assert info.layer_bytes() == (layer,) * 26 and layer == 28_534_784
    assert info.weights_bytes() == 26 * layer + 262_144 * 1152 * 34 // 32 + 1152 * 4 == written
    # KV as the HF folder's plan (tests/engine/test_gemma_plan.py): 1,024 bytes a token and layer (bf16, one KV head
    # of 256), four global layers of the whole context, 22 window layers of 65 blocks each
    for tokens, kv_bytes in [(4096, 40_206_336), (32768, 157_646_848)]:
        p = plan(info, PlanRequest(tokens), given_budgets([], 64 * GiB))
        assert p.kv_dtype == "bfloat16" and p.kv_bytes == 4 * tokens * 1024 + 22 * WINDOW_LAYER == kv_bytes


# -- tokenizer and chat template -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_spm(tmp_path_factory):
    """A Gemma 2 GGUF with a Gemma-style SentencePiece vocabulary and no chat template (as many files come)."""
    vocab = gemma_vocab(1024, CORPUS)
    root = tmp_path_factory.mktemp("spm")
    hf = make_model(root / "hf", "gemma2", **GEMMA | {"tie_word_embeddings": True, "vocab_size": 1024,
                                                      "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0})
    return write_gguf(hf, root / "m.gguf", sentencepiece=vocab), vocab


def texts() -> list[str]:
    import random

    rng = random.Random(3)
    words = CORPUS[:4] + ["  two  spaces", "\ttab", "new\nline", "東京", "🚀", "<start_of_turn>", "<end_of_turn>",
                          "<bos>", "Ünïcödé", "12345", " lead", "trail ", "x\n\ny"]
    return ["".join(rng.choice(words) + rng.choice(["", " ", "  ", "\n"]) for _ in range(rng.randint(1, 8)))
            for _ in range(400)]


def test_the_sentencepiece_tokenizer_matches_transformers_gemma_tokenizer(gemma_spm):
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    path, (tokens, scores, _) = gemma_spm
    ours = tokenizer_from_gguf(GGUFFile(path).metadata, path.name)
    ids = {t: i for i, t in enumerate(tokens)}
    # add_bos_token: what Gemma's tokenizer_config.json says (and the file's tokenizer.ggml.add_bos_token)
    reference = GemmaTokenizer(vocab=ids, merges=generate_merges(ids, dict(zip(tokens, scores))), add_bos_token=True)
    reference.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
                                 replace_extra_special_tokens=False)
    cases = texts()
    mismatches = [t for t in cases if ours.encode(t) != reference(t)["input_ids"]]
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ, e.g. {mismatches[:3]!r}"
    assert ours.encode("hi")[0] == ids["<bos>"]  # add_bos_token, and no "▁" prefix (add_space_prefix false):
    assert ours.encode("hi", add_special_tokens=False) == reference("hi", add_special_tokens=False)["input_ids"]
    assert ours.encode("<end_of_turn>", add_special_tokens=False) == [ids["<end_of_turn>"]]
    assert ours.encode("\t", add_special_tokens=False) == [ids["<0x09>"]]  # byte fallback
    sample = reference(cases[5])["input_ids"]
    assert ours.decode(sample) == reference.decode(sample, skip_special_tokens=True)


def test_a_file_without_a_template_chats_in_the_gemma_format_and_says_so(gemma_spm):
    path, (tokens, _, _) = gemma_spm
    engine = Engine.load(path, cpu_plan(path, 128))
    assert engine.tokenizer.template_source == "gemma (built in)"  # the GUI's "Chat template:" label
    # <end_of_turn> ends generation, as llama.cpp ends it (by the token's text)
    assert {tokens.index("<eos>"), tokens.index("<end_of_turn>")} <= engine.eos_ids
    assert tokens.index("<end_of_turn>") in read_config(path).eos_token_ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = engine.tokenizer.render_chat(messages)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = engine.tokenizer.apply_chat_template(messages)
    assert ids[:2] == [tokens.index("<bos>"), tokens.index("<start_of_turn>")] and ids.count(2) == 1
    # the app's worker formats chats with the tokenizer read the same way (app/worker.py)
    tokenizer = read_tokenizer(path)
    tokenizer.use_builtin_template(read_config(path).model_type)
    assert tokenizer.template_source == "gemma (built in)"
    assert GGUFModel(path).architecture == "gemma2"
