"""Prefill products on ggml blocks for the CPU: a chunk's activations quantized to int8 once, integer tiles.

`matmul(raw, type_name, x, bias)` computes x @ W.T for a chunk of rows straight from the blocks (the memory map): x
is quantized per 32 values to int8 with a float scale (as llama.cpp's Q8_0 / Q8_K), each panel of 32 weight rows is
unpacked once per call to bytes with a scale and a minimum per 32 (per 16 for Q6_K), and tiles of 16 rows x 3 tokens
are integer dot products (kernels/csrc/quant_matmul.h; docs/kernels.md states the accuracy). It is part of the
native decode library (kernels/cpu_decode.py) and runs on its thread pool, as prefill attention does, at the level
that library runs (`STOWAGE_DECODE_ISA`); where that library is off or missing, or with `STOWAGE_NATIVE_PREFILL=0`,
`runs()` is False and kernels/quant_linear.py keeps its float32 tiles.
"""

from __future__ import annotations

import ctypes
import os

import torch

from . import cpu_decode

SWITCH = "STOWAGE_NATIVE_PREFILL"  # "0": the float32 tiles instead (the switch beside STOWAGE_NATIVE_DECODE)
X_BF16, Y_BF16 = 1, 2  # quant_matmul's flags
PANEL_ROWS = 32  # quant_matmul.h's MM_PANEL_ROWS


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The decode library of `isa` (the selected one by default) with quant_matmul's signature, or None."""
    lib = cpu_decode.library(isa) if isa is not None else cpu_decode.current()
    if lib is not None and lib.quant_matmul.argtypes is None:
        lib.quant_matmul.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.quant_matmul.restype = ctypes.c_int
        lib.quant_matmul_type_id.argtypes = [ctypes.c_char_p]
        lib.quant_matmul_type_id.restype = ctypes.c_int
    return lib


def is_available() -> bool:
    return library() is not None


def supports(type_name: str) -> bool:
    """Whether `matmul` takes weights stored as `type_name` (requires is_available())."""
    return library().quant_matmul_type_id(type_name.encode()) >= 0


def runs(type_name: str) -> bool:
    """Whether a prefill chunk on weights stored as `type_name` runs here: switched on, built, a type it takes."""
    return os.environ.get(SWITCH, "1") != "0" and is_available() and supports(type_name)


def scratch_bytes(type_name: str, num_tokens: int, in_features: int, threads: int) -> int:
    """Peak scratch of one `matmul` of `num_tokens` rows (the output not included): x as int8 with a scale and a sum
    per 32 (two sums for Q6_K), and each thread's panel of unpacked rows (quant_matmul.h; kept between calls)."""
    sums = 2 if type_name == "q6_k" else 1
    groups = in_features // 32
    x = num_tokens * (in_features + 4 * groups * (1 + sums))
    panel = PANEL_ROWS * (in_features + 2 * 4 * sums * groups) + 8 * in_features
    return x + threads * panel


def matmul(raw: torch.Tensor, type_name: str, x: torch.Tensor, bias: torch.Tensor | None = None, *,
           isa: str | None = None) -> torch.Tensor:
    """x [n, in] @ W.T (+ bias [out]) -> [n, out] in x's dtype (float32 or bfloat16; bf16 is read and rounded in C,
    with no float32 copy); raw: W's blocks, uint8 [out, row_bytes]."""
    lib = library(isa)
    type_id = lib.quant_matmul_type_id(type_name.encode())
    if type_id < 0:
        raise ValueError(f"no native prefill kernel for {type_name!r}")
    out_features, (n, in_features) = raw.shape[0], x.shape
    assert raw.is_contiguous() and raw.dtype == torch.uint8 and x.dtype in (torch.float32, torch.bfloat16)
    x = x.contiguous()
    y = torch.empty(n, out_features, dtype=x.dtype)
    flags = X_BF16 | Y_BF16 if x.dtype == torch.bfloat16 else 0
    if bias is not None:
        bias = bias.float().contiguous()
    status = lib.quant_matmul(type_id, raw.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None,
                              y.data_ptr(), out_features, in_features, n, flags)
    if status != 0:
        raise MemoryError(f"quant_matmul could not allocate {n * in_features * 2:,} bytes of quantized activations")
    return y
