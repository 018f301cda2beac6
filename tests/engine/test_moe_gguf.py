"""Mixture-of-experts GGUF files (qwen3moe; llama with ffn_*_exps for Mixtral) against transformers on the same
(dequantized) weights: 3-D expert tensors with llama.cpp's names, mapped in place (docs/moe.md)."""

import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from factory import compare_logits_and_tokens, cpu_plan  # noqa: E402
from gguf_factory import dequantized_copy, random_k_blocks  # noqa: E402
from moe_factory import gguf_stored, make_moe_model, write_moe_gguf  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from stowage.engine.errors import ModelFormatError  # noqa: E402
from stowage.engine.formats.config import ModelConfig  # noqa: E402
from stowage.engine.formats.gguf_model import gguf_name, hf_name  # noqa: E402
from stowage.engine.formats.source import read_config  # noqa: E402
from stowage.engine.planning import inspect  # noqa: E402
from stowage.engine.runtime.engine import Engine  # noqa: E402
from stowage.kernels import quant_linear  # noqa: E402
from stowage.kernels.quant_linear import QuantizedWeight  # noqa: E402

PROMPT = "Stowage plans memory: weights, KV cache, workspace and headroom. Pick a context size with the slider;"
ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
QTYPES = ("f32", "f16", "q8_0")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_moe_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def files(models, tmp_path_factory):
    """(arch, qtype) -> (the GGUF file, the HF folder with the weights that file holds)."""
    root = tmp_path_factory.mktemp("gguf")
    return {(arch, q): (write_moe_gguf(hf, root / f"{arch}-{q}.gguf", q),
                        hf if q == "f32" else dequantized_copy(hf, root / f"{arch}-{q}-hf", q, gguf_stored))
            for arch, hf in models.items() for q in QTYPES}


def test_llama_cpp_expert_names_map_to_the_layouts_and_back():
    for arch, block in (("qwen3moe", "mlp"), ("llama", "block_sparse_moe")):
        for gg, hf in ((f"blk.2.ffn_gate_inp.weight", f"model.layers.2.{block}.gate.weight"),
                       (f"blk.2.ffn_down_exps.weight", f"model.layers.2.{block}.experts.down_proj.weight")):
            assert hf_name(gg, arch) == hf and gguf_name(hf, arch) == gg


@pytest.mark.parametrize("arch", ARCHS)
def test_config_from_metadata_is_the_config_json(files, models, arch):
    ours, theirs = read_config(files[arch, "f32"][0]), ModelConfig.from_dir(models[arch])
    assert ours.model_type == arch
    same = ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "norm_topk_prob", "dense_layers",
            "shared_expert_intermediate_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "qk_norm",
            "qkv_bias")
    assert {f: getattr(ours, f) for f in same} == {f: getattr(theirs, f) for f in same}


def test_without_expert_weights_norm_a_qwen3moe_file_renormalizes_as_llama_cpp_does(models, tmp_path):
    assert not ModelConfig.from_dir(models["qwen3_moe"]).norm_topk_prob
    path = write_moe_gguf(models["qwen3_moe"], tmp_path / "m.gguf", weights_norm_key=False)
    assert read_config(path).norm_topk_prob


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_transformers(files, arch, qtype, monkeypatch):
    path, hf = files[arch, qtype]
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32", prefill_chunk=7))
    expert = engine.model.experts[0]["up.3"]
    if qtype == "q8_0":
        assert isinstance(expert, QuantizedWeight)
        # one expert is one slice of the mapped 3-D tensor: expert 3 lies 3 slices past expert 0
        assert expert.data_ptr() - engine.model.experts[0]["up.0"].data_ptr() == 3 * expert.nbytes
    report = engine.memory_report()["cpu"]
    assert report["weights_copied"] + report["weights_mapped"] == engine.plan.device("cpu").weights_bytes
    if qtype != "f16":  # forced float32 converts f16 tensors (a copy the plan counts); the others stay mapped
        assert report["weights_copied"] == 0
    if qtype == "q8_0":
        # the native kernels quantize each activation row to 16 bits per 32 (kernels/cpu_quant.py): within 1e-3
        # of the dequantized weights' product (logits of ~6); the tile path is that product itself, within 1e-4
        compare_logits_and_tokens(engine, reference, PROMPT, 1e-3)
        monkeypatch.setattr(quant_linear.cpu_quant, "is_available", lambda: False)
    compare_logits_and_tokens(engine, reference, PROMPT, 1e-4)


def test_q4_k_experts_match_their_dequantized_blocks(tmp_path, monkeypatch):
    """Q4_K experts (gguf-py cannot quantize to it: random blocks), against transformers on their dequantization."""
    hf = make_moe_model(tmp_path / "hf", "qwen3_moe", hidden_size=256, moe_intermediate_size=256,
                        num_hidden_layers=2, norm_topk_prob=True)
    rng = np.random.default_rng(0)
    override, reference_dir = {}, shutil.copytree(hf, tmp_path / "ref")
    from safetensors.torch import load_file, save_file

    tensors = load_file(reference_dir / "model.safetensors")
    for layer in range(2):
        for role in ("gate", "up", "down"):
            blocks = random_k_blocks("q4_k", (8 * 256, 256), rng).reshape(8, 256, -1)  # [experts, out, row bytes]
            override[f"blk.{layer}.ffn_{role}_exps.weight"] = (blocks, gguf.GGMLQuantizationType.Q4_K)
            weights = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).copy())
            for e in range(8):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{role}_proj.weight"] = weights[e].contiguous()
    save_file(tensors, reference_dir / "model.safetensors")
    path = write_moe_gguf(hf, tmp_path / "m.gguf", "f32", override=override)
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32", prefill_chunk=7))
    assert engine.model.experts[1]["down.7"].type_name == "q4_k"
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    # the native kernels read x at 8 bits with a scale per 256 for the K types (llama.cpp's Q8_K, kernels/csrc/
    # quant_dots.h): within 0.5% of the largest logit (~12), the same greedy tokens
    compare_logits_and_tokens(engine, reference, PROMPT, 0.06)
    monkeypatch.setattr(quant_linear.cpu_quant, "is_available", lambda: False)
    compare_logits_and_tokens(engine, reference, PROMPT, 1e-4)  # the tile path: the dequantized blocks' product


def test_a_missing_expert_tensor_is_named(models, tmp_path):
    path = write_moe_gguf(models["mixtral"], tmp_path / "m.gguf", drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ModelFormatError, match=r"needs tensor\(s\) blk.1.ffn_up_exps.weight"):
        inspect(path)


def test_an_expert_tensor_of_the_wrong_shape_is_named(models, tmp_path):
    wrong = np.zeros((6, 64, 64), np.float32)  # 6 experts where the file says 8
    path = write_moe_gguf(models["qwen3_moe"], tmp_path / "m.gguf",
                          override={"blk.0.ffn_down_exps.weight": (wrong, None)})
    with pytest.raises(ModelFormatError, match=r"model.layers.0.mlp.experts.down_proj.weight' has shape \[6, 64, 64\]"):
        inspect(path)


def test_inspect_counts_each_3d_expert_tensor_once(files):
    from stowage.engine.formats.source import open_source

    path, _ = files["qwen3_moe", "q8_0"]
    info, specs = inspect(path), open_source(path).specs
    assert [sorted(layer) for layer in info.layout.experts] == [["down", "gate", "up"]] * 3
    assert sum(info.expert_bytes()) == sum(specs[n].nbytes for layer in info.layout.experts for n in layer.values())
