"""Prefill products of 16-bit weights on CPUs whose torch kernels for that dtype are slow: fp32 GEMM on widened tiles.

torch multiplies bf16 at speed only where oneDNN finds AVX512-BF16 or AMX, and f16 only with AVX512-FP16 or
AMX-FP16. Elsewhere (Zen 2/3, Intel client parts; f16 on Zen 4) its fallback runs several times below its own fp32
product on the same core (measured: docs/kernels.md, "CPU prefill on 16-bit weights without fast 16-bit
products"). There a chunk of `n >= MIN_ROWS` tokens is multiplied tile by tile: TILE_BYTES of weight rows
widened to fp32 (exact: every bf16 and f16 value is an fp32 value), an fp32 GEMM against the chunk widened once,
and the tile's columns of the output rounded to the weights' dtype once. The products are exact and the sums are
fp32, as in torch's 16-bit kernels, so results differ from theirs only in the order of the sums.

The weights stay where they lie (the memory map); the scratch is one tile, the chunk's fp32 copy and one tile of
output, which `workspace_bytes` states and the planner charges. A decode token (one row) never takes this path:
widening costs more than it saves below MIN_ROWS rows, and the native decode step has its own dots.
"""

from __future__ import annotations

import functools
import os

import torch

from .cbuild import cpu_flags

WIDEN_ENV = "STOWAGE_WIDEN_MATMUL"  # "1": widen every 16-bit product; "0": never; unset: where torch's are slow
TILE_BYTES = 1 << 20  # fp32 weight rows widened at a time: the tile stays in a core's L2 while the GEMM reads it
MIN_ROWS = 16  # below this many tokens torch's own product costs less than widening the weights
# the CPU flags (as /proc/cpuinfo names them) under which torch's product of each dtype runs at speed
FAST_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}


def slow_dtypes(flags: set[str]) -> frozenset[torch.dtype]:
    """The 16-bit dtypes torch multiplies slowly on a CPU with these /proc/cpuinfo flags."""
    return frozenset(dtype for dtype, fast in FAST_FLAGS.items() if not fast & flags)


@functools.cache
def _slow_here() -> frozenset[torch.dtype]:
    return slow_dtypes(cpu_flags())


def widened_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes whose CPU prefill products run widened here (`$STOWAGE_WIDEN_MATMUL` overrides)."""
    forced = os.environ.get(WIDEN_ENV, "").strip()
    if forced:
        return frozenset(FAST_FLAGS) if forced != "0" else frozenset()
    return _slow_here()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs here: a CPU chunk of at least MIN_ROWS tokens on widened 16-bit weights."""
    return (x.device.type == "cpu" and x.shape[0] >= MIN_ROWS and weight.dtype == x.dtype
            and weight.dtype in widened_dtypes())


def tile_rows(in_features: int, out_features: int) -> int:
    """Weight rows widened at a time: TILE_BYTES of fp32, a multiple of 16 rows, at most the matrix."""
    rows = max(16, TILE_BYTES // (4 * in_features) // 16 * 16)
    return min(rows, out_features)


def mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight [out, in].T (+ bias), in x's dtype, computed in fp32 a tile of weight rows at a time."""
    n, (rows, cols) = x.shape[0], weight.shape
    out = torch.empty(n, rows, dtype=x.dtype)
    xf = x.float()
    step = tile_rows(cols, rows)
    for r in range(0, rows, step):
        tile = weight[r : r + step].float()
        part = torch.mm(xf, tile.t()) if bias is None else torch.addmm(bias[r : r + step].float(), xf, tile.t())
        out[:, r : r + step] = part
    return out


def workspace_bytes(num_tokens: int, shapes: list[tuple[int, int]]) -> int:
    """Peak scratch of `mm` over matrices of (in_features, out_features) for a chunk of num_tokens: the chunk's
    fp32 copy, one widened tile and its fp32 output (0 for a chunk too short to widen)."""
    if num_tokens < MIN_ROWS:
        return 0
    peak = 0
    for cols, rows in shapes:
        step = tile_rows(cols, rows)
        peak = max(peak, 4 * (num_tokens * cols + step * cols + num_tokens * step))
    return peak
