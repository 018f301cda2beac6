"""Tiny random mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss), written by transformers as Hugging
Face would."""

from __future__ import annotations

from pathlib import Path

import torch

from factory import _tokenizer_object, save_tokenizer

ARCHS = {"qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig", "mixtral": "MixtralConfig",
         "gpt_oss": "GptOssConfig"}


def make_moe_model(model_dir: Path, arch: str = "qwen3_moe", *, dtype=torch.float32, seed: int = 0,
                   **overrides) -> Path:
    """Save a tiny random `arch` model of 8 experts, 2 active (and factory.py's tokenizer); return model_dir.

    The router is scaled up so its choices are far apart: a rounding difference then never flips an expert."""
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        eos_token_id=_tokenizer_object().token_to_id("<|end|>"), bos_token_id=_tokenizer_object().token_to_id("<s>"),
    )
    if arch in ("mixtral", "gpt_oss"):  # the experts are intermediate_size wide
        kwargs["intermediate_size"] = kwargs.pop("moe_intermediate_size")
    if arch == "gpt_oss":  # alternating layers with a window shorter than the prompts; YaRN as released
        kwargs |= {"num_hidden_layers": 4, "sliding_window": 8}
    if arch == "qwen2_moe":  # Qwen2MoeConfig reads num_experts (and a shared expert beside them)
        kwargs |= {"num_experts": kwargs.pop("num_local_experts"), "shared_expert_intermediate_size": 64}
    kwargs.update(overrides)
    config = getattr(transformers, ARCHS[arch])(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(model_dir)
    save_tokenizer(model_dir)
    return model_dir


# -- gpt-oss with MXFP4 experts, as OpenAI publishes it ---------------------------------------------------------------

def ggml_to_split(raw: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:
    """ggml MXFP4 bytes [..., blocks * 17] as the Hugging Face checkpoints' codes [..., blocks, 16] (weights 2j and
    2j + 1 in byte j) and scales [..., blocks]: the same numbers, the other layout."""
    import numpy as np

    blocks = raw.reshape(*raw.shape[:-1], -1, 17)
    nibbles = np.concatenate([blocks[..., 1:] & 0xF, blocks[..., 1:] >> 4], axis=-1)  # weights 0..31 of a block
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8), blocks[..., 0].copy()


def make_gpt_oss_mxfp4(model_dir: Path, out_dir: Path, reference_dir: Path) -> tuple[Path, Path]:
    """`model_dir` (a gpt-oss of make_moe_model) with its experts as MXFP4 `*_blocks`/`*_scales` [E, out, in / 32, 16]
    (transformers' integrations/mxfp4.py layout) in `out_dir`, and in `reference_dir` the float32 model holding the
    weights those blocks decode to (gguf-py's MXFP4 quantizer and dequantizer, not ours): (out_dir, reference_dir)."""
    import json
    import shutil

    import gguf
    from gguf import GGMLQuantizationType as GGML
    from gguf_factory import hf_tensors
    from safetensors.torch import save_file

    tensors = hf_tensors(model_dir)
    packed, decoded = {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = decoded[name] = t
            continue
        rows = t.transpose(1, 2).contiguous()  # [E, in, out] -> [E, out, in]
        raw = gguf.quants.quantize(rows.numpy(), GGML.MXFP4)
        codes, scales = ggml_to_split(raw)
        packed[name + "_blocks"], packed[name + "_scales"] = torch.from_numpy(codes), torch.from_numpy(scales)
        values = torch.from_numpy(gguf.quants.dequantize(raw, GGML.MXFP4).copy()).reshape(rows.shape)
        decoded[name] = values.transpose(1, 2).contiguous()
    for target, out in ((out_dir, packed), (reference_dir, decoded)):
        shutil.copytree(model_dir, target)
        save_file(out, target / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir, reference_dir


# -- GGUF, as llama.cpp's convert_hf_to_gguf.py writes these models ------------------------------------------------

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}  # Mixtral: llama with experts
EXPERT = {"qwen3_moe": {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
          "qwen2_moe": {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
          "mixtral": {"w1": "gate", "w3": "up", "w2": "down"}}
SHARED = {"shared_expert.gate_proj": "ffn_gate_shexp", "shared_expert.up_proj": "ffn_up_shexp",
          "shared_expert.down_proj": "ffn_down_shexp"}  # Qwen2-MoE's shared expert


def _router(name: str) -> bool:
    """The routers, and Qwen2-MoE's shared expert gate: kept in f32 (llama.cpp's converter and quantizer)."""
    return name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.shared_expert_gate.weight"))


def gguf_stored(qtype: str, name: str, t: torch.Tensor) -> bool:
    """Whether a `qtype` file keeps `t` in that type: the matrices, but for the router, which llama.cpp keeps in f32."""
    from gguf_factory import quantized

    return not _router(name) and quantized(qtype, name, t)


def write_moe_gguf(model_dir: Path, path: Path, qtype: str = "f32", *, drop: tuple[str, ...] = (),
                   override: dict | None = None, weights_norm_key: bool = True) -> Path:
    """`model_dir` (make_moe_model) as a GGUF file with llama.cpp's names: each layer's experts stacked into 3-D
    `blk.N.ffn_{gate,up,down}_exps.weight` [experts, out, in], the router `blk.N.ffn_gate_inp.weight` in f32.
    `drop`: GGUF names left out; `override`: GGUF name -> (array, ggml type or None) written instead;
    `weights_norm_key`: say norm_topk_prob=false as `expert_weights_norm` (else the file leaves it to llama.cpp's rule)."""
    import json

    import gguf
    from gguf import GGMLQuantizationType as GGML
    from gguf_factory import add_shape_keys, add_tokenizer, gguf_name, hf_tensors, permute

    override = dict(override or {})
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    w = gguf.GGUFWriter(path, arch)
    add_shape_keys(w, config)
    w.add_rope_dimension_count(head_dim)
    w.add_expert_count(config["num_experts"] if model_type == "qwen2_moe" else config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    if model_type == "qwen2_moe":
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if not config.get("norm_topk_prob") and weights_norm_key:
            # llama.cpp renormalizes Qwen3-MoE's top-k weights unless told (Qwen3-30B-A3B sets norm_topk_prob)
            w.add_expert_weights_norm(False)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}.get(qtype, 0))
    add_tokenizer(w, model_dir, config)

    def add(target: str, t: torch.Tensor, stored: bool) -> None:
        if target in drop:
            return
        if target in override:
            array, raw_dtype = override.pop(target)
            w.add_tensor(target, array, raw_dtype=raw_dtype)
        elif stored and qtype == "f16":
            w.add_tensor(target, t.half().numpy())
        elif stored:
            w.add_tensor(target, gguf.quants.quantize(t.float().numpy(), GGML[qtype.upper()]),
                         raw_dtype=GGML[qtype.upper()])
        else:
            w.add_tensor(target, t.float().numpy())

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in hf_tensors(model_dir).items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.L.<block>.experts.E.<proj>.weight
            experts.setdefault((int(parts[2]), EXPERT[model_type][parts[-2]]), {})[int(parts[-3])] = t
            continue
        if name.endswith("mlp.shared_expert_gate.weight"):  # llama.cpp's is a vector [hidden]
            add(f"blk.{parts[2]}.ffn_gate_inp_shexp.weight", t.reshape(-1), False)
            continue
        if _router(name):
            add(f"blk.{parts[2]}.ffn_gate_inp.weight", t, False)
            continue
        if ".shared_expert." in name:
            add(f"blk.{parts[2]}.{SHARED[parts[-3] + '.' + parts[-2]]}.weight", t, gguf_stored(qtype, name, t))
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = permute(t, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = permute(t, kv_heads)
        add(gguf_name(name), t, gguf_stored(qtype, name, t))
    for (layer, role), by_index in sorted(experts.items()):
        stacked = torch.stack([by_index[e] for e in range(len(by_index))])  # [experts, out, in]
        add(f"blk.{layer}.ffn_{role}_exps.weight", stacked,
            qtype != "f32" and stacked.shape[-1] % gguf.GGML_QUANT_SIZES[GGML[qtype.upper()]][0] == 0)
    for target, (array, raw_dtype) in override.items():
        w.add_tensor(target, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# gpt-oss as convert_hf_to_gguf.py's GptOssModel writes it: gate_up split into ffn_gate_exps and ffn_up_exps (rows 2j
# and 2j + 1), every matrix [out, in], the norm after attention as post_attention_norm, the sinks as attn_sinks.weight
GPT_OSS_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
                 "mlp.router.bias": "ffn_gate_inp.bias"} | {
    f"self_attn.{x}_proj.{kind}": f"attn_{'output' if x == 'o' else x}.{kind}" for x in "qkvo" for kind in ("weight", "bias")}


def write_gpt_oss_gguf(model_dir: Path, path: Path, reference_dir: Path, experts: str = "mxfp4", *,
                       yarn: bool = True) -> tuple[Path, Path]:
    """`model_dir` (a gpt-oss of make_moe_model) as a `gpt-oss` GGUF file with its experts in `experts` (mxfp4, q8_0
    or f32, quantized by gguf-py) and everything else in f32; in `reference_dir` the float32 Hugging Face model
    holding the weights the file does (gguf-py's dequantization). Returns (path, reference_dir)."""
    import json
    import shutil

    import gguf
    from gguf import GGMLQuantizationType as GGML
    from gguf_factory import add_shape_keys, add_tokenizer, hf_tensors
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    rope = config["rope_parameters"]
    w = gguf.GGUFWriter(path, "gpt-oss")
    add_shape_keys(w, config)
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(config["intermediate_size"])
    w.add_sliding_window(config["sliding_window"])
    if yarn:  # (without: a file that says its rope is not scaled)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_file_type(38 if experts == "mxfp4" else 0)  # MOSTLY_MXFP4_MOE
    add_tokenizer(w, model_dir, config)
    tensors = hf_tensors(model_dir)
    decoded = dict(tensors)
    plain = {"token_embd.weight": tensors["model.embed_tokens.weight"],
             "output_norm.weight": tensors["model.norm.weight"], "output.weight": tensors["lm_head.weight"]}
    for name, t in plain.items():
        w.add_tensor(name, t.float().numpy())
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for hf, target in GPT_OSS_LAYER.items():
            w.add_tensor(f"blk.{layer}.{target}", tensors[p + hf].float().numpy())
        gate_up, down = tensors[p + "mlp.experts.gate_up_proj"], tensors[p + "mlp.experts.down_proj"]  # [E, in, out]
        bias = tensors[p + "mlp.experts.gate_up_proj_bias"]
        stored = {}
        for role, matrix in (("gate", gate_up[:, :, ::2]), ("up", gate_up[:, :, 1::2]), ("down", down)):
            rows = matrix.transpose(1, 2).contiguous().float().numpy()  # [E, out, in]
            if experts == "f32":
                w.add_tensor(f"blk.{layer}.ffn_{role}_exps.weight", rows)
                stored[role] = torch.from_numpy(rows)
            else:
                raw = gguf.quants.quantize(rows, GGML[experts.upper()])
                w.add_tensor(f"blk.{layer}.ffn_{role}_exps.weight", raw, raw_dtype=GGML[experts.upper()])
                stored[role] = torch.from_numpy(gguf.quants.dequantize(raw, GGML[experts.upper()]).copy())
        for role, b in (("gate", bias[:, ::2]), ("up", bias[:, 1::2]), ("down", tensors[p + "mlp.experts.down_proj_bias"])):
            w.add_tensor(f"blk.{layer}.ffn_{role}_exps.bias", b.contiguous().float().numpy())
        both = torch.stack([stored["gate"], stored["up"]], dim=2).reshape(gate_up.shape[0], -1, gate_up.shape[1])
        decoded[p + "mlp.experts.gate_up_proj"] = both.transpose(1, 2).contiguous()  # rows 2j, 2j + 1 again
        decoded[p + "mlp.experts.down_proj"] = stored["down"].transpose(1, 2).contiguous()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shutil.copytree(model_dir, reference_dir)
    save_file(decoded, reference_dir / "model.safetensors")
    return path, reference_dir


# Qwen3-30B-A3B's shapes (its config.json), for plans made from headers alone
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     rope_theta=1_000_000.0)


def write_sparse_moe_gguf(path: Path, config: dict, default: str = "q4_k", types: dict | None = None) -> int:
    """A real-shape `qwen3moe` GGUF whose tensor data is a hole (gguf_factory._write_sparse): headers, metadata and a
    `vocab_size`-token tokenizer, a few MiB of disk. Returns the tensors' bytes."""
    import gguf
    from gguf_factory import _write_sparse, add_byte_level_tokenizer, add_shape_keys

    c = config
    hidden, layers, heads, kv_heads, d = (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                                          c["num_key_value_heads"], c["head_dim"])
    experts, inter, vocab = c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]
    w = gguf.GGUFWriter(path, "qwen3moe")
    add_shape_keys(w, c)
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(inter)
    add_byte_level_tokenizer(w, vocab, "qwen2")
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q_norm.weight": (d,), f"blk.{i}.attn_k_norm.weight": (d,),
                   f"blk.{i}.attn_q.weight": (heads * d, hidden), f"blk.{i}.attn_k.weight": (kv_heads * d, hidden),
                   f"blk.{i}.attn_v.weight": (kv_heads * d, hidden), f"blk.{i}.attn_output.weight": (hidden, heads * d),
                   f"blk.{i}.ffn_gate_inp.weight": (experts, hidden),
                   f"blk.{i}.ffn_gate_exps.weight": (experts, inter, hidden),
                   f"blk.{i}.ffn_up_exps.weight": (experts, inter, hidden),
                   f"blk.{i}.ffn_down_exps.weight": (experts, hidden, inter)}
    return _write_sparse(w, path, shapes, {"ffn_gate_inp.weight": "f32", **(types or {})}, default)


# gpt-oss-20b's shapes (its config.json), for plans made from headers alone
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=128, rope_theta=150000.0)


def write_sparse_gpt_oss_gguf(path: Path, config: dict, default: str = "q8_0", specials: tuple[str, ...] = ()) -> int:
    """A real-shape `gpt-oss` GGUF (MXFP4 experts, the other matrices `default`, vectors and biases f32) whose tensor
    data is a hole (gguf_factory._write_sparse), with the keys GptOssModel writes. Returns the tensors' bytes."""
    import gguf
    from gguf_factory import _write_sparse, add_byte_level_tokenizer, add_shape_keys

    c = config
    hidden, layers, heads, kv_heads, d = (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                                          c["num_key_value_heads"], c["head_dim"])
    experts, inter, vocab = c["num_local_experts"], c["intermediate_size"], c["vocab_size"]
    w = gguf.GGUFWriter(path, "gpt-oss")
    add_shape_keys(w, c)
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(inter)
    w.add_sliding_window(c["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    add_byte_level_tokenizer(w, vocab, "gpt-2", specials)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (hidden,), b + "post_attention_norm.weight": (hidden,),
                   b + "attn_sinks.weight": (heads,), b + "attn_q.weight": (heads * d, hidden),
                   b + "attn_k.weight": (kv_heads * d, hidden), b + "attn_v.weight": (kv_heads * d, hidden),
                   b + "attn_output.weight": (hidden, heads * d), b + "attn_q.bias": (heads * d,),
                   b + "attn_k.bias": (kv_heads * d,), b + "attn_v.bias": (kv_heads * d,), b + "attn_output.bias": (hidden,),
                   b + "ffn_gate_inp.weight": (experts, hidden), b + "ffn_gate_inp.bias": (experts,),
                   b + "ffn_gate_exps.weight": (experts, inter, hidden), b + "ffn_up_exps.weight": (experts, inter, hidden),
                   b + "ffn_down_exps.weight": (experts, hidden, inter), b + "ffn_gate_exps.bias": (experts, inter),
                   b + "ffn_up_exps.bias": (experts, inter), b + "ffn_down_exps.bias": (experts, hidden)}
    types = {f"ffn_{r}_exps.weight": "mxfp4" for r in ("gate", "up", "down")} | {
        f"ffn_{r}_exps.bias": "f32" for r in ("gate", "up", "down")} | {"ffn_gate_inp.weight": "f32"}
    return _write_sparse(w, path, shapes, types, default)
