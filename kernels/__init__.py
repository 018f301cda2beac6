"""Paged attention: a torch reference (runs anywhere) and Triton kernels (CUDA).

`attention_ops(device)` picks the implementation. Triton is imported only there, lazily, so that
a test can set TRITON_INTERPRET before any kernel is decorated.
"""

from __future__ import annotations

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
    if not torch.cuda.is_available():  # no CUDA tensor can exist; nothing to accelerate
        return reference
    try:
        from . import triton_attention
    except ImportError:  # triton is an optional extra; the reference is correct, only slower
        return reference
    if not _gpu_can_run_triton(device):
        return reference
    return triton_attention


def _gpu_can_run_triton(device: torch.device) -> bool:
    # Triton's CUDA backend wants compute capability 7.5 or newer (Turing on).
    return torch.cuda.get_device_capability(device) >= (7, 5)
