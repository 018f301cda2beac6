"""Triton kernel that stores new K/V rows into their paged-cache slots (prefill and decode alike).

Import this module only after TRITON_INTERPRET is settled: `triton.jit` reads it when a kernel is
decorated, which is when this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import block_format

# Largest finite float8_e4m3fn; torch saturates there, and so must we (the GPU's cvt does, the
# interpreter does not promise to).
FP8_MAX = 448.0


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    # One program per token: its [num_kv_heads, head_dim] rows of K and V, one slot.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    # A slot of -1 (padding) writes nothing; masking keeps the kernel free of early returns.
    # (The slot is broadcast to the tile before comparing: the interpreter rejects a scalar mask term.)
    valid = (tl.zeros([H_PAD, D_PAD], dtype=tl.int64) + slot) >= 0
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & valid

    k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if IS_FP8:
        # The caches arrive viewed as uint8; we write e4m3fn bits computed by hand (see below).
        # Divide (not multiply by 1/scale) so the rounding matches the torch reference bit for bit.
        k = _fp8_e4m3fn_bits(tl.clamp(k.to(tl.float32) / k_scale, -FP8_LIMIT, FP8_LIMIT))
        v = _fp8_e4m3fn_bits(tl.clamp(v.to(tl.float32) / v_scale, -FP8_LIMIT, FP8_LIMIT))
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kct + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_e4m3fn_bits(x):
    """float32 in [-448, 448] -> float8_e4m3fn bits (uint32), rounding to nearest even like torch."""
    # Why by hand: the interpreter's float->fp8 cast drops the carry when the mantissa rounds up
    # (7.8 -> 4.0), so a `.to(tl.float8e4nv)` could not be tested on the CPU. These few integer ops
    # are exact in both modes and cost nothing next to the memory traffic.
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): keep 3 of 23 mantissa bits, rounding half to even; a carry out of
    # the mantissa correctly bumps the exponent. Then rebias the exponent from 127 to 7.
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - ((127 - 7) << 3)
    # Subnormals (|x| < 2^-6) are multiples of 2^-9: adding 2^14 (whose ulp is 2^-9) makes the
    # float adder round to that grid, half to even; the low bits are then the count (0..8; 8 is
    # the smallest normal, encoded 0x08, which is right).
    sub = (tl.abs(x) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    return tl.where(mag < 0x3C800000, sub, normal) | sign


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 skips the token
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K and V in its cache slot (Triton)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value, slot_mapping = _unit_stride(key), _unit_stride(value), slot_mapping.contiguous()
    _check_inner_contiguous(k_cache, v_cache)
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if is_fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    elif key.dtype != k_cache.dtype:
        # Narrow the few new rows in torch (round to nearest even everywhere): the interpreter's
        # float32 -> bfloat16 cast truncates, so an in-kernel cast could not be checked on the CPU.
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *cache_strides(k_cache, v_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        IS_FP8=is_fp8,
        FP8_LIMIT=FP8_MAX,
    )


@triton.jit
def load_rows(row_ptr, d, mask, QUANT: tl.constexpr):
    """Cache rows as float32 [rows, D_PAD]: row_ptr [rows, 1] points at each row's first element, d [D_PAD] the
    values wanted. QUANT 0: a float cache; 1: q8_0 blocks (int8), 2: q4_0 blocks (uint8), widened here, in
    registers, from each value's block: its fp16 scale and its quant (kernels/kv_quant.py)."""
    if QUANT == 0:
        return tl.load(row_ptr + d[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        block = d // 32
        i = d % 32
        if QUANT == 1:
            base = block * 34
        else:
            base = block * 18
        lo = tl.load(row_ptr + base[None, :], mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
        hi = tl.load(row_ptr + (base + 1)[None, :], mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
        scale = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        if QUANT == 1:
            q = tl.load(row_ptr + (base + 2 + i)[None, :], mask=mask, other=0).to(tl.float32)
        else:
            byte = tl.load(row_ptr + (base + 2 + i % 16)[None, :], mask=mask, other=0).to(tl.int32)
            q = ((byte >> (4 * (i // 16))[None, :]) & 15).to(tl.float32) - 8.0
        return q * scale


def quant_code(cache: torch.Tensor) -> int:
    """load_rows' QUANT of a cache: 0 float, 1 q8_0, 2 q4_0."""
    fmt = block_format(cache.dtype)
    return 0 if fmt is None else 1 if fmt.name == "q8_0" else 2


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """Block, slot and head strides of both caches, in the order every kernel takes them."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernels index head_dim with unit stride; inputs are small, so copy rather than refuse.
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inner_contiguous(*tensors: torch.Tensor) -> None:
    # A cache is written in place, so it cannot be copied into shape: refuse instead.
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous (stride 1), got strides {t.stride()}")
