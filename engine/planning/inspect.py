"""What a model costs in memory, from its config and the weight files' headers alone (no tensor data); the
tokenizer is read too, to check its ids against the embeddings.

Either format: a Hugging Face folder (config.json, *.safetensors) or a GGUF model (engine/formats/source.py
opens either); both come out as the same ModelLayout and ModelInfo."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from stowage.kernels.quants import FORMATS

from ..defaults import BLOCK_SIZE
from ..dtypes import COMPUTE, kv_dtypes
from ..formats.config import ModelConfig
from ..formats.gguf import GGUFTensor
from ..formats.gguf_model import Matrices
from ..formats.source import ModelSource, open_source
from ..runtime.kv_cache import CacheSpec
from ..formats.layout import ModelLayout, TensorInfo

# Stored dtypes the loader can convert (converted_names says which it does): the floats; block formats never.
_CONVERTIBLE = frozenset(COMPUTE) | {"float64", "float8_e4m3fn", "float8_e5m2"}
# What a model whose weights are in ggml blocks computes in when no dtype is forced: its products dequantize
# to float32 tiles anyway (kernels/quant_linear.py), and bf16 activations halve the KV cache against float32.
# One dtype serves every device of a plan; float16 for CUDA would be chosen here once plans hold one per device.
BLOCK_COMPUTE_DTYPE = "bfloat16"
_BLOCK_FORMATS = frozenset(name for name, fmt in FORMATS.items() if fmt.dtype is None)


def compute_dtype_of(layout: ModelLayout, tensors: Mapping[str, TensorInfo], forced: str | None = None) -> str:
    """What the model computes in: `forced`; bfloat16 when a tensor it reads is in ggml blocks; else the layout's rule."""
    if forced is not None:
        return forced
    if any(tensors[n].dtype_name in _BLOCK_FORMATS for n in layout.read_names()):
        return BLOCK_COMPUTE_DTYPE
    return layout.compute_dtype()


def converted_names(layout: ModelLayout, tensors: Mapping[str, TensorInfo], compute: str,
                    forced: bool = False) -> frozenset[str]:
    """The tensors the loader copies into `compute` (engine/runtime/weights.py place converts exactly these).

    With a forced dtype, every floating one. Otherwise the matrices stored as another float dtype (an fp16 up_proj
    in a bf16 model, float8 embeddings): a matmul takes one dtype. Vectors (norms, biases) stay as stored, since
    the forward converts them per call; so do a GGUF model's matrices, which compute in tiles as stored instead
    (engine/formats/gguf_model.py computes_in_tiles)."""
    def converts(spec: TensorInfo) -> bool:
        if spec.dtype_name not in _CONVERTIBLE:
            return False
        return forced or (spec.dtype_name != compute and len(spec.shape) >= 2 and not isinstance(spec, GGUFTensor))

    return frozenset(n for n in layout.read_names() if converts(tensors[n]))


@dataclass(frozen=True)
class WeightGroup:
    """A set of tensors by stored dtype: (dtype name, elements, stored bytes); bytes follow from the dtype they will have."""

    by_dtype: tuple[tuple[str, int, int], ...] = ()
    loaded_bytes: int = 0  # with no dtype forced: as stored, the tensors converted_names lists in the compute dtype

    @classmethod
    def of(cls, specs: Iterable[TensorInfo], converted: Iterable[TensorInfo] = (),
           compute: str = "float32") -> "WeightGroup":
        """`converted`: those of `specs` that the loader copies into `compute` when no dtype is forced."""
        totals: dict[str, tuple[int, int]] = {}
        stored = 0
        for s in specs:
            numel, nbytes = totals.get(s.dtype_name, (0, 0))
            totals[s.dtype_name] = (numel + s.numel, nbytes + s.nbytes)
            stored += s.nbytes
        growth = sum(s.numel * COMPUTE[compute].itemsize - s.nbytes for s in converted)
        return cls(tuple(sorted((d, n, b) for d, (n, b) in totals.items())), stored + growth)

    def nbytes(self, dtype: str | None = None) -> int:
        """Bytes once loaded; `dtype` converts the floating tensors (as the loader does), None: as the loader leaves
        them (stored, but for the matrices converted_names lists)."""
        if dtype is None:
            return self.loaded_bytes
        itemsize = COMPUTE[dtype].itemsize
        return sum(n * itemsize if d in _CONVERTIBLE else b for d, n, b in self.by_dtype)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        """Stored bytes per dtype name, e.g. {"bfloat16": 436207616}."""
        return {d: b for d, _, b in self.by_dtype}


@dataclass(frozen=True)
class ModelInfo:
    """Per-layer and non-layer weight bytes of a model, and its KV cost per token; nothing is loaded."""

    model_dir: Path
    layout: ModelLayout
    layers: tuple[WeightGroup, ...]  # one per decoder layer
    embed: WeightGroup  # the input embeddings
    norm: WeightGroup  # the final norm
    lm_head: WeightGroup  # the output head; the embeddings again when tied
    other: WeightGroup  # tensors nothing reads: never loaded, never counted
    file_bytes: int  # the weight files' sizes, headers included
    compute_dtype: str  # what the model computes in when no dtype is forced (compute_dtype_of)
    matrices: Matrices | None = None  # GGUF: what the tiled products' scratch depends on (None: safetensors)
    experts: tuple[WeightGroup, ...] = ()  # one per decoder layer: its experts (empty for a dense layer or model)

    @property
    def config(self) -> ModelConfig:
        return self.layout.config

    @property
    def tied_embeddings(self) -> bool:
        return self.layout.tied

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    def layer_bytes(self, dtype: str | None = None) -> tuple[int, ...]:
        """Weight bytes of each layer in the dtype it will have (None: no dtype forced, WeightGroup.nbytes)."""
        return tuple(layer.nbytes(dtype) for layer in self.layers)

    def expert_bytes(self, dtype: str | None = None) -> tuple[int, ...]:
        """Weight bytes of each layer's experts (0 for a dense layer), as layer_bytes counts the rest of it."""
        return tuple(e.nbytes(dtype) for e in self.experts) or (0,) * self.num_layers

    def weights_bytes(self, dtype: str | None = None) -> int:
        """Every weight the loader reads, once (tied embeddings counted once)."""
        head = 0 if self.tied_embeddings else self.lm_head.nbytes(dtype)
        return (sum(self.layer_bytes(dtype)) + sum(self.expert_bytes(dtype)) + self.embed.nbytes(dtype)
                + self.norm.nbytes(dtype) + head)

    @property
    def num_parameters(self) -> int:
        """Every weight the model reads, counted once (a tied head is the embedding)."""
        groups = [*self.layers, *self.experts, self.embed, self.norm] + ([] if self.tied_embeddings else [self.lm_head])
        return sum(n for g in groups for _, n, _ in g.by_dtype)

    @property
    def num_active_parameters(self) -> int:
        """What a model card calls active: num_parameters with each layer's experts counted at num_experts_per_tok of
        num_experts (the same for a dense model)."""
        config = self.config
        experts = sum(n for g in self.experts for _, n, _ in g.by_dtype)
        return self.num_parameters - experts + (experts * config.num_experts_per_tok // config.num_experts
                                                if config.is_moe else experts)

    def kv_spec(self, kv_dtype_name: str | None = None, block_size: int = BLOCK_SIZE) -> CacheSpec:
        """One layer's cache shape; kv_dtype None means the compute dtype ("K/V": K's and V's apart)."""
        k, v = kv_dtypes(kv_dtype_name or self.compute_dtype)
        return CacheSpec(self.config.num_kv_heads, self.config.head_dim, k, block_size, v)

    def kv_bytes_per_token(self, kv_dtype_name: str | None = None) -> int:
        """K and V of one token in one layer (CacheSpec.bytes_per_token: blocks and their scales for q8_0 / q4_0)."""
        return self.kv_spec(kv_dtype_name).bytes_per_token


def inspect(model_dir: str | Path) -> ModelInfo:
    """Read the config and every weight file's header (no tensor data) into a ModelInfo."""
    return inspect_source(open_source(model_dir))


def inspect_source(source: ModelSource) -> ModelInfo:
    """The ModelInfo of an opened model: a path's (inspect), or headers read before a download (engine/hub)."""
    model_dir = source.path
    specs = source.specs
    layout = source.layout()
    if source.has_tokenizer:  # a folder without one is refused by the load, which needs it
        layout.check_token_ids(source.tokenizer.num_token_ids, model_dir.name)
    compute = compute_dtype_of(layout, specs)
    converted = converted_names(layout, specs, compute)

    def group(names) -> WeightGroup:
        return WeightGroup.of([specs[n] for n in names], [specs[n] for n in names if n in converted], compute)

    return ModelInfo(
        model_dir=model_dir,
        layout=layout,
        layers=tuple(group(layer.values()) for layer in layout.layers),
        embed=group([layout.embed]),
        norm=group([layout.norm]),
        lm_head=group([layout.lm_head]),
        other=group(layout.unused),
        file_bytes=source.file_bytes,
        compute_dtype=compute,
        matrices=source.matrices(layout),
        experts=tuple(group(e.values()) for e in layout.experts),
    )
