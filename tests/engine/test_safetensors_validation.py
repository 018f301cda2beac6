"""Malformed weight files are refused with a typed error naming the file and the tensor."""

import json
import struct

import pytest
import torch
from factory import make_model

from engine.checkpoint import Checkpoint
from engine.engine import Engine
from factory import cpu_plan
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.safetensors import MappedFile, read_header


def write_file(path, header: dict, data: bytes, header_len: int | None = None):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", header_len if header_len is not None else len(raw)) + raw + data)
    return path


def test_reads_bf16_without_copy(tmp_path):
    values = torch.randn(4, 8).to(torch.bfloat16)
    data = values.view(torch.int16).numpy().tobytes()
    path = write_file(tmp_path / "a.safetensors",
                      {"w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, len(data)]}}, data)
    spec = read_header(path)["w"]
    mapped = MappedFile(path)
    t = mapped.tensor(spec)
    assert t.dtype == torch.bfloat16 and torch.equal(t, values)
    # the tensor's memory is the mapping itself
    base = mapped._map.ctypes.data
    assert base <= t.data_ptr() < base + path.stat().st_size


@pytest.mark.parametrize("header,data,header_len,message", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 10**6, "beyond the file"),
    ({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 8, None, "outside the data area"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12 bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlap"),
])
def test_lying_headers_are_refused(tmp_path, header, data, header_len, message):
    path = write_file(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(ModelFormatError, match=message) as err:
        read_header(path)
    assert "bad.safetensors" in str(err.value)


def test_header_not_json(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 8)
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        read_header(path)


def test_truncated_file(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ModelFormatError, match="too short"):
        read_header(path)


def test_truncated_real_model_names_the_tensor(tmp_path):
    d = make_model(tmp_path, "llama")
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(ModelFormatError, match=r"model.safetensors: tensor '.*'.*outside the data area"):
        Engine.load(d, cpu_plan(d, 32))


def test_missing_tensor_is_named(tmp_path):
    d = make_model(tmp_path, "llama")
    from safetensors.torch import load_file, save_file
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"model.layers.1.mlp.up_proj.weight"):
        Engine.load(d, cpu_plan(d, 32))


def test_sharded_model_and_missing_shard(tmp_path):
    d = make_model(tmp_path / "m", "llama")
    from safetensors.torch import load_file, save_file
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = Checkpoint(d)
    assert set(ckpt.specs) == set(tensors)
    assert torch.equal(ckpt.tensor(names[-1]), tensors[names[-1]])
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="model-00002-of-00002.safetensors .*missing"):
        Checkpoint(d)


def test_pickle_checkpoints_are_refused_not_loaded(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    # a file that would run code if unpickled; we must never open it as a pickle
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch PWNED'\ntR.")
    with pytest.raises(ModelFormatError, match="never unpickles.*[Cc]onvert"):
        Checkpoint(tmp_path)
    assert not (tmp_path / "PWNED").exists()


def test_unknown_architecture_lists_supported(tmp_path):
    d = make_model(tmp_path, "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="llama.*mistral.*qwen2.*qwen3"):
        Engine.load(d, cpu_plan(d, 32))
