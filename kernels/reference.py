"""Paged attention in plain torch: gather K/V through the block table, then attend in query tiles.

Runs on any device; it is the oracle for the Triton kernels, which share these signatures. It owns its
memory cost: `workspace_bytes` states the peak scratch of one call, and the planner charges exactly
that (no library kernel whose scratch differs between processors). Attention is written out as two
fp32 matrix products and a softmax over query tiles, so the scores never exceed SCORES_BYTES. fp32, not the
compute dtype: a bf16 bmm on the CPU goes through oneDNN, which keeps a primitive (and a copy of K) per shape
it has seen, and the shape changes with every token (measured: 4 GB retained after 100 tiles at 64k tokens).
Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset. fp8 caches store value / scale; reads multiply back.
"""

from __future__ import annotations

import torch

NAME = "reference"
ACC_DTYPE = torch.float32  # what attention is computed in, whatever the cache and model dtypes
SCORES_BYTES = 16 << 20  # the scores and probabilities of one query tile against the context


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
    """One sequence's cached rows, head-major and contiguous: [num_kv_heads, num_blocks * block_size, head_dim].

    Rows past num_tokens (the rest of the last block) are included; callers slice them off."""
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())  # [num_blocks, block_size, KVH, D]
    # one copy does the transpose and the conversion: no intermediate of either layout
    heads = torch.empty(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=cache.device)
    heads.copy_(blocks.permute(2, 0, 1, 3))
    del blocks
    if cache.dtype.itemsize == 1:
        heads.mul_(scale)
    return heads.view(num_kv_heads, num_blocks * block_size, head_dim)


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
        out[i : i + 1] = prefill_attention(query[i : i + 1], k_cache, v_cache, block_tables[i], n - 1, scale,
                                           k_scale, v_scale)
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
    n, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group, ctx = num_heads // num_kv_heads, start_pos + n
    out = torch.empty_like(query)
    k = gather_kv(k_cache, block_table, ctx, k_scale, ACC_DTYPE)
    v = gather_kv(v_cache, block_table, ctx, v_scale, ACC_DTYPE)
    tile = query_tile(n, ctx, num_heads)
    for i0 in range(0, n, tile):
        t = min(tile, n - i0)
        keys = start_pos + i0 + t  # the tile's last query sees keys 0 .. keys-1
        # [t, H, D] -> [KVH, t * group, D]: each KV head's query rows, ordered (token, head in group)
        q = query[i0 : i0 + t].to(ACC_DTYPE).view(t, num_kv_heads, group, head_dim).transpose(0, 1)
        q = q.reshape(num_kv_heads, t * group, head_dim)
        scores = torch.bmm(q, k[:, :keys].transpose(1, 2)).mul_(scale)  # [KVH, t * group, keys]
        del q
        if t > 1:  # the tile's own tokens: query j sees keys up to its own position
            band = scores.view(num_kv_heads, t, group, keys)[..., keys - t :]
            band.masked_fill_(torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)[None, :, None, :],
                              float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        del scores
        o = torch.bmm(probs, v[:, :keys])  # [KVH, t * group, D]
        del probs
        out[i0 : i0 + t] = o.view(num_kv_heads, t, group, head_dim).transpose(0, 1).reshape(t, num_heads, head_dim)
    return out


def query_tile(num_new: int, context_tokens: int, num_heads: int) -> int:
    """Queries per tile: the fp32 scores and probabilities of a tile stay under SCORES_BYTES."""
    per_query = num_heads * context_tokens * 2 * ACC_DTYPE.itemsize
    return max(1, min(num_new, SCORES_BYTES // per_query))


def workspace_bytes(*, num_tokens: int, context_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_seqs: int = 1) -> int:
    """Peak bytes one attention call allocates (its output included): `num_tokens` new tokens of one sequence
    against `context_tokens` (prefill), or one token for each of `num_seqs` sequences (decode, num_tokens=1)."""
    n, ctx, c, f = min(num_tokens, context_tokens), context_tokens, cache_dtype.itemsize, ACC_DTYPE.itemsize
    rows = -(-ctx // block_size) * block_size * num_kv_heads * head_dim  # one gathered K (or V), whole blocks
    out = num_seqs * n * num_heads * head_dim * dtype.itemsize
    # gather_kv: the gathered blocks and their head-major fp32 copy
    gather_peak = rows * (c + f)
    kv = 2 * rows * f  # K and V, gathered, in fp32
    t = query_tile(n, ctx, num_heads)
    # scores and probabilities; the tile's queries (converted and regrouped) or its output (and its regrouped copy)
    tile = 2 * t * num_heads * ctx * f + 2 * t * num_heads * head_dim * f + t * t
    return out + max(kv // 2 + gather_peak, kv + tile)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype.itemsize == 1:
        return (x.float() / scale).to(dtype)
    return x.to(dtype)
