"""The Triton kernels (interpreted on the CPU) on q8_0 / q4_0 caches against the torch reference on the same cache."""

from __future__ import annotations

import pytest
import torch

from stowage.kernels import kv_quant, reference, triton_attention, triton_decode, triton_prefill

Q8, Q4 = torch.int8, torch.uint8


def _cache(k_dtype, v_dtype, lens, *, kvh=2, hd=64, bs=16, seed=0):
    """Sequences of `lens` tokens written through the facade's write_kv, their blocks shuffled in one pool."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // bs) for n in lens]
    nb = sum(per_seq) + 2
    kc = torch.zeros(nb, bs, kvh, kv_quant.row_elems(k_dtype, hd), dtype=k_dtype)
    vc = torch.zeros(nb, bs, kvh, kv_quant.row_elems(v_dtype, hd), dtype=v_dtype)
    order = torch.randperm(nb, generator=g).to(torch.int32)
    tables = torch.full((len(lens), max(per_seq)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        tables[i, : per_seq[i]] = order[used : used + per_seq[i]]
        used += per_seq[i]
        slots = tables[i].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        k, v = torch.randn(n, kvh, hd, generator=g) * 2, torch.randn(n, kvh, hd, generator=g)
        triton_attention.write_kv(k, v, kc, vc, slots)
        assert torch.equal(kc.view(-1, kvh, kc.shape[-1])[slots], reference._to_cache(k, k_dtype, 1.0))
    return kc, vc, tables


TYPES = [(Q8, Q8), (Q4, Q4), (Q8, Q4), (torch.bfloat16, Q4)]
IDS = ["q8_0", "q4_0", "q8_0-q4_0", "bf16-q4_0"]


@pytest.mark.parametrize("k_dtype,v_dtype", TYPES, ids=IDS)
def test_decode_reads_the_blocks(k_dtype, v_dtype):
    lens = [1, 37, 150]
    kc, vc, tables = _cache(k_dtype, v_dtype, lens)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(1))
    ctx = torch.tensor(lens, dtype=torch.int32)
    for options, splits in (({}, 2), ({"window": 50}, 1), ({"softcap": 10.0}, 1)):  # 2: split-K and its merge
        want = reference.decode_attention(q, kc, vc, tables, ctx, 0.125, **options)
        got = triton_decode.decode_attention(q, kc, vc, tables, ctx, 0.125, num_splits=splits, **options)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (options, splits)


@pytest.mark.parametrize("k_dtype,v_dtype", TYPES, ids=IDS)
def test_prefill_reads_the_blocks(k_dtype, v_dtype):
    kc, vc, tables = _cache(k_dtype, v_dtype, [150])
    for q_dtype, tol, options in ((torch.float32, 1e-5, {}), (torch.bfloat16, 1e-2, {"window": 33})):
        q = torch.randn(40, 8, 64, generator=torch.Generator().manual_seed(2)).to(q_dtype)
        want = reference.prefill_attention(q, kc, vc, tables[0], 110, 0.125, **options)
        got = triton_prefill.prefill_attention(q, kc, vc, tables[0], 110, 0.125, **options)
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max(), (q_dtype, options)
