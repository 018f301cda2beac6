"""Matrix products on ggml blocks kept as stored: one tile of rows is dequantized at a time, never the whole matrix.

`QuantizedWeight` holds a [out, in] weight's bytes (on the CPU a view of the memory-mapped file, so
loading copies nothing) and computes `x @ W.T` by dequantizing TILE_WEIGHTS weights at a time into
float32 and multiplying in float32: the result equals the float32 product of the dequantized weights
up to the order of the float32 sums (tests/kernels/test_quant_linear.py states the tolerance). Plain
types (f32/f16/bf16) go through the same path when their dtype is not the compute dtype, so a mixed
file converts tile by tile instead of copying a matrix. The scratch of one product is
`workspace_bytes(shape, num_tokens, dtype)`; the planner charges it (engine/planning/workspace.py).
On the CPU, decode (up to MAX_NATIVE_TOKENS rows) runs the C kernels of kernels/cpu_quant.py on the
blocks themselves instead, when they can be built: no tile, the same float32 product. A prefill chunk (more rows) of
bf16/f16 activations runs kernels/cpu_quant_matmul.py's integer tiles there, on x rounded to int8 per 32 (its
accuracy: docs/kernels.md); float32 activations keep the tiles' exact product. On CUDA every block
type runs the Triton kernel of kernels/triton_quant.py (the blocks copied to the GPU as stored), where the
attention kernels run Triton too; plain types and GPUs without Triton take the tile path there.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import attention_ops, cpu_decode, cpu_quant, cpu_quant_matmul, reference
from .quants import FORMATS, dequantize, dequantize_mxfp4_split, dequantize_rows

# Weights dequantized per tile: 4 MiB of float32, big enough that the per-tile Python cost is small
# against the work (smaller tiles were slower: docs/kernels.md), small enough to stay in cache-ish sizes.
TILE_WEIGHTS = 1 << 20
# Input rows up to which the CPU uses the native kernels: each reads the blocks once for all rows, so a few rows cost
# little more than one; past this the tile's float32 matmul (BLAS) is faster (measured in docs/kernels.md).
MAX_NATIVE_TOKENS = 8
# Peak bytes per weight while kernels.quants dequantizes a tile, its float32 result (4) included: the
# temporaries of the vectorized unpacking. Measured on the peak RSS of a 16M-weight tile
# (tests/kernels/test_quant_linear.py checks these bound it), rounded up.
DEQUANT_PEAK_BYTES = {"f32": 0.0, "f16": 4.0, "bf16": 4.0, "q8_0": 8.5, "q4_0": 8.5, "q4_1": 8.5, "q5_0": 8.5,
                      "q5_1": 8.5, "q4_k": 10.0, "q5_k": 12.0, "q6_k": 10.5, "mxfp4": 8.5}


@dataclass(frozen=True)
class MatrixShape:
    """What a tiled product's scratch depends on: the weight's ggml type and its [out, in] size."""

    type_name: str  # ggml name: "q4_k", "f16", ...
    out_features: int
    in_features: int

    @property
    def tile_rows(self) -> int:
        return max(1, min(self.out_features, TILE_WEIGHTS // self.in_features))


def is_tiled(type_name: str, dtype: torch.dtype) -> bool:
    """Whether a matrix stored as `type_name` is computed through QuantizedWeight for activations of `dtype`."""
    return FORMATS[type_name].dtype != dtype


def workspace_bytes(shape: MatrixShape, num_tokens: int, dtype: torch.dtype, *, bias: bool = False,
                    on_cpu: bool = False) -> int:
    """Peak scratch of one `QuantizedWeight.linear` of `num_tokens` rows, the output itself not included.

    A prefill chunk `on_cpu` that runs the integer tiles (`runs_native_prefill`) takes theirs; otherwise the tile
    path's, which bounds the native decode path too (its scratch is x and y in float32 and a float per 32 inputs)."""
    if on_cpu and runs_native_prefill(shape.type_name, num_tokens, dtype):
        n, inputs, outputs = num_tokens, shape.in_features, shape.out_features
        widened = 0 if dtype == torch.bfloat16 else n * inputs * 4 + n * outputs * 4  # x.float(), y before .to()
        return cpu_quant_matmul.scratch_bytes(shape.type_name, n, inputs, cpu_decode.default_threads()) + widened
    tile = math.ceil(shape.tile_rows * shape.in_features * DEQUANT_PEAK_BYTES[shape.type_name])
    x32 = 0 if dtype == torch.float32 else num_tokens * shape.in_features * 4
    acc = num_tokens * shape.out_features * 4  # the float32 accumulator [out, n]
    biased = num_tokens * shape.out_features * 4 if bias and dtype != torch.float32 else 0
    return tile + x32 + acc + biased


def runs_native_prefill(type_name: str, num_tokens: int, dtype: torch.dtype) -> bool:
    """Whether a CPU product of `num_tokens` rows of `dtype` runs kernels/cpu_quant_matmul.py (as `linear` decides)."""
    return num_tokens > MAX_NATIVE_TOKENS and dtype != torch.float32 and cpu_quant_matmul.runs(type_name)


def rows_workspace_bytes(shape: MatrixShape, num_rows: int) -> int:
    """Peak scratch of `QuantizedWeight.rows` for `num_rows` ids (an embedding lookup), the output not included."""
    row_bytes = FORMATS[shape.type_name].row_bytes(shape.in_features)
    return num_rows * row_bytes + math.ceil(num_rows * shape.in_features * DEQUANT_PEAK_BYTES[shape.type_name])


class QuantizedWeight:
    """A [out, in] weight in a ggml type, kept as stored; products and row lookups return `dtype`."""

    def __init__(self, raw: np.ndarray | torch.Tensor, type_name: str, shape: tuple[int, int], dtype: torch.dtype):
        if type_name not in FORMATS:
            raise ValueError(f"unknown ggml type {type_name!r}; known: {', '.join(FORMATS)}")
        if len(shape) != 2:
            raise ValueError(f"a QuantizedWeight is a matrix; got shape {tuple(shape)}")
        self.raw = _as_bytes(raw).reshape(shape[0], FORMATS[type_name].row_bytes(shape[1]))  # [out, row_bytes]
        self.type_name = type_name
        self.shape = MatrixShape(type_name, *shape)
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def data_ptr(self) -> int:
        return self.raw.data_ptr()

    def to(self, device: torch.device) -> "QuantizedWeight":
        """The same blocks on `device` (a copy of the stored bytes: quantized weights stay quantized there)."""
        moved = QuantizedWeight.__new__(QuantizedWeight)
        moved.__dict__ = {**self.__dict__, "raw": self.raw.to(device)}
        return moved

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias): [n, in] -> [n, out] in `self.dtype`, dequantizing one tile of rows at a time."""
        if self.raw.device.type == "cuda" and _triton_runs(self.raw.device) \
                and _triton_quant().supports(self.type_name):
            return _triton_quant().matmul(self.raw, self.type_name, x, bias, self.dtype)  # no tile: read as stored
        if x.shape[0] <= MAX_NATIVE_TOKENS and self.raw.device.type == "cpu" and cpu_quant.is_available() \
                and cpu_quant.supports(self.type_name):
            y = cpu_quant.matvec(self.raw, self.type_name, x.float(), bias)  # [n, out] float32
            return y if self.dtype == torch.float32 else y.to(self.dtype)
        # A prefill chunk in 16-bit activations: x rounded to int8 per 32 costs about what bf16 already did, no tile;
        # float32 activations ask for the exact product, which the tiles give.
        if self.raw.device.type == "cpu" and runs_native_prefill(self.type_name, x.shape[0], self.dtype):
            y = cpu_quant_matmul.matmul(self.raw, self.type_name,
                                        x if x.dtype == self.dtype == torch.bfloat16 else x.float(), bias)
            return y if y.dtype == self.dtype else y.to(self.dtype)
        out_features, in_features = self.shape.out_features, self.shape.in_features
        x32 = x.float()
        # Accumulated transposed, so each tile's product fills a contiguous slice: acc[r0:r1] = W[r0:r1] @ x.T.
        acc = torch.empty(out_features, x.shape[0], dtype=torch.float32, device=x.device)  # [out, n]
        step = self.shape.tile_rows
        for start in range(0, out_features, step):
            end = min(start + step, out_features)
            tile = dequantize_rows(self.raw, self.type_name, (out_features, in_features), start, end)  # [rows, in]
            torch.mm(tile, x32.t(), out=acc[start:end])
        y = acc.t()  # [n, out]
        if bias is not None:
            y = y + bias.float()
        out = torch.empty(y.shape, dtype=self.dtype, device=x.device)
        return out.copy_(y)  # contiguous, in the compute dtype, in one copy

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, dequantized: an embedding lookup. [n] -> [n, in] in `self.dtype`."""
        picked = self.raw[ids.to(self.raw.device)]  # [n, row_bytes]: only these rows' bytes are read
        return dequantize(picked, self.type_name, (len(ids), self.shape.in_features)).to(self.dtype)

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.type_name}, [{self.shape.out_features}, {self.shape.in_features}], "
                f"{self.dtype}, {self.device})")


def _triton_runs(device: torch.device) -> bool:
    # Triton runs where the attention kernels do: installed, a GPU it supports, the reference not forced.
    return attention_ops(device) is not reference


@functools.cache
def _triton_quant():
    from . import triton_quant  # imported at first use on CUDA: tests set TRITON_INTERPRET before it

    return triton_quant


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """`raw` as a uint8 tensor sharing its memory (a read-only memmap stays mapped, never copied)."""
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            # a read-only memmap: torch warns the tensor is not writable; nothing here writes to it.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(raw))
    raw = raw.contiguous()
    return raw.view(torch.uint8) if raw.dtype != torch.uint8 else raw


class Mxfp4Weight:
    """A [out, in] MXFP4 weight as gpt-oss's Hugging Face checkpoints store it: codes [out, in / 32, 16] and scales
    [out, in / 32] in two tensors (kernels/quants.py dequantize_mxfp4_split), both kept as stored (views of the
    map). Products dequantize a tile of rows at a time into float32, as QuantizedWeight's tile path does."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != 16 \
                or tuple(scales.shape) != tuple(blocks.shape[:2]):
            raise ValueError(f"MXFP4 blocks [out, groups, 16] and scales [out, groups] of uint8, got "
                             f"{blocks.dtype} {list(blocks.shape)} and {scales.dtype} {list(scales.shape)}")
        self.blocks, self.scales, self.dtype = blocks, scales, dtype
        self.type_name = "mxfp4"
        self.shape = MatrixShape("mxfp4", blocks.shape[0], blocks.shape[1] * 32)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def data_ptr(self) -> int:
        return self.blocks.data_ptr()

    def to(self, device: torch.device) -> "Mxfp4Weight":
        return Mxfp4Weight(self.blocks.to(device), self.scales.to(device), self.dtype)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) as float32 [rows, in]."""
        return dequantize_mxfp4_split(self.blocks[start:end], self.scales[start:end])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias): [n, in] -> [n, out] in `self.dtype`, a tile of rows dequantized at a time."""
        out_features = self.shape.out_features
        x32 = x.float()
        acc = torch.empty(out_features, x.shape[0], dtype=torch.float32, device=x.device)  # [out, n]
        step = self.shape.tile_rows
        for start in range(0, out_features, step):
            end = min(start + step, out_features)
            torch.mm(self.dequantize(start, end), x32.t(), out=acc[start:end])
        y = acc.t()
        if bias is not None:
            y = y + bias.float()
        out = torch.empty(y.shape, dtype=self.dtype, device=x.device)
        return out.copy_(y)

    def __repr__(self) -> str:
        return f"Mxfp4Weight([{self.shape.out_features}, {self.shape.in_features}], {self.dtype}, {self.device})"
