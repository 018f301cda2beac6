"""A GGUF model as the engine reads a Hugging Face one: config from the metadata, tensors under HF names, tokenizer.

llama.cpp names tensors `blk.N.attn_q.weight`, ...; `GGUFModel.specs` holds them under the names
engine/formats/layout.py uses (`model.layers.N.self_attn.q_proj.weight`), so the layout, the planner and the
loader read a GGUF model through the same record as a safetensors one. Three things differ from a
Hugging Face checkpoint, and all are undone here:
- llama.cpp's converter permutes the Q and K rows of "llama" files for its rotary layout
  (convert_hf_to_gguf.py `permute`: within each head, row 2j + t holds HF row t * head_dim / 2 + j).
  The weights stay as stored; the Q and K outputs are permuted back per head (`qk_order`, a gather of
  [n, heads, head_dim] per layer). Qwen2/Qwen3/Gemma files are not permuted.
- Llama 3's rope scaling is stored as the frequency factors it produces (`rope_freqs.weight`); its
  parameters are recovered from them and checked to reproduce every factor.
- Gemma's norm weights are stored with the 1 of its (1 + weight) already added, and what llama.cpp hard-codes
  for Gemma (the sliding-window pattern, Gemma 3's local rotary base, the attention scale) is not in the file:
  `_gemma_keys` supplies it as llama.cpp does (docs/gemma.md, "Gemma from GGUF").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch

from stowage.kernels.quant_linear import MatrixShape, QuantizedWeight, rows_workspace_bytes, workspace_bytes
from stowage.kernels.quants import FORMATS

from .checkpoint import FileWatch
from .config import ModelConfig, RopeConfig
from ..dtypes import SAFETENSORS
from ..errors import ModelFormatError, UnsupportedModelError
from .gguf import GGUFCheckpoint, GGUFTensor, find_gguf, open_gguf, part_paths
from ..text.gguf_tokenizer import GGUFTokenizer, cached_tokenizer
from .layout import EMBED, FINAL_NORM, LM_HEAD, expert_tensor_names, layer_tensor_names
from ..runtime.rope import inverse_frequencies

# general.architecture -> the model_type engine/formats/config.py builds (Mistral files say "llama")
# (a llama file with experts is Mixtral's: config_from_gguf)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
                 "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss"}
PERMUTED_QK = frozenset({"llama"})  # architectures whose Q/K rows llama.cpp's converter permutes
GEMMA = frozenset({"gemma2", "gemma3"})
ROPE_FREQS = "rope_freqs.weight"
_GLOBAL = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": LM_HEAD}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Gemma's four norms per layer (gguf-py's tensor_mapping): ffn_norm is the one before the MLP there
_GEMMA_LAYER = _LAYER | {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}
_HF_GLOBAL = {hf: gguf for gguf, hf in _GLOBAL.items()}


# The router and the 3-D experts (docs/moe.md): under the block engine/formats/layout.py reads them from
_MOE_BLOCK = {"llama": "block_sparse_moe", "qwen3moe": "mlp", "qwen2moe": "mlp", "gpt-oss": "mlp"}
_SHARED_EXPERT = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                  "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}


# gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): the norm after attention is post_attention_norm, the router is biased
# and named as transformers' GptOssTopKRouter, each head's sink is attn_sinks.weight (transformers: self_attn.sinks)
_GPT_OSS = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
            "attn_sinks": "self_attn.sinks"}
SINKS = "attn_sinks"


def _layer_names(arch: str) -> dict[str, str]:
    if arch == "gpt-oss":
        return {k: v for k, v in _LAYER.items() if k != "ffn_norm"} | {
            f"ffn_{role}_exps": f"mlp.experts.{role}_proj" for role in ("gate", "up", "down")} | _GPT_OSS
    if arch in _MOE_BLOCK:
        block = _MOE_BLOCK[arch]
        return _LAYER | {"ffn_gate_inp": f"{block}.gate", "ffn_gate_exps": f"{block}.experts.gate_proj",
                         "ffn_up_exps": f"{block}.experts.up_proj", "ffn_down_exps": f"{block}.experts.down_proj"} \
            | (_SHARED_EXPERT if arch == "qwen2moe" else {})
    return _GEMMA_LAYER if arch in GEMMA else _LAYER


def hf_name(name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for one the engine has no name for."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer = _layer_names(arch)
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        if parts[2] == SINKS:  # a parameter of its own in transformers, not a module's weight
            return f"model.layers.{int(parts[1])}.{layer[parts[2]]}" if parts[3] == "weight" else None
        return f"model.layers.{int(parts[1])}.{layer[parts[2]]}.{parts[3]}"
    return None


def gguf_name(name: str, arch: str = "llama") -> str:
    """The inverse of hf_name, for messages: `model.layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`."""
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    if name.startswith("model.layers."):
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        stem, suffix = rest.rsplit(".", 1)
        by_hf = {hf: gguf for gguf, hf in _layer_names(arch).items()}
        if rest in by_hf:  # gpt-oss's sinks: no suffix
            return f"blk.{index}.{by_hf[rest]}.weight"
        if stem in by_hf:
            return f"blk.{index}.{by_hf[stem]}.{suffix}"
    return name


def qk_order(head_dim: int) -> torch.Tensor:
    """Index that puts one head's permuted Q/K outputs back in Hugging Face order: hf[..., i] = stored[..., order[i]]."""
    # stored position 2j + t holds HF position t * head_dim / 2 + j
    return torch.arange(head_dim).view(head_dim // 2, 2).t().reshape(-1)


def computes_in_tiles(type_name: str, dtype: torch.dtype, converts: bool) -> bool:
    """Whether a GGUF matrix stored as `type_name` runs through kernels.quant_linear: always when in blocks; a plain
    one in another dtype than the compute dtype too, unless the load converts plain tensors (a forced dtype: a copy
    the planner counts, as for safetensors)."""
    stored = FORMATS[type_name].dtype
    return stored is None or (not converts and stored != dtype)


@dataclass(frozen=True)
class Matrices:
    """A GGUF model's matrices by role, with the facts their tiled products' scratch depends on (planning)."""

    layers: tuple[tuple[MatrixShape, bool], ...]  # distinct (shape, has a bias) over every layer
    embed: MatrixShape
    head: MatrixShape
    widens: bool = False  # the other matrices are safetensors' own, widened in tiles (kernels/cpu_matmul.py)

    def workspace_bytes(self, dtype: torch.dtype, converts: bool, *, runs_layers: bool, holds_head: bool,
                        holds_embed: bool, num_tokens: int, num_seqs: int, on_cpu: bool = False) -> int:
        """The largest scratch one product (or the embedding lookup) takes on a device: they run one at a time.
        `on_cpu`: the device is the CPU, where a prefill chunk's products may run the native integer tiles."""
        tiled = lambda s: computes_in_tiles(s.type_name, dtype, converts)  # noqa: E731
        sizes = [0]
        if runs_layers:
            rows = max(num_tokens, num_seqs)
            native = on_cpu and not self.widens  # gpt-oss's Hugging Face MXFP4 (Mxfp4Weight) always tiles
            sizes += [workspace_bytes(s, rows, dtype, bias=b, on_cpu=native) for s, b in self.layers if tiled(s)]
        if self.widens:  # the embeddings and head are safetensors' (mxfp4_matrices)
            return max(sizes)
        if holds_head and tiled(self.head):
            sizes.append(workspace_bytes(self.head, num_seqs, dtype))  # logits of the last position only
        if holds_embed and tiled(self.embed):
            sizes.append(rows_workspace_bytes(self.embed, num_tokens))
        return max(sizes)


def mxfp4_matrices(config: ModelConfig) -> Matrices:
    """gpt-oss's MXFP4 experts in a Hugging Face checkpoint (kernels/quant_linear.py Mxfp4Weight, tiles as a GGUF
    file's): gate_up [2 * inter, hidden] and down [hidden, inter], biased; the rest is safetensors', never tiled."""
    inter, hidden = config.expert_intermediate_size, config.hidden_size
    plain = MatrixShape("f32", config.vocab_size, hidden)  # read in torch: no tile (computes_in_tiles never asked)
    return Matrices(((MatrixShape("mxfp4", 2 * inter, hidden), True), (MatrixShape("mxfp4", hidden, inter), True)),
                    plain, plain, widens=True)


def open_model(path: str | Path) -> "GGUFModel":
    """The GGUF model at `path`, parsed once per process while the file is unchanged (inspect, the CLI and the
    loader each ask for it; a 128k-token vocabulary takes a quarter of a second to read)."""
    path = find_gguf(path)
    st = path.stat()
    # not resolved: a Hugging Face cache links each part to blobs/<hash>, and a split file is found by its parts' names
    return _open_model(path.absolute(), st.st_size, st.st_mtime_ns, st.st_ino)


@lru_cache(maxsize=4)
def _open_model(path: Path, size: int, mtime_ns: int, inode: int) -> "GGUFModel":
    return GGUFModel(path)


class GGUFModel:
    """One GGUF model (a file, or all parts of a split one): config, tensor infos under HF names, tokenizer.

    `file`: the parts already parsed, from their headers alone (a file not downloaded yet, engine/hub)."""

    def __init__(self, path: str | Path, file: GGUFCheckpoint | None = None):
        self.path = find_gguf(path) if file is None else Path(path)
        self.name = self.path.name
        # what the parts were before they were mapped (a missing one is left to open_gguf to name)
        self.watch = FileWatch([p for p in part_paths(self.path) if p.is_file()] if file is None else [])
        self.file: GGUFCheckpoint = file or open_gguf(self.path)
        for part in self.file.parts if file is None else ():  # only a mapped file can change under us
            self.watch.mapped(part.path, part.mapping)
        self.metadata = self.file.metadata
        self.architecture = self.metadata.get("general.architecture")
        self.config = config_from_gguf(self.file, self.name)
        # tensors the engine has no name for (rope_freqs.weight, ...) keep theirs: the layout lists them as unused
        self.specs: dict[str, GGUFTensor] = {hf_name(n, self.architecture) or n: _as_hf(t)
                                             for n, t in self.file.tensors.items()}
        self.files = [part.path for part in self.file.parts]
        self._check_complete()

    @property
    def qk_order(self) -> torch.Tensor | None:
        """The per-head gather that undoes the converter's Q/K permutation (None: the file is not permuted)."""
        return qk_order(self.config.head_dim) if self.architecture in PERMUTED_QK else None

    def matrices(self, layers: tuple[dict[str, str], ...], embed: str, lm_head: str,
                 experts: tuple[dict[str, str], ...] = ()) -> Matrices:
        """The Matrices of the layout's tensor names (ModelLayout.layers, .embed, .lm_head, .experts); an expert's
        product is one [out, in] slice of its 3-D tensor."""
        def shape(name: str) -> MatrixShape:
            t = self.specs[name]
            return MatrixShape(t.type_name, *t.shape[-2:])
        in_layers = {(shape(names[short]), f"{short}_bias" in names) for names in layers
                     for short in ("q", "k", "v", "o", "gate", "up", "down", "router") if short in names}
        in_layers |= {(shape(name), False) for names in experts for short, name in names.items()
                      if not short.endswith("_bias")}
        return Matrices(tuple(sorted(in_layers, key=repr)), shape(embed), shape(lm_head))

    def weights(self, dtype: torch.dtype, converts: bool) -> "GGUFWeights":
        """The tensors as the loader places them, for activations of `dtype` (engine/runtime/weights.py place)."""
        return GGUFWeights(self, dtype, converts)

    @cached_property
    def tokenizer(self) -> GGUFTokenizer:
        return cached_tokenizer(self.path, lambda: self.metadata, self.name)  # built once per file, kept on disk

    def _check_complete(self) -> None:
        needed = [EMBED, FINAL_NORM] + [n for i in range(self.config.num_layers)
                                         for n in (layer_tensor_names(self.config, i)
                                                   | expert_tensor_names(self.config, i, fused=True)).values()]
        missing = [gguf_name(n, self.architecture) for n in needed if n not in self.specs]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelFormatError(f"{self.name}: the {self.architecture} architecture needs tensor(s) "
                                   f"{', '.join(missing[:3])}{more}, which the file lacks; it is incomplete or corrupt")


class GGUFWeights:
    """What engine/runtime/weights.py place() reads: `tensor(name)` by HF name, mapped in place; matrices that compute in
    tiles as QuantizedWeight, the rest as torch views of the file (bf16 through its int16 view, never copied)."""

    def __init__(self, model: GGUFModel, dtype: torch.dtype, converts: bool):
        self.model, self.dtype, self.converts = model, dtype, converts

    def tensor(self, name: str) -> torch.Tensor | QuantizedWeight:
        spec = self.model.specs[name]
        raw = self.model.file.raw(spec.name)
        if len(spec.shape) == 2 and computes_in_tiles(spec.type_name, self.dtype, self.converts):
            return QuantizedWeight(raw, spec.type_name, spec.shape, self.dtype)
        if FORMATS[spec.type_name].dtype is None:
            raise ModelFormatError(f"{self.model.name}: tensor {spec.name!r} is {spec.type_name.upper()} but has "
                                   f"{len(spec.shape)} dimensions; Stowage computes on quantized matrices only")
        return _torch_view(raw, spec.type_name).reshape(spec.shape)  # [hidden] read as [1, hidden]: _as_hf

    def expert(self, name: str, index: int) -> torch.Tensor | QuantizedWeight:
        """Expert `index` of the 3-D expert tensor `name` ([num_experts, out, in]): its [out, in] slice of the map,
        as tensor() gives a matrix (no copy)."""
        spec = self.model.specs[name]
        raw = self.model.file.raw(spec.name)[index]
        if len(spec.shape) == 3 and computes_in_tiles(spec.type_name, self.dtype, self.converts):
            return QuantizedWeight(raw, spec.type_name, spec.shape[1:], self.dtype)
        return _torch_view(raw, spec.type_name)

    def check_unchanged(self) -> None:
        """Raise ModelFormatError if a part of the file changed on disk since it was mapped (before each step)."""
        self.model.watch.check()

    def close(self) -> None:
        pass  # the maps close with the GGUFFile objects, once nothing holds a view of them


def _as_hf(tensor: GGUFTensor) -> GGUFTensor:
    """The tensor in Hugging Face's shape: llama.cpp keeps Qwen2-MoE's shared expert gate as a vector [hidden],
    transformers as a [1, hidden] linear weight."""
    if tensor.name.endswith("ffn_gate_inp_shexp.weight") and len(tensor.shape) == 1:
        return dataclasses.replace(tensor, shape=(1, *tensor.shape))
    return tensor


def _torch_view(raw: np.ndarray, type_name: str) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only map; nothing writes to it
        t = torch.from_numpy(raw)
    # the plain ggml types are safetensors' dtype codes in lowercase; one table says how to reinterpret them
    return t.view(SAFETENSORS[type_name.upper()][2])


# -- config -----------------------------------------------------------------------------------------


def config_from_gguf(file: GGUFCheckpoint, name: str) -> ModelConfig:
    """The ModelConfig the metadata describes (llama.cpp's `{arch}.*` keys); typed errors say which key is wrong."""
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{name}: architecture {arch!r} (general.architecture) is not supported; "
                                    f"Stowage runs {', '.join(ARCHITECTURES)} GGUF files (Mistral's are 'llama')")
    key = _Keys(meta, arch, name)
    hidden = key.int("embedding_length")
    num_heads = key.int("attention.head_count")
    num_kv_heads = key.int("attention.head_count_kv", num_heads)
    if hidden % num_heads and "attention.key_length" not in key:
        raise ModelFormatError(f"{name}: {arch}.embedding_length {hidden} is not a multiple of "
                               f"{arch}.attention.head_count {num_heads}, and no key_length says the head size")
    head_dim = key.int("attention.key_length", hidden // num_heads)
    if key.int("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{name}: value heads of {key.int('attention.value_length')} differ from key "
                                    f"heads of {head_dim}; Stowage supports equal key and value head sizes")
    if key.int("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(f"{name}: rotary embeddings on {key.int('rope.dimension_count')} of {head_dim} "
                                    "head dimensions (partial rotary) are not supported")
    if num_heads % num_kv_heads:
        raise ModelFormatError(f"{name}: {arch}.attention.head_count {num_heads} is not a multiple of "
                               f"head_count_kv {num_kv_heads}")
    tensors = file.tensors
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = tensors.get("token_embd.weight")
    vocab = len(tokens) if isinstance(tokens, list) and tokens else (embed.shape[0] if embed else 0)
    if embed is not None and embed.shape[0] != vocab:
        raise ModelFormatError(f"{name}: token_embd.weight has {embed.shape[0]:,} rows for {vocab:,} tokens "
                               "(tokenizer.ggml.tokens); the file is corrupt")
    theta = key.float("rope.freq_base", 10000.0)
    raw = {
        "model_type": ARCHITECTURES[arch], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": key.int("feed_forward_length", key.meta.get(f"{arch}.expert_feed_forward_length")),
        "num_hidden_layers": key.int("block_count"),
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "rms_norm_eps": key.float("attention.layer_norm_rms_epsilon", 1e-5), "rope_theta": theta,
        "rope_scaling": _rope_scaling(key, file, theta, head_dim, name),
        "max_position_embeddings": key.int("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch in ("llama", "gpt-oss") and "blk.0.attn_q.bias" in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors,  # Qwen2-MoE's (the others' follow from the model type)
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        # end of generation: the eos token, and the end-of-turn / end-of-message tokens chat models stop at
        "eos_token_id": [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                            "tokenizer.ggml.eom_token_id") if type(meta.get(k)) is int],
    }
    if arch in ("qwen3moe", "qwen2moe", "gpt-oss") or key.is_set("expert_count"):  # dense llama files: 0 experts
        raw |= _moe_keys(key)
    if arch == "gpt-oss":
        raw |= _gpt_oss_keys(key, raw)
        # a reply ends at <|return|> and a tool call at <|call|>: llama.cpp adds both by their text, for files whose
        # metadata names only one of them (eos: <|return|>) and no eot/eom
        ends = [tokens.index(t) for t in ("<|return|>", "<|call|>") if isinstance(tokens, list) and t in tokens]
        raw["eos_token_id"] = list(dict.fromkeys([*raw["eos_token_id"], *ends]))
    if arch not in GEMMA:
        return ModelConfig.from_dict(raw)
    config = ModelConfig.from_dict(raw | _gemma_keys(key, raw, tokens if isinstance(tokens, list) else []))
    # llama.cpp's converter adds the 1 of Gemma's (1 + weight) norms to every stored norm weight
    # (Gemma2Model/Gemma3Model.modify_tensors): the file holds the scale itself, so the norms multiply by it as is
    return dataclasses.replace(config, norm_plus_one=False)


def _moe_keys(key: "_Keys") -> dict:
    """A file of experts as config.json says it (docs/moe.md): a llama one is Mixtral's. llama.cpp renormalizes the
    top-k weights of Mixtral and Qwen3-MoE, not Qwen2-MoE's (build_moe_ffn's norm_w), unless the file says
    otherwise (expert_weights_norm)."""
    renorm = key.arch not in ("qwen2moe", "gpt-oss")  # gpt-oss: a softmax over the top-k, renormalized already
    norm = key.meta.get(f"{key.arch}.expert_weights_norm", renorm)
    out = {"num_experts": key.int("expert_count"), "num_experts_per_tok": key.int("expert_used_count"),
           "norm_topk_prob": norm if isinstance(norm, bool) else renorm}
    if key.arch == "llama":  # Mixtral: the experts are feed_forward_length wide
        return out | {"model_type": "mixtral"}
    if key.arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = key.int("expert_shared_feed_forward_length")
    # every layer routes (llama.cpp's qwen3moe and qwen2moe have no dense layers)
    return out | {"moe_intermediate_size": key.int("expert_feed_forward_length")}


def _gpt_oss_keys(key: "_Keys", raw: dict) -> dict:
    """What a gpt-oss file says as config.json does: the experts feed_forward_length wide, the sliding window on the
    even layers (llama.cpp's set_swa_pattern(2), as GptOssConfig's layer_types), YaRN (_rope_scaling). llama.cpp
    hard-codes the clamped SwiGLU's alpha 1.702 and limit 7.0, transformers' defaults."""
    layers = raw["num_hidden_layers"]
    out = {"intermediate_size": key.int("expert_feed_forward_length", raw["intermediate_size"]),
           "sliding_window": key.int("attention.sliding_window"),
           "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    if raw["rope_scaling"] is None:  # the file says no YaRN: plain rope, not GptOssConfig's default
        out["rope_parameters"] = {"rope_type": "default"}
    return out


# llama.cpp hard-codes what Gemma files do not say (src/llama-model.cpp, LLM_ARCH_GEMMA2 / LLM_ARCH_GEMMA3):
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # set_swa_pattern(n): layer i slides unless i % n == n - 1
LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding layers (rope_freq_base_train_swa), unscaled
LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # the 27B models, whose scores scale by (hidden / heads) ** -0.5
GEMMA2_SOFTCAPS = (50.0, 30.0)  # attention, final logits: llama_hparams' defaults, which Gemma 2 files override
END_OF_TURN = "<end_of_turn>"  # llama.cpp ends generation at this token by its text (llama-vocab.cpp, EOT)


def swa_layers(arch: str, num_layers: int) -> list[bool]:
    """Which layers attend within the sliding window, as llama_hparams::set_swa_pattern marks them."""
    n = SWA_PATTERN[arch]
    return [i % n < n - 1 for i in range(num_layers)]


def _gemma_keys(key: "_Keys", raw: dict, tokens: list) -> dict:
    """What a Gemma file adds to the HF-style dict, read as llama.cpp reads it; ModelConfig.from_dict does the rest
    (GELU-tanh, embeddings times sqrt(hidden), the sandwich norms, Q/K norms for Gemma 3)."""
    arch, layers = key.arch, raw["num_hidden_layers"]
    # query_pre_attn_scalar is not in the file: llama.cpp takes hidden / heads for the 27B models (by their layer
    # count), the head size for every other one, as gemma_pytorch's configs do
    big = layers == LAYERS_27B[arch]
    scalar = raw["hidden_size"] // raw["num_attention_heads"] if big else raw["head_dim"]
    out = {"query_pre_attn_scalar": float(scalar)}
    if arch == "gemma2":
        attn, final = GEMMA2_SOFTCAPS
        window = key.int("attention.sliding_window", 4096)
        out |= {"attn_logit_softcapping": key.float("attn_logit_softcapping", attn),
                "final_logit_softcapping": key.float("final_logit_softcapping", final)}
    else:  # absent or 0 switches the window (all layers global) or the final soft-cap off, as in llama.cpp
        window = key.int("attention.sliding_window") if key.is_set("attention.sliding_window") else None
        out |= {"final_logit_softcapping": key.float("final_logit_softcapping")
                if key.is_set("final_logit_softcapping") else None,
                "rope_local_base_freq": LOCAL_ROPE_BASE}  # rope_scaling: the global layers' only, as in config.py
    sliding = swa_layers(arch, layers) if window is not None else [False] * layers  # a Gemma 3 without: all global
    out |= {"sliding_window": window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    if END_OF_TURN in tokens:
        out["eos_token_id"] = raw["eos_token_id"] + [tokens.index(END_OF_TURN)]
    return out


class _Keys:
    """Typed reads of `{arch}.` metadata keys; a missing or mistyped one is a ModelFormatError naming it."""

    _MISSING = object()

    def __init__(self, meta: dict, arch: str, name: str):
        self.meta, self.arch, self.name = meta, arch, name

    def __contains__(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.meta

    def is_set(self, key: str) -> bool:
        """Present and not zero (llama.cpp's "off" for an optional number)."""
        return self.meta.get(f"{self.arch}.{key}", 0) != 0

    def int(self, key: str, default=_MISSING) -> int:
        value = self._get(key, default)
        if isinstance(value, list):  # a per-layer array (head_count_kv in some files): one value for every layer
            if not value or len(set(value)) != 1:
                raise UnsupportedModelError(f"{self.name}: {self.arch}.{key} differs between layers ({value[:8]}...); "
                                            "Stowage supports one value for every layer")
            value = value[0]
        if type(value) is not int or value <= 0:
            raise ModelFormatError(f"{self.name}: {self.arch}.{key} is {value!r}; it must be a positive integer")
        return value

    def float(self, key: str, default=_MISSING) -> float:
        value = self._get(key, default)
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise ModelFormatError(f"{self.name}: {self.arch}.{key} is {value!r}; it must be a positive number")
        single = np.float32(value)
        # GGUF stores these as float32: 1e-6 reads back as 9.99999997e-07; the shortest decimal is what was meant
        return float(str(single)) if float(single) == value else float(value)

    def str(self, key: str, default: str) -> str:
        value = self._get(key, default)
        return value if isinstance(value, str) else default

    def _get(self, key: str, default):
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is self._MISSING:
            raise ModelFormatError(f"{self.name}: the metadata has no {self.arch}.{key}; the file is incomplete "
                                   "or was written by a converter Stowage does not know")
        return value


def _rope_scaling(key: _Keys, file: GGUFCheckpoint, theta: float, head_dim: int, name: str) -> dict | None:
    """HF's rope_scaling for the file: none, Llama 3's (recovered from rope_freqs.weight), or linear for Gemma (Gemma
    3's global layers: positions divided by the factor); others are refused."""
    kind = key.str("rope.scaling.type", "none")
    if kind == "yarn" and key.arch == "gpt-oss":
        return _yarn_scaling(key)
    factor = key.float("rope.scaling.factor", 1.0) if kind == "linear" else 1.0
    if kind == "linear" and factor != 1.0 and key.arch in GEMMA:
        return {"rope_type": "linear", "factor": factor}
    if kind not in ("none", "linear") or factor != 1.0:
        raise UnsupportedModelError(f"{name}: rope scaling {kind!r} is not supported (Stowage supports none, "
                                    "Llama 3's frequency factors, and linear for Gemma)")
    if ROPE_FREQS not in file.tensors:
        return None
    tensor = file.tensors[ROPE_FREQS]
    if tensor.type_name != "f32" or tensor.shape != (head_dim // 2,):
        raise ModelFormatError(f"{name}: {ROPE_FREQS} is {tensor.type_name} {list(tensor.shape)}; "
                               f"expected f32 [{head_dim // 2}]")
    factors = np.asarray(file.raw(ROPE_FREQS), dtype=np.float64)
    return _llama3_from_factors(factors, theta, head_dim, name)


def _yarn_scaling(key: _Keys) -> dict:
    """gpt-oss's YaRN from the file. llama.cpp rounds the band's edges to whole dimensions (ggml_rope_yarn_corr_dims);
    gpt-oss was trained without (its config.json: truncate false), and that is what transformers and Stowage compute."""
    out = {"rope_type": "yarn", "factor": key.float("rope.scaling.factor"),
           "original_max_position_embeddings": key.int("rope.scaling.original_context_length"), "truncate": False}
    for name in ("beta_fast", "beta_slow"):
        if key.is_set(f"rope.scaling.yarn_{name}"):
            out[name] = key.float(f"rope.scaling.yarn_{name}")
    return out


def _llama3_from_factors(factors: np.ndarray, theta: float, head_dim: int, name: str) -> dict | None:
    """Llama 3's (factor, low/high_freq_factor, original context) that give these frequency divisors.

    A divisor is 1 at short wavelengths, `factor` at long ones, and 1 / ((1 - s) / factor + s) between, with s
    linear in the frequency: s = a * f + b, where a = L / (2 pi (hf - lf)) and b = -lf / (hf - lf). Only a and b
    matter, so L is fixed at 8192 (Llama 3's) and lf, hf follow from them. Two points in the band fix the line;
    with fewer, any line through them steep enough to keep the other frequencies out of the band gives the same
    table. The result is checked to reproduce every factor."""
    if np.allclose(factors, 1.0):
        return None
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    short, long = factors <= 1 + 1e-6, factors >= factor * (1 - 1e-6)
    between = ~short & ~long
    s = (1 / factors - 1 / factor) / (1 - 1 / factor)
    if between.sum() >= 2:
        a, b = np.polyfit(freqs[between], s[between], 1)
    else:
        f, s0 = (freqs[between][0], s[between][0]) if between.any() else (
            (freqs[long].max() + freqs[short].min()) / 2 if long.any() and short.any() else freqs.mean(), 0.5)
        steep = [1 / f]
        if short.any():
            steep.append((1 - s0) / (freqs[short].min() - f))
        if long.any():
            steep.append(s0 / (f - freqs[long].max()))
        a = 2 * max(steep)
        b = s0 - a * f
    context = 8192
    span = context / (2 * math.pi * a) if a > 0 else 0.0  # hf - lf
    low, high = -b * span, -b * span + span
    if span > 0 and low > 0:
        rope = RopeConfig(theta=theta, kind="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                          original_max_position=context)
        ours = inverse_frequencies(rope, head_dim).double().numpy()
        if np.allclose(ours, freqs / factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                    "high_freq_factor": float(high), "original_max_position_embeddings": context}
    raise UnsupportedModelError(f"{name}: {ROPE_FREQS} holds frequency factors that do not follow Llama 3's "
                                "rope scaling; Stowage cannot reproduce them")
