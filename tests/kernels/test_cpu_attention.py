"""The CPU's native paged attention (kernels/cpu_attention.py) against the torch reference on the same caches."""

from __future__ import annotations

import pytest
import torch

from isa import native_isa
from stowage.kernels import cpu_attention, cpu_decode, reference

pytestmark = pytest.mark.skipif(cpu_decode.current() is None, reason="no native library here (no C compiler)")


def _cache(num_tokens, kv_heads, head_dim, dtype, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen) * 0.5
    v = torch.randn(shape, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: -(-num_tokens // block_size)].to(torch.int32)
    if dtype == torch.float8_e4m3fn:
        return k.to(dtype), v.to(dtype), table
    return k.to(dtype), v.to(dtype), table


CASES = [  # heads, kv heads, head_dim, new tokens, start, window, softcap
    (4, 2, 16, 37, 0, None, None),      # a prompt that ends in a partly filled block
    (9, 3, 64, 20, 117, None, None),    # a chunk after cached tokens
    (8, 1, 32, 50, 300, None, None),    # one KV head for all
    (4, 4, 24, 33, 40, None, None),     # rows of 24: no whole vectors
    (4, 2, 16, 40, 90, 24, None),       # a sliding window shorter than the chunk
    (4, 2, 16, 5, 200, 64, 50.0),       # window and Gemma 2's soft-cap
    (2, 1, 256, 3, 10, None, None),     # Gemma's wide heads
    (128, 1, 16, 2, 5, None, None),     # more query heads per KV head than a tile holds: the reference serves
    # shapes of the bf16 kernel (prefill_bf16.h): states of a tile in one or two vectors of 16, heads of 16-wide
    # tails, windows across tiles
    (15, 5, 64, 300, 0, None, None),    # SmolLM2-360M's heads, a whole prompt: many tiles, the last partly filled
    (32, 32, 64, 70, 33, None, None),   # no grouping: 32 queries a tile
    (12, 2, 80, 45, 29, None, None),    # rows of 80: two pairs of vectors and a tail of 16
    (16, 1, 128, 40, 500, 100, None),   # 16 heads a KV head: 2 queries a tile, a window
    (6, 2, 48, 64, 0, 7, None),         # a window shorter than a cache block
]


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float8_e4m3fn)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,n,start,window,softcap", CASES)
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES)
def test_prefill_matches_the_reference(heads, kv_heads, head_dim, n, start, window, softcap, dtype, cache_dtype):
    k, v, table = _cache(start + n, kv_heads, head_dim, cache_dtype)
    q = (torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(1))).to(dtype)
    args = (q, k, v, table, start, head_dim ** -0.5, 1.0, 1.0)
    ours = cpu_attention.prefill_attention(*args, window=window, softcap=softcap)
    ref = reference.prefill_attention(*args, window=window, softcap=softcap)
    assert ours.dtype == dtype and ours.shape == ref.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("isa", list(cpu_decode.ISAS))
def test_prefill_at_every_instruction_set_matches_the_reference(monkeypatch, isa):
    # each level's kernels (AVX2 and AVX-512: prefill_lanes.h; AVX512-BF16: prefill_bf16.h too; scalar: the
    # generic loop) over the cases above, each dtype pair
    with native_isa(monkeypatch, isa):
        for case in CASES:
            for dtype, cache_dtype in DTYPES:
                test_prefill_matches_the_reference(*case, dtype, cache_dtype)


@pytest.mark.parametrize("block_size", [8, 32])
def test_prefill_over_other_block_sizes_matches_the_reference(block_size):
    k, v, table = _cache(230, 2, 64, torch.bfloat16, block_size=block_size, seed=5)
    q = torch.randn(100, 6, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    args = (q, k, v, table, 130, 64 ** -0.5, 1.0, 1.0)
    torch.testing.assert_close(cpu_attention.prefill_attention(*args).float(),
                               reference.prefill_attention(*args).float(), atol=2e-2, rtol=2e-2)


def test_prefill_reads_every_fp8_value_exactly():
    # one query at position 0 sees one key: its output is that key's value row, every e4m3 byte but the two NaNs
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    v = torch.zeros(2, 16, 1, 256, dtype=torch.uint8)
    v[1, 0, 0] = codes
    v = v.view(torch.float8_e4m3fn)
    k = torch.zeros_like(v)
    q = torch.randn(1, 4, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    out = cpu_attention.prefill_attention(q, k, v, torch.tensor([1], dtype=torch.int32), 0, 0.0625, 1.0, 1.0)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.float(), want.expand(4, 256)[None])


def test_batched_decode_matches_the_reference():
    k, v, _ = _cache(400, 2, 32, torch.bfloat16, seed=3)
    lens = torch.tensor([1, 17, 160, 399], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    tables = torch.full((4, 25), -1, dtype=torch.int32)
    for i, n in enumerate(lens.tolist()):
        blocks = -(-n // 16)
        tables[i, :blocks] = torch.randperm(k.shape[0], generator=gen)[:blocks].to(torch.int32)
    q = torch.randn(4, 8, 32, generator=gen).to(torch.bfloat16)
    args = (q, k, v, tables, lens, 32 ** -0.5)
    torch.testing.assert_close(cpu_attention.decode_attention(*args).float(),
                               reference.decode_attention(*args).float(), atol=2e-2, rtol=2e-2)


def test_cpu_runs_the_native_kernel_and_charges_its_workspace():
    from stowage.kernels import attention_ops

    assert attention_ops("cpu") is cpu_attention
    shape = dict(num_tokens=512, context_tokens=32768, num_heads=32, num_kv_heads=8, head_dim=128,
                 dtype=torch.bfloat16, cache_dtype=torch.bfloat16, block_size=16)
    # no gathered context and no scores: a small fraction of what the reference needs at a long context
    assert cpu_attention.workspace_bytes(**shape) < reference.workspace_bytes(**shape) / 10
