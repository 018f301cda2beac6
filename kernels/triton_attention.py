"""The Triton attention ops, with the reference's signatures: what `attention_ops("cuda")` returns."""

from __future__ import annotations

import torch

from . import reference, triton_decode, triton_prefill, triton_write

__all__ = ["write_kv", "decode_attention", "prefill_attention"]


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Store each token's K and V in its cache slot (Triton; reference for fp8 on pre-Ada GPUs)."""
    ops = reference if _fp8_unsupported(k_cache) else triton_write
    ops.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale=1.0, v_scale=1.0):
    """One new query token per sequence attends to its whole cached context (Triton)."""
    ops = reference if _fp8_unsupported(k_cache) else triton_decode
    return ops.decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def prefill_attention(query, k_cache, v_cache, block_table, start_pos, scale, k_scale=1.0, v_scale=1.0):
    """A chunk of new tokens (their K/V already written) attends causally to the cache (Triton)."""
    ops = reference if _fp8_unsupported(k_cache) else triton_prefill
    return ops.prefill_attention(query, k_cache, v_cache, block_table, start_pos, scale, k_scale, v_scale)


def _fp8_unsupported(cache: torch.Tensor) -> bool:
    # Triton converts float8_e4m3fn ("fp8e4nv") only on compute capability 8.9+ (Ada, Hopper).
    return (
        cache.dtype == torch.float8_e4m3fn
        and cache.device.type == "cuda"
        and torch.cuda.get_device_capability(cache.device) < (8, 9)
    )
