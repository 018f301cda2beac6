"""Triton decode attention over a paged cache: one query token per sequence, GQA, optional split-K.

One program owns (sequence, KV head, split): it loads that KV head's group of query heads once and
streams the split's tokens through an online softmax, so each K/V row is read from memory exactly
once per step, whatever the group size. Long contexts with few sequences would leave most SMs idle,
so the context is cut into splits whose partial results (normalised output and log-sum-exp) a
second, tiny kernel merges. See docs/kernels.md.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .triton_attention import MAX_SPLITS, MIN_SPLIT_TOKENS
from .triton_write import _check_inner_contiguous, _unit_stride, cache_strides, load_rows, quant_code

LOG2E = 1.4426950408889634
TILE_TOKENS = 64  # tokens per inner step; spans several blocks, gathered row by row
# Read when the kernels below are decorated, as triton.jit does (triton.knobs is 3.4+).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,  # [num_heads] float32 (when HAS_SINKS): a logit per head in every softmax, no value (gpt-oss)
    qk_scale,  # softmax scale * k_scale * log2(e): scores go straight into exp2 (without log2(e) when soft-capped)
    v_scale,
    split_tokens,
    window,  # sliding window in tokens (when HAS_WINDOW): keys ctx - window .. ctx - 1
    softcap,  # scores become softcap * tanh(scores / softcap) (when HAS_SOFTCAP)
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    K_QUANT: tl.constexpr,  # load_rows' QUANT of each cache: 0 float, 1 q8_0, 2 q4_0
    V_QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    # Splits cut the keys the query sees: from the window's start, so blocks before it (recycled: -1 in the
    # table) are never loaded.
    lo = tl.maximum(ctx - window, 0) if HAS_WINDOW else 0
    start = lo + split * split_tokens
    end = tl.minimum(ctx, start + split_tokens)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    # Padding rows (g >= GROUP) and columns (d >= HEAD_DIM, e.g. 80 -> 128) load as zeros and
    # are never stored.
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0)
    # q: [G_PAD, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)  # running sum of exp2
    if HAS_SINKS:  # the first split starts from each head's sink (the merge of splits then counts it once)
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=float("-inf")) * LOG2E
        sink = tl.where(split == 0, sink, float("-inf"))
        m_i = sink
        l_i = tl.where(sink > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t0 in range(start, end, TILE):
        t = t0 + tl.arange(0, TILE)
        t_mask = t < end
        # Gather per token: a tile spans TILE / BLOCK_SIZE blocks in any order in the pool; -1
        # padding lies past `end` and is masked off.
        blk = tl.load(table + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = t % BLOCK_SIZE
        td_mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
        k_rows = k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_kt + kv_head * stride_kh
        if K_QUANT == 0:
            k = tl.load(k_rows + d[None, :], mask=td_mask, other=0.0)  # k: [TILE, D_PAD]
        else:
            k = load_rows(k_rows, d, td_mask, K_QUANT)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [G_PAD, TILE]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap) * LOG2E
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vt + kv_head * stride_vh
        if V_QUANT == 0:
            v = tl.load(v_rows + d[None, :], mask=td_mask, other=0.0)  # v: [TILE, D_PAD]
        else:
            v = load_rows(v_rows, d, td_mask, V_QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (its start past this sequence's context) has l_i == 0 and m_i == -inf.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    if not IS_SPLIT:
        out = acc / safe_l[:, None] * v_scale
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        part = acc / safe_l[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        dst = part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + split * stride_pk + d[None, :]
        tl.store(dst, part, mask=gd_mask)
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit
def _tanh(x):
    # tanh from exp2 (no tanh in tl.math on every backend, nor in the interpreter); exact at both tails
    e = tl.exp2(-2.0 * LOG2E * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    v_scale,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    # One program per (sequence, query head): weight each split by exp2(lse - max lse).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    k = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    k_mask = k < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + k, mask=k_mask, other=float("-inf"))
    # Split 0 always holds token 0 (context_lens >= 1), so the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))  # [S_PAD]; empty splits weigh 0
    part = tl.load(
        part_out_ptr + seq * stride_ps + head * stride_ph + k[:, None] * stride_pk + d[None, :],
        mask=k_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [S_PAD, D_PAD]
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0) * v_scale
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, padded with -1
    context_lens: torch.Tensor,  # [num_seqs] int32, >= 1 each
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: gpt-oss's attention sinks
    num_splits: int | None = None,  # None: chosen from the shapes (see choose_num_splits)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One new query token per sequence attends to its cached context (its last `window` tokens when set)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    query, context_lens = _unit_stride(query), context_lens.contiguous()
    _check_inner_contiguous(k_cache, v_cache, block_tables)
    block_size = k_cache.shape[1]
    if k_cache.dtype != torch.float8_e4m3fn:  # as in the reference, scales apply to fp8 caches only
        k_scale = v_scale = 1.0
    # An upper bound on the context from the table's width: reading context_lens would cost a sync.
    max_ctx = block_tables.shape[1] * block_size
    if window is not None:  # the keys one query sees, whatever the context
        max_ctx = min(max_ctx, window)
    if num_splits is None:
        num_sms = _num_sms(query.device.index) if query.is_cuda else 1
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_ctx, num_sms)
    split_tokens = _round_up(max(1, math.ceil(max_ctx / num_splits)), TILE_TOKENS)
    num_splits = math.ceil(max_ctx / split_tokens)  # rounding up may leave trailing splits empty

    out = torch.empty_like(query)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused by the kernel when IS_SPLIT is False
    d_pad = max(16, triton.next_power_of_2(head_dim))
    group = num_heads // num_kv_heads
    # The interpreter multiplies bfloat16 dot operands as their raw uint16 bits, so there the dots
    # run in float32; compiled, they run on the tensor cores in the query's dtype.
    dot_fp32 = query.dtype == torch.float32 or (INTERPRET and query.dtype == torch.bfloat16)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        sinks.to(torch.float32).contiguous() if sinks is not None else out,  # (unread without sinks)
        float(scale) * float(k_scale) * (1.0 if softcap is not None else LOG2E),
        float(v_scale),
        split_tokens,
        int(window or 0),
        float(softcap or 1.0),
        query.stride(0),
        query.stride(1),
        *cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0) if num_splits > 1 else 0,
        part_out.stride(1) if num_splits > 1 else 0,
        part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0) if num_splits > 1 else 0,
        part_lse.stride(1) if num_splits > 1 else 0,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        GROUP=group,
        # tl.dot wants at least 16 rows; the padded rows cost compute, not memory traffic.
        G_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        TILE=TILE_TOKENS,
        # The split count stays a runtime value: it grows with the context, and a constexpr would
        # recompile the kernel each time it changed.
        IS_SPLIT=num_splits > 1,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        K_QUANT=quant_code(k_cache),
        V_QUANT=quant_code(v_cache),
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            float(v_scale),
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            S_PAD=triton.next_power_of_2(num_splits),
        )
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_ctx: int, num_sms: int) -> int:
    """Enough splits to give every SM about two programs, but none shorter than MIN_SPLIT_TOKENS."""
    if max_ctx < 2 * MIN_SPLIT_TOKENS:
        return 1
    wanted = math.ceil(2 * num_sms / (num_seqs * num_kv_heads))
    return max(1, min(wanted, max_ctx // MIN_SPLIT_TOKENS, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:
    # Cached: decode asks once per layer per token.
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
