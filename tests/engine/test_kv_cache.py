import math

import pytest
import torch

from engine.errors import OutOfBlocksError
from engine.kv_cache import BlockAllocator, CacheSpec, KVCache, Sequence


def test_llama_8b_shape_32k_tokens_is_exactly_4_gib():
    spec = CacheSpec(num_kv_heads=8, head_dim=128, dtype=torch.float16, block_size=16)
    # 2 (K and V) * 8 heads * 128 dims * 2 bytes = 4096 bytes per token per layer
    assert spec.bytes_per_token == 4096
    assert 32 * spec.layer_bytes(32_768) == 4 * 2**30


def test_allocate_reserves_exactly_ceil_blocks_and_the_formula_bytes():
    spec = CacheSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_size=16)
    cache = KVCache(spec, [torch.device("cpu")] * 3, num_tokens=100, num_seqs=2)
    assert cache.allocator.num_blocks == 2 * math.ceil(100 / 16) == 14
    # S * ceil(T/B) * B * 2 * kv_heads * head_dim * b per layer, times 3 layers
    assert cache.num_bytes == 3 * 2 * 7 * 16 * 2 * 2 * 16 * 2 == spec.layer_bytes(100, 2) * 3


def test_slots_follow_the_block_table_and_truncate_frees_blocks():
    spec = CacheSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=4)
    cache = KVCache(spec, [torch.device("cpu")], num_tokens=16)
    seq = Sequence()
    slots = cache.reserve(seq, 6)
    seq.token_ids.extend(range(6))
    b0, b1 = seq.block_table
    assert slots.tolist() == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    assert cache.allocator.num_free == 2
    cache.truncate(seq, 3)
    assert seq.block_table == [b0] and seq.num_tokens == 3 and cache.allocator.num_free == 3
    assert cache.reserve(seq, 1).tolist() == [b0 * 4 + 3]


def test_out_of_blocks_is_a_clear_error():
    alloc = BlockAllocator(2)
    alloc.allocate(2)
    with pytest.raises(OutOfBlocksError, match="1 more block.*0 free of 2"):
        alloc.allocate(1)
