"""A bf16 matrix-vector product for the CPU decode step, compiled from C at first use.

Used only where it is known to be right and fast: bf16 weights and input, one row of input, an x86
CPU with AVX512-BF16, a C compiler present. Anywhere else `gemv` is None and callers use torch.
`STOWAGE_FORCE_REFERENCE=1` turns it off, like the Triton kernels.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from .cbuild import cpu_flags, load_library
from .native_libs import GEMV_BF16

@cache
def _library():
    if os.environ.get("STOWAGE_FORCE_REFERENCE", "") not in ("", "0") or not GEMV_BF16.needs <= cpu_flags():
        return None
    lib = load_library(GEMV_BF16)
    if lib is None:
        return None
    lib.gemv_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.gemv_bf16.restype = None
    return lib


def is_available() -> bool:
    return _library() is not None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, cols] bf16, weight: [rows, cols] bf16 contiguous -> [1, rows] bf16. Requires is_available()."""
    rows, cols = weight.shape
    x = x.contiguous()
    out = torch.empty(1, rows, dtype=torch.bfloat16)
    _library().gemv_bf16(weight.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None,
                         out.data_ptr(), rows, cols, torch.get_num_threads())
    return out
