"""Random paged caches for the kernel tests: shuffled blocks, -1 padding, garbage in free blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stowage.kernels import reference

QUERY_DTYPE = {
    torch.float32: torch.float32,
    torch.float16: torch.float16,
    torch.bfloat16: torch.bfloat16,
    torch.float8_e4m3fn: torch.float16,
}


@dataclass
class Paged:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 padded
    context_lens: torch.Tensor  # [num_seqs] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, every cached token in sequence order
    k_scale: float
    v_scale: float


def make_paged(
    context_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    seed: int = 0,
    extra_blocks: int = 3,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Paged:
    """A pool with the sequences' blocks in shuffled order, spare blocks full of NaN, tables padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere first: any row a kernel reads that it should not poisons its output.
    k_cache = torch.full(shape, float("nan")).to(cache_dtype)
    v_cache = torch.full(shape, float("nan")).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 2  # two columns of -1 even for the longest sequence
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    slots = []
    used = 0
    for s, (n, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        blocks = order[used : used + nb]
        used += nb
        block_tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    dtype = QUERY_DTYPE[cache_dtype]
    # Magnitudes of a few units, like real post-RoPE keys; fp8 needs the scale to fit them.
    key = (2 * torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    reference.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return Paged(k_cache, v_cache, block_tables, lens, slot_mapping, k_scale, v_scale)


def random_query(num_seqs: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(QUERY_DTYPE[dtype])


# Worst-case absolute error against the reference on outputs of magnitude ~1: both accumulate in
# float32, but round K, V or P to the working dtype at different points.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float8_e4m3fn: 4e-3}
