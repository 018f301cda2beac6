"""Our compute: paged attention (a torch reference, Triton kernels for CUDA) and CPU matrix products.

`attention_ops(device)` picks the attention implementation that runs on a device (on the CPU the native one,
kernels/cpu_attention.py, where its library is; the torch reference otherwise): an object (a module)
with `NAME`, `write_kv`, `decode_attention`, `prefill_attention`, and `workspace_bytes(...)`, its peak
scratch, which the planner charges. Triton is imported only when a kernel is first called, so a test
can set TRITON_INTERPRET before any kernel is decorated, and planning never imports it. torch itself is imported
at the first `attention_ops`, so `from stowage.kernels import cpu_decode` stays light (the CLI's parser).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType
from typing import TYPE_CHECKING

from . import cpu_decode

if TYPE_CHECKING:
    import torch

FORCE_REFERENCE_ENV = "STOWAGE_FORCE_REFERENCE"


def forced_reference() -> bool:
    return os.environ.get(FORCE_REFERENCE_ENV, "") not in ("", "0")


def attention_ops(device: torch.device | str) -> ModuleType:
    """The attention implementation that runs on `device` (also asked when planning for a GPU not present)."""
    torch, cpu_attention, reference = _torch_modules()
    device = torch.device(device)
    if device.type == "cpu":  # the cache read in place in C where the native library is, else the reference
        return cpu_attention if cpu_decode.current() is not None else reference
    if device.type != "cuda" or forced_reference():
        return reference
    return _cuda_ops(device.index)


@functools.cache
def _torch_modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    # imported once, at the first question (asked once per layer per token: a cache hit, not an import, after that)
    import torch

    from . import cpu_attention, reference

    return torch, cpu_attention, reference


@functools.lru_cache(maxsize=None)
def _cuda_ops(index: int | None) -> ModuleType:
    # Cached per GPU: the engine asks once per layer per token.
    torch, _, reference = _torch_modules()
    if importlib.util.find_spec("triton") is None:  # an optional extra; the reference is correct, only slower
        return reference
    # Triton's CUDA backend wants compute capability 7.5 or newer (Turing on). Without CUDA here (a plan for
    # a GPU budget made on another machine), plan for the kernel a supported GPU would run.
    if torch.cuda.is_available() and torch.cuda.get_device_capability(index) < (7, 5):
        return reference
    from . import triton_attention

    return triton_attention
