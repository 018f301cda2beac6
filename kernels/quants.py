"""ggml's block formats (Q8_0, Q4_K, MXFP4, ...): their sizes, and dequantization to float32 in vectorized torch.

Each format stores a row as whole blocks; a block packs `elems_per_block` weights with its scales in
`bytes_per_block` bytes. The layouts follow llama.cpp (ggml/src/ggml-common.h, dequantize_row_* in
ggml-quants.c) and the results equal gguf-py's numpy dequantization bit for bit: every product and sum
is done in float32 in the same order.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from .block_formats import FORMATS, QK_K, BlockFormat  # noqa: F401 (read here by the kernels and the engine)

# E2M1's values doubled (ggml's kvalues_mxfp4): code c is sign (bit 3), then 0, 0.5, 1, 1.5, 2, 3, 4, 6; the E8M0
# scale e is 2^(e - 127), so a weight is kvalues[c] * 2^(e - 128) (ggml_e8m0_to_fp32_half)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def dequantize(raw: np.ndarray | torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` that `raw` (a tensor's bytes, any view of them) stores as `type_name`."""
    fmt = _format(type_name)
    data = _bytes(raw)
    expected = math.prod(shape[:-1]) * fmt.row_bytes(shape[-1] if shape else 1)
    if data.numel() != expected:
        raise ValueError(f"{data.numel()} bytes of {type_name} cannot hold shape {tuple(shape)} ({expected} bytes)")
    if fmt.dtype is not None:
        return data.view(fmt.dtype).float().reshape(shape)
    blocks = data.reshape(-1, fmt.bytes_per_block)  # [num_blocks, bytes_per_block]
    return _DEQUANTIZE[type_name](blocks).reshape(shape)


def dequantize_rows(raw: np.ndarray | torch.Tensor, type_name: str, shape: tuple[int, ...],
                    row_start: int, row_end: int) -> torch.Tensor:
    """Rows [row_start, row_end) of the tensor, as float32 [row_end - row_start, shape[-1]]; reads only their bytes."""
    fmt = _format(type_name)
    num_rows = math.prod(shape[:-1])
    if not 0 <= row_start <= row_end <= num_rows:
        raise ValueError(f"rows [{row_start}, {row_end}) are not within the {num_rows} rows of shape {tuple(shape)}")
    row_bytes = fmt.row_bytes(shape[-1])
    data = _bytes(raw)
    tile = data[row_start * row_bytes : row_end * row_bytes]
    return dequantize(tile, type_name, (row_end - row_start, shape[-1]))


def _format(type_name: str) -> BlockFormat:
    if type_name not in FORMATS:
        raise ValueError(f"unknown ggml type {type_name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[type_name]


def _bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """`raw` as a flat uint8 tensor sharing its memory."""
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            # a read-only memmap: torch warns it is not writable; we only read it.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    return raw.contiguous().reshape(-1).view(torch.uint8)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 field at byte `start` of every block, as float32 [num_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Each group of bytes gives its low nibbles, then its high ones: [n, bytes] -> [n, 2 * bytes] uint8."""
    n, num_bytes = qs.shape
    qs = qs.reshape(n, num_groups, 1, num_bytes // num_groups)  # [n, groups, 1, group_bytes]
    return ((qs >> _shifts([0, 4], qs)) & 0x0F).reshape(n, 2 * num_bytes)


def _bits(qh: torch.Tensor, num_planes: int) -> torch.Tensor:
    """Bit plane p of every byte: [n, bytes] -> [n, planes, bytes] uint8 of 0/1."""
    return (qh.unsqueeze(1) >> _shifts(range(num_planes), qh).view(1, -1, 1)) & 1


def _shifts(amounts, like: torch.Tensor) -> torch.Tensor:
    """Shift amounts as uint8 [1, 1, len, 1], on the device of `like`."""
    return torch.tensor(list(amounts), dtype=torch.uint8, device=like.device).view(1, 1, -1, 1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:], 1).float() - 8
    return _f16(blocks, 0) * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:], 1).float() + _f16(blocks, 2)


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # qh is a little-endian uint32 whose bit j is the fifth bit of weight j: byte j // 8, bit j % 8.
    high = _bits(qh, 8).transpose(1, 2).reshape(qh.shape[0], 32)  # [n, 32]
    return _nibbles(qs, 1) | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bits(blocks[:, 2:6], blocks[:, 6:]).float() - 16
    return _f16(blocks, 0) * q


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _five_bits(blocks[:, 4:8], blocks[:, 8:]).float() + _f16(blocks, 2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (get_scale_min_k4): two float32 [n, 8, 1]."""
    d, m, low = scales.reshape(-1, 3, 4).unbind(1)  # each [n, 4]
    sc = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _q4_k_like(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scales(blocks[:, 4:16])
    d = _f16(blocks, 0).unsqueeze(-1) * sc  # [n, 8, 1]
    dm = _f16(blocks, 2).unsqueeze(-1) * mn
    return (d * q.float().reshape(-1, 8, 32) - dm).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones.
    return _q4_k_like(blocks, _nibbles(blocks[:, 16:], 4))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 48:], 4).reshape(-1, 8, 32)
    high = _bits(blocks[:, 16:48], 8)  # [n, 8, 32]: bit i of qh[l] is the fifth bit of weight l of sub-block i
    return _q4_k_like(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 2).reshape(n, 2, 4, 32)  # two halves of 128 weights, 4 runs of 32 each
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> _shifts([0, 2, 4, 6], qh)) & 0x03
    q = ((low | (high << 4)).view(torch.int8) - 32).float().reshape(n, 16, 16)
    d = _f16(blocks, 208).unsqueeze(-1) * blocks[:, 192:208].view(torch.int8).float().unsqueeze(-1)  # [n, 16, 1]
    return (d * q).reshape(n, QK_K)


def _mxfp4_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) of uint8 exponents e (e = 0 and 1 are subnormal in float32, as in ggml), float32 of e's shape."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.int32) - 128)


def _mxfp4_codes(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # ggml's block: weights 0..15 in the low nibbles of qs, 16..31 in the high ones
    return _mxfp4_codes(_nibbles(blocks[:, 1:], 1)) * _mxfp4_scale(blocks[:, :1])


def dequantize_mxfp4_split(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as OpenAI's gpt-oss checkpoints store it (transformers' integrations/mxfp4.py): codes [..., G, 16] and
    E8M0 scales [..., G] apart, weight 2j of a group in byte j's low nibble and 2j + 1 in its high one.
    -> float32 [..., G * 32]."""
    low, high = blocks & 0x0F, blocks >> 4
    codes = torch.stack([low, high], dim=-1).reshape(*blocks.shape[:-1], 32)  # [..., G, 32]
    out = _mxfp4_codes(codes) * _mxfp4_scale(scales).unsqueeze(-1)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


_DEQUANTIZE = {"mxfp4": _mxfp4, "q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1,
               "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}
