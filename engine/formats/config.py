"""Model configuration read from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text,
Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss), every value checked.

Types are checked where config.json is read (`from_dict`, through engine/formats/config_values.py), ranges in
`__post_init__`; the file itself is read by engine/formats/json_file.py, RoPE parameters by engine/formats/rope_config.py.
Sliding windows: `layer_windows` holds each layer's window (None: full attention) as transformers derives it
(Mistral: `sliding_window` on every layer; Qwen2/3: only with `use_sliding_window`; Gemma: `layer_types`, else
Gemma 2 alternates and Gemma 3 follows `sliding_window_pattern`). Gemma 3's sliding layers rotate with their
own base (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`): `local_rope`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .config_values import get_bool, get_float, get_int, get_optional_float, require
from ..errors import ModelFormatError, UnsupportedModelError
from .json_file import kind_of, read_json_object  # noqa: F401 (read_json_object: engine/formats/checkpoint.py reads it here)
from .rope_config import RopeConfig, rope_config

# model_type -> architecture class names that config.json may carry for it
SUPPORTED = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "qwen3_moe": ("Qwen3MoeForCausalLM",),
    "qwen2_moe": ("Qwen2MoeForCausalLM",),
    "mixtral": ("MixtralForCausalLM",),
    "gpt_oss": ("GptOssForCausalLM",),
    "gemma2": ("Gemma2ForCausalLM",),
    "gemma3_text": ("Gemma3ForCausalLM",),
}
_GEMMA = ("gemma2", "gemma3_text")
# the model types whose layers route through experts (docs/moe.md)
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
# transformers' defaults for keys a Gemma config.json may leave out (Gemma2Config, Gemma3TextConfig)
_GEMMA_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   sliding_window=4096, max_position_embeddings=8192, rope_theta=10000.0),
    "gemma3_text": dict(query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None,
                        sliding_window=4096, max_position_embeddings=131072, rope_theta=1_000_000.0),
}
# The activations the MLP computes (Gemma: "gelu_pytorch_tanh", GELU with the tanh approximation).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# transformers' head_dim when config.json has none: hidden_size // num_attention_heads, except Qwen3Config's 128.
_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256, "gpt_oss": 64}
# GptOssConfig's defaults for what a config.json may leave out (transformers' configuration_gpt_oss.py)
_GPT_OSS_DEFAULTS = dict(rope_theta=150000.0, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 4096})
MAX_LAYERS = 65_536  # far more than any model has (Llama 3.1 405B: 126)
MAX_WINDOW = 2**31 - 1  # tokens; past any context a model is planned for
MAX_EOS_TOKEN_IDS = 256  # end-of-reply ids one file lists; real models list 1 to 4 (Llama 3.1: 3)


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
    # Gemma: RMSNorm scales by (1 + weight) in fp32; norms after attention and MLP too ("sandwich");
    # embeddings times sqrt(hidden_size); scores scaled by query_pre_attn_scalar**-0.5; tanh soft-capping.
    hidden_act: str = "silu"
    norm_plus_one: bool = False
    sandwich_norm: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window in tokens, None = full; () = all full
    local_rope: RopeConfig | None = None  # the sliding layers' rotary embedding when it differs (Gemma 3)
    # Mixture of experts (docs/moe.md): 0 experts is a dense model. Each routed layer picks num_experts_per_tok
    # experts of expert_intermediate_size; norm_topk_prob renormalizes their weights to sum to 1 (Mixtral always).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an MLP every token runs beside its experts (0: none)
    # gpt-oss (docs/moe.md): a learned logit per head that joins every softmax of its scores ("attention sinks");
    # biases on the router and the experts; softmax over the top-k router logits only; its clamped SwiGLU:
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)
    attention_sinks: bool = False
    moe_bias: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float | None = None  # None: the plain activation
    swiglu_alpha: float = 1.702
    # config.json keys that were absent, with how their value was derived (the layout's errors quote it)
    implied: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        # rotary embeddings rotate pairs of dimensions (engine/runtime/rope.py)
        require(self.head_dim % 2 == 0, f"head_dim must be even, got {self.head_dim}")
        require(math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0,
                 f"rms_norm_eps must be a positive number, got {self.rms_norm_eps}")
        require(self.hidden_act in ACTIVATIONS,
                 f"hidden activation {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            require(value is None or (math.isfinite(value) and value > 0),
                     f"{name} must be a positive number or null, got {value!r}")
        require(len(self.layer_windows) in (0, self.num_layers),
                 f"{len(self.layer_windows)} layer types for {self.num_layers} layers")
        for w in self.layer_windows:
            require(w is None or (isinstance(w, int) and not isinstance(w, bool) and w > 0),
                     f"sliding_window must be a positive integer, got {w!r}")
        if self.swiglu_limit is not None:
            require(math.isfinite(self.swiglu_limit) and self.swiglu_limit > 0
                    and math.isfinite(self.swiglu_alpha) and self.swiglu_alpha > 0,
                    f"swiglu_limit and swiglu_alpha must be positive numbers, got {self.swiglu_limit!r} and "
                    f"{self.swiglu_alpha!r}")
        if self.num_experts:
            require(self.num_experts_per_tok > 0 and self.expert_intermediate_size > 0,
                     f"num_experts_per_tok ({self.num_experts_per_tok}) and the experts' intermediate size "
                     f"({self.expert_intermediate_size}) must be positive integers in a model of experts")
            if self.num_experts_per_tok > self.num_experts:
                raise ModelFormatError(
                    f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) is more than the "
                    f"{self.num_experts} experts the model has; the config is corrupt")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes its MLP through experts (False for every layer of a dense model)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens (a query sees itself and the window - 1 before it); None: all."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelFormatError(f"{model_dir}: not a folder; choose a model folder (config.json, *.safetensors)")
        path = model_dir / "config.json"
        if not path.exists():
            raise ModelFormatError(f"{model_dir}: no config.json; a model folder holds config.json and *.safetensors")
        gen = model_dir / "generation_config.json"
        return cls.from_dict(read_json_object(path), read_json_object(gen) if gen.exists() else None)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ModelFormatError(f"config.json: holds {kind_of(raw)}, not an object")
        model_type = _model_type(raw)
        hidden = get_int(raw, "hidden_size")
        num_heads = get_int(raw, "num_attention_heads")
        implied = {}
        num_kv_heads = get_int(raw, "num_key_value_heads", None)
        if num_kv_heads is None:
            num_kv_heads = num_heads
            implied["num_key_value_heads"] = "num_attention_heads, as transformers defaults it"
        head_dim = get_int(raw, "head_dim", None)
        if head_dim is None:
            if model_type in _DEFAULT_HEAD_DIM:
                head_dim = _DEFAULT_HEAD_DIM[model_type]
                implied["head_dim"] = f"transformers' default for {model_type}"
            else:
                if num_heads > 0 and hidden % num_heads:
                    raise ModelFormatError(
                        f"config.json: hidden_size ({hidden}) is not a multiple of num_attention_heads ({num_heads}) "
                        "and there is no head_dim to say how wide a head is")
                head_dim = hidden // num_heads if num_heads > 0 else 0
                implied["head_dim"] = "hidden_size/num_attention_heads"
        attention_bias = get_bool(raw, "attention_bias")
        num_layers = get_int(raw, "num_hidden_layers")
        if num_layers > MAX_LAYERS:  # before anything is built per layer (layer_windows)
            raise ModelFormatError(f"config.json: num_hidden_layers={num_layers} is more than any model has "
                                   f"(at most {MAX_LAYERS:,} here); the config is corrupt")
        gemma = _gemma_fields(raw, model_type, hidden) if model_type in _GEMMA else {}
        if model_type == "gpt_oss":
            raw = _gpt_oss_defaults(raw)
        return cls(
            model_type=model_type,
            vocab_size=get_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=get_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get_float(raw, "rms_norm_eps", 1e-6),
            rope=gemma.pop("rope", None) or rope_config(raw, get_int(raw, "max_position_embeddings", None)),
            max_position_embeddings=get_int(raw, "max_position_embeddings",
                                         _GEMMA_DEFAULTS.get(model_type, {}).get("max_position_embeddings", 4096)),
            # Gemma ties the head unless told otherwise (transformers' default for it)
            tie_word_embeddings=get_bool(raw, "tie_word_embeddings", model_type in _GEMMA),
            qkv_bias=get_bool(raw, "qkv_bias", True) if model_type == "qwen2_moe"
            else model_type == "qwen2" or attention_bias,
            o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            mlp_bias=get_bool(raw, "mlp_bias"),
            attention_sinks=model_type == "gpt_oss",
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            torch_dtype=_str(raw.get("torch_dtype") or raw.get("dtype")),
            bos_token_id=next(iter(_token_ids(raw.get("bos_token_id"))), None),
            eos_token_ids=_eos_ids(raw, generation or {}),
            implied=implied,
            layer_windows=_layer_windows(raw, model_type, num_layers),
            **gemma,
            **(_moe_fields(raw, model_type, num_layers) if model_type in MOE else {}),
        )


def _model_type(raw: dict) -> str:
    model_type, archs = raw.get("model_type"), raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelFormatError(f"config.json: architectures must be a list of class names, got {archs!r:.80}")
    if isinstance(model_type, str) and model_type in SUPPORTED:
        return model_type
    if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in archs:
        raise UnsupportedModelError(
            "Gemma 3 with vision (model_type 'gemma3', Gemma3ForConditionalGeneration: the 4B, 12B and 27B "
            "checkpoints) keeps its text weights under language_model.* beside a vision tower, which Stowage does "
            "not load yet; the text-only Gemma 3 models (model_type 'gemma3_text': 270M, 1B) and GGUF files "
            "of the text model load")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFormatError(f"config.json: model_type must be a string, got {model_type!r:.80}")
    by_arch = [t for t, names in SUPPORTED.items() if any(a in names for a in archs if isinstance(a, str))]
    if not by_arch:
        supported = ", ".join(f"{t} ({'/'.join(n)})" for t, n in SUPPORTED.items())
        raise UnsupportedModelError(
            f"unsupported architecture: model_type={model_type!r}, architectures={archs!r:.200}; "
            f"Stowage supports {supported}"
        )
    return by_arch[0]


def _str(value) -> str | None:
    return value if isinstance(value, str) else None


def _token_ids(value) -> list[int]:
    """An id or a list of ids as config files write them; anything else names no token."""
    values = value if isinstance(value, list) else [value]
    return [i for i in values if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def _eos_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    """generation_config.json's end-of-reply ids, then config.json's, each once."""
    sources = {"generation_config.json": generation.get("eos_token_id"), "config.json": raw.get("eos_token_id")}
    for name, value in sources.items():
        if isinstance(value, list) and len(value) > MAX_EOS_TOKEN_IDS:
            raise ModelFormatError(f"{name}: eos_token_id lists {len(value):,} ids; at most {MAX_EOS_TOKEN_IDS} are "
                                   f"accepted (a model ends its replies at a few tokens): the file is corrupt")
    return tuple(dict.fromkeys(i for value in sources.values() for i in _token_ids(value)))  # in order, linear


def _window(raw: dict, default: int | None) -> int | None:
    value = get_int(raw, "sliding_window", default)
    if value is not None and not 0 < value <= MAX_WINDOW:  # the kernels compare positions in int64
        raise ModelFormatError(f"config.json: sliding_window must be a positive integer up to {MAX_WINDOW:,}, "
                               f"got {value!r}")
    return value


def _layer_windows(raw: dict, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers decides it for the architecture; () when every layer is full."""
    if model_type == "llama":
        return ()  # LlamaConfig has no sliding window
    if model_type == "gpt_oss" and raw.get("layer_types") is None:  # GptOssConfig: even layers slide
        raw = raw | {"layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                     for i in range(num_layers)]}
    if model_type in ("mistral", "mixtral"):  # sliding_window (null: none) on every layer, layer_types ignored
        window = _window(raw, None)
        return (window,) * num_layers if window is not None else ()
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not get_bool(raw, "use_sliding_window"):
        return ()
    if model_type == "qwen2_moe":
        raise UnsupportedModelError("config.json: use_sliding_window in a Qwen2-MoE model is not supported (no "
                                    "released one sets it)")
    if model_type == "qwen3_moe":  # Qwen3MoeConfig: the window (default 4096) on every layer
        return (_window(raw, 4096),) * num_layers
    window = _window(raw, _GEMMA_DEFAULTS.get(model_type, {}).get("sliding_window"))
    types = raw.get("layer_types")
    if types is None:
        if model_type in ("qwen2", "qwen3"):
            first = get_int(raw, "max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            pattern = 2 if model_type == "gemma2" else get_int(raw, "sliding_window_pattern", 6)
            if pattern <= 0:
                raise ModelFormatError(f"config.json: sliding_window_pattern must be positive, got {pattern}")
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ModelFormatError(
            f"config.json: layer_types must list 'sliding_attention' or 'full_attention' for each of the "
            f"{num_layers} layers, got {types!r:.120}")
    if "sliding_attention" in types and window is None:
        raise ModelFormatError("config.json: layer_types has sliding layers but sliding_window is null")
    return tuple(window if t == "sliding_attention" else None for t in types)


# transformers' num_experts and num_experts_per_tok when config.json leaves them out
_MOE_DEFAULTS = {"qwen3_moe": (128, 8), "qwen2_moe": (60, 4), "mixtral": (8, 2), "gpt_oss": (128, 4)}


def _moe_fields(raw: dict, model_type: str, num_layers: int) -> dict:
    """The experts of a Qwen3-MoE or Mixtral config, read as transformers reads them (docs/moe.md)."""
    # Qwen3-MoE: transformers 5 writes num_local_experts for num_experts; Qwen2-MoE reads num_experts alone
    key = "num_experts" if "num_experts" in raw or model_type == "qwen2_moe" else "num_local_experts"
    num_experts = get_int(raw, key, _MOE_DEFAULTS[model_type][0])
    # OpenAI's gpt-oss config.json also says experts_per_token
    per_token = get_int(raw, "num_experts_per_tok", get_int(raw, "experts_per_token", _MOE_DEFAULTS[model_type][1]))
    fields = dict(num_experts=num_experts, num_experts_per_tok=per_token)
    if model_type == "gpt_oss":  # every layer routes, its experts intermediate_size wide, all of it biased
        return fields | dict(expert_intermediate_size=get_int(raw, "intermediate_size"), moe_bias=True,
                             softmax_after_topk=True, swiglu_limit=get_float(raw, "swiglu_limit", 7.0),
                             swiglu_alpha=get_float(raw, "swiglu_alpha", 1.702))
    if model_type == "mixtral":  # every layer routes; the experts are intermediate_size wide; weights renormalized
        return fields | dict(expert_intermediate_size=get_int(raw, "intermediate_size"), norm_topk_prob=True)
    step = get_int(raw, "decoder_sparse_step", 1)
    if step < 1:
        raise ModelFormatError(f"config.json: decoder_sparse_step must be a positive integer, got {step}")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(type(i) is not int or not 0 <= i < num_layers for i in only):
        raise ModelFormatError(f"config.json: mlp_only_layers must list layer indices below {num_layers}, "
                               f"got {only!r:.80}")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = get_int(raw, "shared_expert_intermediate_size", 5632)
    return fields | dict(expert_intermediate_size=get_int(raw, "moe_intermediate_size"),
                         norm_topk_prob=get_bool(raw, "norm_topk_prob"), dense_layers=dense)


def _gpt_oss_defaults(raw: dict) -> dict:
    """`raw` with GptOssConfig's defaults where it leaves a key out (its rope: YaRN, theta 150000)."""
    out = dict(raw)
    for key in ("sliding_window", "max_position_embeddings", "rms_norm_eps"):
        if out.get(key) is None:
            out[key] = _GPT_OSS_DEFAULTS[key]
    if out.get("attention_bias") is None:
        out["attention_bias"] = True
    if out.get("rope_parameters") is None and out.get("rope_scaling") is None:
        out["rope_parameters"] = _GPT_OSS_DEFAULTS["rope_parameters"]
    params = out.get("rope_parameters") if isinstance(out.get("rope_parameters"), dict) else {}
    if out.get("rope_theta") is None and params.get("rope_theta") is None:
        out["rope_theta"] = _GPT_OSS_DEFAULTS["rope_theta"]
    return out


def _gemma_fields(raw: dict, model_type: str, hidden: int) -> dict:
    """What Gemma 2 and Gemma 3 (text) add to the Llama forward; ModelConfig's comments say what each does."""
    defaults = _GEMMA_DEFAULTS[model_type]
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act == "gelu_tanh":  # the same function under its other name
        act = "gelu_pytorch_tanh"
    if get_bool(raw, "use_bidirectional_attention"):
        raise UnsupportedModelError("config.json: use_bidirectional_attention (an embedding model) is not supported")
    fields = dict(
        hidden_act=act, norm_plus_one=True, sandwich_norm=True, embed_scale=float(hidden) ** 0.5,
        query_pre_attn_scalar=get_float(raw, "query_pre_attn_scalar", defaults["query_pre_attn_scalar"]),
        attn_softcap=get_optional_float(raw, "attn_logit_softcapping", defaults["attn_logit_softcapping"]),
        final_softcap=get_optional_float(raw, "final_logit_softcapping", defaults["final_logit_softcapping"]),
    )
    if model_type == "gemma2":
        return fields
    # Gemma3TextConfig has attn_logit_softcapping, but transformers' Gemma 3 never applies it (released
    # configs set null): ignored here too, so the logits are the ones the model was trained to give.
    fields["attn_softcap"] = None
    # Gemma 3: transformers 5 writes rope_parameters per layer type; older files rope_theta (global),
    # rope_local_base_freq (sliding) and rope_scaling (global only).
    per_type = raw.get("rope_parameters")
    if per_type is not None and not isinstance(per_type, dict):
        raise ModelFormatError(f"config.json: rope_parameters must be an object, got {per_type!r:.80}")
    is_per_type = isinstance(per_type, dict) and all(isinstance(v, dict) for v in per_type.values())
    if per_type is not None and not is_per_type:
        per_type = {"full_attention": per_type}  # one set given the old way: it is the global layers'
    per_type = per_type or {}
    unknown = set(per_type) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ModelFormatError(f"config.json: rope_parameters for unknown layer types {sorted(unknown)}")
    full = {"rope_parameters": per_type.get("full_attention"), "rope_scaling": raw.get("rope_scaling"),
            "rope_theta": raw.get("rope_theta")}
    if full["rope_theta"] is None and "rope_theta" not in (full["rope_parameters"] or {}):
        full["rope_theta"] = defaults["rope_theta"]
    local = {"rope_parameters": per_type.get("sliding_attention"), "rope_theta": raw.get("rope_local_base_freq")}
    if local["rope_theta"] is None and "rope_theta" not in (local["rope_parameters"] or {}):
        local["rope_theta"] = 10000.0
    return fields | {"rope": rope_config(full), "local_rope": rope_config(local)}

