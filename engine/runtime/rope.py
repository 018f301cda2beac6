"""Rotary position embeddings, default, linear- and llama3-scaled, as Hugging Face computes them."""

from __future__ import annotations

import math

import torch

from ..formats.config import ModelConfig, RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2], fp32
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":  # positions divided by factor (Gemma 3's global layers)
        return inv_freq / rope.factor
    if rope.kind != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryTable:
    """cos/sin for every position the KV cache can hold, built once per device and dtype."""

    def __init__(self, config: ModelConfig, max_positions: int, rope: RopeConfig | None = None):
        self.inv_freq = inverse_frequencies(rope or config.rope, config.head_dim)
        self.max_positions = max_positions
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, positions: torch.Tensor, device: torch.device, dtype: torch.dtype):
        """cos, signed sin: [n, 1, head_dim] for the given positions (all below max_positions)."""
        key = (device, dtype)
        if key not in self._cache:
            self._cache[key] = self._build(dtype)
            self._cache[key] = tuple(t.to(device) for t in self._cache[key])
        cos, sin = self._cache[key]
        positions = positions.to(device)
        return cos[positions], sin[positions]

    def _build(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Written half by half into tables of the final dtype, so the build's fp32 temporaries stay at
        # two [positions, head_dim / 2] tensors (engine/workspace.py counts exactly these).
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), self.inv_freq)
        half = freqs.shape[1]
        cos = torch.empty(self.max_positions, 1, 2 * half, dtype=dtype)
        sin = torch.empty(self.max_positions, 1, 2 * half, dtype=dtype)
        part = torch.cos(freqs)
        cos[:, 0, :half] = part
        cos[:, 0, half:] = part
        torch.sin(freqs, out=part)
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the sign of the first half flipped
        sin[:, 0, half:] = part
        sin[:, 0, :half] = part.neg_()
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [n, heads, head_dim]; cos, signed_sin: [n, 1, head_dim]. Three ops: this runs twice per layer per token.
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
