"""The model-layout record: which tensors the model reads, under which names, stored how, computed in what.

Built once from the config and the weight files' headers; `inspect` (planning) and the loader both
read it, so the forecast and the load can never disagree on what is loaded or on what is wrong with
it: every tensor the model reads is checked here, shape and dtype against the config, before
anything is planned or allocated. A new weight format plugs in by giving its tensor specs
`dtype_name`, `shape`, `numel` and `nbytes` (see docs/architecture.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from .config import ModelConfig
from ..dtypes import COMPUTE, SAFETENSORS, name_of
from ..errors import ModelFormatError

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Stored dtypes that cannot hold weights; anything else is a float or a block format its reader dequantizes.
_NOT_WEIGHTS = frozenset(name_of(t) for *_, t in SAFETENSORS.values() if not t.is_floating_point)


class TensorInfo(Protocol):
    """What the layout needs to know of a stored tensor (engine/formats/safetensors.py TensorSpec, GGUF tensor infos)."""

    @property
    def dtype_name(self) -> str: ...  # "bfloat16", "float32", or a block format such as "q8_0"

    @property
    def shape(self) -> tuple[int, ...]: ...  # in torch order: [out_features, in_features] for a linear weight

    @property
    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


# Where a model of experts keeps its router and experts, and its per-expert names for gate, up and down
_MOE_BLOCK = {"mixtral": "block_sparse_moe"}  # any other: "mlp"
_EXPERT_NAMES = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}  # any other: "{role}_proj"
EXPERT_ROLES = ("gate", "up", "down")


def _moe_block(config: ModelConfig, index: int) -> str:
    return f"model.layers.{index}.{_MOE_BLOCK.get(config.model_type, 'mlp')}."


def layer_tensor_names(config: ModelConfig, index: int) -> dict[str, str]:
    """Short name -> checkpoint name for every tensor layer `index` needs, its experts aside (expert_tensor_names)."""
    p = f"model.layers.{index}."
    names = {
        "input_norm": p + "input_layernorm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
    }
    if config.is_moe_layer(index) and config.model_type == "gpt_oss":
        names |= {"router": p + "mlp.router.weight", "router_bias": p + "mlp.router.bias"}
    elif config.is_moe_layer(index):
        names["router"] = _moe_block(config, index) + "gate.weight"
        if config.shared_expert_intermediate_size:  # Qwen2-MoE: beside the experts, gated per token
            names |= {f"shared_{x}": p + f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}
            names["shared_expert_gate"] = p + "mlp.shared_expert_gate.weight"
    else:
        names |= {"gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
                  "down": p + "mlp.down_proj.weight"}
    if config.qkv_bias:
        names |= {f"{x}_bias": p + f"self_attn.{x}_proj.bias" for x in "qkv"}
    if config.o_bias:
        names["o_bias"] = p + "self_attn.o_proj.bias"
    if config.mlp_bias and not config.is_moe_layer(index):
        names |= {f"{x}_bias": p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")}
    if config.attention_sinks:  # gpt-oss: a logit per head beside its scores
        names["sinks"] = p + "self_attn.sinks"
    if config.qk_norm:
        names |= {"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"}
    if config.sandwich_norm:  # Gemma: post_attention_layernorm normalizes the attention output; these the MLP's
        names |= {"pre_ff_norm": p + "pre_feedforward_layernorm.weight",
                  "post_ff_norm": p + "post_feedforward_layernorm.weight"}
    return names


def fused_expert_names(config: ModelConfig, index: int) -> dict[str, str]:
    """The 3-D expert tensors of layer `index`, [num_experts, out, in] (GGUF's ffn_{gate,up,down}_exps), with their
    biases [num_experts, out] where the model has them (gpt-oss's ffn_{gate,up,down}_exps.bias)."""
    names = {role: _moe_block(config, index) + f"experts.{role}_proj.weight" for role in EXPERT_ROLES}
    if config.moe_bias:
        names |= {f"{role}_bias": _moe_block(config, index) + f"experts.{role}_proj.bias" for role in EXPERT_ROLES}
    return names


# gpt-oss's Hugging Face experts: gate and up in one 3-D tensor, their rows interleaved (gate 2j, up 2j + 1), stored
# [num_experts, in, out] in bf16 (GptOssExperts) or as MXFP4 [num_experts, out, in / 32] blocks of 16 bytes and
# their scales (OpenAI's checkpoints: transformers' integrations/mxfp4.py); each with a bias [num_experts, out]
GATE_UP_ROLES = ("gate_up", "down")


def gate_up_names(config: ModelConfig, index: int, mxfp4: bool) -> dict[str, str]:
    """gpt-oss's Hugging Face expert tensors of layer `index` (GATE_UP_ROLES): as stored, or MXFP4 `_blocks` and
    `_scales`, each role with its `_bias`."""
    p = f"model.layers.{index}.mlp.experts."
    names = {f"{role}_bias": p + f"{role}_proj_bias" for role in GATE_UP_ROLES}
    if mxfp4:
        return names | {f"{role}_{part}": p + f"{role}_proj_{part}" for role in GATE_UP_ROLES
                        for part in ("blocks", "scales")}
    return names | {role: p + f"{role}_proj" for role in GATE_UP_ROLES}


def expert_tensor_names(config: ModelConfig, index: int, fused: bool, form: str | None = None) -> dict[str, str]:
    """Short name -> checkpoint name of layer `index`'s experts: "gate" ... when fused into 3-D tensors, else
    "gate.E" ... per expert E (Hugging Face); gpt-oss's Hugging Face forms (`form` "gate_up" or "gate_up_mxfp4":
    gate_up_names); {} for a layer without experts."""
    if not config.is_moe_layer(index):
        return {}
    if form in ("gate_up", "gate_up_mxfp4"):
        return gate_up_names(config, index, form == "gate_up_mxfp4")
    if fused:
        return fused_expert_names(config, index)
    block, names = _moe_block(config, index), _EXPERT_NAMES.get(config.model_type, {})
    return {f"{role}.{e}": block + f"experts.{e}.{names.get(role, role + '_proj')}.weight"
            for e in range(config.num_experts) for role in EXPERT_ROLES}


def is_fused(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> bool:
    """Whether the files hold the experts as 3-D tensors (GGUF) rather than one matrix per expert."""
    first = next((i for i in range(config.num_layers) if config.is_moe_layer(i)), None)
    return first is not None and fused_expert_names(config, first)["gate"] in tensors


def expert_form(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> str:
    """How the files hold the experts: "per_expert" (Hugging Face), "fused" (GGUF's 3-D gate, up, down), or
    gpt-oss's Hugging Face "gate_up" (bf16) or "gate_up_mxfp4" (blocks and scales)."""
    if is_fused(config, tensors):
        return "fused"
    if config.model_type == "gpt_oss":
        first = next((i for i in range(config.num_layers) if config.is_moe_layer(i)), 0)
        return "gate_up_mxfp4" if gate_up_names(config, first, True)["gate_up_blocks"] in tensors else "gate_up"
    return "per_expert"


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
    num_embeddings: int  # the embeddings' rows: token ids 0 .. num_embeddings - 1 can be read (>= vocab_size)
    unused: tuple[str, ...]  # tensors in the files that nothing reads (e.g. a tied checkpoint's lm_head copy)
    experts: tuple[dict[str, str], ...] = ()  # per decoder layer: its experts' short name -> tensor name ({}: none)
    fused_experts: bool = False  # the experts are 3-D tensors [num_experts, out, in] (GGUF), not one per expert
    expert_form: str = "per_expert"  # expert_form(): "per_expert", "fused", "gate_up" or "gate_up_mxfp4"

    @classmethod
    def of(cls, config: ModelConfig, tensors: Mapping[str, TensorInfo], model_name: str) -> "ModelLayout":
        """The layout of a model whose files hold `tensors`; raises ModelFormatError when they do not match."""
        _check_layer_count(config, tensors, model_name)
        layers = tuple(layer_tensor_names(config, i) for i in range(config.num_layers))
        form = expert_form(config, tensors)
        fused = form == "fused"
        experts = tuple(expert_tensor_names(config, i, fused, form) for i in range(config.num_layers))
        # A separate head only when the checkpoint has one and the config does not tie it.
        tied = config.tie_word_embeddings or LM_HEAD not in tensors
        head = EMBED if tied else LM_HEAD
        needed = [EMBED, FINAL_NORM, head] + [n for layer in layers + experts for n in layer.values()]
        missing = [n for n in needed if n not in tensors]
        if missing:
            detail = "the architecture needs tensors that are missing: " + ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelFormatError(f"{model_name}: {detail}")
        _check_tensors(config, tensors, layers, head, model_name, experts, form)
        used = set(needed)
        return cls(config, layers, EMBED, FINAL_NORM, head, tied, tensors[EMBED].dtype_name, tensors[EMBED].shape[0],
                   tuple(sorted(n for n in tensors if n not in used)), experts, fused, form)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def compute_dtype(self, forced: str | None = None) -> str:
        """The dtype the model computes in: `forced`, else the embeddings' stored dtype (float32 if not a float)."""
        if forced is not None:
            return forced
        return self.stored_dtype if self.stored_dtype in COMPUTE else "float32"

    def check_token_ids(self, num_token_ids: int, model_name: str) -> None:
        """Refuse a tokenizer that can produce ids past the embeddings' rows (each would fail the embedding lookup)."""
        if num_token_ids > self.num_embeddings:
            raise ModelFormatError(
                f"{model_name}: the tokenizer has token ids up to {num_token_ids - 1:,} (added and special tokens "
                f"included) but {self.embed!r} has {self.num_embeddings:,} rows, so ids from {self.num_embeddings:,} "
                "on have no embedding; the tokenizer is not the one these weights were trained with: use the "
                "tokenizer files published with the model")

    def read_names(self) -> tuple[str, ...]:
        """Every tensor the model reads, once (a tied head is the embedding tensor)."""
        names = [self.embed, self.norm, self.lm_head,
                 *(n for layer in self.layers + self.experts for n in layer.values())]
        return tuple(dict.fromkeys(names))

    def head_names(self) -> dict[str, str]:
        """The final norm and the output head (the embedding tensor when tied)."""
        return {"norm": self.norm, "lm_head": self.lm_head}


def _check_layer_count(config: ModelConfig, tensors: Mapping[str, TensorInfo], model_name: str) -> None:
    # From the names alone, before any per-layer record is built: a config claiming 10**9 layers costs nothing.
    present: set[int] = set()
    for name in tensors:
        match = _LAYER.match(name)
        if match:
            present.add(int(match.group(1)))
    beyond = sorted(i for i in present if i >= config.num_layers)
    if beyond:
        name = next(n for n in tensors if (m := _LAYER.match(n)) and int(m.group(1)) == beyond[0])
        raise ModelFormatError(
            f"{model_name}: tensor {name!r} belongs to layer {beyond[0]}, but config.json has "
            f"num_hidden_layers={config.num_layers}; the config and the weights disagree")
    if len(present) < config.num_layers:
        empty = [i for i in range(min(config.num_layers, len(present) + 5)) if i not in present][:5]
        raise ModelFormatError(
            f"{model_name}: no weights for layer(s) {', '.join(map(str, empty))} of {config.num_layers}; "
            "the download is incomplete or config.json does not match the weights")


@dataclass(frozen=True)
class _Dim:
    """One expected dimension: its size and the config.json values it follows from."""

    size: int
    formula: str  # "num_attention_heads*head_dim"


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[_Dim, ...]]:
    """Short tensor name -> the shape the forward pass (engine/runtime/model.py) needs, for this config (an expert's
    by "expert_" and its role, a 3-D tensor of every expert's by "experts_" and its role)."""
    experts = _Dim(config.num_experts, "num_experts")
    einter = _Dim(config.expert_intermediate_size,
                  "intermediate_size" if config.model_type in ("mixtral", "gpt_oss") else "moe_intermediate_size")
    shared = _Dim(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
    hidden = _Dim(config.hidden_size, "hidden_size")
    q = _Dim(config.num_heads * config.head_dim, "num_attention_heads*head_dim")
    kv = _Dim(config.num_kv_heads * config.head_dim, "num_key_value_heads*head_dim")
    inter = _Dim(config.intermediate_size, "intermediate_size")
    head_dim = _Dim(config.head_dim, "head_dim")
    heads = _Dim(config.num_heads, "num_attention_heads")
    two_inter = _Dim(2 * config.expert_intermediate_size, "2*intermediate_size")
    return {
        "input_norm": (hidden,), "post_norm": (hidden,), "norm": (hidden,),
        "pre_ff_norm": (hidden,), "post_ff_norm": (hidden,),
        "q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
        "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter),
        "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "o_bias": (hidden,),
        "gate_bias": (inter,), "up_bias": (inter,), "down_bias": (hidden,),
        "q_norm": (head_dim,), "k_norm": (head_dim,),
        "router": (experts, hidden), "router_bias": (experts,), "sinks": (heads,),
        "shared_gate": (shared, hidden), "shared_up": (shared, hidden), "shared_down": (hidden, shared),
        "shared_expert_gate": (_Dim(1, "1"), hidden),
        "expert_gate": (einter, hidden), "expert_up": (einter, hidden), "expert_down": (hidden, einter),
        "experts_gate": (experts, einter, hidden), "experts_up": (experts, einter, hidden),
        "experts_down": (experts, hidden, einter),
        "experts_gate_bias": (experts, einter), "experts_up_bias": (experts, einter),
        "experts_down_bias": (experts, hidden),
        # gpt-oss's Hugging Face forms: [E, in, out] as stored in bf16; MXFP4 blocks [E, out, in / 32, 16], scales
        "gate_up_gate_up": (experts, hidden, two_inter), "gate_up_down": (experts, einter, hidden),
        "gate_up_gate_up_bias": (experts, two_inter), "gate_up_down_bias": (experts, hidden),
        "gate_up_gate_up_blocks": (experts, two_inter, _Dim(config.hidden_size // 32, "hidden_size/32"),
                                   _Dim(16, "16")),
        "gate_up_gate_up_scales": (experts, two_inter, _Dim(config.hidden_size // 32, "hidden_size/32")),
        "gate_up_down_blocks": (experts, hidden, _Dim(config.expert_intermediate_size // 32, "intermediate_size/32"),
                                _Dim(16, "16")),
        "gate_up_down_scales": (experts, hidden, _Dim(config.expert_intermediate_size // 32, "intermediate_size/32")),
    }


def _config_values(config: ModelConfig, formulas: list[str]) -> str:
    """"num_attention_heads=4, head_dim=16 (not in config.json: hidden_size/num_attention_heads)" for the names used."""
    values = {"hidden_size": config.hidden_size, "num_attention_heads": config.num_heads,
              "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
              "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
              "num_experts": config.num_experts, "moe_intermediate_size": config.expert_intermediate_size,
              "shared_expert_intermediate_size": config.shared_expert_intermediate_size, "1": 1, "16": 16,
              "2": 2}
    names = dict.fromkeys(n.split("/")[0] for f in formulas for n in f.split("*"))
    return ", ".join(f"{n}={values[n]}" + (f" (not in config.json: {config.implied[n]})" if n in config.implied else "")
                     for n in names)


def _shape_error(config: ModelConfig, name: str, info: TensorInfo, expected: tuple[_Dim, ...]) -> str | None:
    shape = tuple(info.shape)
    want = tuple(d.size for d in expected)
    if shape == want:
        return None
    text = (f"tensor {name!r} has shape {list(shape)} ({info.dtype_name}) but config.json implies {list(want)} = "
            f"[{', '.join(d.formula for d in expected)}] ({_config_values(config, [d.formula for d in expected])})")
    if shape == want[::-1] and len(want) == 2:
        text += "; it is stored transposed"
    return text + _hint(config, shape, expected)


def _hint(config: ModelConfig, shape: tuple[int, ...], expected: tuple[_Dim, ...]) -> str:
    """What the weights imply for a config value that config.json left out (the usual cause of a mismatch)."""
    if not shape or len(shape) != len(expected) or shape[1:] != tuple(d.size for d in expected[1:]):
        return ""
    rows, formula = shape[0], expected[0].formula
    if formula == "num_key_value_heads*head_dim" and "num_key_value_heads" in config.implied \
            and rows % config.head_dim == 0:
        return (f"; config.json does not set num_key_value_heads, and the weights imply "
                f"num_key_value_heads={rows // config.head_dim} ({rows} rows / head_dim {config.head_dim}): "
                "add it to config.json")
    if formula == "num_attention_heads*head_dim" and "head_dim" in config.implied and rows % config.num_heads == 0:
        return (f"; config.json does not set head_dim, and the weights imply head_dim={rows // config.num_heads} "
                f"({rows} rows / num_attention_heads {config.num_heads}): add it to config.json")
    return ""


def _rows_error(config: ModelConfig, name: str, info: TensorInfo) -> str | None:
    # An embedding or head may be padded past vocab_size, never short of it.
    shape = tuple(info.shape)
    if len(shape) == 2 and shape[1] == config.hidden_size and shape[0] >= config.vocab_size:
        return None
    return (f"tensor {name!r} has shape {list(shape)} ({info.dtype_name}) but config.json implies "
            f"[at least {config.vocab_size}, {config.hidden_size}] = [vocab_size, hidden_size] "
            f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size})")


def _check_tensors(config: ModelConfig, tensors: Mapping[str, TensorInfo], layers: tuple[dict[str, str], ...],
                   head: str, model_name: str, experts: tuple[dict[str, str], ...] = (),
                   form: str = "per_expert") -> None:
    """Every tensor the model reads: a weight dtype (MXFP4 blocks and scales: bytes), and the shape the config
    implies."""
    shapes = _expected_shapes(config)
    problems: list[str] = []
    kind = {"fused": "experts_", "per_expert": "expert_"}.get(form, "gate_up_")
    read = [(FINAL_NORM, "norm")] + [(n, short) for layer in layers for short, n in layer.items()]
    read += [(n, kind + short.split(".")[0]) for layer in experts for short, n in layer.items()]
    for name, short in [(EMBED, ""), (head, "")] + read:
        if short.endswith(("_blocks", "_scales")):
            if tensors[name].dtype_name != "uint8":
                problems.append(f"tensor {name!r} is stored as {tensors[name].dtype_name}; MXFP4 blocks and scales "
                                "are bytes (uint8)")
        elif tensors[name].dtype_name in _NOT_WEIGHTS:
            problems.append(f"tensor {name!r} is stored as {tensors[name].dtype_name}; weights must be "
                            f"floating point ({', '.join(COMPUTE)}) or a quantized block format")
    problems.append(_rows_error(config, EMBED, tensors[EMBED]))
    if head != EMBED:
        problems.append(_rows_error(config, head, tensors[head]) or _head_rows_error(tensors[head], tensors[EMBED]))
    problems += [_shape_error(config, name, tensors[name], shapes[short]) for name, short in read]
    problems = [p for p in problems if p]
    if problems:
        more = f" (and {len(problems) - 1} more tensor problem(s))" if len(problems) > 1 else ""
        raise ModelFormatError(f"{model_name}: {problems[0]}{more}; the weights do not match config.json")


def _head_rows_error(head: TensorInfo, embed: TensorInfo) -> str | None:
    # The head's rows are the ids it can sample; the next step looks each one up in the embeddings.
    if len(embed.shape) != 2 or head.shape[0] <= embed.shape[0]:  # a malformed embedding is reported on its own
        return None
    return (f"tensor {LM_HEAD!r} has {head.shape[0]} rows but {EMBED!r} only {embed.shape[0]}: the head could "
            "produce token ids that have no embedding")
