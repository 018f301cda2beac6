"""Which tensors each layer needs, and putting them on their device (in place on the CPU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .checkpoint import Checkpoint
from .config import ModelConfig
from .errors import GenerationCancelled

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer_tensor_names(config: ModelConfig, index: int) -> dict[str, str]:
    """Short name -> checkpoint name for every tensor layer `index` needs."""
    p = f"model.layers.{index}."
    names = {
        "input_norm": p + "input_layernorm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
    }
    if config.qkv_bias:
        names |= {f"{x}_bias": p + f"self_attn.{x}_proj.bias" for x in "qkv"}
    if config.o_bias:
        names["o_bias"] = p + "self_attn.o_proj.bias"
    if config.mlp_bias:
        names |= {f"{x}_bias": p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")}
    if config.qk_norm:
        names |= {"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    return names


def head_tensor_names(config: ModelConfig, checkpoint_names) -> dict[str, str]:
    """Embeddings, final norm and the output head (the embeddings when tied or absent)."""
    names = {"embed": EMBED, "norm": FINAL_NORM}
    untied = LM_HEAD in checkpoint_names and not config.tie_word_embeddings
    names["lm_head"] = LM_HEAD if untied else EMBED
    return names


@dataclass
class TensorSet:
    """Named tensors on one device; `copied_bytes` counts what was copied rather than mapped."""

    device: torch.device
    tensors: dict[str, torch.Tensor]
    copied_bytes: int = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def get(self, key: str):
        return self.tensors.get(key)

    @property
    def num_bytes(self) -> int:
        seen = {}
        for t in self.tensors.values():
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())


def place(
    checkpoint: Checkpoint, names: dict[str, str], device: torch.device, dtype: torch.dtype | None
) -> TensorSet:
    """Load named tensors onto device; on the CPU in their stored dtype they stay views of the mmap."""
    out, copied, by_source = {}, 0, {}
    for short, name in names.items():
        if name in by_source:  # tied weights: one tensor, two names
            out[short] = by_source[name]
            continue
        t = checkpoint.tensor(name)
        target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        if device.type != "cpu" or target != t.dtype:
            t = t.to(device=device, dtype=target)
            copied += t.numel() * t.element_size()
        out[short] = by_source[name] = t
    return TensorSet(device, out, copied)


def load_layers(
    checkpoint: Checkpoint,
    config: ModelConfig,
    layer_devices: list[torch.device],
    dtype: torch.dtype | None,
    progress: Callable[[float, str], None] | None = None,
    is_cancelled: Callable[[], bool] = lambda: False,
) -> list[TensorSet]:
    layers = []
    for i, device in enumerate(layer_devices):
        if is_cancelled():
            raise GenerationCancelled("loading cancelled")
        layers.append(place(checkpoint, layer_tensor_names(config, i), device, dtype))
        if progress:
            progress((i + 1) / len(layer_devices), f"layer {i + 1}/{len(layer_devices)} on {device}")
    return layers
