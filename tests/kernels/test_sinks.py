"""Attention sinks (gpt-oss: a logit per head in every softmax, no value) in every attention implementation:
the Triton kernels (under the interpreter here) and the native CPU one against the reference, which
tests/engine/test_gpt_oss.py holds to transformers."""

from __future__ import annotations

import pytest
import torch
from paged_cases import TOLERANCE, make_paged, random_query

from stowage.kernels import cpu_attention, cpu_decode, reference, triton_decode, triton_prefill

SINKS = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0, 1.0, 0.0, 2.5])  # 8 query heads


@pytest.mark.parametrize("window, num_splits", [(None, 1), (None, 3), (17, None)])
def test_triton_decode_with_sinks_matches_the_reference(window, num_splits):
    lens = [70, 5, 33, 300]
    paged = make_paged(lens, block_size=16, num_kv_heads=2, head_dim=64, cache_dtype=torch.float32)
    query = random_query(len(lens), 8, 64, torch.float32)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 64**-0.5)
    want = reference.decode_attention(*args, window=window, sinks=SINKS)
    assert (want - reference.decode_attention(*args, window=window)).abs().max() > 0.01  # the sinks matter
    got = triton_decode.decode_attention(*args, window=window, sinks=SINKS, num_splits=num_splits)
    assert (got - want).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("start_pos, n_new", [(0, 19), (40, 7)])
def test_triton_and_native_prefill_with_sinks_match_the_reference(window, start_pos, n_new):
    paged = make_paged([start_pos + n_new], block_size=16, num_kv_heads=2, head_dim=32, cache_dtype=torch.float32)
    q = torch.randn(n_new, 8, 32, generator=torch.Generator().manual_seed(start_pos)) * 2
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables[0], start_pos, 0.2)
    want = reference.prefill_attention(*args, window=window, sinks=SINKS)
    got = triton_prefill.prefill_attention(*args, window=window, sinks=SINKS)
    assert (got - want).abs().max().item() <= TOLERANCE[torch.float32]
    if cpu_decode.current() is not None:
        native = cpu_attention.prefill_attention(*args, window=window, sinks=SINKS)
        assert (native - want).abs().max().item() <= TOLERANCE[torch.float32]
