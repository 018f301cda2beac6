"""Malformed weight files are refused with a typed error naming the file and the tensor."""

import json
import os
import struct

import pytest
import torch
from factory import make_model

from stowage.engine.formats.checkpoint import Checkpoint
from stowage.engine.runtime.engine import Engine
from factory import cpu_plan
from stowage.engine.errors import ModelFormatError, UnsupportedModelError
from stowage.engine.formats.safetensors import MappedFile, read_header
from stowage.engine.runtime.sampler import SamplingParams


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


# -- issue 12: shard indexes, paths and file kinds ----------------------------------------------------------------

def sharded(tmp_path):
    """A two-shard copy of the tiny model: (folder, weight_map)."""
    from safetensors.torch import load_file, save_file
    d = make_model(tmp_path / "m", "llama")
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, keys in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in keys}, d / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, file)
    return d, weight_map


def write_index(d, weight_map):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    return sharded(tmp_path_factory.mktemp("shards"))


@pytest.fixture
def shard_folder(two_shards, tmp_path):
    d, weight_map = two_shards
    for f in d.iterdir():
        os.link(f, tmp_path / f.name)
    return tmp_path, dict(weight_map)


@pytest.mark.parametrize("weight_map,message", [
    (["model-00001-of-00002.safetensors"], "weight_map must map tensor names to file names"),
    (None, "weight_map must map tensor names to file names"),
    ({"model.norm.weight": 3}, "weight_map values must be file names, got 3"),
    ({"model.norm.weight": None}, "weight_map values must be file names, got None"),
    ({"model.norm.weight": ["a.safetensors"]}, "weight_map values must be file names"),
    ({}, "weight_map names no files"),
])
def test_malformed_weight_map(shard_folder, weight_map, message):
    d, _ = shard_folder
    write_index(d, weight_map)
    with pytest.raises(ModelFormatError, match=message):
        Checkpoint(d)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "",
                                  "./model-00001-of-00002.safetensors", "a\\..\\b.safetensors", "nul\0.safetensors"])
def test_index_may_only_name_files_inside_the_folder(shard_folder, tmp_path_factory, name):
    d, weight_map = shard_folder
    outside = tmp_path_factory.mktemp("elsewhere")
    (outside / "outside.safetensors").write_bytes((d / "model-00001-of-00002.safetensors").read_bytes())
    write_index(d, {**weight_map, "model.norm.weight": name})
    with pytest.raises(ModelFormatError, match="not a plain file name inside the model folder"):
        Checkpoint(d)


def test_symlinks_into_a_hugging_face_blobs_folder_load(two_shards, tmp_path):
    # snapshots/<rev>/model-0000N... -> ../../blobs/<hash>, as huggingface_hub lays out its cache
    d, weight_map = two_shards
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(d.iterdir())):
        (blobs / f"{i:040x}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(f"../../blobs/{i:040x}")
    ckpt = Checkpoint(snapshot)
    assert set(ckpt.specs) == set(weight_map)
    engine = Engine.load(snapshot, cpu_plan(snapshot, 32))
    assert engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2)).run()


def hang_guard(seconds=10):
    import signal
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("opening the weights hung"))
    signal.alarm(seconds)  # not a timing assertion: only a guard against waiting forever


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_weights_that_are_not_regular_files_are_refused_without_opening(tmp_path, kind):
    from stowage.engine.planning import inspect
    d = make_model(tmp_path / "m", "llama")
    (d / "model.safetensors").unlink()
    {"fifo": lambda p: os.mkfifo(p), "device": lambda p: p.symlink_to("/dev/zero"),
     "folder": lambda p: p.mkdir()}[kind](d / "model.safetensors")
    hang_guard()
    try:
        with pytest.raises(ModelFormatError, match="model.safetensors: not a regular file"):
            inspect(d)
    finally:
        import signal
        signal.alarm(0)


def test_a_fifo_named_in_an_index_is_refused(shard_folder):
    d, _ = shard_folder
    shard = d / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    hang_guard()
    try:
        with pytest.raises(ModelFormatError, match="not a regular file"):
            Checkpoint(d)
    finally:
        import signal
        signal.alarm(0)


@pytest.mark.parametrize("entry,message", [
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}, "not a pair of integers"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "not a list of non-negative integers"),
])
def test_entries_of_the_wrong_type(tmp_path, entry, message):
    path = write_file(tmp_path / "bad.safetensors", {"w": entry}, b"\0" * 8)
    with pytest.raises(ModelFormatError, match=message):
        read_header(path)


@pytest.mark.parametrize("raw", [b"[" * 50_000 + b"]" * 50_000, b'{"w": ' + b"9" * 5000 + b"}", b'{"w": "\xff"}'])
def test_headers_python_json_cannot_take(tmp_path, raw):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ModelFormatError, match="header is not valid JSON"):
        read_header(path)
