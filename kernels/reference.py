"""Paged attention in plain torch: gather K/V through the block table, then attend in query tiles.

Runs on any device; it is the oracle for the Triton kernels, which share these signatures. It owns its
memory cost: `workspace_bytes` states the peak scratch of one call, and the planner charges exactly
that (no library kernel whose scratch differs between processors). Attention is written out as two
fp32 matrix products and a softmax over query tiles, so the scores never exceed SCORES_BYTES. fp32, not the
compute dtype: a bf16 bmm on the CPU goes through oneDNN, which keeps a primitive (and a copy of K) per shape
it has seen, and the shape changes with every token (what it retained: docs/kernels.md, "prefill_attention").
Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset. fp8 caches store value / scale; reads multiply back. q8_0 / q4_0 caches
(int8 / uint8, kernels/kv_quant.py) hold ggml blocks of 32 along head_dim: written quantized, widened per block.
`window` (sliding-window layers): a query at position p sees keys p - window + 1 .. p, and only the blocks
that range reaches are gathered, so older blocks are never read (a cache may have recycled them).
`softcap` (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask and the softmax.
`sinks` (gpt-oss): a logit per query head, [num_heads] fp32, that joins each softmax's denominator and no value.
"""

from __future__ import annotations

import torch

from . import kv_quant

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
    if kv_quant.block_format(cache.dtype) is not None:  # q8_0 / q4_0: the gathered blocks widened, a cache block at a time
        blocks = kv_quant.dequantize(blocks, dtype)
        head_dim = blocks.shape[-1]
    # one copy does the transpose and the conversion: no intermediate of either layout
    heads = torch.empty(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=cache.device)
    heads.copy_(blocks.permute(2, 0, 1, 3))
    del blocks
    if cache.dtype == torch.float8_e4m3fn:
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
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One new query token per sequence attends to its cached context (the last `window` tokens when set)."""
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        out[i : i + 1] = prefill_attention(query[i : i + 1], k_cache, v_cache, block_tables[i], n - 1, scale,
                                           k_scale, v_scale, window=window, softcap=softcap, sinks=sinks)
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
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    """A chunk of new tokens (their K/V already written) attends causally to the cache (its last `window` tokens)."""
    if window is not None:
        return _window_attention(query, k_cache, v_cache, block_table, start_pos, scale, k_scale, v_scale,
                                 window, softcap, sinks)
    n, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group, ctx = num_heads // num_kv_heads, start_pos + n
    out = torch.empty_like(query)
    k = gather_kv(k_cache, block_table, ctx, k_scale, ACC_DTYPE)
    v = gather_kv(v_cache, block_table, ctx, v_scale, ACC_DTYPE)
    keys_t, values = k[:, :ctx].transpose(1, 2), v[:, :ctx]  # [KVH, D, ctx], [KVH, ctx, D]
    tile = query_tile(n, ctx, num_heads)
    rows = tile * group  # query rows per KV head in one tile, ordered (token, head in group)
    # One set of buffers for every tile, always against the whole context (the causal part is masked): the
    # same shapes each time, so no allocation per tile and no heap fragmentation over tiles of growing length.
    device = query.device
    q = torch.zeros(num_kv_heads, rows, head_dim, dtype=ACC_DTYPE, device=device)
    scores = torch.empty(num_kv_heads, rows, ctx, dtype=ACC_DTYPE, device=device)  # then exp(scores - max)
    o = torch.empty(num_kv_heads, rows, head_dim, dtype=ACC_DTYPE, device=device)
    causal = torch.ones(tile, tile, dtype=torch.bool, device=device).triu(1)[None, :, None, :]
    for i0 in range(0, n, tile):
        t = min(tile, n - i0)
        first = start_pos + i0  # the tile's first query position; query j sees keys 0 .. first + j
        _tile_scores(query[i0 : i0 + t], q, keys_t, scores, scale, softcap)
        per_token = scores.view(num_kv_heads, tile, group, ctx)
        per_token[..., first + tile :].fill_(float("-inf"))
        band = per_token[..., first : first + tile]
        band.masked_fill_(causal[..., : band.shape[-1]], float("-inf"))
        _tile_output(scores, values, o, out[i0 : i0 + t], sinks)
    return out


def _window_attention(query, k_cache, v_cache, block_table, start_pos, scale, k_scale, v_scale, window, softcap,
                      sinks):
    # Keys from the first block the window of the chunk's first query reaches: `lo` is that block's first position.
    n, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group, ctx = num_heads // num_kv_heads, start_pos + n
    first_block = max(0, start_pos - window + 1) // block_size
    lo = first_block * block_size
    span = ctx - lo  # keys gathered (the window of every query in the chunk, and the start of its first block)
    out = torch.empty_like(query)
    k = gather_kv(k_cache, block_table[first_block:], span, k_scale, ACC_DTYPE)
    v = gather_kv(v_cache, block_table[first_block:], span, v_scale, ACC_DTYPE)
    keys_t, values = k[:, :span].transpose(1, 2), v[:, :span]  # [KVH, D, span], [KVH, span, D]
    tile = query_tile(n, span, num_heads)
    rows = tile * group
    device = query.device
    q = torch.zeros(num_kv_heads, rows, head_dim, dtype=ACC_DTYPE, device=device)
    scores = torch.empty(num_kv_heads, rows, span, dtype=ACC_DTYPE, device=device)
    o = torch.empty(num_kv_heads, rows, head_dim, dtype=ACC_DTYPE, device=device)
    key_pos = torch.arange(lo, ctx, device=device)
    for i0 in range(0, n, tile):
        t = min(tile, n - i0)
        _tile_scores(query[i0 : i0 + t], q, keys_t, scores, scale, softcap)
        query_pos = torch.arange(start_pos + i0, start_pos + i0 + tile, device=device)[:, None]  # [tile, 1]
        # masked: keys after the query (causal) or older than its window; rows past the last query see key lo
        hidden = (key_pos > query_pos) | (key_pos <= query_pos - window)  # [tile, span]
        hidden[t:] = key_pos != lo
        scores.view(num_kv_heads, tile, group, span).masked_fill_(hidden[None, :, None, :], float("-inf"))
        del hidden
        _tile_output(scores, values, o, out[i0 : i0 + t], sinks)
    return out


def window_span(num_tokens: int, context_tokens: int, window: int | None, block_size: int) -> int:
    """Keys one call gathers: the whole context, or for a window the blocks the chunk's windows reach."""
    if window is None:
        return context_tokens
    # the first query's window starts at most block_size - 1 positions into its block
    return min(context_tokens, num_tokens + window - 1 + block_size - 1)


def _tile_scores(query: torch.Tensor, q: torch.Tensor, keys_t: torch.Tensor, scores: torch.Tensor, scale: float,
                 softcap: float | None) -> None:
    """Scores of a tile's queries ([t, H, D]) against keys_t ([KVH, D, keys]) into `scores`, through the `q` buffer."""
    t, num_heads, head_dim = query.shape
    num_kv_heads = q.shape[0]
    group = num_heads // num_kv_heads
    q[:, : t * group].view(num_kv_heads, t, group, head_dim).copy_(
        query.view(t, num_kv_heads, group, head_dim).transpose(0, 1))
    q[:, t * group :].zero_()  # rows past the last query: computed, never read
    torch.bmm(q, keys_t, out=scores)
    scores.mul_(scale)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)


def _tile_output(scores: torch.Tensor, values: torch.Tensor, o: torch.Tensor, out: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> None:
    """Masked scores -> softmax in place -> attention output of the tile's queries, written into `out` ([t, H, D]).
    `sinks` [num_heads]: each head's logit joins its softmax (the max and the denominator), adding no value."""
    t, num_heads, head_dim = out.shape
    num_kv_heads = o.shape[0]
    group = num_heads // num_kv_heads
    peak = scores.amax(dim=-1, keepdim=True)  # [KVH, rows, 1]
    if sinks is not None:  # rows are (token, head in group) per KV head
        sink = sinks.to(scores.device, ACC_DTYPE).view(num_kv_heads, 1, group).expand(
            num_kv_heads, scores.shape[1] // group, group).reshape(num_kv_heads, -1, 1)
        peak = torch.maximum(peak, sink)
    scores.sub_(peak).exp_()
    total = scores.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total += (sink - peak).exp_()
    torch.bmm(scores, values, out=o)
    o.div_(total)
    out.view(t, num_kv_heads, group, head_dim).copy_(o[:, : t * group].view(num_kv_heads, t, group, head_dim).transpose(0, 1))


def query_tile(num_new: int, context_tokens: int, num_heads: int) -> int:
    """Queries per tile: the fp32 scores of a tile against the context stay under SCORES_BYTES."""
    per_query = num_heads * context_tokens * ACC_DTYPE.itemsize
    return max(1, min(num_new, SCORES_BYTES // per_query))


def workspace_bytes(*, num_tokens: int, context_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_seqs: int = 1,
                    window: int | None = None, softcap: float | None = None, sinks: bool = False) -> int:
    """Peak bytes one attention call allocates (its output included): `num_tokens` new tokens of one sequence
    against `context_tokens` (prefill), or one token for each of `num_seqs` sequences (decode, num_tokens=1);
    with a sliding `window`, against the keys that window reaches (window_span). `softcap` works in place;
    `sinks` adds three fp32 values per query row (the sinks spread over the rows, the new maxima, their exp)."""
    n, c, f = min(num_tokens, context_tokens), cache_dtype.itemsize, ACC_DTYPE.itemsize
    ctx = window_span(n, context_tokens, window, block_size)
    rows = -(-ctx // block_size) * block_size * num_kv_heads * head_dim  # one gathered K (or V), whole blocks
    out = num_seqs * n * num_heads * head_dim * dtype.itemsize
    # gather_kv: the gathered blocks and their head-major fp32 copy; q8_0 / q4_0: the blocks widened (kv_quant.dequantize:
    # under 1.07 + 1 + 4 bytes a value while the blocks live) and their head-major copy
    gather_peak = rows * (2 * f if kv_quant.block_format(cache_dtype) else c + f)
    kv = 2 * rows * f  # K and V, gathered, in fp32
    t = query_tile(n, ctx, num_heads)
    # the scores buffer, the tile's queries and output, the row maxima and sums, the causal mask
    tile = t * num_heads * ctx * f + 2 * t * num_heads * head_dim * f + 2 * t * num_heads * f + t * t
    if window is not None:  # the key positions (int64) and the tile's mask with its two comparisons (bool)
        tile += 8 * ctx + 3 * t * ctx
    if sinks:
        tile += 3 * t * num_heads * f
    return out + max(kv // 2 + gather_peak, kv + tile)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if kv_quant.block_format(dtype) is not None:
        return kv_quant.quantize(x, dtype)
    if dtype.itemsize == 1:
        return (x.float() / scale).to(dtype)
    return x.to(dtype)
