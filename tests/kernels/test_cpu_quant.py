"""The native matrix-vector kernels on ggml blocks (kernels/cpu_quant.py), every type on every instruction set this
CPU has, against the float64 product of kernels.quants' dequantization with x quantized as they quantize it; and
torch when they cannot be built."""

import numpy as np
import pytest
import torch
from quant_blocks import BLOCK_TYPES, K_TYPES, quantized, random_blocks

from stowage.kernels import cbuild, cpu_quant, quant_linear
from stowage.kernels.quant_linear import QuantizedWeight
from stowage.kernels.quants import dequantize

# x is quantized once (quantize_x in kernels/csrc/quant_dots.h, repeated in quant_blocks.quantized): per 32 to 16-bit
# integers for the types of 32, per 256 to 8 bits for the K types (as llama.cpp's Q8_K); the products are exact
# integers, and what differs from the float64 product with that x is the order of the float32 sums and where the
# scales multiply: a few float32 ulps of |x| @ |W|.T (measured: < 1e-7 at 2560 inputs), stated with margin, as for
# the tile path.
RTOL = 1e-5


def isa_params():
    supported = cpu_quant.supported_isas()
    return [pytest.param(isa, marks=pytest.mark.skipif(isa not in supported, reason=f"this CPU has no {isa}"))
            for isa in cpu_quant.QUANT_ISAS]


@pytest.fixture(params=isa_params())
def isa(request):
    if cpu_quant.library(request.param) is None:
        pytest.skip("no C compiler to build the native kernels")
    return request.param


def check_close(ours, x, w, bias=None, *, type_name="q8_0", integer_x=True):
    """ours = x W.T (+ bias) for x quantized as the kernels quantize it for `type_name` (integer_x), and within
    that rounding of x."""
    bias = torch.zeros(w.shape[0]) if bias is None else bias
    xq, d = quantized(x, type_name) if integer_x else (x.double(), torch.zeros(x.shape))
    ref = xq @ w.double().t() + bias.double()
    scale = xq.abs() @ w.double().abs().t() + bias.double().abs()
    assert scale.max() > 0.1
    assert ((ours.double() - ref).abs() <= RTOL * scale).all(), ((ours.double() - ref).abs() / scale).max().item()
    # each x moved by at most its step d (d / 2 but where r is clamped): the error against the float product is
    # below sum |w| d
    bound = d.double() @ w.double().abs().t()
    exact = x.double() @ w.double().t() + bias.double()
    assert ((ours.double() - exact).abs() <= bound + RTOL * scale).all()


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("rows,cols,num_tokens", [(1, 256, 1), (37, 512, 1), (33, 1280, 3), (96, 2560, 8)])
def test_matches_the_dequantized_product(isa, type_name, rows, cols, num_tokens):
    assert cpu_quant.library(isa).quant_isa().decode() == isa  # the library really is the path asked for
    raw = torch.from_numpy(random_blocks(type_name, (rows, cols), seed=rows + cols))
    x = torch.randn(num_tokens, cols, generator=torch.Generator().manual_seed(rows))
    ours = cpu_quant.matvec(raw, type_name, x, isa=isa)
    assert ours.shape == (num_tokens, rows) and ours.dtype == torch.float32
    check_close(ours, x, dequantize(raw, type_name, (rows, cols)), type_name=type_name)


@pytest.mark.parametrize("type_name", ["q8_0", "q4_1", "q5_0", "q6_k"])
def test_zeros_ties_and_a_clamped_rest(isa, type_name):
    # 32 zeros (step 0); then a step of 1 with halves (ties to even in q, a rest of 128/256 clamped to 127)
    cols = 256
    x = torch.zeros(1, cols)
    x[0, 32:64] = torch.arange(32) - 15.5
    x[0, 63] = 127.0
    x[0, 64:] = torch.randn(cols - 64)
    raw = torch.from_numpy(random_blocks(type_name, (8, cols), seed=9))
    check_close(cpu_quant.matvec(raw, type_name, x, isa=isa), x, dequantize(raw, type_name, (8, cols)),
                type_name=type_name)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_the_k_form_of_zeros_and_ties(isa, type_name):
    # 256 zeros (scale 0); then a step of 1 with halves, ties to even
    x = torch.zeros(1, 512)
    x[0, 256:511] = torch.arange(255) / 2 - 63.5
    x[0, 511] = 127.0
    raw = torch.from_numpy(random_blocks(type_name, (8, 512), seed=3))
    ours = cpu_quant.matvec(raw, type_name, x, isa=isa)
    w = dequantize(raw, type_name, (8, 512))
    check_close(ours, x, w, type_name=type_name)
    assert not torch.allclose(quantized(x, type_name)[0], x.double())  # the ties did round: a real check


@pytest.mark.parametrize("type_name", ["q8_0", "q4_k", "q5_0", "q6_k"])
def test_bias_a_strided_input_and_a_mapped_weight(isa, type_name, tmp_path):
    rows, cols = 19, 768
    raw = random_blocks(type_name, (rows, cols), seed=4)
    raw.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r").reshape(raw.shape)
    held = QuantizedWeight(mapped, type_name, (rows, cols), torch.float32).raw
    assert held.data_ptr() == mapped.ctypes.data  # the kernel reads the map itself
    x = torch.randn(4, cols)[1:3]
    bias = torch.randn(rows).bfloat16()
    check_close(cpu_quant.matvec(held, type_name, x, bias, isa=isa), x, dequantize(raw, type_name, (rows, cols)),
                bias.float(), type_name=type_name)


def test_the_isa_switch(monkeypatch):
    monkeypatch.setenv("STOWAGE_QUANT_ISA", "scalar")
    cpu_quant.selected_isa.cache_clear()
    try:
        assert cpu_quant.selected_isa() == "scalar"
        monkeypatch.setenv("STOWAGE_QUANT_ISA", "sse9")
        cpu_quant.selected_isa.cache_clear()
        with pytest.raises(ValueError, match="not one of avx512, avx2, scalar"):
            cpu_quant.selected_isa()
        monkeypatch.setenv("STOWAGE_FORCE_REFERENCE", "1")
        cpu_quant.selected_isa.cache_clear()
        assert cpu_quant.selected_isa() is None and not cpu_quant.is_available()
    finally:
        monkeypatch.undo()
        cpu_quant.selected_isa.cache_clear()


def test_without_a_compiler_products_fall_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("STOWAGE_KERNEL_CACHE", str(tmp_path / "cache"))  # nothing built before either
    monkeypatch.setattr(cbuild, "PREBUILT", tmp_path / "no-prebuilt")  # nor shipped with the package
    cpu_quant.library.cache_clear()
    try:
        assert not cpu_quant.is_available()
        monkeypatch.setattr(quant_linear, "TILE_WEIGHTS", 1024)
        raw = random_blocks("q4_k", (8, 512), seed=1)
        x = torch.randn(1, 512)
        check_close(QuantizedWeight(raw, "q4_k", (8, 512), torch.float32).linear(x), x,
                    dequantize(raw, "q4_k", (8, 512)), integer_x=False)  # the tile path: float32 x
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))
    finally:
        monkeypatch.undo()
        cpu_quant.library.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_model_decodes_the_same_tokens_natively(dtype, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from factory import cpu_plan, make_model
    from gguf_factory import write_k_quant_gguf

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.sampler import SamplingParams

    if not cpu_quant.is_available():
        pytest.skip("the native kernels cannot be built here")
    hf = make_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.2)
    # Q4_K_M's mix (q4_k, q5_k, q6_k); Q8_0 files decode natively in tests/engine/test_gguf_model.py
    types = {"attn_v.weight": "q6_k", "ffn_down.weight": "q6_k", "ffn_up.weight": "q5_k"}
    path, _ = write_k_quant_gguf(hf, tmp_path / "m.gguf", tmp_path / "ref", types)
    monkeypatch.setenv("STOWAGE_NATIVE_PREFILL", "0")  # prefill on tiles in both: this compares decode's kernels
    calls = []
    native = cpu_quant.matvec
    monkeypatch.setattr(cpu_quant, "matvec", lambda *a, **k: calls.append(a[1]) or native(*a, **k))

    def greedy(max_native_tokens):
        monkeypatch.setattr(quant_linear, "MAX_NATIVE_TOKENS", max_native_tokens)
        engine = Engine.load(path, cpu_plan(path, 256, dtype=dtype))
        # these products, not the native decode step (kernels/csrc/decode_layer.c, tests/engine/test_native_decode.py)
        engine.model._native_for = (engine.cache, None)
        ids = engine.tokenizer.encode("Stowage plans memory: weights, KV cache, workspace and headroom.")
        return engine.generate(ids, SamplingParams(temperature=0, max_tokens=24)).run()

    max_native_tokens = quant_linear.MAX_NATIVE_TOKENS
    tiles = greedy(0)
    assert not calls
    ours = greedy(max_native_tokens)
    assert {"q4_k", "q5_k", "q6_k"} <= set(calls)  # decode ran on the blocks
    assert ours.token_ids == tiles.token_ids and len(ours.token_ids) > 8
