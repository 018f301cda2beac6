"""The native prefill products on ggml blocks (kernels/cpu_quant_matmul.py), every type on every instruction set this
CPU has: against the float64 product of kernels.quants' dequantization with x rounded to int8 as the kernels round
it, and against the exact product within the bound that rounding allows (docs/kernels.md)."""

import numpy as np
import pytest
import torch
from quant_blocks import random_blocks

from stowage.kernels import cpu_decode, cpu_quant_matmul, quant_linear
from stowage.kernels.quant_linear import QuantizedWeight
from stowage.kernels.quants import dequantize

TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
# With x as the kernels round it the products are exact integers; what differs from the float64 product is the order
# of the float32 sums and where the scales multiply: a few float32 ulps of |x| @ |W|.T (measured < 1.1e-7), with margin.
RTOL = 1e-5


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, cols] float32 as the kernels read it (float64 step * q, q = round(x / step) in -127..127), and the
    steps [n, cols / 32, 1]: the float32 steps of mm_quantize_row in kernels/csrc/quant_matmul.h."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    q = (blocks * torch.where(step > 0, 1 / step, 0)).round()  # ties to even, as the C code
    assert q.abs().max() <= 127
    return (q.double() * step.double()).reshape(x.shape), step


def check_close(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """ours = x W.T (+ bias) for x rounded as the kernels round it; and within that rounding of the exact product."""
    bias = torch.zeros(w.shape[0]) if bias is None else bias
    xq, step = rounded(x)
    ref = xq @ w.double().t() + bias.double()
    scale = xq.abs() @ w.double().abs().t() + bias.double().abs()
    assert scale.max() > 0.1  # the comparison is not between near-zero numbers
    err = (ours.double() - ref).abs()
    assert (err <= RTOL * scale).all(), (err / scale).max().item()
    # Each x moved by at most half its step (round to nearest): |error| <= sum_j |w_j| step_j / 2.
    bound = step.expand(*step.shape[:-1], 32).reshape(x.shape).double() / 2 @ w.double().abs().t()
    exact = x.double() @ w.double().t() + bias.double()
    assert ((ours.double() - exact).abs() <= bound + RTOL * scale).all()


@pytest.fixture(params=list(cpu_decode.ISAS))
def isa(request):
    if request.param not in cpu_decode.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    if cpu_decode.library(request.param) is None:
        pytest.skip("no C compiler to build the native kernels")
    return request.param


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows,cols,num_tokens", [(8, 256, 9), (77, 512, 14), (40, 1280, 33)])
def test_matches_the_dequantized_product(isa, type_name, rows, cols, num_tokens):
    # rows not whole groups of 8 nor panels of 32, tokens not whole tiles of 4
    assert cpu_quant_matmul.library(isa).decode_isa().decode() == isa  # the library really is that path
    raw = torch.from_numpy(random_blocks(type_name, (rows, cols), seed=rows + cols))
    x = torch.randn(num_tokens, cols, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(cols)) if rows == 77 else None
    ours = cpu_quant_matmul.matmul(raw, type_name, x, bias, isa=isa)
    assert ours.shape == (num_tokens, rows) and ours.dtype == torch.float32
    check_close(ours, x, dequantize(raw, type_name, (rows, cols)), bias)


@pytest.mark.parametrize("type_name", ["q8_0", "q4_1", "q5_0", "q6_k"])
def test_zeros_ties_and_large_values(isa, type_name):
    # a token of zeros (every step 0); 32 zeros in a token; a step of exactly 1 with halves (ties to even)
    cols = 256
    x = torch.randn(12, cols, generator=torch.Generator().manual_seed(3)) * 1e3
    x[0] = 0
    x[1, :32] = 0
    x[2, 32:64] = torch.arange(32) - 15.5
    x[2, 63] = 127.0
    raw = torch.from_numpy(random_blocks(type_name, (24, cols), seed=9))
    ours = cpu_quant_matmul.matmul(raw, type_name, x, isa=isa)
    assert (ours[0] == 0).all()
    check_close(ours, x, dequantize(raw, type_name, (24, cols)))


@pytest.mark.parametrize("type_name", ["q4_1", "q6_k"])
def test_bf16_in_and_out_round_as_torch(isa, type_name):
    # bf16 x is widened in C (exact) and y rounded there to nearest even: the float32 path's result, as torch rounds it
    raw = torch.from_numpy(random_blocks(type_name, (40, 512), seed=5))
    x = torch.randn(11, 512).bfloat16()
    ours = cpu_quant_matmul.matmul(raw, type_name, x, isa=isa)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, cpu_quant_matmul.matmul(raw, type_name, x.float(), isa=isa).bfloat16())


def test_a_mapped_weight_and_a_strided_input(isa, tmp_path):
    rows, cols = 19, 768
    raw = random_blocks("q4_k", (rows, cols), seed=4)
    raw.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r").reshape(raw.shape)
    held = QuantizedWeight(mapped, "q4_k", (rows, cols), torch.bfloat16).raw
    assert held.data_ptr() == mapped.ctypes.data  # the kernel reads the map itself
    x = torch.randn(cols, 20).t()[3:]  # not contiguous
    check_close(cpu_quant_matmul.matmul(held, "q4_k", x, isa=isa), x, dequantize(raw, "q4_k", (rows, cols)))


def test_quantized_weight_routes_16_bit_prefill_chunks_here(monkeypatch):
    if not cpu_quant_matmul.is_available():
        pytest.skip("the native kernels cannot be built here")
    calls = []
    native = cpu_quant_matmul.matmul
    monkeypatch.setattr(cpu_quant_matmul, "matmul", lambda *a, **k: calls.append(a[1]) or native(*a, **k))
    raw = random_blocks("q6_k", (40, 512), seed=2)
    x = torch.randn(quant_linear.MAX_NATIVE_TOKENS + 1, 512)
    bias = torch.randn(40)
    weight = QuantizedWeight(raw, "q6_k", (40, 512), torch.bfloat16)
    out = weight.linear(x.bfloat16(), bias)
    assert calls == ["q6_k"] and out.dtype == torch.bfloat16 and out.shape == (x.shape[0], 40)
    assert torch.equal(out, native(weight.raw, "q6_k", x.bfloat16().float(), bias).bfloat16())
    # float32 activations take the tiles (the exact product), as do a decode's rows and the switch turned off
    QuantizedWeight(raw, "q6_k", (40, 512), torch.float32).linear(x)
    QuantizedWeight(raw, "q6_k", (40, 512), torch.bfloat16).linear(x[: quant_linear.MAX_NATIVE_TOKENS].bfloat16())
    monkeypatch.setenv("STOWAGE_NATIVE_PREFILL", "0")
    QuantizedWeight(raw, "q6_k", (40, 512), torch.bfloat16).linear(x.bfloat16())
    assert calls == ["q6_k"]


def test_an_unknown_type_is_refused():
    if not cpu_quant_matmul.is_available():
        pytest.skip("the native kernels cannot be built here")
    assert not cpu_quant_matmul.supports("f16")
    with pytest.raises(ValueError, match="no native prefill kernel for 'f16'"):
        cpu_quant_matmul.matmul(torch.zeros(4, 64, dtype=torch.uint8), "f16", torch.zeros(9, 32))


def test_a_gguf_prefill_in_bf16_runs_here_and_stays_near_the_tiles(tmp_path, monkeypatch):
    # A Q4_K_M-like file (q4_k, q5_k, q6_k): a 40-token chunk's logits with the int8 products and with the tiles.
    # float32 activations take the tiles either way (identical); in bf16 the int8 rounding of x adds an error of the
    # size of bf16's own (measured: 0.52 against bf16's 0.29 from float32, logits of std 0.62), the argmax kept.
    pytest.importorskip("gguf")
    if not cpu_quant_matmul.is_available():
        pytest.skip("the native kernels cannot be built here")
    from factory import cpu_plan, make_model
    from gguf_factory import write_k_quant_gguf

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.runtime.kv_cache import Sequence

    hf = make_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.2)
    types = {"attn_v.weight": "q6_k", "ffn_down.weight": "q6_k", "ffn_up.weight": "q5_k"}
    path, _ = write_k_quant_gguf(hf, tmp_path / "m.gguf", tmp_path / "ref", types)
    ids = [(i * 13) % 500 + 3 for i in range(40)]
    calls = []
    native = cpu_quant_matmul.matmul
    monkeypatch.setattr(cpu_quant_matmul, "matmul", lambda *a, **k: calls.append(a[1]) or native(*a, **k))
    logits = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("STOWAGE_NATIVE_PREFILL", switch)
        for dtype in ("float32", "bfloat16"):
            engine = Engine.load(path, cpu_plan(path, 256, dtype=dtype))
            logits[switch, dtype] = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True).float()
            assert bool(calls) == (switch == "1" and dtype == "bfloat16")
            calls.clear()
    assert torch.equal(logits["1", "float32"], logits["0", "float32"])
    bf16_error = (logits["0", "bfloat16"] - logits["0", "float32"]).abs().max()
    assert 0 < (logits["1", "bfloat16"] - logits["0", "bfloat16"]).abs().max() <= 3 * bf16_error
    assert (logits["1", "bfloat16"].argmax(-1) == logits["0", "bfloat16"].argmax(-1)).float().mean() >= 0.9
