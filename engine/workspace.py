"""Transient memory of one prefill chunk on a device: activations, attention scratch, logits, backend overhead.

The formulas follow what the reference path (kernels/reference.py) allocates; docs/planner.md derives
each term and records the measurements they were checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .kv_cache import ceil_div
from .units import MiB

# CUDA: torch's math SDPA (the fallback for a boolean mask with grouped KV heads) holds the scores and the
# probabilities of the chunk against the whole context, fp32 at worst. The planner shrinks the prefill chunk
# so that pair stays under this cap, which keeps the workspace bounded however long the context grows.
MAX_SCORES_BYTES = 512 * MiB
# The CUDA context and kernel images (outside torch's allocator, seen by NVML) plus cuBLAS workspaces.
# Not yet measured on a GPU: bench/gpu_plan_check.py prints the number to put here.
CUDA_OVERHEAD_BYTES = 640 * MiB
# CPU: SDPA's per-thread scratch and the allocator's slack, measured at ~6 MiB on 2 threads (docs/planner.md).
CPU_OVERHEAD_BYTES = 32 * MiB


@dataclass(frozen=True)
class Workspace:
    """Peak transient bytes of one device, by cause."""

    activations_bytes: int = 0  # residual stream and the larger of the attention and MLP phases
    logits_bytes: int = 0  # the last position's logits, on the head's device
    overhead_bytes: int = 0  # the backend's own: CUDA context, cuBLAS, CPU kernel scratch

    @property
    def total_bytes(self) -> int:
        return self.activations_bytes + self.logits_bytes + self.overhead_bytes


def prefill_chunk_for(requested: int, context_tokens: int, num_heads: int, uses_cuda: bool) -> int:
    """The chunk a load should use: the requested one, shrunk on CUDA so the scores stay under their cap."""
    chunk = min(requested, context_tokens)
    if not uses_cuda:
        return chunk  # CPU SDPA runs a blocked kernel that never holds the whole score matrix
    per_query = 2 * num_heads * context_tokens * 4
    fitting = MAX_SCORES_BYTES // per_query
    if fitting >= 16:
        fitting -= fitting % 16  # a multiple of 16 keeps matmul shapes friendly
    return max(1, min(chunk, fitting))


def layer_activation_bytes(config: ModelConfig, *, device_type: str, context_tokens: int, chunk: int,
                           dtype: torch.dtype, block_size: int) -> int:
    """Peak live bytes while one layer runs a chunk of `chunk` tokens against `context_tokens` of context."""
    c, a = min(chunk, context_tokens), dtype.itemsize
    h, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    # residual, its normed copy, and the sum that replaces it
    residual = 3 * c * h * a
    # q, k, v, their rotated copies, and the attention output before o_proj
    projections = c * (heads + 2 * kv_heads) * d * a + c * (heads + kv_heads) * d * a + c * heads * d * a
    gathered = ceil_div(context_tokens, block_size) * block_size  # gather_kv copies whole blocks
    kv_copy = 2 * gathered * kv_heads * d * a
    mask = c * context_tokens  # the causal mask, one bool per (query, key)
    if device_type == "cuda":
        # A boolean mask with grouped KV heads sends SDPA to its math backend, which upcasts to fp32, repeats
        # K/V to every query head, and holds the scores and probabilities of the chunk against the context.
        # The chunk shrinks to keep the scores under their cap (prefill_chunk_for); capping here rather than
        # using the shrunk chunk keeps the estimate rising with the context, which max_context's search needs.
        expanded = 2 * gathered * heads * d * 4
        scores = min(2 * heads * c * context_tokens * 4, MAX_SCORES_BYTES)
        attention = kv_copy + expanded + scores + min(mask, MAX_SCORES_BYTES // (8 * heads)) * 5
    else:
        # measured: reduced-precision inputs are packed into a second K/V copy; the mask becomes an additive bias
        packed = kv_copy if a < 4 else 0
        attention = kv_copy + packed + mask * (1 + a)
    mlp = 3 * c * inter * a  # silu(gate), up, and their product
    return residual + max(projections + attention, mlp) + rope_table_bytes(config, context_tokens, dtype)


def rope_rows(context_tokens: int) -> int:
    """Rows of the rotary cos/sin tables: engine/rope.py builds one row per position the cache holds."""
    return context_tokens


def rope_table_bytes(config: ModelConfig, context_tokens: int, dtype: torch.dtype) -> int:
    """cos and sin, kept on every device that runs layers."""
    return 2 * rope_rows(context_tokens) * config.head_dim * dtype.itemsize


def rope_build_bytes(config: ModelConfig, context_tokens: int) -> int:
    """The fp32 temporaries on the CPU while a rotary table is built (engine/rope.py RotaryTable._build)."""
    rows = rope_rows(context_tokens)
    # positions (fp32), the angles [rows, head_dim / 2] and one cos/sin temporary of the same size
    return rows * 4 + 2 * rows * (config.head_dim // 2) * 4


def device_workspace(config: ModelConfig, *, device_type: str, runs_layers: bool, holds_head: bool,
                     holds_embed: bool, context_tokens: int, chunk: int, dtype: torch.dtype, block_size: int,
                     num_seqs: int = 1) -> Workspace:
    """The workspace one device needs, given what the plan puts there (`chunk`: the requested prefill chunk)."""
    if not (runs_layers or holds_head or holds_embed):
        return Workspace()
    # the embedded chunk before it moves to the first layer's device
    activations = min(chunk, context_tokens) * config.hidden_size * dtype.itemsize if holds_embed else 0
    if runs_layers:
        activations += layer_activation_bytes(config, device_type=device_type, context_tokens=context_tokens,
                                              chunk=chunk, dtype=dtype, block_size=block_size)
    if device_type == "cpu":
        # every device's rotary table is built on the CPU, before any layer runs: a separate, earlier peak
        activations = max(activations, rope_build_bytes(config, context_tokens))
    # lm_head output for the last position of each sequence, then its fp32 copy for sampling
    logits = num_seqs * config.vocab_size * (dtype.itemsize + 4) if holds_head else 0
    overhead = CUDA_OVERHEAD_BYTES if device_type == "cuda" else CPU_OVERHEAD_BYTES
    return Workspace(activations, logits, overhead)
