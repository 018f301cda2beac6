"""The CPU decode step in C (kernels/csrc/decode_layer.c): a run of layers, or the final norm and head, per call.

One library per instruction set (`avx512bf16`, `avx512`, `avx2`, `scalar`), the best the CPU runs unless
`STOWAGE_DECODE_ISA` names one. A prebuilt library beside this file (`kernels/_native/`, made when the package is
built: kernels/build.py) is used first; otherwise it is compiled at first use (a developer
convenience; kernels/cbuild.py). `STOWAGE_NATIVE_DECODE=0` or `STOWAGE_FORCE_REFERENCE=1` turns it off, and
no library at all (no compiler, no prebuilt one) leaves the torch path: `active()` says which runs.
The ctypes structures below mirror the C structs (kernels/csrc/decode_types.h) field for field.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from functools import cache

from .cbuild import cpu_flags, load_library
from .native_libs import ISAS, choose, decode_layer, supported

# Weight and cache type codes of the C side: floats; ggml block types are their quant_type_id (q8_0 / q4_0 caches too).
W_F32, W_F16, W_BF16, CACHE_FP8 = 100, 101, 102, 3
CACHE_Q4_0, CACHE_Q8_0 = 2, 8
ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_CLAMPED = 0, 1, 2


MAX_LANES = 64  # decode_types.h's: the most sequences one batched step takes
MAX_TOPK = 64  # decode_types.h's: the most experts one token chooses


class Matrix(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("type", ctypes.c_int32),
                ("bias_type", ctypes.c_int32), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64)]


class Vector(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int32)]


class Layer(ctypes.Structure):
    _fields_ = [(name, Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")] + \
               [(name, Vector) for name in ("input_norm", "post_norm", "pre_ff_norm", "post_ff_norm", "q_norm",
                                            "k_norm")] + \
               [("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("k_scale", ctypes.c_float),
                ("v_scale", ctypes.c_float), ("window", ctypes.c_int32), ("local_rope", ctypes.c_int32),
                ("router", Matrix), ("experts", ctypes.POINTER(Matrix)),  # experts: [num_experts * 3] or NULL
                ("sinks", ctypes.c_void_p)]  # float32 [num_heads] or NULL


class Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in
                ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "block_size", "cache_type",
                 "v_cache_type", "norm_plus_one", "sandwich", "qk_norm", "act", "num_layers")] + \
               [("eps", ctypes.c_float), ("attn_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float),
                ("inv_freq", ctypes.c_void_p), ("inv_freq_local", ctypes.c_void_p), ("qk_order", ctypes.c_void_p),
                ("layers", ctypes.POINTER(Layer)), ("num_experts", ctypes.c_int32), ("top_k", ctypes.c_int32),
                ("norm_topk", ctypes.c_int32), ("rope_scale", ctypes.c_float), ("swiglu_limit", ctypes.c_float),
                ("swiglu_alpha", ctypes.c_float), ("softmax_after_topk", ctypes.c_int32)]


def enabled() -> bool:
    """Whether the switches allow the native decode step (STOWAGE_NATIVE_DECODE, STOWAGE_FORCE_REFERENCE)."""
    off = os.environ.get("STOWAGE_FORCE_REFERENCE", "") not in ("", "0")
    return not off and os.environ.get("STOWAGE_NATIVE_DECODE", "1") not in ("0", "")


def supported_isas() -> list[str]:
    """The instruction sets this CPU can run, best first."""
    return supported(ISAS, cpu_flags())


@cache
def selected_isa() -> str | None:
    """`STOWAGE_DECODE_ISA` if set (None when the CPU lacks it), else the best the CPU has; None when turned off."""
    if not enabled():
        return None
    return choose(tuple(ISAS), cpu_flags(), "STOWAGE_DECODE_ISA", os.environ)


MAX_SPLITS = 64  # decode_types.h's: key ranges one attention call splits a context into
PAIR_TABLE_BYTES = 640  # decode_layer.c's: a chosen expert's pointers and task, at most


def qvec_bytes(n: int) -> int:
    """An activation vector's integer forms (quant_blocks.h QVEC_BYTES): per 32 a scale and a sum, per 256 the
    K types' scale, per 16 two sums, and three int8 planes; rounded up to 4 (what follows stays aligned)."""
    return (8 * (n // 32) + 4 * (n // 256) + 6 * (n // 16) + 3 * n + 3) // 4 * 4


def scratch_bytes(*, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                  lanes: int = 1, num_experts: int = 0, top_k: int = 0, expert_intermediate: int = 0) -> int:
    """What the native step keeps allocated once it has run (decode_scratch.h ensure_lane, per lane: a sequence of
    a batched step): the layer's vectors, x in its bf16 and integer forms, and attention's per-split sums; with
    experts, the router's logits and the weighted sum, and per chosen expert (`top_k` a lane, each
    `expert_intermediate` wide) its gate/up/act rows in every form (decode_layer.c ensure_pairs).
    `intermediate`: the widest MLP (an expert's or a dense one)."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    wide = max(hidden, q)
    experts = num_experts + hidden if num_experts else 0
    floats = (hidden + wide + (q + 2 * kv) + q + hidden + 3 * intermediate + head_dim
              + num_heads * MAX_SPLITS * (head_dim + 2) + experts)
    per_lane = 4 * floats + qvec_bytes(wide) + qvec_bytes(intermediate) + 2 * (wide + intermediate)
    lanes = min(max(lanes, 1), MAX_LANES)
    if not (top_k and expert_intermediate):
        return lanes * per_lane
    i = expert_intermediate
    per_pair = 4 * 3 * i + qvec_bytes(i) + 2 * i + PAIR_TABLE_BYTES
    return lanes * (per_lane + top_k * per_pair) + 32  # the 32: ensure_pairs' alignment


@cache
def library(isa: str) -> ctypes.CDLL | None:
    """The decode library for `isa` (prebuilt, else built now), or None when there is none to be had."""
    lib = load_library(decode_layer(isa))
    if lib is None:
        return None
    ptr = ctypes.c_void_p
    lib.decode_layers.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int32,
                                  ctypes.c_int64, ptr]
    lib.decode_layers.restype = ctypes.c_int
    lib.decode_head.argtypes = [ctypes.POINTER(Model), ptr, ctypes.c_int32, ctypes.POINTER(Vector),
                                ctypes.POINTER(Matrix), ctypes.c_float, ptr]
    lib.decode_head.restype = ctypes.c_int
    lib.decode_layers_batch.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr,
                                        ctypes.c_int32, ptr, ptr]
    lib.decode_layers_batch.restype = ctypes.c_int
    lib.decode_head_batch.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ptr, ctypes.c_int32,
                                      ctypes.POINTER(Vector), ctypes.POINTER(Matrix), ctypes.c_float, ptr]
    lib.decode_head_batch.restype = ctypes.c_int
    lib.decode_set_threads.argtypes = [ctypes.c_int]
    lib.decode_set_threads.restype = ctypes.c_int
    lib.decode_num_threads.restype = ctypes.c_int
    lib.decode_isa.restype = ctypes.c_char_p
    lib.decode_set_spin.argtypes = [ctypes.c_int64]
    lib.attention_prefill.argtypes = [ptr, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ptr, ptr, ctypes.c_int32,
                                      ctypes.c_int32, ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int32, ctypes.c_int32,
                                      ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_float, ctypes.c_int32,
                                      ptr, ctypes.c_int32, ptr]  # the last: sinks (float32 [heads]) or NULL
    lib.attention_prefill.restype = ctypes.c_int
    lib.decode_type_id.argtypes = [ctypes.c_char_p]
    lib.decode_type_id.restype = ctypes.c_int
    lib.decode_set_threads(default_threads())
    return lib


def current() -> ctypes.CDLL | None:
    """The library that runs here, or None (turned off, or none could be had)."""
    isa = selected_isa()
    return library(isa) if isa is not None else None


THREADS_ENV = "STOWAGE_THREADS"  # `--threads N` of the CLI sets it for the engine process
THREADS_PER_CORE = 4  # the most threads a core is given: more only add switching, and torch's OpenMP pool crashes
# the process when asked for ~100,000 (docs/robustness.md)


def num_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_threads() -> int:
    """The most threads torch and the native step are given (the native pool takes at most decode_types.h's
    MAX_THREADS of them)."""
    return THREADS_PER_CORE * num_cores()


def default_threads() -> int:
    """`STOWAGE_THREADS` if set (at most max_threads()), else the cores this process may run on."""
    if os.environ.get(THREADS_ENV, "").strip():
        return min(max(1, int(os.environ[THREADS_ENV])), max_threads())
    return num_cores()


def use_default_threads() -> int:
    """torch and the native decode step on default_threads() threads (torch's own default ignores the affinity)."""
    import torch

    n = default_threads()
    torch.set_num_threads(n)
    set_threads(n)
    return n


@contextmanager
def torch_on_one_thread():
    """torch on one thread inside the block, for the per-token work around the native step (sampling over the
    vocabulary): those ops are too small to split, and after each split op torch's OpenMP threads spin on the
    cores the native step's threads need (docs/kernels.md, the CPU decode step's "Threads")."""
    import torch

    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def set_threads(n: int) -> int:
    """Use n threads for the native decode step (the caller's included); returns how many it got."""
    lib = current()
    return lib.decode_set_threads(int(n)) if lib is not None else 0


def active() -> str:
    """What runs the CPU decode step here, for `stowage plan` and the About box: e.g. "native avx512bf16, 2 threads"."""
    lib = current()
    if lib is None:
        return "torch (native decode off)" if not enabled() else "torch (no native decode library)"
    return f"native {lib.decode_isa().decode()}, {lib.decode_num_threads()} threads"
