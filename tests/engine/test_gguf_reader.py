"""The GGUF reader on files written by gguf-py: metadata, tensor infos, zero-copy views, parts, and bad files."""

import mmap
import shutil
import struct
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GGML  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402

from stowage.engine.errors import ModelFormatError  # noqa: E402
from stowage.engine.formats.gguf import GGML_TYPES, GGUFFile, find_gguf, open_gguf, read_metadata  # noqa: E402
from stowage.kernels.quants import FORMATS, dequantize, dequantize_rows  # noqa: E402

Q_NAME, F_NAME = "blk.0.attn_q.weight", "blk.0.ffn_norm.weight"


def weights(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def k_quant_bytes(type_name, shape, seed=0):
    """Random K-quant blocks (gguf-py cannot quantize to them) whose f16 scales are small and finite."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[type_name]
    raw = rng.integers(0, 256, (*shape[:-1], fmt.row_bytes(shape[-1])), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.bytes_per_block)
    for start in ([208] if type_name == "q6_k" else [0, 2]):  # d (and dmin)
        blocks[:, start : start + 2] = rng.uniform(-0.05, 0.05, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return raw


def write(path, tensors, *, kv=(), alignment=None, split_max_tensors=0):
    """A GGUF file (or parts) of `tensors`: name -> (array, ggml type or None for the array's own dtype)."""
    w = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    if alignment:
        w.add_custom_alignment(alignment)
    for key, value, vtype, *sub in kv:
        w.add_key_value(key, value, vtype, *sub)
    for name, (array, qtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small(tmp_path):
    """Two tensors and a uint8 array, small enough to patch by hand."""
    return write(tmp_path / "model.gguf", {
        Q_NAME: (gguf.quants.quantize(weights((4, 64)), GGML.Q8_0), GGML.Q8_0),
        F_NAME: (weights((2, 8), 1), None),
    }, kv=[("test.array", [1, 2, 3], V.ARRAY, V.UINT8)])


def test_type_ids_are_ggmls():
    for qtype in GGML:
        assert GGML_TYPES[qtype.value] == qtype.name.lower()


def test_metadata_of_every_value_type(tmp_path):
    kv = [("t.u8", 200, V.UINT8), ("t.i8", -100, V.INT8), ("t.u16", 60000, V.UINT16), ("t.i16", -30000, V.INT16),
          ("t.u32", 4_000_000_000, V.UINT32), ("t.i32", -2_000_000_000, V.INT32), ("t.f32", 0.1, V.FLOAT32),
          ("t.bool", True, V.BOOL), ("t.str", "héllo", V.STRING), ("t.u64", 2**63 + 5, V.UINT64),
          ("t.i64", -(2**62), V.INT64), ("t.f64", 0.1, V.FLOAT64),
          ("t.ints", [1, -2, 3], V.ARRAY, V.INT32), ("t.floats", [0.5, 0.25], V.ARRAY, V.FLOAT32),
          ("t.strs", ["a", "", "ünï"], V.ARRAY), ("t.nested", [[1, 2], [3]], V.ARRAY),
          ("t.nested_strs", [["x"], ["y", "z"]], V.ARRAY), ("t.bools", [True, False], V.ARRAY, V.BOOL)]
    path = write(tmp_path / "m.gguf", {"w": (weights((2, 4)), None)}, kv=kv)
    meta = GGUFFile(path).metadata
    assert meta["general.architecture"] == "llama"
    expected = {key: value for key, value, *_ in kv} | {"t.f32": float(np.float32(0.1))}
    assert {k: meta[k] for k in expected} == expected


def test_tensor_infos_match_what_was_written(tmp_path):
    tensors = {
        "f32": (weights((3, 5)), None),
        "f16": (weights((2, 3, 4)).astype(np.float16), None),
        "bf16": (gguf.quants.quantize(weights((4, 8)), GGML.BF16), GGML.BF16),
        "q8_0": (gguf.quants.quantize(weights((2, 64)), GGML.Q8_0), GGML.Q8_0),
        "q4_0": (gguf.quants.quantize(weights((3, 32)), GGML.Q4_0), GGML.Q4_0),
        "q5_1": (gguf.quants.quantize(weights((1, 96)), GGML.Q5_1), GGML.Q5_1),
        "q4_k": (k_quant_bytes("q4_k", (2, 512)), GGML.Q4_K),
        "q6_k": (k_quant_bytes("q6_k", (3, 256)), GGML.Q6_K),
        "vec": (weights((7,)), None),
    }
    path = write(tmp_path / "m.gguf", tensors)
    ours = GGUFFile(path)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert ours.version == 3 and list(ours.tensors) == list(tensors)
    shapes = {"f32": (3, 5), "f16": (2, 3, 4), "bf16": (4, 8), "q8_0": (2, 64), "q4_0": (3, 32), "q5_1": (1, 96),
              "q4_k": (2, 512), "q6_k": (3, 256), "vec": (7,)}
    dtype_names = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "vec": "float32"}
    for name, t in ours.tensors.items():
        assert t.shape == shapes[name]
        assert t.type_name == ("f32" if name == "vec" else name)
        assert t.dtype_name == dtype_names.get(name, name)
        assert (t.offset, t.nbytes, t.numel) == (theirs[name].data_offset, theirs[name].n_bytes,
                                                 theirs[name].n_elements)


def test_raw_views_are_mapped_not_copied(tmp_path):
    path = write(tmp_path / "m.gguf", {"w": (weights((4, 8)), None),
                                       "q": (k_quant_bytes("q5_k", (2, 256)), GGML.Q5_K),
                                       "b": (gguf.quants.quantize(weights((2, 8)), GGML.BF16), GGML.BF16)})
    f = GGUFFile(path)
    file_bytes = path.read_bytes()
    for name, dtype, shape in [("w", np.float32, (4, 8)), ("q", np.uint8, (2, 176)), ("b", np.int16, (2, 8))]:
        raw = f.raw(name)
        assert isinstance(raw, np.memmap) and not raw.flags.writeable
        assert raw.dtype == dtype and raw.shape == shape
        base = raw
        while not isinstance(base, mmap.mmap):  # the chain of views ends at the file mapping itself
            base = base.base
        t = f.tensors[name]
        assert raw.tobytes() == file_bytes[t.offset : t.offset + t.nbytes]
    assert np.array_equal(f.raw("w"), weights((4, 8)))
    # views into one mapping of the whole file: their addresses lie as far apart as their file offsets
    assert f.raw("q").ctypes.data - f.raw("w").ctypes.data == f.tensors["q"].offset - f.tensors["w"].offset


@pytest.mark.parametrize("qtype", [GGML.F32, GGML.F16, GGML.BF16, GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q5_0,
                                   GGML.Q5_1, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K])
def test_tensors_dequantize_like_gguf_py(tmp_path, qtype):
    name = qtype.name.lower()
    if name in ("q4_k", "q5_k", "q6_k"):
        raw = k_quant_bytes(name, (6, 256), seed=7)
    else:
        raw = gguf.quants.quantize(weights((6, 256), 7), qtype)
    path = write(tmp_path / "m.gguf", {"w": (raw, None if qtype in (GGML.F32, GGML.F16) else qtype)})
    f = GGUFFile(path)
    t = f.tensors["w"]
    expected = gguf.quants.dequantize(np.asarray(gguf.GGUFReader(path).tensors[0].data), qtype)
    ours = dequantize(f.raw("w"), t.type_name, t.shape)
    assert ours.shape == (6, 256) and np.array_equal(ours.numpy(), expected.reshape(6, 256))
    assert torch.equal(dequantize_rows(f.raw("w"), t.type_name, t.shape, 2, 5), ours[2:5])


def test_custom_alignment(tmp_path):
    path = write(tmp_path / "m.gguf", {"a": (weights((3,)), None), "b": (weights((5,)), None)}, alignment=256)
    f = GGUFFile(path)
    assert f.alignment == 256 and f.data_start % 256 == 0
    assert all((t.offset - f.data_start) % 256 == 0 for t in f.tensors.values())
    assert np.array_equal(f.raw("b"), weights((5,)))


@pytest.fixture
def parts(tmp_path):
    tensors = {f"t.{i}": (weights((2, 4), i), None) for i in range(3)}
    write(tmp_path / "model.gguf", tensors, kv=[("test.value", 7, V.UINT32)], split_max_tensors=1)
    paths = [tmp_path / f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(p.exists() for p in paths)
    return paths


def test_multi_part_model_opens_from_any_part(parts):
    for path in [parts[1], parts[0], parts[0].parent]:
        model = open_gguf(path)
        assert [p.path for p in model.parts] == parts
        assert list(model.tensors) == ["t.0", "t.1", "t.2"]
        assert model.metadata["test.value"] == 7 and model.metadata["split.count"] == 3
        assert [model.tensors[f"t.{i}"].path for i in range(3)] == parts
        for i in range(3):
            assert np.array_equal(model.raw(f"t.{i}"), weights((2, 4), i))


def test_a_missing_part_is_named(parts):
    parts[2].unlink()
    with pytest.raises(ModelFormatError, match="part model-00003-of-00003.gguf of this 3-part model is missing"):
        open_gguf(parts[0])


def test_a_tensor_in_two_parts_is_refused(parts):
    data = parts[1].read_bytes()
    parts[1].write_bytes(data.replace(b"t.1", b"t.0"))
    with pytest.raises(ModelFormatError, match="tensor 't.0' also appears in model-00001-of-00003.gguf"):
        open_gguf(parts[0])


def test_a_part_renamed_to_a_single_file_is_refused(parts, tmp_path):
    single = tmp_path / "alone.gguf"
    shutil.copy(parts[0], single)
    with pytest.raises(ModelFormatError, match="metadata says it is part 1 of 3, but its name says part 1 of 1"):
        open_gguf(single)


def test_find_gguf(tmp_path, parts, small):
    assert find_gguf(small) == small
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(small, one / "x.gguf")
    assert find_gguf(one) == one / "x.gguf"
    with pytest.raises(ModelFormatError, match="holds 2 GGUF models"):
        find_gguf(tmp_path)  # the split model and model.gguf
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="no .gguf file"):
        find_gguf(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelFormatError, match="not a .gguf file"):
        find_gguf(tmp_path / "notes.txt")
    with pytest.raises(ModelFormatError, match="no such file or folder"):
        find_gguf(tmp_path / "absent")


# --- bad files: each is refused with a message that says what is wrong ------------------------------------

def info_fields(data: bytes, name: str) -> dict[str, int]:
    """Byte positions of a tensor info's fields (dims, type, offset)."""
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (num_dims,) = struct.unpack_from("<I", data, at)
    return {"dims": at + 4, "type": at + 4 + 8 * num_dims, "offset": at + 8 + 8 * num_dims}


def patched(data: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, *(value if isinstance(value, tuple) else (value,)))
    return bytes(out)


def refused(path, data: bytes, match: str):
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match=match) as caught:
        GGUFFile(path)
    assert str(caught.value).startswith(path.name + ":")
    return caught.value


def test_truncated_files(small):
    data = small.read_bytes()
    q = GGUFFile(small).tensors[Q_NAME]
    in_array = data.index(b"test.array") + len(b"test.array") + 4 + 4 + 8 + 1  # types, count, one item
    in_infos = data.index(Q_NAME.encode()) + 3
    for cut, match in [(2, "not a GGUF file"), (12, "the header needs 8 bytes"),
                       (24 + 8 + 5, "the header's tensor count 2 cannot fit in the 37-byte file"),
                       (in_array, "metadata 'test.array' is an array of 3 items, which needs at least 3 bytes"),
                       (in_infos, "the name in tensor info 0 needs"),
                       (q.offset + 10, f"tensor '{Q_NAME}' data is not within the file bounds")]:
        message = refused(small, data[:cut], match)
        assert "truncated" in str(message) or cut == 2
    refused(small, b"", "the file is empty")


def test_lying_counts_and_lengths(small):
    data = small.read_bytes()
    refused(small, patched(data, 8, "<Q", 10**12), "tensor count 1,000,000,000,000 cannot fit")
    refused(small, patched(data, 16, "<Q", 10**12), "metadata count 1,000,000,000,000 cannot fit")
    refused(small, patched(data, 8, "<Q", 3), ".")  # one tensor more: the data read as an info does not hold up
    refused(small, patched(data, 24, "<Q", 2**50), "the key of metadata entry 0 needs 1,125,899,906,842,624 bytes")


def test_an_array_of_2_to_the_40_items_is_refused_without_allocating(small):
    data = small.read_bytes()
    count_at = data.index(b"test.array") + len(b"test.array") + 4 + 4  # value type, item type, then the count
    started = time.perf_counter()
    refused(small, patched(data, count_at, "<Q", 2**40), "'test.array' is an array of 1,099,511,627,776 items")
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("field,value,match", [
    ("offset", 2**40, f"tensor '{Q_NAME}' data is not within the file bounds"),
    ("offset", 8, "not a multiple of the alignment 32"),
    ("type", 99, f"tensor '{Q_NAME}' has unknown ggml type id 99"),
    ("type", 16, f"tensor '{Q_NAME}' is stored as IQ2_XXS, which Stowage does not read"),
    ("type", 10, "stored as Q2_K"),
    ("dims", (2**40, 2**40), "whose product overflows 64 bits"),
    ("dims", (63, 4), "rows of 63 weights, not a whole number of Q8_0 blocks of 32"),
])
def test_bad_tensor_infos(small, field, value, match):
    data = small.read_bytes()
    at = info_fields(data, Q_NAME)[field]
    refused(small, patched(data, at, "<QQ" if field == "dims" else ("<Q" if field == "offset" else "<I"), value),
            match)


def test_overlapping_tensors(small):
    data = small.read_bytes()
    # the q8_0 tensor takes bytes [0, 272) of the data; move the other to 256, still aligned
    refused(small, patched(data, info_fields(data, F_NAME)["offset"], "<Q", 256),
            f"tensors '{Q_NAME}' and '{F_NAME}' overlap")


@pytest.mark.parametrize("at,fmt,value,match", [
    (0, "<4s", b"GGML", "not a GGUF file .it starts with b'GGML'"),
    (4, "<I", 1, "GGUF version 1 is an early format"),
    (4, "<I", 4, "GGUF version 4 is not one Stowage knows"),
    (4, "<I", 3 << 24, "big-endian"),
])
def test_bad_headers(small, at, fmt, value, match):
    refused(small, patched(small.read_bytes(), at, fmt, value), match)


def test_bad_metadata(tmp_path):
    path = write(tmp_path / "m.gguf", {"w": (weights((2, 4)), None)}, alignment=64,
                 kv=[("test.aa", 1, V.UINT32), ("test.bb", [[1]], V.ARRAY)])
    data = path.read_bytes()
    refused(path, data.replace(b"test.bb", b"test.aa"), "metadata key 'test.aa' appears twice")
    alignment_at = data.index(b"general.alignment") + len(b"general.alignment") + 4
    refused(path, patched(data, alignment_at, "<I", 48), "general.alignment is 48; it must be a power of two")
    type_at = data.index(b"test.aa") + len(b"test.aa")
    refused(path, patched(data, type_at, "<I", 13), "metadata 'test.aa' has unknown value type 13")
    inner_type_at = data.index(b"test.bb") + len(b"test.bb") + 4 + 4 + 8  # outer type, item type, length
    refused(path, patched(data, inner_type_at, "<I", 77), r"metadata 'test.bb'\[0\] has unknown item type 77")
    nested = [1]
    for _ in range(8):
        nested = [nested]
    deep = write(tmp_path / "deep.gguf", {"w": (weights((2, 4)), None)}, kv=[("test.deep", nested, V.ARRAY)])
    with pytest.raises(ModelFormatError, match=r"metadata 'test.deep'(\[0\]){8} nests arrays more than 8 deep"):
        GGUFFile(deep)
    nested[0] = nested[0][0]  # eight deep is fine
    assert GGUFFile(write(deep, {"w": (weights((2, 4)), None)}, kv=[("test.deep", nested, V.ARRAY)])).metadata[
        "test.deep"] == nested


def test_read_metadata_reads_only_the_keys_asked_for(tmp_path):
    path = write(tmp_path / "m.gguf", {F_NAME: (weights((2, 8)), None)},
                 kv=[("test.strings", ["a", "bc"] * 1000, V.ARRAY, V.STRING), ("test.nested", [[1], [2, 3]], V.ARRAY),
                     ("general.file_type", 15, V.UINT32)])
    assert read_metadata(path, frozenset({"general.architecture", "general.file_type"})) == {
        "general.architecture": "llama", "general.file_type": 15}
    assert read_metadata(path, frozenset({"absent"})) == {}
    data = path.read_bytes()
    count_at = data.index(b"test.strings") + len(b"test.strings") + 4 + 4
    path.write_bytes(patched(data, count_at, "<Q", 2**40))  # a skipped array that lies is refused all the same
    started = time.perf_counter()
    with pytest.raises(ModelFormatError, match="metadata 'test.strings' needs 8,796,093,022,208 bytes"):
        read_metadata(path, frozenset({"general.file_type"}))
    assert time.perf_counter() - started < 1.0


def test_a_gguf_file_without_the_suffix_opens_by_its_magic(small, tmp_path):
    blob = tmp_path / "sha256-0123"  # how Ollama stores a model
    shutil.copy(small, blob)
    assert find_gguf(blob) == blob and Q_NAME in open_gguf(blob).tensors
