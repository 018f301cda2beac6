"""Paged attention: a torch reference (runs anywhere) and Triton kernels (CUDA).

`attention_ops(device)` picks the implementation. Triton is imported only there, lazily, so that
a test can set TRITON_INTERPRET before any kernel is decorated.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from . import reference

FORCE_REFERENCE_ENV = "STOWAGE_FORCE_REFERENCE"


def attention_ops(device: torch.device | str) -> ModuleType:
    """The module whose write_kv / decode_attention / prefill_attention serve tensors on device."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get(FORCE_REFERENCE_ENV, "") not in ("", "0"):
        return reference
    return _cuda_ops(device.index)


@functools.lru_cache(maxsize=None)
def _cuda_ops(index: int | None) -> ModuleType:
    # Cached per GPU: the engine asks once per layer per token.
    if not torch.cuda.is_available():  # no CUDA tensor can exist; nothing to accelerate
        return reference
    try:
        from . import triton_attention
    except ImportError:  # triton is an optional extra; the reference is correct, only slower
        return reference
    # Triton's CUDA backend wants compute capability 7.5 or newer (Turing on).
    if torch.cuda.get_device_capability(index) < (7, 5):
        return reference
    return triton_attention
