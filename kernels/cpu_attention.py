"""Paged attention on the CPU in C (kernels/csrc/prefill_attention.h): the cache read in place through the block table.

The same signatures as kernels/reference.py, which stays the oracle in the tests. No gathered copy of the
context, no dense mask, no scores matrix: a chunk's queries go through their keys a cache block at a time
(online softmax), so the only memory a call allocates is its output (`workspace_bytes`); each thread keeps the
states of one tile of queries on its stack (at most 320 KiB, in the engine's fixed overhead). Used on the CPU wherever the native library is (kernels/__init__.py).
"""

from __future__ import annotations

import torch

from . import cpu_decode, reference

NAME = "cpu-native"
write_kv = reference.write_kv  # one row per token: nothing to gain in C
# tensor dtype -> the C type code; int8 / uint8 caches are q8_0 / q4_0 blocks (kernels/kv_quant.py), read in place
_TYPES = {torch.float32: cpu_decode.W_F32, torch.float16: cpu_decode.W_F16, torch.bfloat16: cpu_decode.W_BF16,
          torch.float8_e4m3fn: cpu_decode.CACHE_FP8, torch.int8: cpu_decode.CACHE_Q8_0,
          torch.uint8: cpu_decode.CACHE_Q4_0}
# prefill_attention.h's PF_STATES (query heads per KV head at most), decode_types.h's MAX_HEAD_DIM
STATES, MAX_HEAD_DIM = 64, 512


def prefill_attention(query, k_cache, v_cache, block_table, start_pos: int, scale: float, k_scale: float = 1.0,
                      v_scale: float = 1.0, *, window: int | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of new tokens (their K/V already written) attends causally to the cache (its last `window` tokens);
    `sinks` [num_heads] (gpt-oss) join each head's softmax (the portable C kernel: the vector ones have none)."""
    n, num_heads, head_dim = query.shape
    if not supports(num_heads, k_cache.shape[2], head_dim):
        return reference.prefill_attention(query, k_cache, v_cache, block_table, start_pos, scale, k_scale, v_scale,
                                           window=window, softcap=softcap, sinks=sinks)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    query = query.contiguous()
    table = block_table.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    status = cpu_decode.current().attention_prefill(query.data_ptr(), _TYPES[query.dtype], n, start_pos, k_cache.data_ptr(),
                                   v_cache.data_ptr(), _TYPES[k_cache.dtype], _TYPES[v_cache.dtype], k_scale, v_scale,
                                   table.data_ptr(),
                                   num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, softcap or 0.0,
                                   window or 0, out.data_ptr(), _TYPES[out.dtype],
                                   sinks.data_ptr() if sinks is not None else None)
    if status != 0:
        raise ValueError(f"attention_prefill refused {num_heads} heads of {head_dim} over {k_cache.shape[2]} KV heads")
    return out


def decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0, *, window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One new query token per sequence attends to its cached context (the last `window` tokens when set)."""
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        out[i : i + 1] = prefill_attention(query[i : i + 1], k_cache, v_cache, block_tables[i], n - 1, scale,
                                           k_scale, v_scale, window=window, softcap=softcap, sinks=sinks)
    return out


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether these shapes run here (else the reference serves them)."""
    return head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= STATES


def workspace_bytes(*, num_tokens: int, context_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_seqs: int = 1,
                    window: int | None = None, softcap: float | None = None, sinks: bool = False) -> int:
    """Peak bytes one call allocates: its output (and with sinks, their float32 copy)."""
    if not supports(num_heads, num_kv_heads, head_dim):
        return reference.workspace_bytes(num_tokens=num_tokens, context_tokens=context_tokens, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                         cache_dtype=cache_dtype, block_size=block_size, num_seqs=num_seqs,
                                         window=window, softcap=softcap, sinks=sinks)
    return num_seqs * min(num_tokens, context_tokens) * num_heads * head_dim * dtype.itemsize + sinks * num_heads * 4
