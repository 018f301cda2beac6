"""Triton prefill attention over a paged cache: a chunk of new tokens, causal, GQA, no gather copy.

The chunk's K/V are already in the cache (write_kv runs first), so the chunk and the earlier
context are one key range read through the block table. One program owns BLOCK_M query tokens of
one KV head and the group of query heads sharing it, folded into the rows of one tile
(row = token * G_PAD + head-in-group), so each K/V tile is loaded once for the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import INTERPRET, LOG2E, _tanh
from .triton_write import _check_inner_contiguous, _unit_stride, cache_strides, load_rows, quant_code

ROWS = 64  # query rows (tokens x group heads) per program
TILE_N = 64  # keys per inner step


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    out_ptr,
    sinks_ptr,  # [num_heads] float32 (when HAS_SINKS): a logit per head in every softmax, no value (gpt-oss)
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,
    num_new,
    start_pos,
    window,  # sliding window in tokens (when HAS_WINDOW): a query at p sees keys p - window + 1 .. p
    softcap,  # scores become softcap * tanh(scores / softcap) (when HAS_SOFTCAP)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    K_QUANT: tl.constexpr,  # load_rows' QUANT of each cache: 0 float, 1 q8_0, 2 q4_0
    V_QUANT: tl.constexpr,
):
    m_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = tl.arange(0, BLOCK_M * G_PAD)
    tok = m_block * BLOCK_M + r // G_PAD  # index in the chunk
    g = r % G_PAD
    heads = kv_head * GROUP + g
    row_ok = (tok < num_new) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    rd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=rd_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    pos = start_pos + tok  # [ROWS] absolute position of each row's token

    m_i = tl.full([BLOCK_M * G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * G_PAD], dtype=tl.float32)
    if HAS_SINKS:  # each row starts from its head's sink
        m_i = tl.load(sinks_ptr + heads, mask=row_ok, other=float("-inf")) * LOG2E
        l_i = tl.where(row_ok, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], dtype=tl.float32)
    # Keys past this program's last token are masked for every row: stop there (causal).
    end = tl.minimum(start_pos + num_new, start_pos + (m_block + 1) * BLOCK_M)
    # Keys before the window of this program's first token are masked for every row: start there, so blocks
    # before it (recycled: -1 in the table) are never loaded.
    lo = tl.maximum(start_pos + m_block * BLOCK_M - window + 1, 0) if HAS_WINDOW else 0
    for t0 in range(lo, end, TILE):
        t = t0 + tl.arange(0, TILE)
        t_ok = t < end
        blk = tl.load(table_ptr + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        off = t % BLOCK_SIZE
        td_mask = t_ok[:, None] & d_ok[None, :]
        k_rows = k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_kt + kv_head * stride_kh
        if K_QUANT == 0:
            k = tl.load(k_rows + d[None, :], mask=td_mask, other=0.0)  # [TILE, D_PAD]
        else:
            k = load_rows(k_rows, d, td_mask, K_QUANT)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, TILE]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap) * LOG2E
        visible = t_ok[None, :] & (t[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (t[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows whose every key so far is masked keep m = -inf; subtracting a finite stand-in keeps
        # exp2 from producing NaN (-inf - -inf) for them.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vt + kv_head * stride_vh
        if V_QUANT == 0:
            v = tl.load(v_rows + d[None, :], mask=td_mask, other=0.0)  # [TILE, D_PAD]
        else:
            v = load_rows(v_rows, d, td_mask, V_QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    dst = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=rd_mask)


def prefill_attention(
    query: torch.Tensor,  # [num_new, num_heads, head_dim], positions start_pos .. start_pos+num_new-1
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32 of this one sequence
    start_pos: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: gpt-oss's attention sinks
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    """A chunk of new tokens (their K/V already written) attends causally to the cache (its last `window` tokens)."""
    num_new, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    query, block_table = _unit_stride(query), block_table.contiguous()
    _check_inner_contiguous(k_cache, v_cache)
    if k_cache.dtype != torch.float8_e4m3fn:  # as in the reference, scales apply to fp8 caches only
        k_scale = v_scale = 1.0
    out = torch.empty_like(query)
    if num_new == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_m = max(1, ROWS // g_pad)
    dot_fp32 = query.dtype == torch.float32 or (INTERPRET and query.dtype == torch.bfloat16)
    _prefill_kernel[(triton.cdiv(num_new, block_m), num_kv_heads)](
        query,
        k_cache,
        v_cache,
        block_table,
        out,
        sinks.to(torch.float32).contiguous() if sinks is not None else out,  # (unread without sinks)
        float(scale) * float(k_scale) * (1.0 if softcap is not None else LOG2E),
        float(v_scale),
        num_new,
        int(start_pos),
        int(window or 0),
        float(softcap or 1.0),
        query.stride(0),
        query.stride(1),
        *cache_strides(k_cache, v_cache),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_M=block_m,
        BLOCK_SIZE=k_cache.shape[1],
        TILE=TILE_N,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        K_QUANT=quant_code(k_cache),
        V_QUANT=quant_code(v_cache),
    )
    return out
