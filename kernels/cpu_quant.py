"""Matrix-vector products on ggml blocks for the CPU decode step, compiled from C at first use.

`matvec(raw, type_name, x, bias)` computes x @ W.T for a few rows of float32 input straight from the
blocks (the memory map; nothing is copied or dequantized to memory), each row of x quantized once to 16-bit
integers per 32 and multiplied with the weights as integers (kernels/csrc/quant_dots.h; docs/kernels.md).
One library per instruction set is built from kernels/csrc/quant_gemv.c: `avx512` (AVX-512 F/BW/VL + VNNI),
`avx2` (AVX2 + FMA + F16C), and `scalar` (portable C), the best the CPU has unless `STOWAGE_QUANT_ISA` names one.
`STOWAGE_FORCE_REFERENCE=1`, no C compiler, or a failed build: `is_available()` is False and
kernels/quant_linear.py uses its torch tile path.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from .cbuild import cpu_flags, load_library
from .native_libs import QUANT_ISAS, choose, quant_gemv, supported

def supported_isas() -> list[str]:
    """The instruction sets this CPU can run, best first."""
    return supported(QUANT_ISAS, cpu_flags())


@cache
def selected_isa() -> str | None:
    """`STOWAGE_QUANT_ISA` if set (None when the CPU lacks it), else the best the CPU has; None when turned off."""
    if os.environ.get("STOWAGE_FORCE_REFERENCE", "") not in ("", "0"):
        return None
    return choose(QUANT_ISAS, cpu_flags(), "STOWAGE_QUANT_ISA", os.environ)


@cache
def library(isa: str) -> ctypes.CDLL | None:
    """The kernels built for `isa`, or None when they cannot be built here."""
    lib = load_library(quant_gemv(isa))
    if lib is None:
        return None
    lib.quant_gemv.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.quant_gemv.restype = ctypes.c_int
    lib.quant_type_id.argtypes = [ctypes.c_char_p]
    lib.quant_type_id.restype = ctypes.c_int
    lib.quant_isa.restype = ctypes.c_char_p
    return lib


def is_available() -> bool:
    return selected_isa() is not None and library(selected_isa()) is not None


def supports(type_name: str) -> bool:
    """Whether `matvec` takes weights stored as `type_name` (requires is_available())."""
    return library(selected_isa()).quant_type_id(type_name.encode()) >= 0


def matvec(raw: torch.Tensor, type_name: str, x: torch.Tensor, bias: torch.Tensor | None = None, *,
           isa: str | None = None) -> torch.Tensor:
    """x [n, in] float32 @ W.T (+ bias float32 [out]) -> float32 [n, out]; raw: W's blocks, uint8 [out, row_bytes]."""
    lib = library(isa or selected_isa())
    type_id = lib.quant_type_id(type_name.encode())
    if type_id < 0:
        raise ValueError(f"no native kernel for {type_name!r}")
    out_features, (n, in_features) = raw.shape[0], x.shape
    assert raw.is_contiguous() and raw.dtype == torch.uint8 and x.dtype == torch.float32
    x = x.contiguous()
    y = torch.empty(n, out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.float().contiguous()
    status = lib.quant_gemv(type_id, raw.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None,
                            y.data_ptr(), out_features, in_features, n, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"quant_gemv could not allocate {n * in_features // 32 * 4} bytes of sums")
    return y
