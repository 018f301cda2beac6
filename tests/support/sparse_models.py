"""Real-shape model folders whose weight files are a safetensors header and a hole (os.truncate).

A 16 GB Llama-3.1-8B costs a few kilobytes of disk; inspect() and the planner see exactly the
tensors a real download has.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

LLAMA_3_1_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA_3_1_70B = {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64}
QWEN2_5_7B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
QWEN3_0_6B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def tensor_shapes(config: dict, *, store_tied_head: bool = False) -> dict[str, list[int]]:
    """Every tensor name and shape a Hugging Face checkpoint of this config holds."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], h]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [heads * d, h], p + "self_attn.k_proj.weight": [kv_heads * d, h],
            p + "self_attn.v_proj.weight": [kv_heads * d, h], p + "self_attn.o_proj.weight": [h, heads * d],
            p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter],
        }
        if config["model_type"] == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": [heads * d], p + "self_attn.k_proj.bias": [kv_heads * d],
                       p + "self_attn.v_proj.bias": [kv_heads * d]}
        if config["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": [d], p + "self_attn.k_norm.weight": [d]}
    shapes["model.norm.weight"] = [h]
    if not config["tie_word_embeddings"] or store_tied_head:
        shapes["lm_head.weight"] = [config["vocab_size"], h]
    return shapes


def write_sparse_model(model_dir: Path, config: dict, *, dtype: str = "BF16", num_shards: int = 1,
                       store_tied_head: bool = False) -> Path:
    """config.json plus safetensors shards whose data regions are holes; returns model_dir."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    names = list(tensor_shapes(config, store_tied_head=store_tied_head).items())
    per_shard = math.ceil(len(names) / num_shards)
    weight_map = {}
    for s in range(num_shards):
        file_name = "model.safetensors" if num_shards == 1 else f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        header, offset = {}, 0
        for name, shape in names[s * per_shard:(s + 1) * per_shard]:
            nbytes = math.prod(shape) * ITEMSIZE[dtype]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file_name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = model_dir / file_name
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
        os.truncate(path, 8 + len(raw) + offset)  # the data region is a hole: no disk, no data to read
    if num_shards > 1:
        (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model_dir
