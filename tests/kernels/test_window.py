"""Sliding-window and soft-capped attention: the reference against dense masked attention, and the Triton
kernels (interpreted) against the reference, with the blocks before each window recycled (-1 in the table)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import TOLERANCE, make_paged, random_query

from stowage.kernels import reference, triton_attention, triton_decode, triton_prefill


def _dense(q, k, v, scale, first_pos, window=None, softcap=None):
    # q: [n, H, D] at positions first_pos..; k, v: [ctx, KVH, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("nhd,chd->hnc", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos, keys = first_pos + torch.arange(q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
    hidden = keys > pos
    if window is not None:
        hidden |= keys <= pos - window
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def _contiguous_kv(paged, seq, n):
    k = reference.gather_kv(paged.k_cache, paged.block_tables[seq], n, paged.k_scale, torch.float32)
    v = reference.gather_kv(paged.v_cache, paged.block_tables[seq], n, paged.v_scale, torch.float32)
    return k.transpose(0, 1)[:n], v.transpose(0, 1)[:n]


@pytest.mark.parametrize("window", [1, 5, 16, 23, 200])
@pytest.mark.parametrize("start_pos", [0, 7, 40])
def test_prefill_window_matches_dense(start_pos, window):
    # chunks smaller and larger than the window, starting inside and past it
    n_new = 19
    paged = make_paged([start_pos + n_new], block_size=16, num_kv_heads=2, head_dim=32, cache_dtype=torch.float32)
    q = torch.randn(n_new, 4, 32, generator=torch.Generator().manual_seed(window + start_pos))
    got = reference.prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables[0], start_pos, 0.2,
                                      window=window, softcap=3.0)
    k, v = _contiguous_kv(paged, 0, start_pos + n_new)
    torch.testing.assert_close(got, _dense(q, k, v, 0.2, start_pos, window, 3.0), atol=1e-5, rtol=1e-5)


def test_decode_window_matches_dense_and_never_reads_blocks_outside_it():
    lens = [70, 5, 33]
    paged = make_paged(lens, block_size=16, num_kv_heads=2, head_dim=32, cache_dtype=torch.float32)
    q = torch.randn(len(lens), 4, 32, generator=torch.Generator().manual_seed(1))
    tables = paged.block_tables.clone()
    # blocks wholly before every window: a recycling cache may have handed them to someone else
    tables[0, :3] = -1
    got = reference.decode_attention(q, paged.k_cache, paged.v_cache, tables, paged.context_lens, 0.2, window=17)
    for i, n in enumerate(lens):
        k, v = _contiguous_kv(paged, i, n)
        torch.testing.assert_close(got[i : i + 1], _dense(q[i : i + 1], k, v, 0.2, n - 1, 17), atol=1e-5, rtol=1e-5)


def test_softcap_without_window():
    paged = make_paged([30], block_size=16, num_kv_heads=1, head_dim=16, cache_dtype=torch.float32)
    q = torch.randn(12, 2, 16, generator=torch.Generator().manual_seed(2)) * 4
    got = reference.prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables[0], 18, 0.5, softcap=2.0)
    k, v = _contiguous_kv(paged, 0, 30)
    torch.testing.assert_close(got, _dense(q, k, v, 0.5, 18, None, 2.0), atol=1e-5, rtol=1e-5)


def test_workspace_shrinks_to_the_window():
    shape = dict(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
                 block_size=16)
    full = reference.workspace_bytes(num_tokens=512, context_tokens=32768, **shape)
    windowed = reference.workspace_bytes(num_tokens=512, context_tokens=32768, window=512, **shape)
    # window 512 + chunk 512: 1,038 of 32,768 keys gathered; the scores tile (<= 16 MiB) is what is left
    assert windowed < full / 2
    mask = 8 * 1038 + 3 * 512 * 1038
    assert windowed - reference.workspace_bytes(num_tokens=512, context_tokens=1038, **shape) <= mask
    # a window longer than the context changes only the mask's own bytes
    assert reference.workspace_bytes(num_tokens=512, context_tokens=1024, window=4096, **shape) >= \
        reference.workspace_bytes(num_tokens=512, context_tokens=1024, **shape)
    # Triton streams K/V: a window only shortens the keys a decode step splits (under 1,024: no partials at all)
    assert triton_attention.workspace_bytes(num_tokens=512, context_tokens=32768, window=512, **shape) == \
        512 * 8 * 64 * 2
    assert triton_attention.workspace_bytes(num_tokens=1, context_tokens=32768, window=512, **shape) == 8 * 64 * 2
    assert triton_attention.workspace_bytes(num_tokens=1, context_tokens=32768, window=4096, **shape) == \
        8 * 64 * 2 + 8 * 8 * 65 * 4


def _recycle(paged, lens, window, chunk=1):
    """Block tables with every block wholly before the window of a chunk's first query set to -1, as the
    sliding-window cache (engine/runtime/kv_cache.py) leaves them."""
    tables = paged.block_tables.clone()
    block_size = paged.k_cache.shape[1]
    for i, n in enumerate(lens):
        tables[i, : max(0, n - chunk - window + 1) // block_size] = -1
    return tables


@pytest.mark.parametrize("window, num_splits", [(17, None), (17, 3), (600, 3), (5000, None)])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_triton_decode_window_and_softcap_match_the_reference(window, num_splits, softcap):
    lens = [70, 5, 33, 1100]
    paged = make_paged(lens, block_size=16, num_kv_heads=2, head_dim=64, cache_dtype=torch.float16)
    query = random_query(len(lens), 8, 64, torch.float16) * 4  # scores of ~20: the cap bends them
    tables = _recycle(paged, lens, window)
    args = (query, paged.k_cache, paged.v_cache, tables, paged.context_lens, 64**-0.5)
    want = reference.decode_attention(*args, window=window, softcap=softcap)
    got = triton_decode.decode_attention(*args, window=window, softcap=softcap, num_splits=num_splits)
    assert torch.isfinite(got).all(), "read a NaN row: outside the window or through -1"
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("window", [5, 16, 23])
@pytest.mark.parametrize("start_pos, n_new", [(0, 19), (7, 70), (40, 19), (100, 3)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_triton_prefill_window_and_softcap_match_the_reference(window, start_pos, n_new, softcap):
    # chunks smaller and larger than the window, starting inside and past it; 5 query heads per KV head
    lens = [start_pos + n_new]
    paged = make_paged(lens, block_size=16, num_kv_heads=2, head_dim=32, cache_dtype=torch.float32)
    q = torch.randn(n_new, 10, 32, generator=torch.Generator().manual_seed(window + start_pos)) * 3
    table = _recycle(paged, lens, window, chunk=n_new)[0]
    want = reference.prefill_attention(q, paged.k_cache, paged.v_cache, table, start_pos, 0.2, window=window,
                                       softcap=softcap)
    got = triton_prefill.prefill_attention(q, paged.k_cache, paged.v_cache, table, start_pos, 0.2, window=window,
                                           softcap=softcap)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= TOLERANCE[torch.float32]
