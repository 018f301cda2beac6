"""Paged attention in plain torch: gather K/V through the block table, then attend.

Runs on any device; it is the oracle for the Triton kernels, which share these signatures.
Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset. fp8 caches store value / scale; reads multiply back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 skips the token
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K and V in its cache slot."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_blocks, block_size = k_cache.shape[:2]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    slots = slot_mapping.long()
    _copy_rows(flat_k, slots, _to_cache(key, k_cache.dtype, k_scale))
    _copy_rows(flat_v, slots, _to_cache(value, v_cache.dtype, v_scale))


def _copy_rows(dst: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    # index_copy_ has no float8 kernel on the CPU; the bytes are the same viewed as uint8.
    if dst.dtype.itemsize == 1:
        dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
    dst.index_copy_(0, slots, rows)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """The first num_tokens rows of one sequence, contiguous: [num_tokens, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    rows = blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:num_tokens]
    return _from_cache(rows, dtype, scale)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, padded with -1
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens each query attends to (its own included)
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One new query token per sequence attends to its whole cached context."""
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n, k_scale, query.dtype)
        v = gather_kv(v_cache, block_tables[i], n, v_scale, query.dtype)
        out[i] = _attend(query[i : i + 1], k, v, scale, causal=False)[0]
    return out


def prefill_attention(
    query: torch.Tensor,  # [num_new, num_heads, head_dim], positions start_pos .. start_pos+num_new-1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32 of this one sequence
    start_pos: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    """A chunk of new tokens (their K/V already written) attends causally to the cache."""
    num_ctx = start_pos + query.shape[0]
    k = gather_kv(k_cache, block_table, num_ctx, k_scale, query.dtype)
    v = gather_kv(v_cache, block_table, num_ctx, v_scale, query.dtype)
    return _attend(query, k, v, scale, causal=True)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    # q: [n, H, D]; k, v: [ctx, KVH, D]; the n queries are the last n positions of ctx.
    n, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qh = q.transpose(0, 1).reshape(num_kv_heads, group * n, -1) if n == 1 else q.transpose(0, 1)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, ctx, D]
    if n == 1:
        # GQA without repeating K/V: fold the group into the query length.
        out = F.scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), scale=scale)
        return out[0].reshape(num_heads, 1, -1).transpose(0, 1)
    mask = None
    if causal and ctx > n:
        # query i sits at position ctx - n + i and sees keys 0 .. ctx - n + i
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
    # A first chunk (ctx == n) needs no mask tensor: is_causal lets CUDA pick the flash kernel.
    out = F.scaled_dot_product_attention(
        qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=mask, scale=scale,
        is_causal=causal and ctx == n, enable_gqa=group > 1,
    )
    return out[0].transpose(0, 1)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype.itemsize == 1:
        return (x.float() / scale).to(dtype)
    return x.to(dtype)


def _from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype.itemsize == 1:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)
