"""Random ggml blocks for the kernel tests: any bytes, but float16 scales that are small and finite."""

from __future__ import annotations

import numpy as np

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
