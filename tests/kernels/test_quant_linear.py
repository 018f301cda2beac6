"""Products on ggml blocks (kernels/quant_linear.py) against the float32 product of the dequantized weights,
their zero-copy hold on a memory map, and the scratch they state against what a fresh process measures."""

import json

import numpy as np
import pytest
import torch
from factory import run_fresh
from quant_blocks import BLOCK_TYPES, K_TYPES, quantized, random_blocks

from stowage.kernels import cpu_quant, quant_linear
from stowage.kernels.quant_linear import (
    DEQUANT_PEAK_BYTES, MatrixShape, QuantizedWeight, is_tiled, rows_workspace_bytes, workspace_bytes,
)
from stowage.kernels.quants import FORMATS, dequantize

ALL_TYPES = BLOCK_TYPES + ["f32", "f16", "bf16"]
# The product sums in float32 in another order than the reference: each output may differ by a few ulps of
# the sum of |x_i * w_i| (the error bound of a float32 dot product of this length is ~ in * 2^-24 of it).
FP32_RTOL = 1e-5


def weight_bytes(type_name: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    if type_name in BLOCK_TYPES:
        return random_blocks(type_name, shape, seed)
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05)
    return w.to(FORMATS[type_name].dtype).view(torch.uint8).numpy()


def check_close(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None, rtol=FP32_RTOL, k_form=False):
    """|ours - x @ w.T| within rtol of |x| @ |w|.T (+|bias|): the float32 summation-order bound. `k_form`: against
    x as the native kernels read it for the K types (8 bits per 256; their 16 bits per 32 for the others lie
    within rtol)."""
    if k_form:
        x = quantized(x, "q4_k")[0]
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    err = (ours.double() - ref).abs()
    assert scale.max() > 0.1  # the comparison is not between near-zero numbers
    assert (err <= rtol * scale + 1e-30).all(), (err / scale).max().item()


@pytest.fixture(params=["tiles", "native"])
def path(request, monkeypatch):
    """Each product through the torch tile path, and through the native kernels where they build (decode only)."""
    if request.param == "native" and not cpu_quant.is_available():
        pytest.skip("the native kernels cannot be built here")
    monkeypatch.setattr(quant_linear, "MAX_NATIVE_TOKENS", 0 if request.param == "tiles" else 8)
    monkeypatch.setenv("STOWAGE_NATIVE_PREFILL", "0")  # the prefill kernels' int8 x: tests/kernels/test_quant_matmul.py
    return request.param


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_linear_matches_the_dequantized_product(type_name, num_tokens, path, monkeypatch):
    # 3 rows per tile: the last tile is partial, and tiles straddle nothing but whole rows
    monkeypatch.setattr(quant_linear, "TILE_WEIGHTS", 3 * 512)
    shape = (10, 512)
    raw = weight_bytes(type_name, shape, seed=num_tokens)
    weight = QuantizedWeight(raw, type_name, shape, torch.float32)
    assert weight.shape.tile_rows == 3
    x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(1))
    out = weight.linear(x)
    assert out.shape == (num_tokens, shape[0]) and out.dtype == torch.float32 and out.is_contiguous()
    check_close(out, x, dequantize(raw, type_name, shape), k_form=path == "native" and type_name in K_TYPES)


@pytest.mark.parametrize("type_name", ["q8_0", "q4_k", "q6_k"])
def test_bias_and_bf16_activations(type_name, path):
    shape = (48, 256)
    raw = weight_bytes(type_name, shape, seed=7)
    w = dequantize(raw, type_name, shape)
    bias = torch.randn(shape[0]) * 0.1
    x = torch.randn(4, shape[1], generator=torch.Generator().manual_seed(2))
    k_form = path == "native" and type_name in K_TYPES
    check_close(QuantizedWeight(raw, type_name, shape, torch.float32).linear(x, bias), x, w, bias, k_form=k_form)
    # bf16 in and out: the same float32 product (of the bf16 input), rounded once to bf16 at the end
    xb = x.bfloat16()
    out = QuantizedWeight(raw, type_name, shape, torch.bfloat16).linear(xb, bias)
    assert out.dtype == torch.bfloat16
    check_close(out.float(), xb.float(), w, bias, rtol=2**-8 + FP32_RTOL, k_form=k_form)


@pytest.mark.parametrize("type_name", ["q8_0", "q5_1", "q4_k", "f16"])
def test_rows_are_the_dequantized_rows_exactly(type_name):
    shape = (20, 256)
    raw = weight_bytes(type_name, shape, seed=3)
    ids = torch.tensor([5, 0, 19, 5])
    rows = QuantizedWeight(raw, type_name, shape, torch.float32).rows(ids)
    assert torch.equal(rows, dequantize(raw, type_name, shape)[ids])


def test_a_memory_map_is_held_in_place(tmp_path, path):
    raw = random_blocks("q4_k", (8, 512))
    raw.tofile(tmp_path / "w.bin")
    mapped = np.memmap(tmp_path / "w.bin", dtype=np.uint8, mode="r").reshape(raw.shape)
    weight = QuantizedWeight(mapped, "q4_k", (8, 512), torch.float32)
    assert weight.data_ptr() == mapped.ctypes.data and weight.nbytes == raw.nbytes
    assert torch.equal(weight.linear(torch.ones(1, 512)), QuantizedWeight(raw, "q4_k", (8, 512), torch.float32)
                       .linear(torch.ones(1, 512)))


def test_what_computes_in_tiles():
    assert all(is_tiled(t, torch.bfloat16) for t in BLOCK_TYPES)
    assert is_tiled("f16", torch.bfloat16) and is_tiled("f32", torch.bfloat16)
    assert not is_tiled("bf16", torch.bfloat16) and not is_tiled("f32", torch.float32)


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="unknown ggml type"):
        QuantizedWeight(np.zeros((2, 34), np.uint8), "iq2_xxs", (2, 32), torch.float32)
    with pytest.raises(ValueError, match="is a matrix"):
        QuantizedWeight(np.zeros(34, np.uint8), "q8_0", (32,), torch.float32)


def test_workspace_by_hand():
    # q8_0 [4096, 4096], 512 bf16 tokens: a tile is 2^20 / 4096 = 256 rows of 4096 weights at 8.5 bytes each,
    # plus x in float32 (512 * 4096 * 4) and the float32 accumulator (4096 * 512 * 4)
    shape = MatrixShape("q8_0", 4096, 4096)
    assert shape.tile_rows == 256
    assert workspace_bytes(shape, 512, torch.bfloat16) == 256 * 4096 * 17 // 2 + 2 * 512 * 4096 * 4
    # float32 activations are used as they are; a bias adds a float32 [n, out] only for other dtypes
    assert workspace_bytes(shape, 512, torch.float32, bias=True) == 256 * 4096 * 17 // 2 + 512 * 4096 * 4
    assert workspace_bytes(shape, 1, torch.bfloat16, bias=True) == 256 * 4096 * 17 // 2 + 4096 * 4 * 3
    # an embedding lookup reads its rows' blocks and dequantizes them: 34 bytes per 32 weights, then 8.5 per weight
    assert rows_workspace_bytes(MatrixShape("q8_0", 32000, 4096), 16) == 16 * 4096 // 32 * 34 + 16 * 4096 * 17 // 2
    # a matrix narrower than a tile is one tile of all its rows
    assert MatrixShape("q4_k", 8, 256).tile_rows == 8


PEAK = r"""
import json, sys, torch
sys.path.insert(0, "tests/kernels")
torch.set_num_threads(1)
from quant_blocks import random_blocks
from stowage.kernels.quant_linear import QuantizedWeight
type_name, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
weight = QuantizedWeight(random_blocks(type_name, (rows, cols)), type_name, (rows, cols), torch.bfloat16)
weight.linear(torch.randn(1, cols).bfloat16())  # the runtime's first-use pages, before the baseline

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

peaks = {}
for n in map(int, sys.argv[4:]):
    x = torch.randn(n, cols).bfloat16()
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the resident size now
    base = status("VmRSS:")
    out = weight.linear(x)
    peaks[n] = {"peak": status("VmHWM:") - base, "out": out.numel() * out.element_size()}
    del out
print(json.dumps(peaks))
"""


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["q8_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_the_stated_scratch_bounds_the_measured_peak(type_name, monkeypatch):
    # Every large allocation mmapped and unmapped when freed, so the resident size follows what is live.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    # one tile is the whole 4096 x 256 matrix (2^20 weights): the peak resident growth of a product is its
    # scratch and its output, megabytes against tens of KiB of noise
    rows, cols = 4096, 256
    monkeypatch.setenv("STOWAGE_FORCE_REFERENCE", "1")  # the tile path, for decode too
    out = run_fresh(PEAK, type_name, rows, cols, 1, 512)
    assert out.returncode == 0, out.stderr
    measured = {int(n): m for n, m in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    shape = MatrixShape(type_name, rows, cols)
    # decode: one row, so the scratch is the tile's dequantization; the table states it within 15%
    tile = DEQUANT_PEAK_BYTES[type_name] * rows * cols
    assert 0.85 * tile <= measured[1]["peak"] <= workspace_bytes(shape, 1, torch.bfloat16) + 2**18, measured
    # prefill: plus x in float32 and the accumulator. The BLAS packing buffers (~1.5 MiB here) are the CPU
    # overhead the planner charges every device (engine/planning/workspace.py CPU_OVERHEAD_BYTES)
    stated = workspace_bytes(shape, 512, torch.bfloat16) + measured[512]["out"]
    assert measured[512]["peak"] <= stated + 2 * 2**20, (measured, stated)


@pytest.mark.slow
@pytest.mark.skipif(not cpu_quant.is_available(), reason="needs a C compiler for the native kernels")
def test_native_decode_needs_no_tile(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    rows, cols = 4096, 256
    out = run_fresh(PEAK, "q4_k", rows, cols, 1, 8)
    assert out.returncode == 0, out.stderr
    measured = {int(n): m for n, m in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    shape = MatrixShape("q4_k", rows, cols)
    for n in (1, 8):  # x and y in float32 and the output, under the tile path's statement; no tile
        assert measured[n]["peak"] <= n * (cols + rows) * 4 + measured[n]["out"] + 2**18, measured
        assert measured[n]["peak"] < workspace_bytes(shape, n, torch.bfloat16) / 4
