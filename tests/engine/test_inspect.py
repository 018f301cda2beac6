"""inspect(): per-layer and non-layer bytes and KV per token, from headers only, on real-shape sparse files."""

import json
import os
import time

import pytest
import torch

from stowage.engine.formats.checkpoint import Checkpoint
from stowage.engine.errors import ModelFormatError
from stowage.engine.planning.inspect import inspect
from sparse_models import LLAMA_3_1_8B, QWEN2_5_7B, QWEN3_0_6B, write_sparse_model

# Llama-3.1-8B, one decoder layer, elements:
#   q, o: 4096 x 4096 = 16,777,216 each; k, v: 1024 x 4096 = 4,194,304 each
#   gate, up, down: 14336 x 4096 = 58,720,256 each; two norms: 4096 each
#   2*16,777,216 + 2*4,194,304 + 3*58,720,256 + 2*4096 = 218,112,000 elements = 436,224,000 bytes in bf16
LLAMA_LAYER_BYTES = 436_224_000
LLAMA_EMBED_BYTES = 128256 * 4096 * 2  # 1,050,673,152; lm_head the same, untied
LLAMA_TOTAL_BYTES = 32 * LLAMA_LAYER_BYTES + 2 * LLAMA_EMBED_BYTES + 4096 * 2  # 16,060,522,496: 8.03 B parameters


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    return write_sparse_model(tmp_path_factory.mktemp("llama8b"), LLAMA_3_1_8B, num_shards=4)


def test_llama_8b_bytes_from_headers(llama_8b):
    info = inspect(llama_8b)
    assert info.num_layers == 32
    assert info.layer_bytes() == (LLAMA_LAYER_BYTES,) * 32
    assert info.layers[0].bytes_by_dtype == {"bfloat16": LLAMA_LAYER_BYTES}
    assert info.embed.nbytes() == info.lm_head.nbytes() == LLAMA_EMBED_BYTES
    assert info.norm.nbytes() == 8192
    assert not info.tied_embeddings
    assert info.weights_bytes() == LLAMA_TOTAL_BYTES == 16_060_522_496
    assert info.file_bytes > LLAMA_TOTAL_BYTES  # the headers on top
    assert info.max_position_embeddings == 131072
    assert info.compute_dtype == "bfloat16"
    # K and V, 8 heads x 128 dims: 2 * 8 * 128 * itemsize
    assert info.kv_bytes_per_token("float16") == 4096
    assert info.kv_bytes_per_token() == 4096  # the compute dtype, bf16
    assert info.kv_bytes_per_token("fp8") == 2048
    assert info.kv_bytes_per_token("float32") == 8192


def test_inspect_reads_headers_only_and_is_fast(llama_8b):
    files = sorted(llama_8b.glob("*.safetensors"))
    allocated = sum(p.stat().st_blocks * 512 for p in files)
    assert allocated < 1 << 20, "the data regions should be holes"
    assert sum(p.stat().st_size for p in files) > 16 * 10**9
    before = _bytes_read()
    start = time.perf_counter()
    inspect(llama_8b)
    elapsed = time.perf_counter() - start
    read = _bytes_read() - before
    header_bytes = sum(int.from_bytes(p.open("rb").read(8), "little") + 8 for p in files)
    # config.json and the index are a few KB; the 16 GB of tensor data must not be touched
    assert read < header_bytes + 64 * 1024, f"inspect read {read:,} bytes; headers are {header_bytes:,}"
    assert elapsed < 1.0, f"inspect took {elapsed:.3f} s"


def test_weights_dtype_conversion_counts_the_converted_size(llama_8b):
    info = inspect(llama_8b)
    assert info.layer_bytes("float32") == (2 * LLAMA_LAYER_BYTES,) * 32
    assert info.weights_bytes("float16") == LLAMA_TOTAL_BYTES


def test_qwen2_biases_counted(tmp_path):
    info = inspect(write_sparse_model(tmp_path, QWEN2_5_7B))
    # per layer: q, o 3584x3584 = 12,845,056 each; k, v 512x3584 = 1,835,008 each;
    # gate, up, down 18944x3584 = 67,895,296 each; biases 3584 + 512 + 512; norms 2*3584
    layer = 2 * 12_845_056 + 2 * 1_835_008 + 3 * 67_895_296 + 3584 + 512 + 512 + 2 * 3584
    assert layer == 233_057_792
    assert info.layer_bytes() == (2 * layer,) * 28
    assert info.config.qkv_bias
    # 7.62 B parameters: 28 layers, embeddings and head 152064x3584 each, final norm
    assert info.weights_bytes() == 2 * (28 * layer + 2 * 152064 * 3584 + 3584) == 15_231_233_024
    assert info.kv_bytes_per_token() == 2 * 4 * 128 * 2


def test_qwen3_tied_embeddings_counted_once(tmp_path):
    info = inspect(write_sparse_model(tmp_path, QWEN3_0_6B))
    # per layer: q 2048x1024, k, v 1024x1024, o 1024x2048, MLP 3 x 3072x1024, norms 2*1024, q/k norms 2*128
    layer = 2 * 2_097_152 + 2 * 1_048_576 + 3 * 3_145_728 + 2048 + 256
    assert info.layer_bytes() == (2 * layer,) * 28
    assert info.tied_embeddings
    assert info.lm_head == info.embed
    embed = 151936 * 1024 * 2
    assert info.weights_bytes() == 28 * 2 * layer + embed + 2048 == 1_192_099_840  # 0.6 B parameters
    assert info.kv_bytes_per_token("bfloat16") == 2 * 8 * 128 * 2


def test_tied_checkpoint_that_stores_lm_head_does_not_count_it(tmp_path):
    info = inspect(write_sparse_model(tmp_path, QWEN3_0_6B, store_tied_head=True))
    assert info.tied_embeddings
    assert info.other.nbytes() == 151936 * 1024 * 2  # present in the file, never loaded
    assert info.weights_bytes() == 1_192_099_840


def test_matches_a_real_checkpoint(tmp_path):
    from factory import make_model

    model_dir = make_model(tmp_path / "m", "qwen2", dtype=torch.bfloat16)
    info = inspect(model_dir)
    ckpt = Checkpoint(model_dir)
    for i in range(info.num_layers):
        expected = sum(s.nbytes for n, s in ckpt.specs.items() if n.startswith(f"model.layers.{i}."))
        assert info.layer_bytes()[i] == expected
    assert info.weights_bytes() == sum(s.nbytes for s in ckpt.specs.values())
    assert info.compute_dtype == "bfloat16"


def test_layer_beyond_config_is_a_format_error(tmp_path):
    write_sparse_model(tmp_path, {**QWEN3_0_6B, "num_hidden_layers": 4})
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_0_6B, "num_hidden_layers": 3}))
    with pytest.raises(ModelFormatError, match="belongs to layer 3.*num_hidden_layers=3"):
        inspect(tmp_path)


def test_missing_layer_is_a_format_error(tmp_path):
    write_sparse_model(tmp_path, {**QWEN3_0_6B, "num_hidden_layers": 2})
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_0_6B, "num_hidden_layers": 3}))
    with pytest.raises(ModelFormatError, match="no weights for layer.* 2 of 3"):
        inspect(tmp_path)


def test_truncated_shard_is_refused(tmp_path):
    write_sparse_model(tmp_path, QWEN3_0_6B)
    path = tmp_path / "model.safetensors"
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(ModelFormatError, match="truncated"):
        inspect(tmp_path)
