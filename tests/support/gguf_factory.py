"""GGUF files from the tiny Hugging Face models of factory.py, written the way llama.cpp's convert_hf_to_gguf.py does.

Names, metadata keys, the Q/K row permutation of llama files, Llama 3's `rope_freqs.weight` and the
tokenizer metadata follow the converter; only what the tiny models use is written. Kept apart from the
engine's own mapping (engine/formats/gguf_model.py) so the tests check one against the other.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as GGML

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3_text": "gemma3"}
GEMMA = ("gemma2", "gemma3")
NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@lru_cache(maxsize=8)
def _tensor_name_map(arch: str, num_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)


def gguf_name(name: str, arch: str = "llama", num_layers: int = 64) -> str:
    if arch in GEMMA:  # the names gguf-py's tensor map gives (Gemma's four norms differ from Llama's two)
        mapped = _tensor_name_map(arch, num_layers).get_name(name, (".weight",))
        assert mapped is not None, name
        return mapped
    if name in NAMES:
        return NAMES[name]
    _, _, index, rest = name.split(".", 3)
    stem, suffix = rest.rsplit(".", 1)
    return f"blk.{index}.{LAYER[stem]}.{suffix}"


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute: HF's rotary halves -> llama.cpp's interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _rope(config: dict) -> tuple[float, dict | None]:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (params if params.get("rope_type") == "llama3" else None)
    return float(config.get("rope_theta", params.get("rope_theta", 10000.0))), scaling


def rope_factors(config: dict, head_dim: int) -> torch.Tensor:
    """LlamaModel.generate_extra_tensors: the frequency divisors Llama 3's rope scaling amounts to."""
    base, s = _rope(config)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def quantized(qtype: str, name: str, t: torch.Tensor) -> bool:
    """Which tensors a quantized file stores in blocks: matrices whose rows are whole blocks (norms stay f32)."""
    return qtype != "f32" and t.dim() == 2 and t.shape[-1] % gguf.GGML_QUANT_SIZES[GGML[qtype.upper()]][0] == 0


def roundtrip(t: torch.Tensor, qtype: str) -> torch.Tensor:
    """The weights a `qtype` file holds for `t`: quantized and dequantized again (gguf-py's numpy code)."""
    raw = gguf.quants.quantize(t.float().numpy(), GGML[qtype.upper()])
    return torch.from_numpy(gguf.quants.dequantize(raw, GGML[qtype.upper()]).copy()).reshape(t.shape)


def dequantized_copy(model_dir: Path, out_dir: Path, qtype: str, stored=quantized) -> Path:
    """The HF model with the weights a `qtype` GGUF of it holds (the reference transformers runs); `stored(qtype,
    name, tensor)`: whether the file keeps that tensor in `qtype` (moe_factory.gguf_stored for models of experts)."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out_dir)
    tensors = {n: roundtrip(t, qtype) if stored(qtype, n, t) else t for n, t in hf_tensors(model_dir).items()}
    save_file(tensors, out_dir / "model.safetensors")
    return out_dir


def add_shape_keys(w: gguf.GGUFWriter, config: dict) -> None:
    """The `{arch}.` keys every converter writes from a config.json dict: sizes, heads, head size, norm epsilon, rope
    base (transformers 5's `rope_parameters` or a top-level `rope_theta`)."""
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])


def write_gguf(model_dir: Path, path: Path, qtype: str = "f32", *, drop: tuple[str, ...] = (),
               arch: str | None = None, override: dict | None = None, split_max_tensors: int = 0,
               sentencepiece: tuple[list[str], list[float], list[int]] | None = None) -> Path:
    """`model_dir` (factory.make_model) as a GGUF file: matrices in `qtype` ("f32", "f16", "q8_0", "q4_0", ...).

    `drop`: GGUF names left out; `override`: GGUF name -> (array, ggml type or None) written instead (or added);
    `split_max_tensors`: parts of at most that many tensors, named as gguf-split does (the first part is returned);
    `sentencepiece`: a Gemma vocabulary (gemma_vocab) written as the converter writes one, instead of the folder's
    byte-level BPE tokenizer (which is what it writes for a Gemma 3 without tokenizer.model)."""
    override = dict(override or {})
    config = _config(model_dir)
    arch = arch or ARCH[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    theta, scaling = _rope(config) if arch not in GEMMA else (None, None)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch in GEMMA:
        add_gemma_parameters(w, config, arch)
    else:
        w.add_rope_freq_base(theta)
        w.add_rope_dimension_count(head_dim)
    w.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}.get(qtype, 0))
    if sentencepiece is not None:
        add_gemma_sentencepiece(w, sentencepiece)
    else:
        add_tokenizer(w, model_dir, config)
    tensors = hf_tensors(model_dir)
    if config.get("tie_word_embeddings") or arch == "gemma2":  # Gemma2Model skips lm_head.weight: always tied
        tensors.pop("lm_head.weight", None)
    for name, t in tensors.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")) and arch == "llama":
            t = permute(t, heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")) and arch == "llama":
            t = permute(t, kv_heads)
        elif name.endswith("norm.weight") and arch in GEMMA:
            t = t.float() + 1  # Gemma2Model/Gemma3Model.modify_tensors: the 1 of (1 + weight), added in float32
        target = gguf_name(name, arch, config["num_hidden_layers"])
        if target in drop:
            continue
        if target in override:
            array, raw_dtype = override.pop(target)
            w.add_tensor(target, array, raw_dtype=raw_dtype)
            continue
        if quantized(qtype, name, t):
            if qtype == "f16":
                w.add_tensor(target, t.half().numpy())
            else:
                w.add_tensor(target, gguf.quants.quantize(t.float().numpy(), GGML[qtype.upper()]),
                             raw_dtype=GGML[qtype.upper()])
        else:
            w.add_tensor(target, t.float().numpy())
    if scaling and scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", rope_factors(config, head_dim).numpy())
    for target, (array, raw_dtype) in override.items():
        w.add_tensor(target, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.with_name(f"{path.stem}-00001-of-{len(w.tensors):05d}.gguf") if len(w.tensors) > 1 else path


def add_gemma_parameters(w: gguf.GGUFWriter, config: dict, arch: str) -> None:
    """What Gemma2Model / Gemma3Model.set_gguf_parameters add: soft-caps, the window, Gemma 3's global rope.

    Gemma 2 writes no rope base (llama.cpp's default 10000 is Gemma 2's) and both soft-caps; Gemma 3 the global
    layers' base and linear scaling (from rope_parameters["full_attention"]), a final soft-cap only when set, and
    the window unless sliding_window_pattern is 1. Neither writes query_pre_attn_scalar nor the layer pattern."""
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(config["sliding_window"])
        return
    params = config.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    w.add_rope_freq_base(full.get("rope_theta", config.get("rope_theta", 1_000_000.0)))
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    assert config.get("attn_logit_softcapping") is None  # the converter refuses one
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("sliding_window_pattern") != 1:
        w.add_sliding_window(config["sliding_window"])


def add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    """The byte-level BPE tokenizer of factory.py's models, as convert_hf_to_gguf.py writes a gpt2 vocabulary."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    # the converter pads the list to the embedding's rows with unused [PADn] tokens
    pad = range(len(tokens), config["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens + [f"[PAD{i}]" for i in pad])
    w.add_token_types(types + [gguf.TokenType.UNUSED for _ in pad])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    if config["eos_token_id"] is not None:  # a model that never stops on its own has none
        w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(True)  # factory.py's post-processor adds <s>
    template = model_dir / "chat_template.jinja"
    if template.exists():
        w.add_chat_template(template.read_text())


def random_q8_0(shape: tuple[int, int], rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Random Q8_0 blocks (uint8 [rows, row_bytes]) with one small scale: a large file without quantizing."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // 32, 34), dtype=np.uint8)
    blocks[:, :2] = np.full((1, 1), scale / 127, np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // 32 * 34)


def write_random_q8_0(path: Path, tokenizer_dir: Path, *, layers: int, hidden: int, inter: int, heads: int,
                      kv_heads: int, vocab: int) -> int:
    """A tied llama-architecture Q8_0 file of random blocks (norms f32) and factory.py's tokenizer padded to
    `vocab`; returns the bytes of the tensors the engine loads."""
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    add_tokenizer(w, tokenizer_dir, {"vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 1})
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden),
              "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    total = 0
    tensors = {"token_embd.weight": random_q8_0((vocab, hidden), rng), "output_norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        tensors |= {f"blk.{i}.{n}.weight": random_q8_0(s, rng) for n, s in shapes.items()}
        tensors |= {f"blk.{i}.attn_norm.weight": np.ones(hidden, np.float32),
                    f"blk.{i}.ffn_norm.weight": np.ones(hidden, np.float32)}
    for name, array in tensors.items():
        w.add_tensor(name, array, raw_dtype=GGML.Q8_0 if array.dtype == np.uint8 else None)
        total += array.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def add_byte_level_tokenizer(w: gguf.GGUFWriter, vocab: int, pre: str, specials: tuple[str, ...] = ()) -> None:
    """A `vocab`-token byte-level BPE vocabulary (byte_level_vocab) as a gpt2 tokenizer, bos 0 and eos 1; `specials`:
    control tokens appended (the vocabulary grows by as many)."""
    tokens, merges = byte_level_vocab(vocab - len(specials))
    tokens += list(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (vocab - len(specials)) + [gguf.TokenType.CONTROL] * len(specials))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """`size` byte-level BPE tokens (the 256 bytes, then merges of earlier tokens) and their merges."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    seen, merges = set(tokens), []
    i = 0
    while len(tokens) < size:
        left, right = tokens[i % 256], tokens[(i * 7 + 3) % len(tokens)]
        i += 1
        if left + right in seen:
            continue
        seen.add(left + right)
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    return tokens, merges


def write_sparse_gguf(path: Path, config: dict, types: dict[str, str], default: str = "q4_k") -> int:
    """A real-shape llama-architecture GGUF whose tensor data is a hole (os.truncate): headers, metadata and a
    `vocab_size`-token tokenizer as a download has them, a few MiB of disk. `types`: ggml type
    by role (the name without "blk.N.": "output.weight", "ffn_down.weight"); matrices default to `default`, norms
    are f32. Returns the tensors' bytes."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    add_byte_level_tokenizer(w, vocab, "llama-bpe")
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
                   f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                   f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
                   f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, inter)}
    return _write_sparse(w, path, shapes, types, default)


def _write_sparse(w: gguf.GGUFWriter, path: Path, shapes: dict[str, tuple[int, ...]], types: dict[str, str],
                  default: str) -> int:
    """The tensor infos of `shapes` (vectors f32, matrices by role in `types`, else `default`), data a hole."""
    total = padded = 0
    for name, shape in shapes.items():
        role = name.split(".", 2)[2] if name.startswith("blk.") else name
        qtype = "f32" if len(shape) == 1 else types.get(role, default)
        ggml = GGML[qtype.upper()]
        block, block_bytes = gguf.GGML_QUANT_SIZES[ggml]
        nbytes = math.prod(shape) // block * block_bytes
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=ggml)
        total += nbytes
        padded += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    start = fout.tell()
    w.close()
    os.truncate(path, start + padded)
    return total


def write_sparse_gemma3_gguf(path: Path, config: dict, qtype: str = "q8_0") -> int:
    """A real-shape `gemma3` GGUF (a Hugging Face Gemma3TextConfig dict) whose tensor data is a hole, with the keys
    Gemma3Model writes and a `vocab_size`-token SentencePiece list of placeholder pieces; returns the tensors' bytes."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab, d = (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"],
                                 config["head_dim"])
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_sliding_window(config["sliding_window"])
    tokens = GEMMA_SPECIAL + [f"<unused{i}>" for i in range(vocab - len(GEMMA_SPECIAL))]
    add_gemma_sentencepiece(w, (tokens, [0.0] * vocab, [gguf.TokenType.CONTROL] * len(GEMMA_SPECIAL)
                                + [gguf.TokenType.NORMAL] * (vocab - len(GEMMA_SPECIAL))))
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.{n}.weight": (hidden,) for n in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                              "post_ffw_norm")}
        shapes |= {f"blk.{i}.attn_q_norm.weight": (d,), f"blk.{i}.attn_k_norm.weight": (d,),
                   f"blk.{i}.attn_q.weight": (heads * d, hidden), f"blk.{i}.attn_k.weight": (kv_heads * d, hidden),
                   f"blk.{i}.attn_v.weight": (kv_heads * d, hidden), f"blk.{i}.attn_output.weight": (hidden, heads * d),
                   f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, inter)}
    return _write_sparse(w, path, shapes, {}, qtype)


# Byte offsets of the float16 scales (d, dmin) in each block of the K-quants, and a magnitude for them that keeps
# the weights below ~0.5 (q6_k: d * 127 * 32; q4_k/q5_k: d * 63 * 31 + dmin * 63).
K_SCALES = {"q4_k": ([0, 2], 2e-4), "q5_k": ([0, 2], 2e-4), "q6_k": ([208], 1e-4)}


def random_k_blocks(qtype: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random `qtype` blocks for a [rows, cols] matrix (gguf-py cannot quantize to K-quants), small finite scales."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[GGML[qtype.upper()]]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block, block_bytes), dtype=np.uint8)
    fields, scale = K_SCALES[qtype]
    for start in fields:
        blocks[:, start : start + 2] = rng.uniform(0, scale, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of permute: llama.cpp's stored rows back in Hugging Face order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_k_quant_gguf(model_dir: Path, path: Path, hf_out: Path, types: dict[str, str], *,
                       default: str = "q4_k") -> tuple[Path, Path]:
    """A K-quant GGUF of `model_dir`'s shape with random blocks (roles as in write_sparse_gguf: "attn_v.weight",
    "output.weight"; "f16" allowed), and beside it the HF model holding exactly the weights the file does."""
    from safetensors.torch import save_file

    config = _config(model_dir)
    arch = ARCH[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rng = np.random.default_rng(0)
    override, hf = {}, {}
    for name, t in hf_tensors(model_dir).items():
        target = gguf_name(name)
        role = target.split(".", 2)[2] if target.startswith("blk.") else target
        qtype = types.get(role, default)
        if t.dim() != 2 or name == "lm_head.weight" and config.get("tie_word_embeddings"):
            hf[name] = t
            continue
        if qtype == "f16":
            raw, ggml = (torch.from_numpy(rng.standard_normal(tuple(t.shape))) * 0.05).half().numpy(), None
            stored = torch.from_numpy(raw).float()
        else:
            raw, ggml = random_k_blocks(qtype, tuple(t.shape), rng), GGML[qtype.upper()]
            stored = torch.from_numpy(gguf.quants.dequantize(raw, ggml).copy()).reshape(t.shape)
        override[target] = (raw, ggml)
        if arch == "llama" and name.endswith("q_proj.weight"):
            stored = unpermute(stored, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            stored = unpermute(stored, kv_heads)
        hf[name] = stored
    shutil.copytree(model_dir, hf_out)
    save_file({n: t.contiguous() for n, t in hf.items()}, hf_out / "model.safetensors")
    return write_gguf(model_dir, path, "f32", override=override), hf_out


# Gemma's SentencePiece layout: its special tokens first (ids as in Gemma 2/3: <pad> 0, <eos> 1, <bos> 2, <unk> 3)
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def gemma_vocab(size: int, corpus: list[str]) -> tuple[list[str], list[float], list[int]]:
    """A Gemma-style SentencePiece BPE vocabulary of `size` tokens trained on `corpus`: (tokens, scores, types) as
    convert_hf_to_gguf.py's _create_vocab_sentencepiece writes them (specials, the 256 byte tokens, then pieces by
    score: merges best first, single characters last)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    trainer_tok = Tokenizer(BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    fixed = len(GEMMA_SPECIAL) + 256
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=size - fixed, show_progress=False))
    spec = json.loads(trainer_tok.to_str())
    merged = ["".join(m if isinstance(m, list) else m.split(" ")) for m in spec["model"]["merges"]]
    chars = sorted(set(spec["model"]["vocab"]) - set(merged))
    pieces = (merged + chars)[: size - fixed]
    pad = [f"[PAD{i}]" for i in range(1, size - fixed - len(pieces) + 1)]  # the converter pads to vocab_size
    tokens = GEMMA_SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + pieces + pad
    scores = [0.0] * fixed + [-float(i) for i in range(len(pieces))] + [-1000.0] * len(pad)
    T = gguf.TokenType
    types = [T.UNKNOWN if t == "<unk>" else T.CONTROL for t in GEMMA_SPECIAL] + [T.BYTE] * 256 + \
        [T.NORMAL] * len(pieces) + [T.UNUSED] * len(pad)
    return tokens, scores, types


def add_gemma_sentencepiece(w: gguf.GGUFWriter, vocab: tuple[list[str], list[float], list[int]]) -> None:
    """Gemma2Model.set_vocab: _set_vocab_sentencepiece (model "llama", Gemma's ids and add_bos_token from its
    tokenizer_config.json) and add_add_space_prefix(False)."""
    tokens, scores, types = vocab
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<bos>"))
    w.add_eos_token_id(tokens.index("<eos>"))
    w.add_unk_token_id(tokens.index("<unk>"))
    w.add_pad_token_id(tokens.index("<pad>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
