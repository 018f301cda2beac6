"""The Triton attention ops, with the reference's signatures: what `attention_ops("cuda")` returns.

The kernel modules import triton; they are imported on the first call, so planning for a GPU (which
asks only `workspace_bytes`) never imports triton.
Sliding windows and soft-capped scores (Gemma, Mistral) are in the kernels: a window starts the key loop at the
window's first position, so the blocks a sliding-window cache recycled are never read.
"""

from __future__ import annotations

import importlib

import torch

from . import reference
from .kv_quant import block_format

NAME = "triton"
# Split-K decode (kernels/triton_decode.py): partials exist only past 2 * MIN_SPLIT_TOKENS of context.
MIN_SPLIT_TOKENS = 512  # below this a split's fixed cost outweighs the parallelism it buys
MAX_SPLITS = 64


def _kernel(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Store each token's K and V in its cache slot (Triton; reference for fp8 on pre-Ada GPUs, and for q8_0 / q4_0
    caches: the new rows quantized in torch, bit for bit ggml's, then copied into their slots)."""
    quantized = block_format(k_cache.dtype) is not None or block_format(v_cache.dtype) is not None
    ops = reference if quantized or _fp8_unsupported(k_cache) else _kernel("triton_write")
    ops.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale=1.0, v_scale=1.0, *,
                     window=None, softcap=None, sinks=None):
    """One new query token per sequence attends to its cached context, its last `window` tokens when set (Triton);
    `sinks` [num_heads] (gpt-oss) join each head's softmax."""
    ops = reference if _fp8_unsupported(k_cache) else _kernel("triton_decode")
    return ops.decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                                window=window, softcap=softcap, sinks=sinks)


def prefill_attention(query, k_cache, v_cache, block_table, start_pos, scale, k_scale=1.0, v_scale=1.0, *,
                      window=None, softcap=None, sinks=None):
    """A chunk of new tokens (their K/V already written) attends causally to the cache (Triton)."""
    ops = reference if _fp8_unsupported(k_cache) else _kernel("triton_prefill")
    return ops.prefill_attention(query, k_cache, v_cache, block_table, start_pos, scale, k_scale, v_scale,
                                 window=window, softcap=softcap, sinks=sinks)


def workspace_bytes(*, num_tokens: int, context_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_seqs: int = 1,
                    window: int | None = None, softcap: float | None = None, sinks: bool = False) -> int:
    """Peak bytes one call allocates: its output (with sinks, their float32 copy), and for a long decode the split-K
    partials (fp32 output and log-sum-exp per split). Prefill streams K/V through registers and allocates only its output. An fp8 cache on
    a pre-Ada GPU falls back to the reference, which the planner does not model: plan with an fp16 cache there.
    A window cuts the keys a decode step splits to the window; a softcap works in registers."""
    n = min(num_tokens, context_tokens)
    keys = context_tokens if window is None else min(context_tokens, window)
    out = num_seqs * n * num_heads * head_dim * dtype.itemsize + sinks * num_heads * 4
    if n > 1 or keys < 2 * MIN_SPLIT_TOKENS:
        return out
    splits = min(keys // MIN_SPLIT_TOKENS, MAX_SPLITS)  # the most choose_num_splits picks
    return out + num_seqs * num_heads * splits * (head_dim + 1) * 4


def _fp8_unsupported(cache: torch.Tensor) -> bool:
    # Triton converts float8_e4m3fn ("fp8e4nv") only on compute capability 8.9+ (Ada, Hopper).
    return (
        cache.dtype == torch.float8_e4m3fn
        and cache.device.type == "cuda"
        and torch.cuda.get_device_capability(cache.device) < (8, 9)
    )
