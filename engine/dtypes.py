"""Every dtype name Stowage reads or writes, in one table: stored (safetensors), compute, and KV cache.

The names are plain strings; the tables of numpy's and torch's dtypes behind them (SAFETENSORS, COMPUTE, KV) are
built when first read, so code that only names a dtype (the CLI's parser, a model listing) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# What the model may compute in (and what `dtype=` may convert floating weights to).
COMPUTE_NAMES = ("float32", "float16", "bfloat16")
# What the KV cache may store; fp8 keeps value / scale; q8_0 and q4_0 are ggml's blocks of 32, the storage dtype
# naming the format (kernels/kv_quant.py; docs/kernels.md). K and V may differ: "K/V", e.g. "q8_0/q4_0".
KV_NAMES = (*COMPUTE_NAMES, "fp8", "q8_0", "q4_0")
# Spellings users type for a KV dtype ("auto": the compute dtype).
KV_ALIASES: dict[str, str | None] = {"auto": None, "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
                                     "fp8_e4m3": "fp8"}
_TABLES = ("SAFETENSORS", "COMPUTE", "KV")


def __getattr__(name: str):
    """SAFETENSORS, COMPUTE and KV, built on first use (importing numpy and torch), then plain module attributes."""
    if name not in _TABLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if "KV" not in globals():
        globals().update(_tables())
    return globals()[name]


def _tables() -> dict[str, dict]:
    import numpy as np
    import torch

    # safetensors dtype code -> (bytes per element, numpy dtype to view the bytes, torch dtype to reinterpret as)
    safetensors: dict[str, tuple[int, np.dtype, torch.dtype]] = {
        "F64": (8, np.dtype("<f8"), torch.float64),
        "F32": (4, np.dtype("<f4"), torch.float32),
        "F16": (2, np.dtype("<f2"), torch.float16),
        "BF16": (2, np.dtype("<i2"), torch.bfloat16),
        "I64": (8, np.dtype("<i8"), torch.int64),
        "I32": (4, np.dtype("<i4"), torch.int32),
        "I16": (2, np.dtype("<i2"), torch.int16),
        "I8": (1, np.dtype("i1"), torch.int8),
        "U8": (1, np.dtype("u1"), torch.uint8),
        "BOOL": (1, np.dtype("u1"), torch.bool),
        "F8_E4M3": (1, np.dtype("u1"), torch.float8_e4m3fn),
        "F8_E5M2": (1, np.dtype("u1"), torch.float8_e5m2),
    }
    compute: dict[str, torch.dtype] = dict(zip(COMPUTE_NAMES, (torch.float32, torch.float16, torch.bfloat16)))
    kv: dict[str, torch.dtype] = {**compute, "fp8": torch.float8_e4m3fn, "q8_0": torch.int8, "q4_0": torch.uint8}
    assert tuple(kv) == KV_NAMES
    return {"SAFETENSORS": safetensors, "COMPUTE": compute, "KV": kv}


def name_of(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def check_compute(name: str) -> None:
    """Raise ValueError naming the choices unless `name` is a compute dtype."""
    if name not in COMPUTE_NAMES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(COMPUTE_NAMES)}")


def check_kv(name: str) -> None:
    """Raise ValueError naming the choices unless `name` is a KV dtype name: one for both, or "K/V"."""
    k, _, v = name.partition("/")
    _check_one_kv(k)
    _check_one_kv(v or k)


def _check_one_kv(name: str) -> None:
    if name not in KV_NAMES:
        raise ValueError(f"KV dtype {name!r} is not one of {', '.join(KV_NAMES)}, nor two of them as K/V (q8_0/q4_0)")


def compute_dtype(name: str) -> torch.dtype:
    check_compute(name)
    return __getattr__("COMPUTE")[name]


def kv_dtype(name: str) -> torch.dtype:
    _check_one_kv(name)
    return __getattr__("KV")[name]


def kv_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """K's and V's cache dtypes of a KV dtype name: one name for both, or "K/V"."""
    k, _, v = name.partition("/")
    return kv_dtype(k), kv_dtype(v or k)


def kv_name(name: str) -> str:
    """A KV dtype as a user types it, aliases included, in its one spelling: "bf16/q4_0" -> "bfloat16/q4_0",
    "q8_0/q8_0" -> "q8_0". Raises ValueError naming the choices ("auto" is the CLI's, not a dtype)."""
    k, _, v = name.partition("/")
    k, v = KV_ALIASES.get(k, k), KV_ALIASES.get(v or k, v or k)
    check_kv(f"{k}/{v}")  # raises ValueError naming the choices
    return k if k == v else f"{k}/{v}"
