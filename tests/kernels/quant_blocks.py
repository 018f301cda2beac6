"""Random ggml blocks for the kernel tests: any bytes, but float16 scales that are small and finite; and x as the
native kernels quantize it (kernels/csrc/quant_dots.h quantize_x)."""

from __future__ import annotations

import numpy as np
import torch

from stowage.kernels.quants import FORMATS

BLOCK_TYPES = [name for name, fmt in FORMATS.items() if fmt.dtype is None]
# Byte offsets of each block's float16 scales (d, dmin, m): random bytes there could be inf or NaN.
F16_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2],
              "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208], "mxfp4": []}
# Byte offsets of each block's E8M0 scale (2^(e - 127)): random bytes there would reach float32's overflow.
E8M0_FIELDS = {"mxfp4": [0]}


def random_blocks(type_name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bytes of a `type_name` tensor of `shape`, uint8 [..., row_bytes], with small finite f16 scales."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[type_name]
    raw = rng.integers(0, 256, (*shape[:-1], fmt.row_bytes(shape[-1])), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.bytes_per_block)
    for start in F16_FIELDS[type_name]:
        scales = rng.uniform(-0.05, 0.05, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8)
    for start in E8M0_FIELDS.get(type_name, []):  # 2^-9 .. 2^-4: the f16 scales' magnitudes
        blocks[:, start] = rng.integers(118, 124, blocks.shape[0], dtype=np.uint8)
    return raw


# the types whose native dots read x in its K form: 8 bits with a scale per 256, as llama.cpp's Q8_K
K_TYPES = ("q4_k", "q5_k", "q6_k")


def quantized(x: torch.Tensor, type_name: str = "q8_0") -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, cols] float32 as the kernels read it for `type_name` (float64), and the step each value's rounding
    stays within, per value [n, cols]."""
    k_form = type_name in K_TYPES
    blocks = x.reshape(*x.shape[:-1], -1, 256 if k_form else 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127  # float32 steps as the C code takes them
    t = blocks * torch.where(step > 0, 1 / step, 0)
    q = t.round()  # ties to even, as the C code
    if k_form:
        return (q.double() * step.double()).reshape(x.shape), step.expand(blocks.shape).reshape(x.shape)
    r = ((t - q) * 256).round().clamp(-127, 127)
    d = step / 256
    return ((256 * q.double() + r.double()) * d.double()).reshape(x.shape), d.expand(blocks.shape).reshape(x.shape)
