"""Triton decode attention (interpreted on the CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import TOLERANCE, make_paged, random_query

from stowage.kernels import reference, triton_decode

LENS = [1, 37, 100]  # a length-1 sequence, lengths that are not multiples of the block size


def _check(lens, *, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, cache_dtype=torch.float16,
           num_splits=None, k_scale=1.0, v_scale=1.0):
    paged = make_paged(lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale)
    query = random_query(len(lens), num_heads, head_dim, cache_dtype)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5,
            paged.k_scale, paged.v_scale)
    want = reference.decode_attention(*args)
    got = triton_decode.decode_attention(*args, num_splits=num_splits)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all(), "read a NaN row: outside the context or through -1 padding"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[cache_dtype], f"max abs error {err}"


def test_interpreter_is_active():
    assert triton_decode.INTERPRET, "TRITON_INTERPRET was not set before the kernels were decorated"


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_head_dims_and_block_sizes(head_dim, block_size):
    _check(LENS, block_size=block_size, head_dim=head_dim)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_dtypes(cache_dtype):
    _check(LENS, cache_dtype=cache_dtype, head_dim=80)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.02)])
def test_fp8_cache_with_scales(k_scale, v_scale):
    _check(LENS, cache_dtype=torch.float8_e4m3fn, k_scale=k_scale, v_scale=v_scale, head_dim=96)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 3), (10, 2), (8, 1)])
def test_query_heads_per_kv_head(num_heads, num_kv_heads):
    # groups of 1 (MHA), 2, 5 (not a power of two) and 8 (MQA)
    _check(LENS, num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_split_k(num_splits, cache_dtype):
    # with 5 splits of a 768-token table, the short sequences leave most splits empty
    _check([1, 130, 700], num_splits=num_splits, cache_dtype=cache_dtype, k_scale=0.5, v_scale=0.25)


def test_split_k_block_size_32_odd_head_dim():
    _check([33, 300], block_size=32, head_dim=80, num_heads=6, num_kv_heads=2, num_splits=3)


def test_splits_equal_single_pass():
    paged = make_paged([500], block_size=16, num_kv_heads=1, head_dim=64, cache_dtype=torch.float32)
    query = random_query(1, 2, 64, torch.float32)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.125)
    one = triton_decode.decode_attention(*args, num_splits=1)
    four = triton_decode.decode_attention(*args, num_splits=4)
    torch.testing.assert_close(four, one, atol=1e-6, rtol=1e-5)


def test_choose_num_splits_by_hand():
    # 16 sequences x 8 KV heads = 128 programs already fill 132 SMs about once: 3 splits for two each
    assert triton_decode.choose_num_splits(16, 8, 32768, num_sms=132) == 3
    # one sequence: 2 * 132 / 8 = 33 splits, each of 32768 / 33 ~ 993 tokens
    assert triton_decode.choose_num_splits(1, 8, 32768, num_sms=132) == 33
    # 1k tokens: splits are at least 512 tokens long
    assert triton_decode.choose_num_splits(1, 8, 1024, num_sms=132) == 2
    assert triton_decode.choose_num_splits(1, 8, 1000, num_sms=132) == 1
    assert triton_decode.choose_num_splits(1, 1, 1 << 20, num_sms=132) == triton_decode.MAX_SPLITS


def test_rejects_uneven_groups():
    paged = make_paged([5], block_size=16, num_kv_heads=3, head_dim=64, cache_dtype=torch.float16)
    query = random_query(1, 4, 64, torch.float16)
    with pytest.raises(ValueError, match="4 query heads cannot share 3 KV heads"):
        triton_decode.decode_attention(query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 1.0)


def test_decode_loop_with_triton_writes():
    # What the engine does each step: write the new token's K/V, then attend over the grown context.
    # 12 cached tokens, then 8 steps that cross the block boundary at 16.
    from stowage.kernels import triton_write

    gen = torch.Generator().manual_seed(9)
    block_size, kvh, head_dim, num_heads = 16, 2, 64, 4
    k_cache = torch.zeros(4, block_size, kvh, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    table = [3, 0]  # out of order in the pool
    block_tables = torch.tensor([table + [-1]], dtype=torch.int32)

    def slots(positions):
        return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])

    def rows(n):
        return torch.randn(n, kvh, head_dim, generator=gen).to(torch.bfloat16)

    triton_write.write_kv(rows(12), rows(12), k_cache, v_cache, slots(range(12)))
    for pos in range(12, 20):
        triton_write.write_kv(rows(1), rows(1), k_cache, v_cache, slots([pos]))
        query = torch.randn(1, num_heads, head_dim, generator=gen).to(torch.bfloat16)
        lens = torch.tensor([pos + 1], dtype=torch.int32)
        args = (query, k_cache, v_cache, block_tables, lens, 0.125)
        err = (triton_decode.decode_attention(*args).float() - reference.decode_attention(*args).float()).abs().max()
        assert err <= TOLERANCE[torch.bfloat16], f"step {pos}: {err}"


def test_fp8_error_against_full_precision_is_bounded():
    # The accuracy cost of the fp8 cache itself (docs/kernels.md): e4m3 keeps 3 mantissa bits, so K
    # and V carry up to 1/16 relative error (rms ~1/28); measured here: 5.1% on the output.
    lens = [200, 77]
    exact = make_paged(lens, block_size=16, num_kv_heads=2, head_dim=64, cache_dtype=torch.float32)
    fp8 = make_paged(lens, block_size=16, num_kv_heads=2, head_dim=64, cache_dtype=torch.float8_e4m3fn)
    query = random_query(len(lens), 8, 64, torch.float32)
    want = reference.decode_attention(query, exact.k_cache, exact.v_cache, exact.block_tables, exact.context_lens, 0.125)
    got = triton_decode.decode_attention(query.half(), fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.context_lens,
                                         0.125).float()
    rel = ((got - want).norm() / want.norm()).item()
    assert 0.01 < rel < 0.08, rel  # not zero (fp8 really is used) and small
