"""MXFP4 weights (gpt-oss's experts) against a dequantization written from the OCP Microscaling spec, not from ours:
ggml's block (1 byte E8M0 scale + 16 bytes of E2M1 codes, weight j in byte j's low nibble and j + 16 in its high
one) and the Hugging Face checkpoints' layout (codes and scales apart, weights 2j and 2j + 1 in byte j)."""

import numpy as np
import pytest
import torch

from stowage.kernels.quant_linear import Mxfp4Weight, QuantizedWeight
from stowage.kernels.quants import FORMATS, dequantize, dequantize_mxfp4_split


def e2m1(code: int) -> float:
    """OCP MX spec, E2M1: sign bit, two exponent bits (bias 1), one mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return sign * magnitude


def e8m0(byte: int) -> float:
    return 2.0 ** (int(byte) - 127)  # exact as a Python float for every byte used here


def spec_ggml(raw: np.ndarray) -> np.ndarray:
    """[rows, blocks * 17] ggml bytes -> float64 [rows, blocks * 32], one weight at a time."""
    rows, width = raw.shape
    out = np.zeros((rows, width // 17 * 32))
    for r in range(rows):
        for b in range(width // 17):
            block = raw[r, b * 17 : (b + 1) * 17]
            for j in range(16):
                out[r, b * 32 + j] = e2m1(block[1 + j] & 0xF) * e8m0(block[0])
                out[r, b * 32 + j + 16] = e2m1(block[1 + j] >> 4) * e8m0(block[0])
    return out


def spec_split(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes [rows, groups, 16], scales [rows, groups] -> float64 [rows, groups * 32]."""
    rows, groups, _ = codes.shape
    out = np.zeros((rows, groups * 32))
    for r in range(rows):
        for g in range(groups):
            for j in range(16):
                out[r, g * 32 + 2 * j] = e2m1(codes[r, g, j] & 0xF) * e8m0(scales[r, g])
                out[r, g * 32 + 2 * j + 1] = e2m1(codes[r, g, j] >> 4) * e8m0(scales[r, g])
    return out


def random_blocks(rng, rows: int, blocks: int) -> np.ndarray:
    raw = rng.integers(0, 256, size=(rows, blocks, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(120, 132, size=(rows, blocks))  # scales around 1
    raw[0, 0, 0], raw[0, 1, 0] = 0, 1  # the two subnormal scales, 2^-127 and 2^-126
    return raw.reshape(rows, blocks * 17)


def test_the_block_is_ggmls():
    assert (FORMATS["mxfp4"].elems_per_block, FORMATS["mxfp4"].bytes_per_block) == (32, 17)


def test_ggml_blocks_dequantize_exactly():
    raw = random_blocks(np.random.default_rng(0), 6, 4)
    ours = dequantize(raw, "mxfp4", (6, 128))
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.double().numpy(), spec_ggml(raw))
    assert ours[0, :32].abs().max() > 0  # the subnormal scales are not flushed to zero


def test_hugging_face_blocks_dequantize_exactly():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, size=(5, 3, 16), dtype=np.uint8)
    scales = rng.integers(110, 135, size=(5, 3), dtype=np.uint8)
    ours = dequantize_mxfp4_split(torch.from_numpy(codes), torch.from_numpy(scales))
    assert np.array_equal(ours.double().numpy(), spec_split(codes, scales))


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_products_equal_the_float32_product_of_the_spec_weights(rows, monkeypatch):
    from stowage.kernels import quant_linear

    monkeypatch.setattr(quant_linear.cpu_quant, "is_available", lambda: False)  # the tiles: the exact product
    rng = np.random.default_rng(2)
    raw = random_blocks(rng, 40, 2)  # [40, 64]
    x = torch.from_numpy(rng.standard_normal((rows, 64)).astype(np.float32))
    bias = torch.randn(40)
    expected = x.double() @ torch.from_numpy(spec_ggml(raw)).t() + bias.double()
    tolerance = 1e-6 * expected.abs().max().item()  # float32 sums of 64 products
    ggml = QuantizedWeight(raw, "mxfp4", (40, 64), torch.float32).linear(x, bias)
    assert (ggml.double() - expected).abs().max() <= tolerance
    # the same weights in the Hugging Face layout: codes regrouped so weight 2j, 2j + 1 share a byte
    values = spec_ggml(raw).reshape(40, 2, 32)
    codes, scales = _split_of(raw)
    assert np.array_equal(spec_split(codes, scales).reshape(40, 2, 32), values)
    hf = Mxfp4Weight(torch.from_numpy(codes), torch.from_numpy(scales), torch.float32).linear(x, bias)
    assert (hf.double() - expected).abs().max() <= tolerance


def _split_of(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml blocks [rows, blocks * 17] as Hugging Face's codes [rows, blocks, 16] and scales [rows, blocks]."""
    blocks = raw.reshape(raw.shape[0], -1, 17)
    nibbles = np.concatenate([blocks[..., 1:] & 0xF, blocks[..., 1:] >> 4], axis=-1)  # weight order 0..31
    codes = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    return codes, blocks[..., 0].copy()


# -- a gpt-oss checkpoint with MXFP4 experts, as OpenAI publishes it, read in place --

@pytest.fixture(scope="module")
def mxfp4_models(tmp_path_factory):
    from moe_factory import make_gpt_oss_mxfp4, make_moe_model

    base = make_moe_model(tmp_path_factory.mktemp("base"), "gpt_oss")
    root = tmp_path_factory.mktemp("mxfp4")
    return make_gpt_oss_mxfp4(base, root / "packed", root / "reference")


def test_mxfp4_experts_match_transformers_on_the_decoded_weights(mxfp4_models):
    from factory import cpu_plan, greedy_reference
    from transformers import AutoModelForCausalLM

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.kv_cache import Sequence
    from stowage.engine.runtime.sampler import SamplingParams

    packed, decoded = mxfp4_models
    reference = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32).eval()
    engine = Engine.load(packed, cpu_plan(packed, 256, prefill_chunk=5))
    assert engine.model.experts[0]["gate_up.0"].__class__ is Mxfp4Weight
    ids = engine.tokenizer.encode("Stowage plans memory: weights, KV cache, workspace and headroom.")
    seq = Sequence()
    ours = engine.model.forward(ids, seq, engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert theirs.abs().max() > 1.0 and (ours - theirs).abs().max().item() <= 1e-4
    engine.cache.release(seq)
    expected = greedy_reference(reference, ids, engine.eos_ids, 16)
    assert engine.generate(ids, SamplingParams(temperature=0, max_tokens=16)).run().token_ids == expected


def test_mxfp4_blocks_are_counted_as_experts_and_mapped_in_place(mxfp4_models):
    from factory import cpu_plan

    from stowage.engine.planning import inspect
    from stowage.engine.runtime.engine import Engine

    packed, decoded = mxfp4_models
    info = inspect(packed)
    e, h, inter = 8, 64, 64
    blocks = e * (2 * inter * h + h * inter) // 32 * 17  # 16 bytes of codes and 1 of scale per 32 weights
    biases = e * (2 * inter + h) * 4
    assert info.expert_bytes() == (blocks + biases,) * 4
    assert info.layer_bytes() == inspect(decoded).layer_bytes()
    plan = cpu_plan(packed, 64)
    report = Engine.load(packed, plan).memory_report()["cpu"]
    assert report["weights_copied"] == 0 and report["weights_mapped"] == info.weights_bytes()


def test_mxfp4_scales_of_the_wrong_shape_are_named(mxfp4_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from stowage.engine.errors import ModelFormatError
    from stowage.engine.planning import inspect

    bad = tmp_path / "bad"
    shutil.copytree(mxfp4_models[0], bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.3.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :1].clone()
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ModelFormatError, match=name):
        inspect(bad)


def test_the_native_decode_product_reads_mxfp4_blocks_on_every_instruction_set():
    """kernels/csrc (quant_blocks.h, quant_dots.h, quant_x86.h's AVX2 dot): activations quantized to 16 bits per 32,
    so within 1e-4 of the largest output of the spec weights' product (docs/kernels.md)."""
    from stowage.kernels import cpu_quant

    if not cpu_quant.is_available():
        pytest.skip("no native kernels here")
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, 48, 4)  # [48, 128]
    x = torch.from_numpy(rng.standard_normal((3, 128)).astype(np.float32))
    expected = x.double() @ torch.from_numpy(spec_ggml(raw)).t()
    for isa in cpu_quant.supported_isas():
        y = cpu_quant.matvec(torch.from_numpy(raw), "mxfp4", x, isa=isa)
        assert (y.double() - expected).abs().max() <= 1e-4 * expected.abs().max(), isa


def test_the_plan_charges_the_mxfp4_experts_tiles(mxfp4_models):
    """The experts' products dequantize a tile at a time (Mxfp4Weight): the planner charges that scratch, as for GGUF."""
    from factory import cpu_plan

    from stowage.kernels.quant_linear import MatrixShape, workspace_bytes

    packed, decoded = mxfp4_models
    ours, theirs = (cpu_plan(m, 64, prefill_chunk=16).device("cpu").workspace for m in (packed, decoded))
    assert theirs.dequant_bytes == 0
    assert ours.dequant_bytes == max(workspace_bytes(MatrixShape("mxfp4", *shape), 16, torch.float32, bias=True)
                                     for shape in ((128, 64), (64, 64))) > 0
    assert ours.widened_bytes == theirs.widened_bytes  # the rest is the same safetensors products
