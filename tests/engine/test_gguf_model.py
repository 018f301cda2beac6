"""GGUF models through the same path as safetensors: inspect, plan, load, generate; against transformers on the
same (dequantized) weights. The files are written here from factory.py's tiny models the way llama.cpp converts."""

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from factory import cpu_plan, greedy_reference, make_model  # noqa: E402
from gguf_factory import dequantized_copy, permute, rope_factors, write_gguf  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from stowage.engine import cli  # noqa: E402
from stowage.engine.formats.config import ModelConfig  # noqa: E402
from stowage.engine.runtime.engine import Engine  # noqa: E402
from stowage.engine.errors import ModelFormatError, UnsupportedModelError  # noqa: E402
from stowage.engine.formats.source import is_gguf, read_config, read_tokenizer  # noqa: E402
from stowage.engine.formats.gguf_model import GGUFModel, gguf_name, hf_name, qk_order  # noqa: E402
from stowage.engine.planning import inspect  # noqa: E402
from stowage.engine.planning.budgets import given_budgets  # noqa: E402
from stowage.engine.planning.plan import PlanRequest, plan  # noqa: E402
from stowage.engine.runtime.rope import inverse_frequencies  # noqa: E402
from stowage.engine.runtime.sampler import SamplingParams  # noqa: E402
from stowage.kernels import quant_linear  # noqa: E402
from stowage.engine.units import GiB  # noqa: E402
from stowage.engine.runtime.kv_cache import Sequence  # noqa: E402
from stowage.kernels.quant_linear import MatrixShape, QuantizedWeight, rows_workspace_bytes, workspace_bytes  # noqa: E402

PROMPT = "Stowage plans memory: weights, KV cache, workspace and headroom. Pick a context size with the slider;"
ARCHS = {
    "llama": {"initializer_range": 0.2},
    "llama-tied": {"initializer_range": 0.2, "tie_word_embeddings": True, "num_key_value_heads": 1},
    "llama-rope3": {"initializer_range": 0.2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                    "rope_theta": 500000.0},
    "mistral": {"initializer_range": 0.2},
    "qwen2": {"initializer_range": 0.2},
    "qwen3": {"initializer_range": 0.2},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> the HF folder factory.py writes."""
    root = tmp_path_factory.mktemp("hf")
    return {name: make_model(root / name, name.split("-")[0], **overrides) for name, overrides in ARCHS.items()}


@pytest.fixture(scope="module")
def files(models, tmp_path_factory):
    """(arch, qtype) -> (the GGUF file, the HF folder with the weights that file holds)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, hf in models.items():
        for qtype in ("f32", "q8_0"):
            path = write_gguf(hf, root / f"{name}-{qtype}.gguf", qtype)
            out[name, qtype] = path, hf if qtype == "f32" else dequantized_copy(hf, root / f"{name}-{qtype}-hf", qtype)
    return out


# -- names, permutation, config ----------------------------------------------------------------------


def test_every_llama_cpp_name_maps_to_the_layouts_and_back(models):
    config = ModelConfig.from_dir(models["qwen3"])
    from stowage.engine.formats.layout import EMBED, FINAL_NORM, LM_HEAD, layer_tensor_names

    names = [EMBED, FINAL_NORM, LM_HEAD, *layer_tensor_names(config, 0).values(),
             *layer_tensor_names(ModelConfig.from_dir(models["qwen2"]), 11).values()]
    for name in names:
        assert gguf_name(name) != name and hf_name(gguf_name(name)) == name
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.x.attn_q.weight") is None


def test_qk_order_undoes_the_converters_permutation():
    heads, head_dim = 3, 8
    w = torch.randn(heads * head_dim, 5)
    x = torch.randn(5)
    stored = (permute(w, heads) @ x).view(heads, head_dim)
    assert not torch.equal(stored, (w @ x).view(heads, head_dim))
    assert torch.equal(stored[..., qk_order(head_dim)], (w @ x).view(heads, head_dim))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_from_metadata_is_the_config_json(files, models, arch):
    path, _ = files[arch, "q8_0"]
    ours, theirs = read_config(path), ModelConfig.from_dir(models[arch])
    if arch == "llama-rope3":
        # recovered from rope_freqs.weight: other band edges, the same frequencies
        assert ours.rope.kind == "llama3" and ours.rope.factor == theirs.rope.factor
        assert torch.allclose(inverse_frequencies(ours.rope, ours.head_dim),
                              inverse_frequencies(theirs.rope, theirs.head_dim), rtol=1e-6, atol=0)
        ours = ModelConfig(**{**ours.__dict__, "rope": theirs.rope})
    # A Mistral written as llama.cpp's `llama` arch carries no sliding window (llama.cpp applies none there);
    # the tiny model's 4096-token window is past its 1024 positions anyway.
    assert ours == ModelConfig(**{**theirs.__dict__, "torch_dtype": None, "model_type": "qwen3" if arch == "qwen3"
                                  else ("qwen2" if arch == "qwen2" else "llama"), "layer_windows": ()})


def test_a_mistral_file_is_a_llama_one(files):
    assert GGUFModel(files["mistral", "f32"][0]).architecture == "llama"


# -- same tokens and logits as transformers ------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_greedy_tokens_match_transformers(files, arch, qtype):
    path, hf = files[arch, qtype]
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    # float32 activations, as the reference computes; the blocks stay blocks (nothing is converted)
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32", prefill_chunk=7))
    if qtype == "q8_0":
        assert isinstance(engine.model.layers[0]["q"], QuantizedWeight)
    ids = engine.tokenizer.encode(PROMPT)
    assert ids == AutoTokenizer.from_pretrained(hf)(PROMPT)["input_ids"]
    seq = Sequence()
    ours = engine.model.forward(ids, seq, engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-4
    engine.cache.release(seq)
    result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=32)).run()
    assert result.token_ids == greedy_reference(reference, ids, engine.eos_ids, 32)
    assert engine.memory_report()["cpu"]["weights_copied"] == 0


# what llama.cpp's Q4_K_M puts where (attn_v and ffn_down in q6_k), with an f16 head beside it
Q4_K_M = {"attn_v.weight": "q6_k", "ffn_down.weight": "q6_k", "output.weight": "f16", "ffn_up.weight": "q5_k"}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_k_quants_and_an_f16_head_match_transformers(arch, tmp_path, monkeypatch):
    from gguf_factory import write_k_quant_gguf

    # K-quant rows are blocks of 256 weights: hidden and intermediate sizes of 256 and 512
    hf = make_model(tmp_path / "hf", arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2)
    path, reference_dir = write_k_quant_gguf(hf, tmp_path / "m.gguf", tmp_path / "ref", Q4_K_M)
    types = {t.type_name for t in GGUFModel(path).specs.values()}
    assert {"q4_k", "q5_k", "q6_k", "f16"} <= types
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    ids = read_tokenizer(path).encode(PROMPT)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert theirs.abs().max() > 1.0
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32", prefill_chunk=7))
    with monkeypatch.context() as tiles:  # the dequantized blocks' product itself, prefill and decode
        tiles.setattr(quant_linear, "MAX_NATIVE_TOKENS", 0)
        tiles.setattr(engine.model, "_native_for", (engine.cache, None))
        ours = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
        assert (ours - theirs).abs().max().item() <= 1e-4
        result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=16)).run()
        assert result.token_ids == greedy_reference(reference, ids, engine.eos_ids, 16)
    # chunks of 7 on the native kernels, which read x at 8 bits per 256 for the K types (llama.cpp's Q8_K): close,
    # and a tiny random model's near-ties may then pick other tokens (tests/kernels/test_cpu_quant.py checks them)
    ours = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
    assert (ours - theirs).abs().max().item() <= 5e-3 * theirs.abs().max().item()
    # by default: bf16 activations; the f16 head computes tile by tile too (converted per tile, never copied)
    engine = Engine.load(path, cpu_plan(path, 256))
    assert engine.plan.dtype == "bfloat16" and isinstance(engine.model.head["lm_head"], QuantizedWeight)
    ours = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
    assert (ours - theirs).abs().max().item() <= 0.1 * theirs.abs().max().item()
    assert engine.memory_report()["cpu"]["weights_copied"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_file_computes_in_bfloat16_by_default(files, arch):
    path, hf = files[arch, "q8_0"]
    engine = Engine.load(path, cpu_plan(path, 256))
    assert (engine.plan.dtype, engine.plan.kv_dtype) == ("bfloat16", "bfloat16")
    assert engine.cache.k_cache[0].dtype == torch.bfloat16 and engine.model.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = engine.tokenizer.encode(PROMPT)
    ours = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    # bf16 activations (8 bits of mantissa) through 3 layers: close, not equal
    assert (ours - theirs).abs().max().item() <= 0.1 * theirs.abs().max().item()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    assert engine.memory_report()["cpu"]["weights_copied"] == 0


# -- planning ----------------------------------------------------------------------------------------


def test_inspect_counts_the_quantized_bytes(files):
    path, _ = files["qwen2", "q8_0"]
    info = inspect(path)
    model = GGUFModel(path)
    expected = [sum(t.nbytes for n, t in model.specs.items() if n.startswith(f"model.layers.{i}."))
                for i in range(info.num_layers)]
    assert info.layer_bytes() == tuple(expected)
    assert set(info.layers[0].bytes_by_dtype) == {"q8_0", "float32"}  # matrices in blocks, norms and biases f32
    # a forced dtype converts the plain tensors only: blocks are never "converted" by the count
    q8 = info.layers[0].bytes_by_dtype["q8_0"]
    plain = info.layers[0].bytes_by_dtype["float32"]
    assert info.layer_bytes("bfloat16")[0] == q8 + plain // 2
    assert info.compute_dtype == "bfloat16" and info.kv_bytes_per_token() == 2 * 2 * 16 * 2
    assert info.file_bytes == path.stat().st_size and info.config.model_type == "qwen2"
    assert inspect(files["qwen2", "f32"][0]).compute_dtype == "float32"


def test_the_plan_charges_the_tile_scratch(files):
    path, _ = files["llama", "q8_0"]
    info = inspect(path)
    budgets = given_budgets([], 64 * GiB)
    cpu = plan(info, PlanRequest(256, prefill_chunk=64), budgets).device("cpu")
    # by hand: the largest of the layer products at 64 rows (the MLP's [160, 64] and [64, 160]: both one tile),
    # the head at one row, the embedding lookup of 64 rows (all q8_0, bf16 activations)
    layer = max(workspace_bytes(MatrixShape("q8_0", o, i), 64, torch.bfloat16)
                for o, i in [(64, 64), (32, 64), (64, 64), (160, 64), (64, 160)])
    head = workspace_bytes(MatrixShape("q8_0", 512, 64), 1, torch.bfloat16)
    embed = rows_workspace_bytes(MatrixShape("q8_0", 512, 64), 64)
    assert cpu.workspace.dequant_bytes == max(layer, head, embed) > 0
    # an f32 file computing in float32 multiplies its matrices in place: no tiles, no scratch
    f32 = plan(inspect(files["llama", "f32"][0]), PlanRequest(256), budgets).device("cpu")
    assert f32.workspace.dequant_bytes == 0
    # a forced dtype converts plain weights at load (a counted copy, as for safetensors), so no tiles either
    assert plan(inspect(files["llama", "f32"][0]), PlanRequest(256, dtype="bfloat16"),
                budgets).device("cpu").workspace.dequant_bytes == 0


def test_a_llama_3_1_8b_shaped_q4_k_file_plans_from_its_headers(tmp_path, monkeypatch):
    from gguf_factory import write_sparse_gguf
    from sparse_models import LLAMA_3_1_8B

    from stowage.kernels import cpu_decode, cpu_quant_matmul

    path = tmp_path / "Llama-3.1-8B-Q4_K.gguf"
    written = write_sparse_gguf(path, LLAMA_3_1_8B, {"output.weight": "q6_k"})
    info = inspect(path)
    # by hand: a layer's matrices are 218,103,808 weights at 144 bytes per 256 (q4_k), its two norms 2 x 4096 f32;
    # the embeddings 128,256 x 4,096 in q4_k, the head the same in q6_k (210 bytes per 256), the final norm f32
    layer = 218_103_808 * 144 // 256 + 2 * 4096 * 4
    assert info.layer_bytes() == (layer,) * 32 and layer == 122_716_160
    assert info.weights_bytes() == 32 * layer + 295_501_824 + 430_940_160 + 16_384 == written == 4_653_375_488
    assert info.compute_dtype == "bfloat16" and info.kv_bytes_per_token() == 2 * 8 * 128 * 2
    p = plan(info, PlanRequest(8192), given_budgets([], 16 * GiB))
    assert p.fits and p.kv_bytes == 32 * 8192 * 4096 == 2**30
    # the embedding lookup of a 512-token chunk: its rows' blocks (2,304 bytes each) and 10 bytes per weight dequantizing
    lookup = 512 * 2304 + 512 * 4096 * 10
    if cpu_quant_matmul.runs("q4_k"):
        # the chunk's products run the integer tiles: the largest, ffn_down ([4096, 14336]), takes x as int8 with a
        # scale and a sum per 32, and each thread's panel of 32 unpacked rows (bytes, a scale and a minimum per 32)
        threads = cpu_decode.default_threads()
        down = 512 * (14336 + 448 * 4 * 2) + threads * (32 * (14336 + 448 * 4 * 2) + 8 * 14336)
        assert p.device("cpu").workspace.dequant_bytes == max(lookup, down) == lookup == 22_151_168
    # where they do not (switched off, or not built), the tiles: the largest is ffn_gate ([14336, 4096], tiles of 256
    # rows at 10 bytes per weight dequantizing) beside x in float32 [512, 4096] and the accumulator [14336, 512]
    monkeypatch.setenv(cpu_quant_matmul.SWITCH, "0")
    p = plan(info, PlanRequest(8192), given_budgets([], 16 * GiB))
    assert p.device("cpu").workspace.dequant_bytes == 256 * 4096 * 10 + 512 * 4096 * 4 + 14336 * 512 * 4 == 48_234_496


def test_the_load_maps_what_the_plan_counted(files):
    path, _ = files["llama-tied", "q8_0"]
    p = cpu_plan(path, 128)
    engine = Engine.load(path, p)
    report = engine.memory_report()["cpu"]
    assert report["weights_copied"] == 0
    assert report["weights_mapped"] == p.device("cpu").weights_bytes
    assert engine.model.head["lm_head"] is engine.model.embed["embed"]  # tied: one QuantizedWeight


def test_a_folder_holding_one_gguf_file_is_that_model(files, tmp_path):
    shutil.copy(files["qwen3", "q8_0"][0], tmp_path / "m.gguf")
    assert is_gguf(tmp_path) and not is_gguf(files["qwen3", "f32"][1])
    assert inspect(tmp_path).weights_bytes() == inspect(files["qwen3", "q8_0"][0]).weights_bytes()


# -- the commands -----------------------------------------------------------------------------------


def test_stowage_plan_and_generate_on_a_gguf_file(files, capsys):
    path, _ = files["qwen2", "q8_0"]
    assert cli.main(["plan", str(path), "--context", "256", "--ram-budget", "8GiB", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["fits"] and shown["dtype"] == "bfloat16" and shown["kv_dtype"] == "bfloat16"
    assert shown["devices"][-1]["weights_bytes"] == inspect(path).weights_bytes()
    assert cli.main(["generate", str(path), "--prompt", PROMPT, "--max-tokens", "8", "--json",
                     "--dtype", "float32"]) == 0
    generated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32"))
    ids = read_tokenizer(path).encode(PROMPT)
    expected = engine.generate(ids, SamplingParams(temperature=0, max_tokens=8)).run()
    assert generated["token_ids"] == expected.token_ids and generated["prompt_tokens"] == len(ids)


# -- files the engine refuses ---------------------------------------------------------------------------


def test_an_unknown_architecture_is_refused(models, tmp_path):
    path = write_gguf(models["llama"], tmp_path / "phi.gguf", "f32", arch="phi3")
    with pytest.raises(UnsupportedModelError, match="architecture 'phi3'.*llama, qwen2, qwen3"):
        inspect(path)


def test_a_missing_tensor_is_named(models, tmp_path):
    path = write_gguf(models["qwen2"], tmp_path / "m.gguf", "q8_0", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelFormatError, match=r"m.gguf: the qwen2 architecture needs tensor\(s\) blk.1.ffn_up.weight"):
        inspect(path)


def test_a_missing_metadata_key_is_named(models, tmp_path):
    path = write_gguf(models["llama"], tmp_path / "m.gguf", "f32")
    data = path.read_bytes()
    key = b"llama.block_count"
    path.write_bytes(data.replace(key, b"llama.block_cnt__"))  # same length: the file stays well formed
    with pytest.raises(ModelFormatError, match="no llama.block_count"):
        inspect(path)


def test_a_type_the_engine_refuses_is_named_before_anything_is_loaded(models, tmp_path):
    # Q2_K: a block format llama.cpp writes that Stowage does not compute on
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, "llama")
    q2_k = gguf.GGMLQuantizationType.Q2_K  # 84 bytes per block of 256
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 84), np.uint8), raw_dtype=q2_k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="'blk.0.ffn_down.weight' is stored as Q2_K, which Stowage does not read"):
        inspect(path)


def test_a_quantized_vector_is_refused(models, tmp_path):
    norm = gguf.quants.quantize(np.ones(64, np.float32), gguf.GGMLQuantizationType.Q8_0)  # two blocks
    path = write_gguf(models["llama"], tmp_path / "m.gguf", "f32",
                      override={"output_norm.weight": (norm, gguf.GGMLQuantizationType.Q8_0)})
    with pytest.raises(ModelFormatError, match="'output_norm.weight' is Q8_0 but has 1 dimensions"):
        Engine.load(path, cpu_plan(path, 64))


def test_rope_freqs_that_are_not_llama3s_are_refused(models, tmp_path):
    config = json.loads((models["llama-rope3"] / "config.json").read_text())
    factors = rope_factors(config, 16).numpy()
    assert factors.max() == 8.0 and (factors == 1).any()  # the test model's table has all three bands
    bad = np.array([1, 1, 2, 5, 3, 8, 8, 8], np.float32)  # not monotone in the band: no Llama 3 table
    path = write_gguf(models["llama"], tmp_path / "m.gguf", "f32", override={"rope_freqs.weight": (bad, None)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight holds frequency factors"):
        inspect(path)
