"""ggml block formats: our torch dequantization equals gguf-py's numpy one bit for bit, whole and by row tiles."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GGML  # noqa: E402

from stowage.kernels.quants import FORMATS, dequantize, dequantize_rows  # noqa: E402
from quant_blocks import BLOCK_TYPES, random_blocks  # noqa: E402

QUANTIZABLE = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]  # gguf-py's numpy quantizer has no K-quants


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGML[type_name.upper()])


def test_block_sizes_are_ggmls():
    for name, fmt in FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[GGML[name.upper()]] == (fmt.elems_per_block, fmt.bytes_per_block), name


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("shape", [(1, 256), (5, 512), (2, 3, 768)])
def test_random_blocks_match_gguf_py_exactly(type_name, shape):
    raw = random_blocks(type_name, shape, seed=shape[-1] + len(shape))
    ours = dequantize(raw, type_name, shape)
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert np.array_equal(ours.numpy(), reference(raw, type_name))


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_quantized_weights_match_gguf_py_exactly(type_name):
    weights = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(weights, GGML[type_name.upper()])
    ours = dequantize(raw, type_name, weights.shape)
    assert np.array_equal(ours.numpy(), reference(raw, type_name))
    # and it is the weights, to the format's precision (4 bits: a step is about max|w| / 8)
    assert np.abs(ours.numpy() - weights).max() < 0.5


@pytest.mark.parametrize("type_name", ["f32", "f16", "bf16"])
def test_plain_types_pass_through(type_name):
    weights = np.random.default_rng(2).standard_normal((3, 40)).astype(np.float32)
    raw = gguf.quants.quantize(weights, GGML[type_name.upper()]).view(np.uint8)
    ours = dequantize(raw, type_name, weights.shape)
    assert np.array_equal(ours.numpy(), reference(raw, type_name))
    if type_name == "f32":
        assert np.array_equal(ours.numpy(), weights)


@pytest.mark.parametrize("type_name", BLOCK_TYPES + ["f16", "bf16"])
def test_row_tiles_match_the_whole(type_name):
    shape = (7, 512)
    raw = (random_blocks(type_name, shape, seed=3) if type_name in BLOCK_TYPES
           else gguf.quants.quantize(np.random.default_rng(3).standard_normal(shape).astype(np.float32),
                                     GGML[type_name.upper()]).view(np.uint8))
    whole = reference(raw, type_name)
    tiles = [(0, 1), (1, 4), (4, 7), (3, 3)]
    for start, end in tiles:
        tile = dequantize_rows(raw, type_name, shape, start, end)
        assert tile.shape == (end - start, 512)
        assert np.array_equal(tile.numpy(), whole[start:end])


def test_rows_of_a_3d_tensor_are_its_flattened_leading_dims():
    shape = (2, 3, 256)
    raw = random_blocks("q4_k", shape, seed=4)
    whole = reference(raw, "q4_k").reshape(6, 256)
    assert np.array_equal(dequantize_rows(raw, "q4_k", shape, 2, 5).numpy(), whole[2:5])


def test_a_torch_uint8_tensor_is_read_like_an_array():
    raw = random_blocks("q6_k", (4, 256), seed=5)
    assert torch.equal(dequantize(torch.from_numpy(raw), "q6_k", (4, 256)), dequantize(raw, "q6_k", (4, 256)))
    assert torch.equal(dequantize_rows(torch.from_numpy(raw), "q6_k", (4, 256), 1, 3),
                       dequantize(raw, "q6_k", (4, 256))[1:3])


def test_hand_checked_blocks():
    # q8_0: d = 0.5, qs = -128, -1, 0, 1, ... -> weights d * q
    q8 = np.zeros(34, np.uint8)
    q8[:2] = np.array([0.5], np.float16).view(np.uint8)
    q8[2:6] = np.array([-128, -1, 0, 1], np.int8).view(np.uint8)
    assert dequantize(q8, "q8_0", (32,))[:5].tolist() == [-64.0, -0.5, 0.0, 0.5, 0.0]
    # q4_0: d = 2, byte 0 = 0x9A: weight 0 is its low nibble (10 - 8) * 2, weight 16 its high one (9 - 8) * 2
    q4 = np.full(18, 0x88, np.uint8)
    q4[:2] = np.array([2.0], np.float16).view(np.uint8)
    q4[2] = 0x9A
    weights = dequantize(q4, "q4_0", (32,))
    assert (weights[0].item(), weights[16].item(), weights[1].item()) == (4.0, 2.0, 0.0)


def test_misuse_is_refused():
    raw = random_blocks("q8_0", (2, 64))
    with pytest.raises(ValueError, match="cannot hold shape"):
        dequantize(raw, "q8_0", (3, 64))
    with pytest.raises(ValueError, match="not a whole number"):
        dequantize(raw, "q8_0", (4, 16))
    with pytest.raises(ValueError, match="not within the 2 rows"):
        dequantize_rows(raw, "q8_0", (2, 64), 1, 3)
    with pytest.raises(ValueError, match="unknown ggml type 'iq2_xxs'"):
        dequantize(raw, "iq2_xxs", (2, 64))
