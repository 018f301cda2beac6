"""One function opens a model path, whatever it holds: a Hugging Face folder, a GGUF file, any part of a split
GGUF, a folder holding one. The same model comes out the same way each time."""

import pytest
from factory import make_model
from gguf_factory import write_gguf

from stowage.engine.errors import ModelFormatError
from stowage.engine.formats.source import open_source


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    hf = make_model(root / "hf")
    (root / "single").mkdir()
    single = write_gguf(hf, root / "single" / "tiny-f32.gguf", "f32")
    (root / "split").mkdir()
    first = write_gguf(hf, root / "split" / "tiny-f32.gguf", "f32", split_max_tensors=7)
    parts = sorted((root / "split").glob("*.gguf"))
    assert len(parts) > 1 and first in parts
    return {"hf": hf, "file": single, "folder": single.parent, "first part": parts[0], "last part": parts[-1]}


@pytest.mark.parametrize("kind", ["hf", "file", "folder", "first part", "last part"])
def test_every_kind_of_path_opens_to_the_same_model(paths, kind):
    reference = open_source(paths["hf"])
    source = open_source(paths[kind])
    assert (source.gguf is None) == (kind == "hf")
    assert source.config.num_layers == reference.config.num_layers
    assert source.config.hidden_size == reference.config.hidden_size
    assert source.layout().read_names() == reference.layout().read_names()  # tensors under the same names
    assert source.tokenizer.encode("hello world") == reference.tokenizer.encode("hello world")
    assert all(path.is_file() for path in source.files)
    if kind.endswith("part"):
        assert len(source.files) > 1  # every part, whichever one was named


def test_a_folder_with_neither_format_is_a_typed_error(tmp_path):
    with pytest.raises(ModelFormatError):
        open_source(tmp_path)
