"""ggml's block formats (Q8_0, Q4_K, MXFP4, ...) as sizes alone: weights per block, bytes per block.

Apart from their dequantization (kernels/quants.py, torch) so that reading a GGUF file's header (a model
listing, a plan) needs no torch. The layouts follow llama.cpp (ggml/src/ggml-common.h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

QK_K = 256  # weights per super-block of the K-quants


@dataclass(frozen=True)
class BlockFormat:
    """How many weights one block holds and how many bytes it takes; `dtype_name` is set for the plain types."""

    elems_per_block: int
    bytes_per_block: int
    dtype_name: str | None = None  # "float32", "float16", "bfloat16": torch's name of the plain type

    @property
    def dtype(self) -> torch.dtype | None:
        """The plain type's torch dtype (None for a block format)."""
        if self.dtype_name is None:
            return None
        import torch

        return getattr(torch, self.dtype_name)

    def row_bytes(self, row_elems: int) -> int:
        """Bytes of one row of `row_elems` weights; raises ValueError when the row is not whole blocks."""
        if row_elems % self.elems_per_block:
            raise ValueError(f"a row of {row_elems} weights is not a whole number of blocks of {self.elems_per_block}")
        return row_elems // self.elems_per_block * self.bytes_per_block


FORMATS: dict[str, BlockFormat] = {
    "f32": BlockFormat(1, 4, "float32"),
    "f16": BlockFormat(1, 2, "float16"),
    "bf16": BlockFormat(1, 2, "bfloat16"),
    "q8_0": BlockFormat(32, 2 + 32),  # d: f16, qs: int8[32]
    "q4_0": BlockFormat(32, 2 + 16),  # d, qs: 32 nibbles
    "q4_1": BlockFormat(32, 2 + 2 + 16),  # d, m, qs
    "q5_0": BlockFormat(32, 2 + 4 + 16),  # d, qh: 32 high bits, qs
    "q5_1": BlockFormat(32, 2 + 2 + 4 + 16),  # d, m, qh, qs
    "q4_k": BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 2),  # d, dmin, 8 x (6-bit scale, 6-bit min), qs
    "q5_k": BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),  # d, dmin, scales, qh, qs
    "q6_k": BlockFormat(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),  # ql, qh, int8 scales[16], d
    "mxfp4": BlockFormat(32, 1 + 16),  # e: E8M0 scale, qs: 32 E2M1 codes (weight j low nibble, j + 16 high)
}
