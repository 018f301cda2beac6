"""The oracle itself against plain dense attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_paged

from stowage.kernels import reference


def _dense(q, k, v, scale, first_pos):
    # q: [n, H, D] at positions first_pos..; k, v: [ctx, KVH, D]; repeat K/V per query head
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("nhd,chd->hnc", q.float(), k) * scale
    pos = first_pos + torch.arange(q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def _contiguous_kv(paged, seq, n):
    # gather_kv is head-major and padded to whole blocks: [KVH, blocks * block_size, D] -> [n, KVH, D]
    k = reference.gather_kv(paged.k_cache, paged.block_tables[seq], n, paged.k_scale, torch.float32)
    v = reference.gather_kv(paged.v_cache, paged.block_tables[seq], n, paged.v_scale, torch.float32)
    return k.transpose(0, 1)[:n], v.transpose(0, 1)[:n]


@pytest.mark.parametrize("start_pos", [0, 21])
def test_prefill_is_causal_over_the_cache(start_pos):
    # a chunk of 19 new tokens after start_pos cached ones, block size 16: spans 3 blocks
    n_new = 19
    paged = make_paged([start_pos + n_new], block_size=16, num_kv_heads=2, head_dim=80, cache_dtype=torch.float32)
    q = torch.randn(n_new, 6, 80, generator=torch.Generator().manual_seed(5))
    got = reference.prefill_attention(q, paged.k_cache, paged.v_cache, paged.block_tables[0], start_pos, 0.1)
    k, v = _contiguous_kv(paged, 0, start_pos + n_new)
    torch.testing.assert_close(got, _dense(q, k, v, 0.1, start_pos), atol=1e-5, rtol=1e-5)


def test_decode_matches_dense():
    paged = make_paged([1, 40], block_size=16, num_kv_heads=2, head_dim=64, cache_dtype=torch.float32)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(6))
    got = reference.decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.125)
    for s, n in enumerate(paged.context_lens.tolist()):
        k, v = _contiguous_kv(paged, s, n)
        torch.testing.assert_close(got[s], _dense(q[s : s + 1], k, v, 0.125, n - 1)[0], atol=1e-5, rtol=1e-5)


def test_fp8_write_stores_value_over_scale():
    k_cache = torch.zeros(1, 16, 1, 4, dtype=torch.float8_e4m3fn)
    v_cache = k_cache.clone()
    x = torch.tensor([[[1.0, -2.0, 0.5, 1000.0]]])
    reference.write_kv(x, x, k_cache, v_cache, torch.tensor([3]), k_scale=0.5, v_scale=4.0)
    assert k_cache[0, 3, 0].float().tolist() == [2.0, -4.0, 1.0, 448.0]  # saturates, never inf/NaN
    assert v_cache[0, 3, 0].float().tolist() == [0.25, -0.5, 0.125, 256.0]
