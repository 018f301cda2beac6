"""ggml's q8_0 and q4_0 blocks as KV cache rows: the format, its bytes, and quantizing and widening in torch.

A quantized cache row (one token's K or V of one KV head) is head_dim / 32 blocks laid end to end, each ggml's:
q8_0 an fp16 scale d then 32 int8 (value = q * d, 34 bytes); q4_0 an fp16 d then 16 bytes of nibbles, values
0..15 in the low nibbles and 16..31 in the high ones (value = (q - 8) * d, 18 bytes). The cache tensor's storage
dtype names the format: int8 rows are q8_0 blocks, uint8 rows q4_0 blocks (no float KV dtype is one byte of
either), so every kernel knows what it reads from the tensor alone. docs/kernels.md, "The KV cache in q8_0 and q4_0".

A row in blocks holds its values rotated: H k, with H the orthonormal Walsh-Hadamard matrix of `rotation_size`
applied to each run of that many values (llama.cpp does the same for its quantized caches). A few key channels
far larger than the rest would otherwise set each block's one scale; rotated, every value carries a share of them.
q . k = (H q) . (H k), so the model rotates the query too, and sum p v = H (sum p (H v)): it rotates the attention
output back. Kernels never see it: they read and write rotated rows as any others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

QK = 32  # values per block, both formats


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block type as the cache stores it."""

    name: str
    block_bytes: int  # the fp16 scale and the quants of 32 values


Q8_0 = BlockFormat("q8_0", 34)
Q4_0 = BlockFormat("q4_0", 18)
FORMATS: dict[torch.dtype, BlockFormat] = {torch.int8: Q8_0, torch.uint8: Q4_0}


def block_format(dtype: torch.dtype) -> BlockFormat | None:
    """The block format of a cache of this storage dtype, None for a float (or fp8) cache."""
    return FORMATS.get(dtype)


def check_head_dim(dtype: torch.dtype, head_dim: int) -> None:
    """Raises ValueError when a row of head_dim values is not whole blocks of this cache dtype."""
    fmt = block_format(dtype)
    if fmt is not None and head_dim % QK:
        raise ValueError(f"a {fmt.name} KV cache needs head_dim to be a multiple of {QK} (its blocks), "
                         f"this model's is {head_dim}; use bfloat16, float16 or fp8 for its cache")


def rotation_size(dtype: torch.dtype, head_dim: int) -> int:
    """The Hadamard size a cache of this dtype rotates runs of head_dim by: the largest power of two dividing
    head_dim for q8_0 / q4_0 (at least 32: their rows are whole blocks), 0 (none) for a float or fp8 cache."""
    return head_dim & -head_dim if block_format(dtype) is not None else 0


@functools.cache
def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(device)


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., head_dim] with each run of n values multiplied by the orthonormal Hadamard matrix of size n (its own
    inverse: applying it twice gives x back), computed in float32 and returned in x's dtype; n = 0: x itself."""
    if not n:
        return x
    *lead, d = x.shape
    return (x.float().reshape(*lead, d // n, n) @ _hadamard_matrix(n, x.device)).reshape(x.shape).to(x.dtype)


def row_elems(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of the cache tensor's last dimension: head_dim, or the bytes of head_dim / 32 blocks."""
    fmt = block_format(dtype)
    return head_dim if fmt is None else head_dim // QK * fmt.block_bytes


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one token's K (or V) of one KV head."""
    return row_elems(dtype, head_dim) * dtype.itemsize


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] into blocks [..., row_elems] of `dtype` (int8: q8_0, uint8: q4_0), bit for bit as
    ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref (float32 arithmetic, the same rounding)."""
    *lead, head_dim = x.shape
    b = x.float().reshape(-1, QK)  # [blocks, 32]
    fmt = FORMATS[dtype]
    if fmt is Q8_0:
        d = b.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        v = b * inv
        qs = (v.sign() * (v.abs() + 0.5).floor()).to(torch.int8).view(torch.uint8)  # roundf: half away from zero
    else:
        # the value of largest magnitude, with its sign (the first of equals), becomes -8
        top = b.gather(1, b.abs().argmax(dim=1, keepdim=True))
        d = top / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = (b * inv + 8.5).clamp_(min=0).floor_().clamp_(max=15).to(torch.uint8)
        qs = q[:, :16] | (q[:, 16:] << 4)
    scale = d.to(torch.float16).view(torch.uint8)  # [blocks, 2], little-endian as in a GGUF file
    blocks = torch.cat([scale, qs], dim=1)
    return blocks.reshape(*lead, head_dim // QK * fmt.block_bytes).view(dtype)


def dequantize(blocks: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blocks [..., row_elems] (int8: q8_0, uint8: q4_0) back to values [..., head_dim] in out_dtype."""
    fmt = FORMATS[blocks.dtype]
    *lead, nbytes = blocks.shape
    b = blocks.reshape(-1, fmt.block_bytes).view(torch.uint8)
    d = b[:, :2].contiguous().view(torch.float16).float()  # [blocks, 1]
    if fmt is Q8_0:
        q = b[:, 2:].view(torch.int8).float()
    else:
        qs = b[:, 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=1).float().sub_(8)
    return q.mul_(d).to(out_dtype).reshape(*lead, nbytes // fmt.block_bytes * QK)
