"""What the settings panel says of an inspected model: its family, layers, weights and their type, its longest context,
and for a model of experts how many it routes through and how many parameters a token reads."""

from __future__ import annotations

from stowage.engine.formats.discovery import gguf_quant
from stowage.engine.units import format_bytes, format_tokens


def describe(info) -> str:
    """'qwen3_moe, 48 layers, 17.3 GiB of Q4_K_M weights, up to 40K tokens' (a planning.inspect.ModelInfo), and a
    second line for a model of experts."""
    if info.matrices is not None:  # GGUF: its blocks' type, which is not the dtype it computes in
        weights = f"{format_bytes(info.weights_bytes())} of {stored_type(info)} weights"
    else:
        weights = f"{format_bytes(info.weights_bytes())} of weights ({info.compute_dtype})"
    text = f"{info.config.model_type}, {info.num_layers} layers, {weights}, up to " \
           f"{format_tokens(info.max_position_embeddings)}"
    return f"{text}\n{experts(info)}" if info.config.is_moe else text


def experts(info) -> str:
    """'MoE: 128 experts, 8 active, 3.3 B of 30.5 B parameters read per token'."""
    c = info.config
    return (f"MoE: {c.num_experts} experts, {c.num_experts_per_tok} active, {count(info.num_active_parameters)} of "
            f"{count(info.num_parameters)} parameters read per token")


def count(n: int) -> str:
    """A parameter count as model cards write it, cut (not rounded) to its first decimal: '30.5 B', '3.3 B' (for
    3,353,000,000, which Qwen's card calls 3.3B), '740 M', '96.2 K'."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            tenths = n * 10 // size
            return f"{tenths // 10}.{tenths % 10} {unit}" if tenths < 1000 else f"{tenths // 10} {unit}"
    return str(n)


def stored_type(info) -> str:
    """A GGUF model's quantization as its file names it ("Q4_K_M"), else the type most of its layers' weights are
    stored in, by count ("Q4_1")."""
    named = gguf_quant(info.model_dir)
    if named:
        return named
    stored: dict[str, int] = {}
    for layer in info.layers:
        for dtype, numel, _ in layer.by_dtype:
            stored[dtype] = stored.get(dtype, 0) + numel
    return max(stored, key=stored.get).upper() if stored else "GGUF"
