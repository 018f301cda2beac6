"""Model configuration read from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelFormatError, UnsupportedModelError

# model_type -> architecture class names that config.json may carry for it
SUPPORTED = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelFormatError(f"{model_dir}: not a folder; choose a model folder (config.json, *.safetensors)")
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelFormatError(f"{model_dir}: no config.json; a model folder holds config.json and *.safetensors") from None
        except json.JSONDecodeError as e:
            raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
        gen = Path(model_dir) / "generation_config.json"
        gen_raw = {}
        if gen.exists():
            try:
                gen_raw = json.loads(gen.read_text())
            except json.JSONDecodeError as e:
                raise ModelFormatError(f"{gen}: not valid JSON ({e})") from e
        return cls.from_dict(raw, gen_raw)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        if model_type not in SUPPORTED:
            by_arch = [t for t, names in SUPPORTED.items() if any(a in names for a in archs)]
            if not by_arch:
                supported = ", ".join(f"{t} ({'/'.join(n)})" for t, n in SUPPORTED.items())
                raise UnsupportedModelError(
                    f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
                    f"Stowage supports {supported}"
                )
            model_type = by_arch[0]
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                bos_token_id=_first(raw.get("bos_token_id")),
                eos_token_ids=_eos_ids(raw, generation or {}),
            )
        except KeyError as e:
            raise ModelFormatError(f"config.json: missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"config.json: bad value ({e})") from e


def _first(value):
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _eos_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _rope(raw: dict) -> RopeConfig:
    # transformers 5 may keep rope_theta only under rope_parameters; older files use rope_scaling.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    merged = {**params, **scaling} if scaling else params
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ("default", "llama3"):
        raise UnsupportedModelError(f"config.json: rope type {kind!r} is not supported (supported: default, llama3)")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        kind="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )
