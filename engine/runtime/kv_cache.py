"""The paged KV cache: block pools per kind of layer, block tables per sequence, sliding windows recycled.

Layers are grouped by what they keep: full-attention layers keep every block of the context; the layers of one
sliding window W keep only the blocks a window and a prefill chunk can reach, and recycle older ones. Each group
has its own pool and each sequence a table per group, indexed by logical block (position // block_size) in every
group, so all tables of a sequence are as long and every kernel keeps its signature: a window group's recycled
entries are -1, and the kernels never read a block before the window's start (docs/planner.md).

A sequence can start from another's cached prefix (share): it holds the other's full blocks of that prefix
read-only, counted by the allocator, and writes only into blocks of its own past them (docs/prefix-sharing.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from stowage.kernels.kv_quant import check_head_dim, rotation_size, row_bytes, row_elems

from ..defaults import BLOCK_SIZE, PREFILL_CHUNK
from ..errors import InvalidArgumentError, OutOfBlocksError


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheSpec:
    """The shape of one layer's cache; the memory math lives here."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # K's (and V's unless v_dtype): a float, fp8, or q8_0 / q4_0 blocks (kernels/kv_quant.py)
    block_size: int = BLOCK_SIZE
    v_dtype: torch.dtype | None = None  # None: the same as K's

    def __post_init__(self):
        for dtype in (self.dtype, self.value_dtype):
            try:
                check_head_dim(dtype, self.head_dim)
            except ValueError as e:
                raise InvalidArgumentError(str(e)) from None

    @property
    def value_dtype(self) -> torch.dtype:
        return self.v_dtype or self.dtype

    @property
    def rotations(self) -> tuple[int, int]:
        """The Hadamard sizes K's and V's rows are stored rotated by (0: not rotated; kernels/kv_quant.py)."""
        return rotation_size(self.dtype, self.head_dim), rotation_size(self.value_dtype, self.head_dim)

    def row_shape(self, dtype: torch.dtype) -> tuple[int, int]:
        """The last two dimensions of a cache of this dtype: [num_kv_heads, head_dim or its blocks' bytes]."""
        return self.num_kv_heads, row_elems(dtype, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one layer: num_kv_heads * (row_bytes(K) + row_bytes(V)); a float row is
        head_dim * itemsize, a q8_0 row head_dim / 32 * 34 bytes, a q4_0 row head_dim / 32 * 18."""
        return self.num_kv_heads * (row_bytes(self.dtype, self.head_dim) + row_bytes(self.value_dtype, self.head_dim))

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def kv_block_bytes(self) -> tuple[int, int]:
        """K's and V's bytes of one block of one layer (apart: their dtypes may differ)."""
        return tuple(self.block_size * self.num_kv_heads * row_bytes(d, self.head_dim)
                     for d in (self.dtype, self.value_dtype))

    def blocks_per_seq(self, num_tokens: int, window: int | None = None, chunk: int = PREFILL_CHUNK) -> int:
        """Blocks one sequence of num_tokens holds at most in a layer: all of them, or what a window reaches.

        A chunk of c new tokens at position s reads keys s - window + 1 .. s + c - 1: window + c - 1 positions,
        which touch at most ceil((window + c - 2) / B) + 1 blocks (the first position at the end of a block)."""
        full = ceil_div(num_tokens, self.block_size)
        if window is None:
            return full
        c = max(1, min(chunk, num_tokens))
        return min(full, ceil_div(window + c - 2, self.block_size) + 1)

    def num_blocks(self, num_tokens: int, num_seqs: int = 1, *, window: int | None = None,
                   chunk: int = PREFILL_CHUNK) -> int:
        return num_seqs * self.blocks_per_seq(num_tokens, window, chunk)

    def layer_bytes(self, num_tokens: int, num_seqs: int = 1, *, window: int | None = None,
                    chunk: int = PREFILL_CHUNK) -> int:
        """S * ceil(T / B) * B * 2 * kv_heads * head_dim * b (DESIGN.md); a window layer: S * min(ceil(T / B),
        ceil((window + chunk - 2) / B) + 1) blocks instead."""
        return self.num_blocks(num_tokens, num_seqs, window=window, chunk=chunk) * self.block_bytes


class BlockAllocator:
    """Hands out block ids from a fixed pool; the same ids index the cache of every layer of one group.

    Each block counts the sequences that hold it (sequences started from another's prefix share its full blocks):
    a block goes back to the pool when the last of them frees it."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._holders = [0] * num_blocks  # block -> how many sequences hold it; 0: free

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_holders(self, block: int) -> int:
        return self._holders[block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(
                f"the KV cache is full: {n} more block(s) needed, {len(self._free)} free of {self.num_blocks}; "
                "start a new conversation or load with a larger context"
            )
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._holders[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more sequence holds these (held) blocks."""
        for b in blocks:
            assert self._holders[b] > 0, f"block {b} is shared but nobody holds it"
            self._holders[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One sequence lets go of these blocks; those it held last go back to the pool."""
        for b in reversed(blocks):
            assert self._holders[b] > 0, f"block {b} is freed but nobody holds it"
            self._holders[b] -= 1
            if not self._holders[b]:
                self._free.append(b)


@dataclass
class Sequence:
    """One conversation's cached tokens and the blocks that hold them."""

    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # the full-attention layers' blocks
    window_tables: dict[int, list[int]] = field(default_factory=dict)  # window -> its layers' blocks, -1 recycled

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class CacheGroup:
    """Layers that keep the same tokens: one pool of blocks, one block table per sequence."""

    window: int | None  # None: the whole context
    max_blocks_per_seq: int  # what a sequence holds at most once older blocks are recycled
    allocator: BlockAllocator

    def table(self, seq: Sequence) -> list[int]:
        return seq.block_table if self.window is None else seq.window_tables.setdefault(self.window, [])


def first_held(table: list[int]) -> int:
    """Index of the first block a table still holds: recycled entries (-1) are always a prefix."""
    lo, hi = 0, len(table)
    while lo < hi:
        mid = (lo + hi) // 2
        if table[mid] < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


class KVCache:
    """Per-layer K/V block pools, each on its layer's device, sized for exactly context_tokens per sequence.

    `layer_windows` (ModelConfig.layer_windows; () when every layer is full) and `prefill_chunk` (the most
    tokens one forward adds) size the window groups. A window that reaches the whole context is a full layer here."""

    def __init__(self, spec: CacheSpec, layer_devices: list[torch.device], context_tokens: int, num_seqs: int = 1, *,
                 layer_windows: tuple[int | None, ...] = (), prefill_chunk: int = PREFILL_CHUNK):
        self.spec = spec
        self.context_tokens = context_tokens  # what one sequence may hold: the plan's context
        self.prefill_chunk = prefill_chunk
        assert not layer_windows or len(layer_windows) == len(layer_devices), "one window (or None) per layer"
        kept = {w: spec.blocks_per_seq(context_tokens, w, prefill_chunk) for w in set(layer_windows) | {None}}
        windows = [w if kept[w] < kept[None] else None for w in layer_windows or [None] * len(layer_devices)]
        keys = sorted(set(windows), key=lambda w: -1 if w is None else w)  # the full group first
        self.groups = [CacheGroup(w, kept[w], BlockAllocator(num_seqs * kept[w])) for w in keys]
        self.layer_group = [keys.index(w) for w in windows]  # layer -> index into groups
        # k_cache[l], v_cache[l]: [num_blocks of the layer's group, block_size, num_kv_heads, head_dim] (q8_0 / q4_0:
        # the last dimension is the bytes of head_dim / 32 blocks)
        blocks = [(self.groups[g].allocator.num_blocks, spec.block_size) for g in self.layer_group]
        self.k_cache = [torch.zeros(*b, *spec.row_shape(spec.dtype), dtype=spec.dtype, device=d)
                        for b, d in zip(blocks, layer_devices)]
        self.v_cache = [torch.zeros(*b, *spec.row_shape(spec.value_dtype), dtype=spec.value_dtype, device=d)
                        for b, d in zip(blocks, layer_devices)]
        # fp8 stores value / scale; 1.0 keeps the fp8 range for typical K/V magnitudes (see docs/kernels.md)
        self.k_scale = [1.0] * len(layer_devices)
        self.v_scale = [1.0] * len(layer_devices)

    @property
    def allocator(self) -> BlockAllocator:
        """The full-attention layers' pool (the only one of a model without windows)."""
        return self.groups[0].allocator

    @property
    def max_new_tokens(self) -> int | None:
        """The most tokens one forward may add: a window group holds only what a chunk of that many reaches."""
        return self.prefill_chunk if any(g.window is not None for g in self.groups) else None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> torch.Tensor:
        """Grow seq's block tables for num_new_tokens more tokens, recycling window blocks no query will read again;
        return the new tokens' slots in each group: [num_groups, num_new_tokens]."""
        bs, start = self.spec.block_size, seq.num_tokens
        length = ceil_div(start + num_new_tokens, bs)
        for g in self.groups:
            table = g.table(seq)
            if g.window is not None:
                # keep the newest blocks up to the group's share (history for truncate), never one this chunk reads
                cut = min(length - g.max_blocks_per_seq, max(0, start - g.window + 1) // bs)
                first = first_held(table)
                if cut > first:
                    g.allocator.free(table[first:cut])
                    table[first:cut] = [-1] * (cut - first)
            if length > len(table):
                table.extend(g.allocator.allocate(length - len(table)))
            # a shared block is always full: the first new token goes into a block only this sequence holds
            assert not start % bs or g.allocator.num_holders(table[start // bs]) == 1, "write into a shared block"
        positions = torch.arange(start, start + num_new_tokens)
        tables = torch.tensor([g.table(seq)[:length] for g in self.groups], dtype=torch.int64)  # [groups, blocks]
        return tables[:, positions // bs] * bs + positions % bs

    def num_reusable(self, seq: Sequence, num_tokens: int) -> int:
        """How many of seq's first num_tokens tokens a truncate keeps: all of them while every window group still
        holds the last window of them, else 0 (the window layers' K/V there depend on the recycled ones)."""
        num_tokens = min(num_tokens, seq.num_tokens)
        for g in self.groups:
            if g.window is None or not num_tokens:
                continue
            if g.table(seq)[max(0, num_tokens - g.window + 1) // self.spec.block_size] < 0:
                return 0
        return num_tokens

    def num_shareable(self, seq: Sequence, num_tokens: int) -> int:
        """How many of seq's first num_tokens cached tokens another sequence can start from (share): whole blocks
        only, while every window group still holds the last window of them (num_reusable), else 0."""
        bs = self.spec.block_size
        return self.num_reusable(seq, min(num_tokens, seq.num_tokens) // bs * bs)

    def share(self, seq: Sequence, source: Sequence, num_tokens: int) -> int:
        """Start the empty seq from source's first num_tokens cached tokens (num_shareable of them), holding source's
        blocks of them read-only, and return how many: seq's own blocks start after them, so neither sequence
        writes into a block the other reads. A window group shares only the blocks a chunk from there reads."""
        assert not seq.num_tokens, "share starts an empty sequence"
        bs = self.spec.block_size
        n = self.num_shareable(source, num_tokens)
        length = n // bs
        for g in self.groups:
            first = 0 if g.window is None else min(max(0, n - g.window + 1) // bs, length)
            blocks = g.table(source)[first:length]
            g.allocator.share(blocks)
            g.table(seq)[:] = [-1] * first + blocks
        seq.token_ids[:] = source.token_ids[:n]
        return n

    def truncate(self, seq: Sequence, num_tokens: int) -> int:
        """Keep the first num_tokens cached tokens of seq where the cache still can (num_reusable), release the
        blocks past them, and return the number kept: the caller prefills from there (seq.num_tokens).

        A block kept in part is kept only while seq holds it alone: the next token is written into it, and another
        sequence that holds it reads what is there; then the cut is at the start of that block."""
        bs = self.spec.block_size
        keep = self.num_reusable(seq, num_tokens)
        if keep % bs and any(g.allocator.num_holders(g.table(seq)[keep // bs]) > 1 for g in self.groups):
            keep = self.num_reusable(seq, keep - keep % bs)
        length = ceil_div(keep, bs)
        for g in self.groups:
            table = g.table(seq)
            g.allocator.free([b for b in table[length:] if b >= 0])
            del table[length:]
        del seq.token_ids[keep:]
        return keep

    def release(self, seq: Sequence) -> None:
        self.truncate(seq, 0)

    def can_fit(self, growth: list[tuple[Sequence, int]]) -> bool:
        """Whether each sequence can grow by its number of tokens (prefilled in chunks), in this order, from the
        free blocks now.

        Blocks held by several sequences are counted once: a new block is needed only past a sequence's table, and a
        window block it recycles returns to the pool only when no other sequence holds it still."""
        bs = self.spec.block_size
        for g in self.groups:
            free, dropped = g.allocator.num_free, Counter()
            for seq, n in growth:
                table = g.table(seq)
                new = max(0, ceil_div(seq.num_tokens + n, bs) - len(table))
                if g.window is not None:  # it holds at most its share: the oldest blocks go as new ones come
                    first = first_held(table)
                    recycled = max(0, len(table) - first + new - g.max_blocks_per_seq)
                    old = table[first : first + recycled]
                    free += recycled - len(old)  # new blocks of this growth, recycled again before it ends
                    for b in old:
                        dropped[b] += 1
                        free += dropped[b] == g.allocator.num_holders(b)  # its last holder let go
                free -= new
                if free < 0:
                    return False
        return True

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Every group's block table of each sequence: [num_groups, num_seqs, max_blocks] int32, -1 padded."""
        width = max(len(g.table(seq)) for g in self.groups for seq in seqs)
        return torch.tensor([[g.table(s) + [-1] * (width - len(g.table(s))) for s in seqs] for g in self.groups],
                            dtype=torch.int32)

    # -- a sequence's blocks out of the cache and back (engine/serving/kv_store.py) ------------------------
    def held_range(self, seq: Sequence, group: int) -> tuple[int, int]:
        """The logical blocks [first, end) one group holds of seq's tokens (a window group's recycled ones before)."""
        table = self.groups[group].table(seq)
        end = ceil_div(seq.num_tokens, self.spec.block_size)
        return min(first_held(table), end), end

    def export_layer(self, seq: Sequence, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks a layer holds of seq's tokens (held_range), on the CPU: [n, block_size, heads, row]."""
        first, end = self.held_range(seq, self.layer_group[layer])
        ids = torch.tensor(self.groups[self.layer_group[layer]].table(seq)[first:end], dtype=torch.int64)
        ids = ids.to(self.k_cache[layer].device)
        return self.k_cache[layer][ids].cpu(), self.v_cache[layer][ids].cpu()

    def adopt(self, seq: Sequence, token_ids: list[int], firsts: list[int]) -> None:
        """Give an empty seq blocks for token_ids, group g holding logical blocks from firsts[g] on (-1 before);
        their K/V are then filled in by import_layer. Raises OutOfBlocksError (nothing held) when they do not fit."""
        assert not seq.num_tokens, "adopt fills an empty sequence"
        end = ceil_div(len(token_ids), self.spec.block_size)
        firsts = [min(f, end) for f in firsts]
        for g, first in zip(self.groups, firsts):
            if end - first > g.allocator.num_free:
                g.allocator.allocate(end - first)  # raises, naming the shortage, before any group took blocks
        for g, first in zip(self.groups, firsts):
            g.table(seq)[:] = [-1] * first + g.allocator.allocate(end - first)
        seq.token_ids[:] = token_ids

    def import_layer(self, seq: Sequence, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V ([n, block_size, heads, row], any device) into the blocks a layer holds of seq (adopt)."""
        first, end = self.held_range(seq, self.layer_group[layer])
        ids = torch.tensor(self.groups[self.layer_group[layer]].table(seq)[first:end], dtype=torch.int64)
        device = self.k_cache[layer].device
        ids = ids.to(device)
        self.k_cache[layer][ids] = k.to(device)
        self.v_cache[layer][ids] = v.to(device)
