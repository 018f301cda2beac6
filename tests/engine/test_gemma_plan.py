"""The planner on a Gemma-3-1B shape: sliding-window layers charged for their window, numbers checked by hand.

Gemma 3 1B: 26 layers, hidden 1152, 4 heads / 1 KV head of 256, window 512 on five layers of six (layers 5, 11,
17 and 23 are global), vocab 262144, tied, bf16. One token of one layer's KV: 2 * 1 * 256 * 2 = 1,024 bytes.
A window layer keeps ceil((512 + 512 - 2) / 16) + 1 = 65 blocks of 16 tokens (window + prefill chunk of 512):
65 * 16 * 1,024 = 1,064,960 bytes, whatever the context; a global layer ceil(T / 16) * 16 * 1,024.
"""

import json
import math
import os

import pytest
import torch
from sparse_models import ITEMSIZE

from stowage.engine.formats.config import ModelConfig
from stowage.engine.runtime.kv_cache import CacheSpec, KVCache
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.plan import PlanRequest, max_context, plan
from stowage.engine.planning.report import to_dict
from stowage.engine.units import GiB

GEMMA_3_1B = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
WINDOW_LAYER = 65 * 16 * 1024  # 1,064,960
GLOBAL = (5, 11, 17, 23)
LAYER_BYTES = 2 * (2 * 1024 * 1152 + 2 * 256 * 1152 + 3 * 6912 * 1152 + 4 * 1152 + 2 * 256)  # 53,684,224
EMBED_BYTES = 262144 * 1152 * 2  # 603,979,776: the tied head too


def gemma_shapes(config: dict) -> dict[str, list[int]]:
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], h]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + n + ".weight": [h] for n in ("input_layernorm", "post_attention_layernorm",
                                                    "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        shapes |= {
            p + "self_attn.q_proj.weight": [heads * d, h], p + "self_attn.k_proj.weight": [kv_heads * d, h],
            p + "self_attn.v_proj.weight": [kv_heads * d, h], p + "self_attn.o_proj.weight": [h, heads * d],
            p + "self_attn.q_norm.weight": [d], p + "self_attn.k_norm.weight": [d],
            p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter],
        }
    return shapes | {"model.norm.weight": [h]}


def write_gemma(model_dir, config=GEMMA_3_1B):
    """config.json and a safetensors header whose data region is a hole (as tests/support/sparse_models.py)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in gemma_shapes(config).items():
        nbytes = math.prod(shape) * ITEMSIZE["BF16"]
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = model_dir / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    os.truncate(path, 8 + len(raw) + offset)
    return model_dir


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    return inspect(write_gemma(tmp_path_factory.mktemp("gemma3-1b")))


def test_the_shape_is_read_as_gemma_3_1b(info):
    windows = info.config.layer_windows
    assert [i for i, w in enumerate(windows) if w is None] == list(GLOBAL) and set(windows) == {512, None}
    assert info.layer_bytes() == (LAYER_BYTES,) * 26 and LAYER_BYTES == 53_684_224
    assert info.weights_bytes() == 26 * LAYER_BYTES + EMBED_BYTES + 2304 == 1_999_771_904


@pytest.mark.parametrize("tokens, kv_bytes, naive", [
    (4096, 4 * 4096 * 1024 + 22 * WINDOW_LAYER, 26 * 4096 * 1024),  # 40,206,336 instead of 109,051,904
    (32768, 4 * 32768 * 1024 + 22 * WINDOW_LAYER, 26 * 32768 * 1024),  # 157,646,848 instead of 872,415,232
    (131072, 4 * 131072 * 1024 + 22 * WINDOW_LAYER, 26 * 131072 * 1024),  # 560,300,032 instead of 3,489,660,928
])
def test_window_layers_are_charged_for_their_window(info, tokens, kv_bytes, naive):
    assert kv_bytes in (40_206_336, 157_646_848, 560_300_032)
    p = plan(info, PlanRequest(tokens), given_budgets([], 64 * GiB))
    (cpu,) = p.devices
    assert cpu.kv_bytes == p.kv_bytes == kv_bytes and kv_bytes < naive / 2
    assert cpu.weights_bytes == 1_999_771_904 and cpu.total_bytes == cpu.weights_bytes + kv_bytes + cpu.workspace_bytes
    assert to_dict(p)["devices"][0]["kv_bytes"] == kv_bytes
    assert p.fits == (tokens <= 32768)  # 128k is past Gemma 3 1B's positions: charged, but refused for that


def test_per_device_kv_follows_the_kinds_of_layer_each_device_holds(info):
    p = plan(info, PlanRequest(32768, gpu_layers=6), given_budgets([8 * GiB], 16 * GiB))
    gpu, cpu = p.devices
    assert gpu.layers == tuple(range(6))  # five window layers and global layer 5
    assert gpu.kv_bytes == 5 * WINDOW_LAYER + 32768 * 1024 == 38_879_232
    assert cpu.kv_bytes == 17 * WINDOW_LAYER + 3 * 32768 * 1024 == 118_767_616
    assert [d["kv_bytes"] for d in to_dict(p)["devices"]] == [38_879_232, 118_767_616]


def test_the_cache_allocates_what_the_plan_charged(info):
    p = plan(info, PlanRequest(4096), given_budgets([], 64 * GiB))
    spec = CacheSpec(1, 256, torch.bfloat16, p.block_size)
    # meta tensors: the allocation's shape without its memory
    cache = KVCache(spec, [torch.device("meta")] * 26, p.context_tokens, p.num_seqs,
                    layer_windows=info.config.layer_windows, prefill_chunk=p.prefill_chunk)
    assert cache.num_bytes == p.kv_bytes == 40_206_336
    assert [g.allocator.num_blocks for g in cache.groups] == [256, 65]


def test_the_slider_reaches_further(tmp_path):
    # Gemma 3 1B stops at its 32,768 positions on both machines; with the positions lifted (as Gemma 3 4B's
    # 131,072) the reach shows what the cache costs: see docs/planner.md for the figures
    lifted = write_gemma(tmp_path / "lifted", GEMMA_3_1B | {"max_position_embeddings": 1 << 22})
    full = write_gemma(tmp_path / "full", GEMMA_3_1B | {"max_position_embeddings": 1 << 22,
                                                        "layer_types": ["full_attention"] * 26})
    assert ModelConfig.from_dir(full).layer_windows == (None,) * 26
    for ram in (8 * GiB, 16 * GiB):
        budgets = given_budgets([], ram)
        before, after = (max_context(inspect(m), PlanRequest(4096), budgets) for m in (full, lifted))
        assert after > 3 * before
        assert max_context(inspect(write_gemma(tmp_path / f"real{ram}")), PlanRequest(4096), budgets) == 32768
