"""What a model folder costs in memory, from config.json and the safetensors headers alone."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import weight_files
from .config import ModelConfig
from .errors import ModelFormatError
from .kv_cache import KV_DTYPES, CacheSpec
from .safetensors import DTYPES, TensorSpec, read_header

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")  # what `dtype=` may convert floating weights to
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class WeightGroup:
    """Element counts of a set of tensors by stored dtype; bytes follow from the dtype they will have."""

    numel_by_dtype: tuple[tuple[str, int], ...] = ()  # (safetensors dtype, elements), sorted

    @classmethod
    def of(cls, specs: list[TensorSpec]) -> "WeightGroup":
        counts: Counter[str] = Counter()
        for s in specs:
            counts[s.dtype] += s.nbytes // DTYPES[s.dtype][0]
        return cls(tuple(sorted(counts.items())))

    def nbytes(self, dtype: str | None = None) -> int:
        """Bytes once loaded; `dtype` converts the floating tensors (as the loader does), None keeps them."""
        total = 0
        for st_dtype, numel in self.numel_by_dtype:
            stored = DTYPES[st_dtype][2]
            itemsize = getattr(torch, dtype).itemsize if dtype and stored.is_floating_point else stored.itemsize
            total += numel * itemsize
        return total

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        """Stored bytes per torch dtype name, e.g. {"bfloat16": 436207616}."""
        return {torch_dtype_name(DTYPES[d][2]): n * DTYPES[d][0] for d, n in self.numel_by_dtype}


@dataclass(frozen=True)
class ModelInfo:
    """Per-layer and non-layer weight bytes of a model, and its KV cost per token; nothing is loaded."""

    model_dir: Path
    config: ModelConfig
    layers: tuple[WeightGroup, ...]  # one per decoder layer
    embed: WeightGroup  # the input embeddings
    norm: WeightGroup  # the final norm
    lm_head: WeightGroup  # the output head; the embeddings again when tied
    other: WeightGroup  # tensors outside the layers, embeddings, norm and head: never loaded, never counted
    tied_embeddings: bool
    file_bytes: int  # the weight files' sizes, headers included

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def compute_dtype(self) -> str:
        """What the model computes in when no dtype is forced: the embeddings' dtype, as the engine decides."""
        name = next(iter(self.embed.bytes_by_dtype))
        return name if name in WEIGHT_DTYPES else "float32"

    def layer_bytes(self, dtype: str | None = None) -> tuple[int, ...]:
        """Weight bytes of each layer in the dtype it will have (None: as stored)."""
        return tuple(layer.nbytes(dtype) for layer in self.layers)

    def weights_bytes(self, dtype: str | None = None) -> int:
        """Every weight the loader reads, once (tied embeddings counted once)."""
        head = 0 if self.tied_embeddings else self.lm_head.nbytes(dtype)
        return sum(self.layer_bytes(dtype)) + self.embed.nbytes(dtype) + self.norm.nbytes(dtype) + head

    def kv_spec(self, kv_dtype: str | None = None, block_size: int = 16) -> CacheSpec:
        """One layer's cache shape; kv_dtype None means the compute dtype."""
        name = kv_dtype or self.compute_dtype
        if name not in KV_DTYPES:
            raise ValueError(f"KV dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
        return CacheSpec(self.config.num_kv_heads, self.config.head_dim, KV_DTYPES[name], block_size)

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        """K and V of one token in one layer: 2 * kv_heads * head_dim * bytes."""
        return self.kv_spec(kv_dtype).bytes_per_token


def inspect(model_dir: str | Path) -> ModelInfo:
    """Read config.json and every weight file's header (no tensor data) into a ModelInfo."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    files = weight_files(model_dir)
    specs: dict[str, TensorSpec] = {}
    for path in files:
        specs.update(read_header(path))
    layers: list[list[TensorSpec]] = [[] for _ in range(config.num_layers)]
    rest: dict[str, TensorSpec] = {}
    for name, spec in specs.items():
        match = _LAYER.match(name)
        if match is None:
            rest[name] = spec
            continue
        index = int(match.group(1))
        if index >= config.num_layers:
            raise ModelFormatError(
                f"{model_dir.name}: tensor {name!r} belongs to layer {index}, but config.json has "
                f"num_hidden_layers={config.num_layers}; the config and the weights disagree"
            )
        layers[index].append(spec)
    empty = [i for i, layer in enumerate(layers) if not layer]
    if empty:
        raise ModelFormatError(
            f"{model_dir.name}: no weights for layer(s) {', '.join(map(str, empty[:5]))} of {config.num_layers}; "
            "the download is incomplete or config.json does not match the weights"
        )
    if EMBED not in rest:
        raise ModelFormatError(f"{model_dir.name}: the embeddings {EMBED!r} are missing from the weight files")
    # Same rule as the loader: a separate head only when the checkpoint has one and the config does not tie it.
    tied = config.tie_word_embeddings or LM_HEAD not in rest
    embed = WeightGroup.of([rest.pop(EMBED)])
    head_spec = rest.pop(LM_HEAD, None)
    norm = WeightGroup.of([rest.pop(FINAL_NORM)] if FINAL_NORM in rest else [])
    return ModelInfo(
        model_dir=model_dir,
        config=config,
        layers=tuple(WeightGroup.of(layer) for layer in layers),
        embed=embed,
        norm=norm,
        lm_head=embed if tied else WeightGroup.of([head_spec]),
        # e.g. a tied checkpoint's stored lm_head.weight: the loader never reads it, so it costs nothing
        other=WeightGroup.of(list(rest.values()) + ([head_spec] if tied and head_spec else [])),
        tied_embeddings=tied,
        file_bytes=sum(p.stat().st_size for p in files),
    )
