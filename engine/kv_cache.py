"""The paged KV cache: a pool of fixed-size blocks per layer, block tables per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .defaults import BLOCK_SIZE
from .errors import OutOfBlocksError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheSpec:
    """The shape of one layer's cache; the memory math lives here."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = BLOCK_SIZE

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks(self, num_tokens: int, num_seqs: int = 1) -> int:
        return num_seqs * ceil_div(num_tokens, self.block_size)

    def layer_bytes(self, num_tokens: int, num_seqs: int = 1) -> int:
        """S * ceil(T / B) * B * 2 * kv_heads * head_dim * b (DESIGN.md)."""
        return self.num_blocks(num_tokens, num_seqs) * self.block_bytes


class BlockAllocator:
    """Hands out block ids from a fixed pool; the same ids index every layer's cache."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(
                f"the KV cache is full: {n} more block(s) needed, {len(self._free)} free of {self.num_blocks}; "
                "start a new conversation or load with a larger context"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class Sequence:
    """One conversation's cached tokens and the blocks that hold them."""

    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class KVCache:
    """Per-layer K/V block pools, each on its layer's device, sized for exactly num_tokens per sequence."""

    def __init__(self, spec: CacheSpec, layer_devices: list[torch.device], num_tokens: int, num_seqs: int = 1):
        self.spec = spec
        self.max_tokens = num_tokens
        num_blocks = spec.num_blocks(num_tokens, num_seqs)
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # k_cache[l], v_cache[l]: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = [torch.zeros(shape, dtype=spec.dtype, device=d) for d in layer_devices]
        self.v_cache = [torch.zeros(shape, dtype=spec.dtype, device=d) for d in layer_devices]
        # fp8 stores value / scale; 1.0 keeps the fp8 range for typical K/V magnitudes (see docs/kernels.md)
        self.k_scale = [1.0] * len(layer_devices)
        self.v_scale = [1.0] * len(layer_devices)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> torch.Tensor:
        """Grow seq's block table for num_new_tokens more tokens; return their slots: [num_new_tokens]."""
        needed = ceil_div(seq.num_tokens + num_new_tokens, self.spec.block_size) - len(seq.block_table)
        if needed > 0:
            seq.block_table.extend(self.allocator.allocate(needed))
        bs = self.spec.block_size
        positions = range(seq.num_tokens, seq.num_tokens + num_new_tokens)
        return torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in positions], dtype=torch.int64)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the first num_tokens cached tokens of seq; release the blocks past them."""
        keep = ceil_div(num_tokens, self.spec.block_size)
        self.allocator.free(seq.block_table[keep:])
        del seq.block_table[keep:]
        del seq.token_ids[num_tokens:]

    def release(self, seq: Sequence) -> None:
        self.truncate(seq, 0)

    def block_table_tensor(self, seq: Sequence) -> torch.Tensor:
        return torch.tensor(seq.block_table, dtype=torch.int32)
