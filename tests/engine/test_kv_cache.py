import math

import pytest
import torch

from stowage.engine.errors import OutOfBlocksError
from stowage.engine.runtime.kv_cache import BlockAllocator, CacheSpec, KVCache, Sequence


def test_llama_8b_shape_32k_tokens_is_exactly_4_gib():
    spec = CacheSpec(num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
    # 2 (K and V) * 8 heads * 128 dims * 2 bytes = 4096 bytes per token per layer
    assert spec.bytes_per_token == 4096
    assert 32 * spec.layer_bytes(32_768) == 4 * 2**30


def test_allocate_reserves_exactly_ceil_blocks_and_the_formula_bytes():
    spec = CacheSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_size=16)
    cache = KVCache(spec, [torch.device("cpu")] * 3, context_tokens=100, num_seqs=2)
    assert cache.allocator.num_blocks == 2 * math.ceil(100 / 16) == 14
    # S * ceil(T/B) * B * 2 * kv_heads * head_dim * b per layer, times 3 layers
    assert cache.num_bytes == 3 * 2 * 7 * 16 * 2 * 2 * 16 * 2 == spec.layer_bytes(100, 2) * 3


def test_slots_follow_the_block_table_and_truncate_frees_blocks():
    spec = CacheSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=4)
    cache = KVCache(spec, [torch.device("cpu")], context_tokens=16)
    seq = Sequence()
    slots = cache.reserve(seq, 6)
    seq.token_ids.extend(range(6))
    b0, b1 = seq.block_table
    assert slots.tolist() == [[b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]]  # one group
    assert cache.allocator.num_free == 2
    assert cache.truncate(seq, 3) == 3
    assert seq.block_table == [b0] and seq.num_tokens == 3 and cache.allocator.num_free == 3
    assert cache.reserve(seq, 1).tolist() == [[b0 * 4 + 3]]


def test_out_of_blocks_is_a_clear_error():
    alloc = BlockAllocator(2)
    alloc.allocate(2)
    with pytest.raises(OutOfBlocksError, match="1 more block.*0 free of 2"):
        alloc.allocate(1)


# Sliding windows: block size 4, window 6, chunks of up to 4 tokens. A chunk of c tokens at s reads keys
# s - 5 .. s + c - 1 (6 + c - 1 positions), which touch at most ceil((6 + 4 - 2) / 4) + 1 = 3 blocks.
WINDOWED = CacheSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=4)


def windowed_cache(num_tokens=64, num_seqs=1):
    return KVCache(WINDOWED, [torch.device("cpu")] * 3, num_tokens, num_seqs, layer_windows=(6, None, 6),
                   prefill_chunk=4)


def grow(cache, seq, n):
    slots = cache.reserve(seq, n)
    seq.token_ids.extend(range(seq.num_tokens, seq.num_tokens + n))
    return slots


def test_window_layers_keep_what_a_window_and_a_chunk_reach():
    assert WINDOWED.blocks_per_seq(64, 6, 4) == 3 and WINDOWED.blocks_per_seq(64) == 16
    assert WINDOWED.blocks_per_seq(8, 6, 4) == 2  # a short context: all of its blocks, no more
    assert WINDOWED.blocks_per_seq(64, 6, 1) == 3  # decode: 6 positions can still touch 3 blocks
    assert WINDOWED.layer_bytes(64, 2, window=6, chunk=4) == 2 * 3 * 4 * 2 * 1 * 4 * 4
    cache = windowed_cache(num_seqs=2)
    assert [g.window for g in cache.groups] == [None, 6] and cache.layer_group == [1, 0, 1]
    assert [g.allocator.num_blocks for g in cache.groups] == [32, 6]
    assert cache.num_bytes == 2 * (32 + 2 * 6) * 4 * 1 * 4 * 4
    assert cache.max_new_tokens == 4
    # a window that reaches the whole context is a full layer: one group, nothing recycled
    assert len(KVCache(WINDOWED, [torch.device("cpu")], 8, layer_windows=(6,), prefill_chunk=4).groups) == 1


def test_window_blocks_are_recycled_and_never_the_ones_a_chunk_reads():
    cache = windowed_cache()
    seq = Sequence()
    for _ in range(10):  # 40 tokens, in chunks of 4
        slots = grow(cache, seq, 4)
        table = seq.window_tables[6]
        assert len(table) == len(seq.block_table) == seq.num_tokens // 4  # indexed by logical block in both groups
        start = seq.num_tokens - 4
        assert all(b >= 0 for b in table[max(0, start - 5) // 4 :])  # every key of the chunk's windows is held
        assert sum(b >= 0 for b in table) <= 3
        assert slots[1].tolist() == [table[p // 4] * 4 + p % 4 for p in range(start, seq.num_tokens)]
    assert table[:7] == [-1] * 7 and cache.groups[1].allocator.num_free == 0
    assert cache.groups[0].allocator.num_free == 16 - 10
    tables = cache.block_tables([seq])
    assert tables.shape == (2, 1, 10) and tables[1, 0].tolist() == table


def test_truncate_keeps_a_prefix_only_while_its_window_is_held():
    cache = windowed_cache()
    seq = Sequence()
    for _ in range(10):
        grow(cache, seq, 4)
    # blocks 7..9 (positions 28..39) are held: a prefix of n tokens needs positions n - 5 .. n - 1
    assert cache.num_reusable(seq, 39) == 39 and cache.num_reusable(seq, 33) == 33
    assert cache.num_reusable(seq, 32) == 0  # needs position 27, recycled
    assert cache.truncate(seq, 35) == 35 and seq.num_tokens == 35
    assert seq.window_tables[6] == [-1] * 7 + seq.window_tables[6][7:9] and len(seq.block_table) == 9
    assert cache.truncate(seq, 20) == 0  # the window layers' K/V there were recycled: prefill again from 0
    assert seq.num_tokens == 0 and seq.block_table == [] and seq.window_tables[6] == []
    assert [g.allocator.num_free for g in cache.groups] == [16, 3]


def test_can_fit_counts_each_group_with_its_share():
    cache = windowed_cache(num_tokens=64, num_seqs=1)
    a, b = Sequence(), Sequence()
    assert cache.can_fit([(a, 64)])  # prefilled in chunks, the window group never holds more than 3 blocks
    grow(cache, a, 4)
    grow(cache, a, 4)  # a holds 2 window blocks of 3
    assert cache.can_fit([(a, 40)]) and cache.can_fit([(b, 4)])
    assert not cache.can_fit([(b, 8)])  # b would need 2 window blocks, 1 is free
    assert not cache.can_fit([(a, 4), (b, 4)])
    cache.release(a)
    assert cache.can_fit([(b, 64)])
