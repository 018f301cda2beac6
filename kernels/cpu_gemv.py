"""A bf16 matrix-vector product for the CPU decode step, compiled from C at first use.

Used only where it is known to be right and fast: bf16 weights and input, one row of input, an x86
CPU with AVX512-BF16, a C compiler present. Anywhere else `gemv` is None and callers use torch.
`STOWAGE_FORCE_REFERENCE=1` turns it off, like the Triton kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "gemv_bf16.c"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]


def _cpu_has_avx512_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags and " avx512bw" in flags


def _cache_dir() -> Path:
    if os.environ.get("STOWAGE_KERNEL_CACHE"):
        return Path(os.environ["STOWAGE_KERNEL_CACHE"]) / "kernels"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("stowage")) / "kernels"


def _build() -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gemv_bf16-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            return None
        os.replace(built, target)  # atomic: a concurrent build never sees half a file
    return target


@cache
def _library():
    if os.environ.get("STOWAGE_FORCE_REFERENCE", "") not in ("", "0") or not _cpu_has_avx512_bf16():
        return None
    try:
        path = _build()
        lib = ctypes.CDLL(str(path)) if path is not None else None
    except (OSError, ImportError):  # no writable cache folder (or no platformdirs to find one), or a library
        # the loader refuses: torch's mm serves
        return None
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
