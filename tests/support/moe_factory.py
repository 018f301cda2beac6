"""Tiny random mixture-of-experts models (Qwen3-MoE, Mixtral), written by transformers as Hugging Face would."""

from __future__ import annotations

from pathlib import Path

import torch

from factory import _tokenizer_object, save_tokenizer

ARCHS = {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}


def make_moe_model(model_dir: Path, arch: str = "qwen3_moe", *, dtype=torch.float32, seed: int = 0,
                   **overrides) -> Path:
    """Save a tiny random `arch` model of 8 experts, 2 active (and factory.py's tokenizer); return model_dir.

    The router is scaled up so its choices are far apart: a rounding difference then never flips an expert."""
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
        eos_token_id=_tokenizer_object().token_to_id("<|end|>"), bos_token_id=_tokenizer_object().token_to_id("<s>"),
    )
    if arch == "mixtral":
        kwargs["intermediate_size"] = kwargs.pop("moe_intermediate_size")
    kwargs.update(overrides)
    config = getattr(transformers, ARCHS[arch])(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(model_dir)
    save_tokenizer(model_dir)
    return model_dir
