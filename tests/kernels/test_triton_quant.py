"""The Triton dequantize-and-multiply kernels (kernels/triton_quant.py) against the CPU: under TRITON_INTERPRET=1
here (conftest.py), compiled on a GPU by test_compiled_kernels_match_the_cpu (skipped without one)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quant_blocks import BLOCK_TYPES, K_TYPES, quantized, random_blocks

from stowage.kernels import cpu_quant, quant_linear, triton_quant
from stowage.kernels.quant_linear import QuantizedWeight
from stowage.kernels.quants import dequantize

TYPES = list(triton_quant.TYPES)
assert set(TYPES) == set(BLOCK_TYPES)  # every block format the reader opens
FP32_RTOL = 1e-5  # the float32 summation-order bound, as tests/kernels/test_quant_linear.py states it


def check_close(ours, x, w, bias=None, rtol=FP32_RTOL):
    """|ours - x @ w.T| within rtol of |x| @ |w|.T (+|bias|)."""
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    assert scale.max() > 0.1
    err = (ours.double() - ref).abs()
    assert (err <= rtol * scale + 1e-30).all(), (err / scale).max().item()


def blocks(type_name, shape, seed=0):
    return torch.from_numpy(random_blocks(type_name, shape, seed))


def test_interpreter_is_active():
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("type_name", TYPES)
def test_the_weights_are_unpacked_exactly(type_name):
    # x = I: every output is one weight times 1.0, so y == W.T bit for bit where the unpacking is exact
    shape = (70, 256)  # 70 rows: two programs of 64, the second partial
    raw = blocks(type_name, shape)
    y = triton_quant.matmul(raw, type_name, torch.eye(shape[1]))
    assert torch.equal(y, dequantize(raw, type_name, shape).t())


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
def test_products_match_the_cpu(type_name, num_tokens):
    shape = (40, 512)
    raw = blocks(type_name, shape, seed=num_tokens)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(3)) * 0.1
    x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
    cpu = QuantizedWeight(raw, type_name, shape, torch.float32).linear(x, bias)  # native or tiles, as it runs here
    ours = triton_quant.matmul(raw, type_name, x, bias)
    assert ours.shape == (num_tokens, shape[0]) and ours.dtype == torch.float32
    w = dequantize(raw, type_name, shape)
    check_close(ours, x, w, bias)
    # the native kernels' K types read x at 8 bits per 256 (tests/kernels/test_cpu_quant.py); both paths are
    # otherwise the dequantized product
    k_form = type_name in K_TYPES and cpu_quant.is_available() and num_tokens <= quant_linear.MAX_NATIVE_TOKENS
    check_close(cpu, quantized(x, type_name)[0].float() if k_form else x, w, bias)
    if not k_form:
        assert torch.allclose(ours, cpu, rtol=0, atol=2 * FP32_RTOL * (x.abs() @ w.abs().t()).max().item())


def test_bf16_activations_and_result():
    shape = (64, 256)
    raw = blocks("q4_k", shape, seed=9)
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    ours = triton_quant.matmul(raw, "q4_k", x, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    check_close(ours.float(), x.float(), dequantize(raw, "q4_k", shape), rtol=2**-8 + FP32_RTOL)


def test_misuse_is_refused():
    raw = blocks("q8_0", (4, 64))
    with pytest.raises(ValueError, match="do not hold 96 weights"):
        triton_quant.matmul(raw, "q8_0", torch.zeros(1, 96))
    assert not triton_quant.supports("f16") and triton_quant.supports("q6_k")


GPU_SCRIPT = r"""
import torch
from quant_blocks import K_TYPES, random_blocks
from stowage.kernels.quant_linear import QuantizedWeight
from stowage.kernels.quants import dequantize
from stowage.kernels import cpu_quant, quant_linear, triton_quant
worst = 0.0
for type_name in triton_quant.TYPES:
    for num_tokens, shape, dtype in [(1, (4096, 4096), torch.bfloat16), (7, (1000, 2048), torch.float32),
                                     (512, (2048, 1024), torch.bfloat16), (600, (96, 512), torch.float32)]:
        raw = torch.from_numpy(random_blocks(type_name, shape, seed=num_tokens))
        x = torch.randn(num_tokens, shape[1]).to(dtype)
        bias = torch.randn(shape[0]) * 0.1
        cpu = QuantizedWeight(raw, type_name, shape, dtype).linear(x, bias).float()
        gpu = QuantizedWeight(raw, type_name, shape, dtype).to(torch.device("cuda")).linear(x.cuda(), bias.cuda())
        assert gpu.dtype == dtype and gpu.device.type == "cuda"
        w = dequantize(raw, type_name, shape)
        scale = x.double().abs() @ w.double().abs().t() + bias.double().abs()
        if type_name in K_TYPES and num_tokens <= quant_linear.MAX_NATIVE_TOKENS and cpu_quant.is_available():
            # the CPU's native K-type dots read x at 8 bits (test_cpu_quant.py): the GPU's is the exact product
            cpu = (x.double() @ w.double().t() + bias.double()).float()
        # bf16: one rounding of the result (2^-8) and TF32 products (2^-11 of each term); float32: IEEE products
        rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
        err = ((gpu.cpu().double() - cpu.double()).abs() / scale).max().item()
        worst = max(worst, err / rtol)
        assert err <= rtol, (type_name, num_tokens, shape, dtype, err)
        print("ok ", type_name, num_tokens, shape, dtype, f"{err:.2e}")
print(f"worst {worst:.3f} of the tolerance")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled Triton kernels need one")
def test_compiled_kernels_match_the_cpu():
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-P", "-c", GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok ") == 4 * len(triton_quant.TYPES)
