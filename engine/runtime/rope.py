"""Rotary position embeddings, default, linear-, llama3- and YaRN-scaled, as Hugging Face computes them."""

from __future__ import annotations

import math

import torch

from ..formats.config import ModelConfig, RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2], fp32
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":  # positions divided by factor (Gemma 3's global layers)
        return inv_freq / rope.factor
    if rope.kind == "yarn":
        return _yarn(rope, head_dim, inv_freq)
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


def _yarn(rope: RopeConfig, head_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    # YaRN (transformers' _compute_yarn_parameters): dimensions that turn fewer than beta_slow times over the original
    # context are interpolated (divided by factor), those past beta_fast kept, a linear ramp between.
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    interpolation = 1.0 / (rope.factor * pos_freqs)  # as HF computes it, to the last bit
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation


class RotaryTable:
    """cos/sin for every position the KV cache can hold, built once per device and dtype."""

    def __init__(self, config: ModelConfig, max_positions: int, rope: RopeConfig | None = None):
        rope = rope or config.rope
        self.inv_freq = inverse_frequencies(rope, config.head_dim)
        self.attention_factor = rope.attention_factor  # YaRN scales cos and sin; 1 otherwise
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
        scale = self.attention_factor
        part = torch.cos(freqs)
        if scale != 1.0:
            part.mul_(scale)
        cos[:, 0, :half] = part
        cos[:, 0, half:] = part
        torch.sin(freqs, out=part)
        if scale != 1.0:
            part.mul_(scale)
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the sign of the first half flipped
        sin[:, 0, half:] = part
        sin[:, 0, :half] = part.neg_()
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [n, heads, head_dim]; cos, signed_sin: [n, 1, head_dim]. Three ops: this runs twice per layer per token.
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
