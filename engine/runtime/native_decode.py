"""The CPU decode step through kernels/cpu_decode.py: the model's CPU layers and head, described once, run per token.

`NativeDecode.build(model, cache)` describes the CPU layers at the end of the model (the planner puts the
GPU layers first) and the head to the C side, pointers to the mapped weights and the cache included; it
is None where the native step cannot run them (no library, a weight type or activation it lacks). Each
decode token then costs one call for those layers and one for the head instead of some 30 torch calls
and 7 matrix products per layer. A step of several sequences is the same call with one lane per sequence
(`run_layers_batch`): each weight row is read once for all of them. Prefill stays on the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from stowage.kernels import cpu_decode
from stowage.kernels.cpu_decode import Layer, Matrix, Model, Vector
from stowage.kernels.quant_linear import QuantizedWeight

FLOAT_CODES = {torch.float32: cpu_decode.W_F32, torch.float16: cpu_decode.W_F16, torch.bfloat16: cpu_decode.W_BF16}
# the cache's: floats, fp8, and q8_0 / q4_0 blocks (int8 / uint8 storage, kernels/kv_quant.py), K's and V's apart
CACHE_CODES = {**FLOAT_CODES, torch.float8_e4m3fn: cpu_decode.CACHE_FP8, torch.int8: cpu_decode.CACHE_Q8_0,
               torch.uint8: cpu_decode.CACHE_Q4_0}
PLAIN_GGML = {"f32": cpu_decode.W_F32, "f16": cpu_decode.W_F16, "bf16": cpu_decode.W_BF16}
ACTS = {"silu": cpu_decode.ACT_SILU, "gelu_pytorch_tanh": cpu_decode.ACT_GELU_TANH}
MAX_HEAD_DIM, MAX_GROUP = 512, 64  # decode_layer.c's
LAYER_MATRICES = {"q": "q", "k": "k", "v": "v", "o": "o", "gate": "gate", "up": "up", "down": "down"}
LAYER_NORMS = ("input_norm", "post_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")


def native_intermediate(cfg) -> int:
    """The widest MLP the native step's scratch holds: the dense one, or an expert's (decode_types.h model)."""
    return max(cfg.intermediate_size, cfg.expert_intermediate_size)


class Unsupported(Exception):
    """A tensor or setting the native step does not take; the model stays on the torch path."""


def _matrix(weight, bias) -> Matrix:
    if isinstance(weight, QuantizedWeight):
        if weight.device.type != "cpu":
            raise Unsupported("weight not on the CPU")
        code = PLAIN_GGML.get(weight.type_name)
        if code is None:
            code = cpu_decode.current().decode_type_id(weight.type_name.encode())
        if code < 0:
            raise Unsupported(f"no native kernel for {weight.type_name}")
        rows, cols = weight.shape.out_features, weight.shape.in_features
    else:
        if weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous() \
                or weight.dtype not in FLOAT_CODES:
            raise Unsupported(f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device}")
        code, (rows, cols) = FLOAT_CODES[weight.dtype], weight.shape
    m = Matrix(weight.data_ptr(), None, code, 0, rows, cols)
    if bias is not None:
        m.bias, m.bias_type = _vector_ptr(bias, rows)
    return m


def _vector_ptr(t: torch.Tensor, n: int) -> tuple[int, int]:
    if t.device.type != "cpu" or t.numel() != n or not t.is_contiguous() or t.dtype not in FLOAT_CODES:
        raise Unsupported(f"vector {tuple(t.shape)} {t.dtype}")
    return t.data_ptr(), FLOAT_CODES[t.dtype]


def _vector(t: torch.Tensor | None, n: int) -> Vector:
    return Vector(None, 0) if t is None else Vector(*_vector_ptr(t, n))


class NativeDecode:
    """The C description of a model's trailing CPU layers (`first`..) and, when it is on the CPU, its head."""

    def __init__(self, lib, model: Model, keep: list, first: int, head: tuple | None, dtype: torch.dtype):
        self.lib, self.model, self._keep, self.first, self.head, self.dtype = lib, model, keep, first, head, dtype
        self.h_code = FLOAT_CODES[dtype]
        self.num_layers = model.num_layers

    @classmethod
    def build(cls, transformer, cache) -> "NativeDecode | None":
        """The native step for `transformer` over `cache`, or None where it cannot run (the torch path then does)."""
        lib = cpu_decode.current()
        if lib is None:
            return None
        try:
            return cls._build(lib, transformer, cache)
        except Unsupported:
            return None

    @classmethod
    def _build(cls, lib, transformer, cache) -> "NativeDecode":
        cfg, layers = transformer.config, transformer.layers
        if cfg.is_moe and (cfg.num_experts_per_tok > cpu_decode.MAX_TOPK or cfg.expert_intermediate_size % 32
                           or cfg.shared_expert_intermediate_size):  # decode_layer.c has no shared expert
            raise Unsupported("experts")
        if transformer.local_rotary is not None and transformer.local_rotary.attention_factor != 1.0:
            raise Unsupported("a scaled rope on the sliding layers")  # one rope_scale for both tables
        if cfg.hidden_act not in ACTS or cfg.head_dim > MAX_HEAD_DIM or cfg.head_dim % 2 \
                or cfg.num_heads // cfg.num_kv_heads > MAX_GROUP \
                or transformer.dtype not in FLOAT_CODES or cache.spec.dtype not in CACHE_CODES \
                or cache.spec.value_dtype not in CACHE_CODES:
            raise Unsupported("configuration")
        first = len(layers)
        while first > 0 and layers[first - 1].device.type == "cpu":
            first -= 1
        keep: list = []
        structs = (Layer * len(layers))()
        for i in range(first, len(layers)):
            w = layers[i]
            s = structs[i]
            experts = transformer.experts[i]
            if experts is not None:  # the router here, each expert's gate, up, down in one array
                if "gate_up.0" in experts.tensors:  # gpt-oss's Hugging Face experts: gate and up rows interleaved
                    raise Unsupported("gate_up experts")
                s.router = _matrix(w["router"], w.get("router_bias"))
                array = (Matrix * (3 * cfg.num_experts))(*(_matrix(experts[f"{role}.{e}"],
                                                                   experts.get(f"{role}_bias.{e}"))
                                                           for e in range(cfg.num_experts)
                                                           for role in ("gate", "up", "down")))
                keep.append(array)
                s.experts = ctypes.cast(array, ctypes.POINTER(Matrix))
            for field, key in LAYER_MATRICES.items():
                if key in w.tensors:
                    setattr(s, field, _matrix(w[key], w.get(f"{key}_bias")))
            sizes = {"q_norm": cfg.head_dim, "k_norm": cfg.head_dim}
            for name in LAYER_NORMS:
                setattr(s, name, _vector(w.get(name), sizes.get(name, cfg.hidden_size)))
            s.k_cache, s.v_cache = cache.k_cache[i].data_ptr(), cache.v_cache[i].data_ptr()
            s.k_scale, s.v_scale = float(cache.k_scale[i]), float(cache.v_scale[i])
            s.window = cfg.window(i) or 0
            if "sinks" in w.tensors:
                sinks = w["sinks"].float().contiguous()
                keep.append(sinks)
                s.sinks = _vector_ptr(sinks, cfg.num_heads)[0]
            s.local_rope = int(cfg.window(i) is not None and transformer.local_rotary is not None)
        inv_freq = transformer.rotary.inv_freq.float().contiguous()
        local = transformer.local_rotary.inv_freq.float().contiguous() if transformer.local_rotary else None
        order = None
        if transformer.qk_order is not None:
            order = next(iter(transformer.qk_order.values())).to("cpu", torch.int64).contiguous()
        keep += [inv_freq, local, order, structs]
        model = Model(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, native_intermediate(cfg),
                      cache.spec.block_size, CACHE_CODES[cache.spec.dtype], CACHE_CODES[cache.spec.value_dtype],
                      int(cfg.norm_plus_one), int(cfg.sandwich_norm),
                      int(cfg.qk_norm), cpu_decode.ACT_SWIGLU_CLAMPED if cfg.swiglu_limit is not None
                      else ACTS[cfg.hidden_act], len(layers), cfg.rms_norm_eps, cfg.attention_scale,
                      cfg.attn_softcap or 0.0, inv_freq.data_ptr(),
                      local.data_ptr() if local is not None else None,
                      order.data_ptr() if order is not None else None, structs, cfg.num_experts,
                      cfg.num_experts_per_tok, int(cfg.norm_topk_prob), transformer.rotary.attention_factor,
                      cfg.swiglu_limit or 0.0, cfg.swiglu_alpha, int(cfg.softmax_after_topk))
        head = None
        if transformer.head_device.type == "cpu":
            try:
                lm_head = transformer.head["lm_head"]
                head = (_vector(transformer.head["norm"], cfg.hidden_size), _matrix(lm_head, None),
                        cfg.final_softcap or 0.0, lm_head.shape[0] if isinstance(lm_head, torch.Tensor)
                        else lm_head.shape.out_features)
            except Unsupported:
                head = None
        return cls(lib, model, keep, first, head, transformer.dtype)

    def run_layers(self, h: torch.Tensor, position: int, block_tables: torch.Tensor,
                   layer_group: list[int]) -> torch.Tensor:
        """Layers first.. for one token at `position` (its slots reserved): h [1, hidden] -> their output (a new tensor).

        block_tables: [num_groups, max_blocks] int32, one row per cache group; layer_group[l]: layer l's row.
        h may come from a GPU layer before them: the C step reads a copy in host memory."""
        h = h.to("cpu", self.dtype).contiguous().clone()
        assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
        base, row = block_tables.data_ptr(), block_tables.stride(0) * 4
        tables = (ctypes.c_void_p * self.num_layers)(*(base + g * row for g in layer_group))
        if self.lib.decode_layers(ctypes.byref(self.model), self.first, self.num_layers, h.data_ptr(), self.h_code,
                                  position, tables) != 0:
            raise MemoryError("the native decode step could not allocate its scratch")
        return h

    def run_layers_batch(self, h: torch.Tensor, positions: list[int], block_tables: torch.Tensor,
                         layer_group: list[int]) -> torch.Tensor:
        """Layers first.. for n sequences, one new token each (its slots reserved): h [n, hidden] -> their output.

        Each weight row is read once for all n (decode_layer.c's lanes). block_tables: [num_groups, n, max_blocks]
        int32; layer_group[l]: layer l's group. n is at most cpu_decode.MAX_LANES."""
        n = h.shape[0]
        h = h.to("cpu", self.dtype).contiguous().clone()
        assert block_tables.dtype == torch.int32 and block_tables.stride(2) == 1
        base, g_stride, s_stride = block_tables.data_ptr(), block_tables.stride(0) * 4, block_tables.stride(1) * 4
        tables = (ctypes.c_void_p * (n * self.num_layers))(
            *(base + layer_group[l] * g_stride + b * s_stride for b in range(n) for l in range(self.num_layers)))
        pos = (ctypes.c_int64 * n)(*positions)
        if self.lib.decode_layers_batch(ctypes.byref(self.model), self.first, self.num_layers, n, h.data_ptr(),
                                        self.h_code, pos, tables) != 0:
            raise MemoryError("the native decode step could not allocate its scratch")
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] from the last layer's output h [n, hidden]; requires self.head."""
        norm, matrix, softcap, vocab = self.head
        h = h.to("cpu", self.dtype).contiguous()  # the last layer may be a GPU's
        out = torch.empty(h.shape[0], vocab, dtype=torch.float32)
        if self.lib.decode_head_batch(ctypes.byref(self.model), h.shape[0], h.data_ptr(), self.h_code,
                                      ctypes.byref(norm), ctypes.byref(matrix), softcap, out.data_ptr()) != 0:
            raise MemoryError("the native decode step could not allocate its scratch")
        return out
