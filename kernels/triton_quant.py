"""Triton dequantize-and-multiply on ggml blocks for CUDA: y = x @ dequant(W).T (+ bias), W read as stored.

Each program computes a [BLOCK_N, BLOCK_O] tile of y: it walks the input dimension 32 weights at a
time (a Q8_0/Q4_0 block, or one sub-block of a K-quant super-block), unpacks those 32 weights of its
BLOCK_O rows from the raw bytes into float32 registers exactly as kernels/quants.py does (the same
products in the same order, so the weights are bit-identical to the reference dequantization), and
accumulates `tl.dot(x, w.T)` in float32. Nothing is dequantized to memory: the scratch is the output.
Layouts: llama.cpp's ggml-common.h and dequantize_row_* in ggml-quants.c (see kernels/quants.py).

`matmul(raw, type_name, x, bias, dtype)` has the signature of `reference_matmul` below, the oracle of
tests/kernels/test_triton_quant.py (under TRITON_INTERPRET=1 on the CPU, compiled on a GPU).
Import this module only after TRITON_INTERPRET is settled (triton.jit reads it at decoration).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quants import FORMATS, dequantize

# The types this module multiplies, and the code its kernel branches on (a constexpr: one compile per type).
TYPES = {"q8_0": 0, "q4_0": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4, "q4_1": 5, "q5_0": 6, "q5_1": 7, "mxfp4": 8}
STEP = 32  # weights unpacked per step of the input dimension
BLOCK_O = 64  # output features per program
MIN_BLOCK_N, MAX_BLOCK_N = 16, 64  # tl.dot needs 16 rows; past 64, more programs


def supports(type_name: str) -> bool:
    return type_name in TYPES


@triton.jit
def _f16(ptr, offset):
    """The little-endian float16 at byte `offset` (per row), as float32: blocks are 2-byte fields at odd places."""
    lo = tl.load(ptr + offset).to(tl.uint16)
    hi = tl.load(ptr + offset + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(ptr, block, j):
    """get_scale_min_k4: sub-block j's 6-bit scale and min of a Q4_K/Q5_K super-block (scales at byte 4)."""
    a = tl.load(ptr + block + 4 + j).to(tl.int32)  # scales[j]
    b = tl.load(ptr + block + 4 + j + 4).to(tl.int32)  # scales[j + 4]
    c = tl.load(ptr + block + 4 + j % 4).to(tl.int32)  # scales[j - 4] when j >= 4
    low = j < 4
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _weights(w_ptr, row, s, k, TYPE: tl.constexpr):
    """Weights [s * 32, s * 32 + 32) of the rows starting at byte `row` ([BLOCK_O]), as float32 [BLOCK_O, 32]."""
    if TYPE == 0:  # q8_0: d (f16), qs int8[32]; 34 bytes
        block = row + s * 34
        d = _f16(w_ptr, block)
        q = tl.load(w_ptr + block[:, None] + 2 + k[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * d[:, None]
    elif TYPE == 1:  # q4_0: d, qs[16]: weight l is the low nibble of qs[l], l + 16 its high nibble; 18 bytes
        block = row + s * 18
        d = _f16(w_ptr, block)
        byte = tl.load(w_ptr + block[:, None] + 2 + (k % 16)[None, :]).to(tl.int32)
        q = ((byte >> (4 * (k // 16))[None, :]) & 0xF).to(tl.float32) - 8.0
        w = d[:, None] * q
    elif TYPE == 8:  # mxfp4: e (E8M0), qs[16] of E2M1 codes as q4_0's nibbles; 17 bytes
        block = row + s * 17
        e = tl.load(w_ptr + block).to(tl.uint32)
        # 2^(e - 128) as ggml_e8m0_to_fp32_half builds it: subnormal for e < 2
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        byte = tl.load(w_ptr + block[:, None] + 1 + (k % 16)[None, :]).to(tl.int32)
        code = (byte >> (4 * (k // 16))[None, :]) & 0xF
        m = code & 7  # ggml's kvalues_mxfp4: 0, 1, 2, 3 as they are; 4, 6, 8, 12 for m = 4 .. 7
        mag = tl.where(m < 4, m, (2 + (m & 1)) << ((m >> 1) - 1)).to(tl.float32)
        w = tl.where(code >= 8, -mag, mag) * d[:, None]
    elif TYPE == 5 or TYPE == 6 or TYPE == 7:  # q4_1 (d, m, qs), q5_0 (d, qh: u32, qs), q5_1 (d, m, qh, qs)
        BYTES: tl.constexpr = 20 if TYPE == 5 else (22 if TYPE == 6 else 24)
        QS: tl.constexpr = 4 if TYPE == 5 else (6 if TYPE == 6 else 8)
        block = row + s * BYTES
        d = _f16(w_ptr, block)
        byte = tl.load(w_ptr + block[:, None] + QS + (k % 16)[None, :]).to(tl.int32)
        q = (byte >> (4 * (k // 16))[None, :]) & 0xF
        if TYPE != 5:  # the fifth bit of weight l: bit l of the little-endian qh, byte l // 8
            QH: tl.constexpr = 2 if TYPE == 6 else 4
            qh = tl.load(w_ptr + block[:, None] + QH + (k // 8)[None, :]).to(tl.int32)
            q = q | (((qh >> (k % 8)[None, :]) & 1) << 4)
        if TYPE == 6:
            w = d[:, None] * (q.to(tl.float32) - 16.0)
        else:
            w = d[:, None] * q.to(tl.float32) + _f16(w_ptr, block + 2)[:, None]
    elif TYPE == 2 or TYPE == 3:  # q4_k (144 bytes) / q5_k (176): d, dmin, 12 bytes of scales, [qh[32]], qs[128]
        BYTES: tl.constexpr = 144 if TYPE == 2 else 176
        QS: tl.constexpr = 16 if TYPE == 2 else 48
        j = s % 8  # the sub-block: chunk j // 2 of qs, low nibbles for even j, high for odd
        block = row + (s // 8) * BYTES
        sc, mn = _k_scale_min(w_ptr, block, j)
        byte = tl.load(w_ptr + block[:, None] + QS + 32 * (j // 2) + k[None, :]).to(tl.int32)
        q = (byte >> (4 * (j % 2))) & 0xF
        if TYPE == 3:  # the fifth bit: bit j of qh[l]
            qh = tl.load(w_ptr + block[:, None] + 16 + k[None, :]).to(tl.int32)
            q = q | (((qh >> j) & 1) << 4)
        d = _f16(w_ptr, block) * sc
        dm = _f16(w_ptr, block + 2) * mn
        w = d[:, None] * q.to(tl.float32) - dm[:, None]
    else:  # q6_k (210 bytes): ql[128], qh[64], int8 scales[16], d; two halves of 128, four runs of 32 each
        t = s % 8
        half = t // 4
        run = t % 4
        block = row + (s // 8) * 210
        low = tl.load(w_ptr + block[:, None] + 64 * half + 32 * (run % 2) + k[None, :]).to(tl.int32)
        qh = tl.load(w_ptr + block[:, None] + 128 + 32 * half + k[None, :]).to(tl.int32)
        q = ((low >> (4 * (run // 2))) & 0xF) | (((qh >> (2 * run)) & 3) << 4)
        scale = tl.load(w_ptr + block[:, None] + 192 + 8 * half + 2 * run + (k // 16)[None, :])
        d = _f16(w_ptr, block + 208)[:, None] * scale.to(tl.int8, bitcast=True).to(tl.float32)
        w = d * (q - 32).to(tl.float32)
    return w


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, num_rows, out_features, num_steps, row_bytes, stride_x, stride_y,
                   TYPE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_O: tl.constexpr, STEP: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ro = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    k = tl.arange(0, STEP)
    # rows past the end read row 0 (a valid address) and are never stored
    row = tl.where(ro < out_features, ro, 0).to(tl.int64) * row_bytes
    x_rows = x_ptr + rn.to(tl.int64)[:, None] * stride_x
    x_mask = rn[:, None] < num_rows
    acc = tl.zeros([BLOCK_N, BLOCK_O], dtype=tl.float32)
    for s in range(0, num_steps):
        w = _weights(w_ptr, row, s, k, TYPE)  # [BLOCK_O, STEP]
        x = tl.load(x_rows + s * STEP + k[None, :], mask=x_mask, other=0.0).to(tl.float32)  # [BLOCK_N, STEP]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ro, mask=ro < out_features, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rn.to(tl.int64)[:, None] * stride_y + ro[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=x_mask & (ro[None, :] < out_features))


def matmul(raw: torch.Tensor, type_name: str, x: torch.Tensor, bias: torch.Tensor | None = None,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ dequant(W).T (+ bias): raw uint8 [out, row_bytes] in `type_name`, x [n, in] -> [n, out] in `dtype`.

    Sums in float32. A float32 result multiplies in IEEE float32; a bf16/f16 one in TF32, whose error is well
    inside the result's own rounding."""
    num_rows, in_features = x.shape
    out_features = raw.shape[0]
    if FORMATS[type_name].row_bytes(in_features) != raw.shape[1]:
        raise ValueError(f"{raw.shape[1]} bytes per row of {type_name} do not hold {in_features} weights")
    x = x.contiguous()
    y = torch.empty(num_rows, out_features, dtype=dtype, device=x.device)
    block_n = min(MAX_BLOCK_N, max(MIN_BLOCK_N, triton.next_power_of_2(num_rows)))
    grid = (triton.cdiv(num_rows, block_n), triton.cdiv(out_features, BLOCK_O))
    _matmul_kernel[grid](
        x, raw, bias if bias is not None else x, y, num_rows, out_features, in_features // STEP, raw.shape[1],
        x.stride(0), y.stride(0), TYPE=TYPES[type_name], HAS_BIAS=bias is not None,
        PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_N=block_n, BLOCK_O=BLOCK_O, STEP=STEP)
    return y


def reference_matmul(raw: torch.Tensor, type_name: str, x: torch.Tensor, bias: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The oracle: the whole weight dequantized by kernels.quants, then one float32 matmul."""
    w = dequantize(raw, type_name, (raw.shape[0], raw.shape[1] // FORMATS[type_name].bytes_per_block
                                    * FORMATS[type_name].elems_per_block))
    y = x.float() @ w.t()
    return (y if bias is None else y + bias.float()).to(dtype)
