"""The model-layout record: which tensors the model reads, under which names, stored how, computed in what.

Built once from the config and the weight files' headers; `inspect` (planning) and the loader both
read it, so the forecast and the load can never disagree on what is loaded. A new weight format
plugs in by giving its tensor specs `dtype_name`, `numel` and `nbytes` (see docs/architecture.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from .config import ModelConfig
from .dtypes import COMPUTE
from .errors import ModelFormatError

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class TensorInfo(Protocol):
    """What the layout needs to know of a stored tensor (engine/safetensors.py TensorSpec, GGUF tensor infos)."""

    @property
    def dtype_name(self) -> str: ...  # "bfloat16", "float32", or a block format such as "q8_0"

    @property
    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


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


@dataclass(frozen=True)
class ModelLayout:
    """Every tensor the model reads, by role; `tied`: the output head is the embedding tensor itself."""

    config: ModelConfig
    layers: tuple[dict[str, str], ...]  # per decoder layer: short name -> tensor name
    embed: str
    norm: str
    lm_head: str  # == embed when tied
    tied: bool
    stored_dtype: str  # the embeddings' stored dtype name
    unused: tuple[str, ...]  # tensors in the files that nothing reads (e.g. a tied checkpoint's lm_head copy)

    @classmethod
    def of(cls, config: ModelConfig, tensors: Mapping[str, TensorInfo], model_name: str) -> "ModelLayout":
        """The layout of a model whose files hold `tensors`; raises ModelFormatError when they do not match."""
        for name in tensors:
            match = _LAYER.match(name)
            if match and int(match.group(1)) >= config.num_layers:
                raise ModelFormatError(
                    f"{model_name}: tensor {name!r} belongs to layer {match.group(1)}, but config.json has "
                    f"num_hidden_layers={config.num_layers}; the config and the weights disagree")
        layers = tuple(layer_tensor_names(config, i) for i in range(config.num_layers))
        # A separate head only when the checkpoint has one and the config does not tie it.
        tied = config.tie_word_embeddings or LM_HEAD not in tensors
        head = EMBED if tied else LM_HEAD
        needed = [EMBED, FINAL_NORM, head] + [n for layer in layers for n in layer.values()]
        missing = [n for n in needed if n not in tensors]
        if missing:
            empty = [i for i, layer in enumerate(layers) if all(n not in tensors for n in layer.values())]
            if empty:
                detail = (f"no weights for layer(s) {', '.join(map(str, empty[:5]))} of {config.num_layers}; "
                          "the download is incomplete or config.json does not match the weights")
            else:
                detail = "the architecture needs tensors that are missing: " + ", ".join(missing[:5]) + (
                    f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelFormatError(f"{model_name}: {detail}")
        used = set(needed)
        return cls(config, layers, EMBED, FINAL_NORM, head, tied, tensors[EMBED].dtype_name,
                   tuple(sorted(n for n in tensors if n not in used)))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def compute_dtype(self, forced: str | None = None) -> str:
        """The dtype the model computes in: `forced`, else the embeddings' stored dtype (float32 if not a float)."""
        if forced is not None:
            return forced
        return self.stored_dtype if self.stored_dtype in COMPUTE else "float32"

    def head_names(self) -> dict[str, str]:
        """The final norm and the output head (the embedding tensor when tied)."""
        return {"norm": self.norm, "lm_head": self.lm_head}
