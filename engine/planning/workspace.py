"""Transient memory of one prefill chunk on a device: activations, attention scratch, logits, backend overhead.

The attention scratch is the kernel's own statement (`workspace_bytes` of the ops `kernels.attention_ops`
picks for the device), so the forecast follows whichever implementation will run there. The rest follows
what engine/runtime/model.py allocates; docs/planner.md derives each term. GGUF matrices computed tile by tile add the
largest scratch one of their products states (kernels/quant_linear.py workspace_bytes, docs/gguf.md), and so do
16-bit weights multiplied on widened fp32 tiles where the CPU's 16-bit products are slow (kernels/cpu_matmul.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from stowage.kernels import cpu_attention, cpu_decode, cpu_matmul

from ..formats.config import ModelConfig
from ..formats.gguf_model import Matrices
from ..runtime.native_decode import native_intermediate
from ..units import MiB

# The CUDA context and kernel images (outside torch's allocator, seen by NVML) plus cuBLAS workspaces: NVML's used
# growth less torch's peak reserved, 685 MiB in each of bench/gpu_plan_check.py's 12 plans on an H200 (torch
# 2.11.0+cu130, driver 580; docs/gpu-runs/2026-12-04).
CUDA_OVERHEAD_BYTES = 685 * MiB
# CPU: per-thread scratch of the matrix products and the allocator's slack (docs/planner.md).
CPU_OVERHEAD_BYTES = 32 * MiB


@dataclass(frozen=True)
class Workspace:
    """Peak transient bytes of one device, by cause."""

    activations_bytes: int = 0  # residual stream and the larger of the attention and MLP phases
    logits_bytes: int = 0  # the last position's logits, on the head's device
    overhead_bytes: int = 0  # the backend's own: CUDA context, cuBLAS, CPU kernel scratch
    dequant_bytes: int = 0  # the largest tile scratch of a product on quantized (GGUF) weights
    widened_bytes: int = 0  # the largest scratch of a product on 16-bit weights widened to fp32 tiles (CPU prefill)

    @property
    def total_bytes(self) -> int:
        return (self.activations_bytes + self.logits_bytes + self.overhead_bytes + self.dequant_bytes
                + self.widened_bytes)


def attention_bytes(config: ModelConfig, attention: ModuleType, *, context_tokens: int, chunk: int,
                    dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_seqs: int) -> int:
    """The attention kernel's scratch: the larger of a prefill chunk and a decode step of every sequence, over
    the kinds of layer the model has (full, or a sliding window; soft-capped scores)."""
    shape = dict(context_tokens=context_tokens, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                 head_dim=config.head_dim, dtype=dtype, cache_dtype=cache_dtype, block_size=block_size)
    if config.attn_softcap is not None:
        shape["softcap"] = config.attn_softcap
    if config.attention_sinks:  # the kernels' sink path (native, Triton and the reference)
        shape["sinks"] = True
    peak = 0
    for window in set(config.layer_windows) or {None}:
        kind = shape if window is None else shape | {"window": window}
        peak = max(peak, attention.workspace_bytes(num_tokens=chunk, **kind),
                   attention.workspace_bytes(num_tokens=1, num_seqs=num_seqs, **kind))
    return peak


def layer_activation_bytes(config: ModelConfig, attention: ModuleType, *, context_tokens: int, chunk: int,
                           dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_seqs: int = 1) -> int:
    """Peak live bytes while one layer runs a chunk of `chunk` tokens against `context_tokens` of context."""
    c, a = min(chunk, context_tokens), dtype.itemsize
    h, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    # residual, its normed copy, and the sum that replaces it
    residual = 3 * c * h * a
    # q, k, v, their normed (Qwen3) and rotated copies; the attention output is the kernel's
    copies = 2 if config.qk_norm else 1
    projections = c * (heads + 2 * kv_heads) * d * a + copies * c * (heads + kv_heads) * d * a
    attention_scratch = attention_bytes(config, attention, context_tokens=context_tokens, chunk=c, dtype=dtype,
                                        cache_dtype=cache_dtype, block_size=block_size, num_seqs=num_seqs)
    mlp = 3 * c * inter * a  # silu(gate), up, and their product
    if config.is_moe:  # the routed layers' MLP phase, its experts here or not (dense layers keep theirs)
        mlp = max(mlp if config.dense_layers else 0, expert_activation_bytes(config, chunk=c, dtype=dtype))
    return residual + max(projections + attention_scratch, mlp) + rope_table_bytes(config, context_tokens, dtype)


def expert_activation_bytes(config: ModelConfig, *, chunk: int, dtype: torch.dtype) -> int:
    """Peak live bytes of one routed MLP over `chunk` tokens (engine/runtime/model.py Transformer.moe): the router's
    logits and fp32 probabilities, the top-k weights and indices, the summed output, and one expert's product over
    at most every token of the chunk (its input rows, silu(gate), up, their product, the weighted output)."""
    c, a, h = chunk, dtype.itemsize, config.hidden_size
    router = c * config.num_experts * (a + 4) + c * config.num_experts_per_tok * (4 + 8 + a)
    expert = 2 * c * h * a + 3 * c * config.expert_intermediate_size * a + c * h * a
    if config.swiglu_limit is not None:  # gpt-oss: gate and up in one product, then two clamped copies and a sigmoid
        expert += 3 * c * config.expert_intermediate_size * a
    # Qwen2-MoE's shared expert: its gate, up and product, its output and gate, before it joins the sum
    shared = 3 * c * config.shared_expert_intermediate_size * a + c * h * a + 2 * c * a \
        if config.shared_expert_intermediate_size else 0
    return router + c * h * a + expert + shared


def rope_rows(context_tokens: int) -> int:
    """Rows of the rotary cos/sin tables: engine/runtime/rope.py builds one row per position the cache holds."""
    return context_tokens


def rope_table_bytes(config: ModelConfig, context_tokens: int, dtype: torch.dtype) -> int:
    """cos and sin, kept on every device that runs layers (two pairs when sliding layers rotate on their own)."""
    tables = 2 if config.local_rope is not None else 1
    return tables * 2 * rope_rows(context_tokens) * config.head_dim * dtype.itemsize


def rope_build_bytes(config: ModelConfig, context_tokens: int) -> int:
    """The fp32 temporaries on the CPU while a rotary table is built (engine/runtime/rope.py RotaryTable._build)."""
    rows = rope_rows(context_tokens)
    # positions (fp32), the angles [rows, head_dim / 2] and one cos/sin temporary of the same size
    return rows * 4 + 2 * rows * (config.head_dim // 2) * 4


def device_workspace(config: ModelConfig, attention: ModuleType, *, device_type: str, runs_layers: bool,
                     holds_head: bool, holds_embed: bool, context_tokens: int, chunk: int, dtype: torch.dtype,
                     cache_dtype: torch.dtype, block_size: int, num_seqs: int = 1, matrices: Matrices | None = None,
                     converts: bool = False, runs_experts: bool = False) -> Workspace:
    """The workspace one device needs, given what the plan puts there and the attention ops that run there.

    `matrices`: a GGUF model's (ModelInfo.matrices); `converts`: the load converts plain weights (a forced dtype);
    `runs_experts`: experts of some layer are here (a device may hold experts of layers that run elsewhere)."""
    if not (runs_layers or holds_head or holds_embed or runs_experts):
        return Workspace()
    # the embedded chunk before it moves to the first layer's device
    activations = min(chunk, context_tokens) * config.hidden_size * dtype.itemsize if holds_embed else 0
    if runs_experts and not runs_layers:
        activations += expert_activation_bytes(config, chunk=min(chunk, context_tokens), dtype=dtype)
    if runs_layers:
        activations += layer_activation_bytes(config, attention, context_tokens=context_tokens, chunk=chunk,
                                              dtype=dtype, cache_dtype=cache_dtype, block_size=block_size,
                                              num_seqs=num_seqs)
    if device_type == "cpu":
        # every device's rotary table is built on the CPU, before any layer runs: a separate, earlier peak
        activations = max(activations, rope_build_bytes(config, context_tokens))
    # lm_head output for the last position of each sequence, then its fp32 copy for sampling
    logits = num_seqs * config.vocab_size * (dtype.itemsize + 4) if holds_head else 0
    overhead = CUDA_OVERHEAD_BYTES if device_type == "cuda" else CPU_OVERHEAD_BYTES
    if device_type == "cpu" and runs_layers and attention.NAME == cpu_attention.NAME:
        # the native decode step runs here (the same library as this attention): its scratch, a lane per sequence
        overhead += cpu_decode.scratch_bytes(hidden=config.hidden_size, num_heads=config.num_heads,
                                             num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                             intermediate=native_intermediate(config), lanes=num_seqs,
                                             num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                                             expert_intermediate=config.expert_intermediate_size)
    dequant = 0 if matrices is None else matrices.workspace_bytes(
        dtype, converts, runs_layers=runs_layers or runs_experts, holds_head=holds_head, holds_embed=holds_embed,
        num_tokens=min(chunk, context_tokens), num_seqs=num_seqs, on_cpu=device_type == "cpu")
    widened = widened_bytes(config, chunk=min(chunk, context_tokens), dtype=dtype) \
        if device_type == "cpu" and (runs_layers or runs_experts) and (matrices is None or matrices.widens) else 0
    return Workspace(activations, logits, overhead, dequant, widened)


def widened_bytes(config: ModelConfig, *, chunk: int, dtype: torch.dtype) -> int:
    """A layer's largest widened-tile scratch for a prefill chunk (kernels/cpu_matmul.py), where it runs: the
    head multiplies only the last position's row, which is never widened."""
    if dtype not in cpu_matmul.widened_dtypes():
        return 0
    h, q, kv, inter = (config.hidden_size, config.num_heads * config.head_dim,
                       config.num_kv_heads * config.head_dim, config.intermediate_size)
    shapes = [(h, q), (h, kv), (q, h), (h, inter), (inter, h)]
    if config.is_moe:  # the router, and an expert's products (over at most the chunk's tokens)
        e = config.expert_intermediate_size
        shapes += [(h, config.num_experts), (h, e), (e, h)]
    return cpu_matmul.workspace_bytes(chunk, shapes)
