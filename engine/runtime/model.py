"""The Llama-family transformer (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text; Qwen3-MoE, Qwen2-MoE, Mixtral
and gpt-oss) over the paged KV cache.

Gemma differs in ways ModelConfig names: (1 + weight) norms in fp32, a norm after attention and after the MLP,
embeddings scaled by sqrt(hidden_size), GELU-tanh, its own attention scale, soft-capped scores and logits,
sliding-window layers (Mistral too) and, in Gemma 3, a rotary base of their own for the sliding layers.
A model of experts routes each token's MLP through the top-k of its layer's experts (docs/moe.md, `moe`).
gpt-oss adds attention sinks (a logit per head in every softmax), biased routers and experts, and its clamped SwiGLU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stowage.kernels import attention_ops, cpu_decode, cpu_gemv, cpu_matmul
from stowage.kernels.kv_quant import hadamard
from stowage.kernels.quant_linear import QuantizedWeight

from ..formats.config import ModelConfig
from .kv_cache import KVCache, Sequence
from .native_decode import NativeDecode
from .rope import RotaryTable, apply_rotary
from .weights import TensorSet


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused op (statistics in fp32). Hugging Face rounds to the input dtype before scaling, so
    # bf16/fp16 results may differ from it in the last bit; fp32 is identical. GGUF keeps norms in f32
    # beside bf16 activations: the (small) weight is converted per call, the mapped file never.
    return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Gemma scales by (1 + weight) and rounds once, at the end: all of it in fp32, as Hugging Face does.
    return (F.rms_norm(x.float(), weight.shape, None, eps) * (1.0 + weight.float())).to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    # ids: [n] -> [n, hidden]; quantized embeddings (GGUF) dequantize only the rows asked for
    return F.embedding(ids, weight) if isinstance(weight, torch.Tensor) else weight.rows(ids)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [n, in], weight: [out, in]. The decode step of bf16 weights on the CPU is memory-bound and
    # torch's matrix-vector product reads far below the bandwidth: use our AVX512-BF16 kernel there.
    if not isinstance(weight, torch.Tensor):  # GGUF blocks: dequantized tile by tile (kernels/quant_linear.py)
        return weight.linear(x, bias)
    if bias is not None and bias.dtype != x.dtype:  # GGUF's f32 biases beside bf16 activations
        bias = bias.to(x.dtype)
    if x.shape[0] == 1 and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and weight.is_contiguous() \
            and x.device.type == "cpu" and cpu_gemv.is_available():  # built once, at the first decode step
        return cpu_gemv.gemv(x, weight, bias)
    if cpu_matmul.applies(x, weight):  # a prefill chunk where torch's 16-bit product is slow: fp32 on widened tiles
        return cpu_matmul.mm(x, weight, bias)
    # mm/addmm beat F.linear for bf16 on the CPU (docs/benchmarks.md, "Figures behind code comments").
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


@dataclass
class StepInputs:
    """What every layer on one device needs for this forward call; built once per device.

    Indexed by the layer's cache group (KVCache.layer_group): the full-attention layers and each sliding window
    keep their own blocks, so slots and block tables differ per group."""

    ops: object  # the attention implementation for the device
    cos: torch.Tensor  # [n, 1, head_dim]
    sin: torch.Tensor  # [n, 1, head_dim], sign-flipped first half (see rope.py)
    slots: torch.Tensor  # [num_groups, n]
    block_table: torch.Tensor | None  # [num_groups, max_blocks] int32: one sequence's chunk
    context_lens: torch.Tensor  # [1] or [num_seqs] int32, decode only
    block_tables: torch.Tensor | None = None  # [num_groups, num_seqs, max_blocks] int32, -1 padded: batched decode
    local: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of the sliding layers' own rope (Gemma 3)


class Transformer:
    """Runs one sequence's new tokens through every layer, each on its own device."""

    def __init__(self, config: ModelConfig, embed: TensorSet, head: TensorSet, layers: list[TensorSet],
                 max_positions: int, qk_order: torch.Tensor | None = None,
                 experts: list[TensorSet | None] | None = None):
        self.config = config
        # per layer: its experts ("gate.E", "up.E", "down.E"), on their own device (None: a dense layer)
        self.experts = experts or [None] * len(layers)
        # [head_dim]: puts each head's Q/K outputs in Hugging Face order when the file stores the rows permuted
        # (llama.cpp's llama files, engine/formats/gguf_model.py); per device, as the layers are
        self.qk_order = {layer.device: qk_order.to(layer.device) for layer in layers} if qk_order is not None else None
        self.embed = embed  # the embeddings, on their device
        self.head = head  # the final norm and lm_head, on the head's device
        self.layers = layers
        self.head_device = head.device
        self.rotary = RotaryTable(config, max_positions)
        self.local_rotary = RotaryTable(config, max_positions, config.local_rope) if config.local_rope else None
        self.scale = config.attention_scale
        self.norm = gemma_rms_norm if config.norm_plus_one else rms_norm
        self.act = (lambda x: F.gelu(x, approximate="tanh")) if config.hidden_act == "gelu_pytorch_tanh" else F.silu
        self.dtype = layers[0]["q"].dtype if layers else embed["embed"].dtype
        self._native_for: tuple[KVCache, NativeDecode | None] | None = None  # the native decode step, per cache

    def attention_kernels(self) -> dict[str, str]:
        """The attention implementation each device's layers run, by the plan's device name."""
        return {layer.label: attention_ops(layer.device).NAME for layer in self.layers}

    @torch.inference_mode()
    def forward(self, token_ids: list[int], seq: Sequence, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Append token_ids to seq (writing their K/V) and return fp32 logits: [n or 1, vocab].

        More tokens than the cache's window groups can take at once (cache.max_new_tokens) run in chunks."""
        step = cache.max_new_tokens or len(token_ids)
        outs = []
        for i in range(0, len(token_ids), step):
            h = self._forward(token_ids[i : i + step], seq, cache)
            outs.append(h if all_logits else h[-1:])
        return self._logits(torch.cat(outs) if all_logits else outs[-1])

    def _forward(self, token_ids: list[int], seq: Sequence, cache: KVCache) -> torch.Tensor:
        n, start = len(token_ids), seq.num_tokens
        slots = cache.reserve(seq, n)
        positions = torch.arange(start, start + n)
        block_table = cache.block_tables([seq])[:, 0]  # every group's, once per call
        context_lens = torch.tensor([start + n], dtype=torch.int32)
        steps: dict[torch.device, StepInputs] = {}
        h = self._embed(token_ids)
        native = self.native(cache) if n == 1 else None  # one token: the CPU layers and head in C
        stop = native.first if native is not None else len(self.layers)
        for i, layer in enumerate(self.layers[:stop]):
            dev = layer.device
            step = steps.get(dev)
            if step is None:
                cos, sin = self.rotary.get(positions, dev, self.dtype)
                step = steps[dev] = StepInputs(attention_ops(dev), cos, sin, slots.to(dev), block_table.to(dev),
                                               context_lens.to(dev), local=self._local(positions, dev))
            h = self._layer(i, layer, h.to(dev), start, step, cache)
        if stop < len(self.layers):
            h = native.run_layers(h, start, block_table, cache.layer_group)
        seq.token_ids.extend(token_ids)
        return h

    @functools.cached_property
    def prefills_on_native_tiles(self) -> bool:
        """Whether a prefill chunk's products on the CPU run in the native int8 tiles (every CPU layer's matrices
        in ggml blocks, 16-bit activations, the kernels built): torch's own ops around them then do better on one
        thread than on threads that spin on the cores the native pool uses (docs/kernels.md)."""
        from stowage.kernels import cpu_quant_matmul

        cpu = [layer for layer in self.layers if layer.device.type == "cpu"]
        matrices = [t for layer in cpu for t in layer.tensors.values() if isinstance(t, QuantizedWeight)]
        return self.dtype in (torch.bfloat16, torch.float16) and bool(matrices) and \
            all(cpu_quant_matmul.runs(m.type_name) for m in matrices)

    def native(self, cache: KVCache) -> NativeDecode | None:
        """The native CPU decode step over `cache` (described once per cache), or None where torch runs it."""
        if self._native_for is None or self._native_for[0] is not cache:
            self._native_for = (cache, NativeDecode.build(self, cache))
        return self._native_for[1]

    @torch.inference_mode()
    def decode_step(self, token_ids: list[int], seqs: list[Sequence], cache: KVCache) -> torch.Tensor:
        """Append token_ids[i] to seqs[i] in one pass over the weights; return fp32 logits: [num_seqs, vocab].

        The linear layers run on [num_seqs, hidden]; attention reads each sequence through its own block table."""
        native = self.native(cache) if len(seqs) <= cpu_decode.MAX_LANES else None
        if len(seqs) == 1 and native is not None:  # one sequence: the native step of forward()
            return self.forward(token_ids, seqs[0], cache)
        starts = [seq.num_tokens for seq in seqs]
        slots = torch.cat([cache.reserve(seq, 1) for seq in seqs], dim=1)  # [num_groups, num_seqs]
        positions = torch.tensor(starts)
        block_tables = cache.block_tables(seqs)
        context_lens = torch.tensor([start + 1 for start in starts], dtype=torch.int32)
        steps: dict[torch.device, StepInputs] = {}
        h = self._embed(token_ids)
        stop = native.first if native is not None else len(self.layers)  # the CPU layers at the end: in C
        for i, layer in enumerate(self.layers[:stop]):
            dev = layer.device
            if dev not in steps:
                cos, sin = self.rotary.get(positions, dev, self.dtype)
                steps[dev] = StepInputs(attention_ops(dev), cos, sin, slots.to(dev), None, context_lens.to(dev),
                                        block_tables.to(dev), self._local(positions, dev))
            h = self._layer(i, layer, h.to(dev), 0, steps[dev], cache)
        if stop < len(self.layers):
            h = native.run_layers_batch(h, starts, block_tables, cache.layer_group)
        for seq, token in zip(seqs, token_ids):
            seq.token_ids.append(token)
        return self._logits(h, batch=native is not None)

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        h = embedding(torch.tensor(token_ids, device=self.embed.device), self.embed["embed"])
        if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the compute dtype first, as in HF
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def _local(self, positions: torch.Tensor, device: torch.device):
        return self.local_rotary.get(positions, device, self.dtype) if self.local_rotary else None

    def _logits(self, h: torch.Tensor, batch: bool = False) -> torch.Tensor:
        """fp32 logits of h's rows; one row, or a decode step's batch (one row per sequence, as many lanes as the
        plan charged: cpu_decode.scratch_bytes), go through the native head where it runs."""
        native = self._native_for[1] if self._native_for is not None else None
        if (h.shape[0] == 1 or batch) and native is not None and native.head is not None:
            # the final norm and head in C, each row of the head read once for all of h's rows
            return native.logits(h)
        h = self.norm(h.to(self.head_device), self.head["norm"], self.config.rms_norm_eps)
        return softcap(linear(h, self.head["lm_head"]).float(), self.config.final_softcap)

    def _layer(self, i: int, w: TensorSet, h: torch.Tensor, start: int, step: StepInputs, cache: KVCache) -> torch.Tensor:
        cfg, norm = self.config, self.norm
        n = h.shape[0]
        x = norm(h, w["input_norm"], cfg.rms_norm_eps)
        q = linear(x, w["q"], w.get("q_bias")).view(n, cfg.num_heads, cfg.head_dim)
        k = linear(x, w["k"], w.get("k_bias")).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = linear(x, w["v"], w.get("v_bias")).view(n, cfg.num_kv_heads, cfg.head_dim)
        if self.qk_order is not None:
            order = self.qk_order[w.device]
            q, k = q[..., order], k[..., order]
        if cfg.qk_norm:
            q = norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = norm(k, w["k_norm"], cfg.rms_norm_eps)
        window = cfg.window(i)
        cos, sin = step.local if (window is not None and step.local is not None) else (step.cos, step.sin)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_rot, v_rot = cache.spec.rotations  # a cache in blocks stores rows rotated (kernels/kv_quant.py)
        q, k, v = hadamard(q, k_rot), hadamard(k, k_rot), hadamard(v, v_rot)
        g = cache.layer_group[i]
        k_cache, v_cache = cache.k_cache[i], cache.v_cache[i]
        k_scale, v_scale = cache.k_scale[i], cache.v_scale[i]
        step.ops.write_kv(k, v, k_cache, v_cache, step.slots[g], k_scale, v_scale)
        kind = dict(window=window, softcap=cfg.attn_softcap) | ({"sinks": w["sinks"]} if cfg.attention_sinks else {})
        if step.block_tables is not None:  # one new token for each of n sequences
            attn = step.ops.decode_attention(q, k_cache, v_cache, step.block_tables[g], step.context_lens,
                                             self.scale, k_scale, v_scale, **kind)
        elif n == 1:
            attn = step.ops.decode_attention(q, k_cache, v_cache, step.block_table[g, None], step.context_lens,
                                             self.scale, k_scale, v_scale, **kind)
        else:
            attn = step.ops.prefill_attention(q, k_cache, v_cache, step.block_table[g], start, self.scale,
                                              k_scale, v_scale, **kind)
        attn = linear(hadamard(attn, v_rot).reshape(n, -1), w["o"], w.get("o_bias"))
        if cfg.sandwich_norm:  # Gemma: post_attention_layernorm normalizes the attention output
            h = h + norm(attn, w["post_norm"], cfg.rms_norm_eps)
            x = norm(h, w["pre_ff_norm"], cfg.rms_norm_eps)
        else:
            h = h + attn
            x = norm(h, w["post_norm"], cfg.rms_norm_eps)
        if self.experts[i] is not None:
            mlp = self.moe(x, w["router"], self.experts[i], w.get("router_bias")).to(h.device)
            if "shared_gate" in w.tensors:  # Qwen2-MoE's shared expert, gated per token by a sigmoid
                shared = linear(self.act(linear(x, w["shared_gate"])) * linear(x, w["shared_up"]), w["shared_down"])
                mlp = mlp + torch.sigmoid(linear(x, w["shared_expert_gate"])) * shared
        else:
            gate = self.act(linear(x, w["gate"], w.get("gate_bias")))
            mlp = linear(gate * linear(x, w["up"], w.get("up_bias")), w["down"], w.get("down_bias"))
        return h + (norm(mlp, w["post_ff_norm"], cfg.rms_norm_eps) if cfg.sandwich_norm else mlp)

    def moe(self, x: torch.Tensor, router: torch.Tensor | QuantizedWeight, experts: TensorSet,
            router_bias: torch.Tensor | None = None) -> torch.Tensor:
        """The routed MLP of x [n, hidden]: each token's top-k experts, weighted by their router probabilities.

        Softmax over every expert in fp32, then top-k, renormalized when norm_topk_prob (Qwen3-MoE's choice; Mixtral
        always, which equals a softmax over the top-k logits); gpt-oss: top-k of the biased logits, then a softmax
        over those. Experts run in ascending order, each one product over the tokens routed to it, added into the
        output as transformers does, so only the chosen experts' rows are read; the output is on the experts'
        device (the attention's may be another)."""
        cfg = self.config
        logits = linear(x, router, router_bias).float()  # [n, num_experts]
        if cfg.softmax_after_topk:
            top, chosen = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)  # [n, k]
            weights = torch.softmax(top, dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        x = x.to(experts.device)
        weights, chosen = weights.to(device=x.device, dtype=x.dtype), chosen.to(x.device)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # sorted
            tokens, slot = torch.where(chosen == e)
            xe = x[tokens]
            if f"gate_up.{e}" in experts.tensors:  # gpt-oss's Hugging Face experts: gate and up rows interleaved
                gate_up = linear(xe, experts[f"gate_up.{e}"], experts.get(f"gate_up_bias.{e}"))
                gate, up = gate_up[:, ::2], gate_up[:, 1::2]
            else:
                gate = linear(xe, experts[f"gate.{e}"], experts.get(f"gate_bias.{e}"))
                up = linear(xe, experts[f"up.{e}"], experts.get(f"up_bias.{e}"))
            y = linear(self._glu(gate, up), experts[f"down.{e}"], experts.get(f"down_bias.{e}"))
            # a token meets an expert once: a gather and add (index_add_ takes ms per call on bf16 CPU tensors)
            out[tokens] += y * weights[tokens, slot, None]
        return out

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up; gpt-oss's clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha * g), where it has a limit."""
        limit = self.config.swiglu_limit
        if limit is None:
            return self.act(gate) * up
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * self.config.swiglu_alpha))
