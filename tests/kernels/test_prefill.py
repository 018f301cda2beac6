"""Triton prefill attention (interpreted on the CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import TOLERANCE, make_paged, random_query

from stowage.kernels import reference, triton_prefill


def _check(start_pos, num_new, *, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64,
           cache_dtype=torch.float16, k_scale=1.0, v_scale=1.0):
    # The sequence under test is the second of two, so its blocks sit among another's in the pool.
    paged = make_paged([29, start_pos + num_new], block_size=block_size, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale)
    query = random_query(num_new, num_heads, head_dim, cache_dtype)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables[1], start_pos, head_dim**-0.5,
            paged.k_scale, paged.v_scale)
    want = reference.prefill_attention(*args)
    got = triton_prefill.prefill_attention(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "read a NaN row: past the causal limit or through -1 padding"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[cache_dtype], f"max abs error {err}"


@pytest.mark.parametrize("start_pos,num_new", [(0, 1), (0, 45), (21, 19), (32, 70), (100, 3)])
def test_chunk_positions(start_pos, num_new):
    # a first chunk, a chunk starting mid-block, one starting on a block edge, a short late chunk
    _check(start_pos, num_new)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_head_dims_and_block_sizes(head_dim, block_size):
    _check(13, 20, block_size=block_size, head_dim=head_dim)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (10, 2), (8, 1)])
def test_query_heads_per_kv_head(num_heads, num_kv_heads):
    _check(7, 30, num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cache_dtypes(cache_dtype):
    scales = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    _check(18, 25, cache_dtype=cache_dtype, head_dim=80, k_scale=scales[0], v_scale=scales[1])
