"""A GGUF file's tokenizer is built once per file identity and read back from a JSON file on disk: the same
encodings, no metadata parsed; a changed file builds again; a damaged entry is rebuilt, never an error."""

import json
import os
from pathlib import Path

import pytest
from factory import make_model
from gguf_factory import write_gguf

from stowage.engine.formats.gguf import open_gguf
from stowage.engine.text import gguf_tokenizer
from stowage.engine.text.gguf_tokenizer import MAX_CACHED, cached_tokenizer

TEXTS = ["Stowage plans memory", "  two  spaces\nand a line", "<|end|> special", "Café 東京 🚀 123456"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tokcache"), "llama")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "tokenizers"
    monkeypatch.setenv(gguf_tokenizer.TOKENIZER_DIR_ENV, str(folder))
    return folder


class Metadata:
    """metadata() for cached_tokenizer, counting how often the file's metadata had to be parsed."""

    def __init__(self, path):
        self.path, self.calls = path, 0

    def __call__(self):
        self.calls += 1
        return open_gguf(self.path).metadata


def encodings(tok):
    return [tok.encode(t) for t in TEXTS], tok.bos_token, tok.eos_token, tok.chat_template


def test_second_read_comes_from_the_cache(model_dir, tmp_path, cache):
    path = write_gguf(model_dir, tmp_path / "m.gguf", "q8_0")
    first, second = Metadata(path), Metadata(path)
    built = cached_tokenizer(path, first, path.name)
    read = cached_tokenizer(path, second, path.name)
    assert (first.calls, second.calls) == (1, 0)
    assert encodings(read) == encodings(built)
    assert read.chat_template and read.eos_token == "<|end|>"
    assert [read.decode(ids) for ids in encodings(read)[0]] == [built.decode(ids) for ids in encodings(built)[0]]
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 2 and all(name.endswith(".json") for name in entries)
    for name in entries:  # plain JSON, nothing executable
        json.loads((cache / name).read_text())


def test_a_changed_file_builds_again(model_dir, tmp_path, cache):
    path = write_gguf(model_dir, tmp_path / "m.gguf", "q8_0")
    old = cached_tokenizer(path, Metadata(path), path.name)
    changed_dir = tmp_path / "changed"
    changed_dir.mkdir()
    for f in model_dir.iterdir():
        (changed_dir / f.name).write_bytes(f.read_bytes())
    (changed_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    write_gguf(changed_dir, path, "q8_0")  # the same path, rewritten: another template in the metadata
    again = Metadata(path)
    new = cached_tokenizer(path, again, path.name)
    assert again.calls == 1
    assert new.chat_template != old.chat_template and new.chat_template.startswith("{% for m in messages %}[")
    touched = Metadata(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # same bytes, a newer mtime: built again
    cached_tokenizer(path, touched, path.name)
    assert touched.calls == 1


def test_a_damaged_entry_is_rebuilt(model_dir, tmp_path, cache):
    path = write_gguf(model_dir, tmp_path / "m.gguf", "q8_0")
    built = cached_tokenizer(path, Metadata(path), path.name)
    (tokenizer_file,) = cache.glob("*.tokenizer.json")
    tokenizer_file.write_text(tokenizer_file.read_text()[:1000])  # cut short
    rebuilt = Metadata(path)
    assert encodings(cached_tokenizer(path, rebuilt, path.name)) == encodings(built)
    assert rebuilt.calls == 1
    (entry,) = (p for p in cache.glob("*.json") if not p.name.endswith(".tokenizer.json"))
    entry.write_text('{"identity": ')  # not JSON
    assert encodings(cached_tokenizer(path, Metadata(path), path.name)) == encodings(built)
    again = Metadata(path)
    cached_tokenizer(path, again, path.name)
    assert again.calls == 0  # the rebuilt entry is whole again


def test_an_unwritable_cache_still_gives_the_tokenizer(model_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_tokenizer.TOKENIZER_DIR_ENV, str(blocker / "tokenizers"))  # under a file: cannot exist
    path = write_gguf(model_dir, tmp_path / "m.gguf", "q8_0")
    assert cached_tokenizer(path, Metadata(path), path.name).encode("Stowage")


def test_the_cache_keeps_the_most_recently_used(model_dir, tmp_path, cache, monkeypatch):
    paths = [write_gguf(model_dir, tmp_path / f"m{i}.gguf", "q8_0") for i in range(4)]
    for p in paths[:3]:
        cached_tokenizer(p, Metadata(p), p.name)
    for entry in (p for p in cache.glob("*.json") if not p.name.endswith(".tokenizer.json")):
        used = [p.resolve() for p in paths].index(Path(json.loads(entry.read_text())["identity"][2]))  # m0: oldest
        os.utime(entry, (1_000_000 + used, 1_000_000 + used))
    monkeypatch.setattr(gguf_tokenizer, "MAX_CACHED", 3)
    cached_tokenizer(paths[3], Metadata(paths[3]), paths[3].name)  # a fourth: the least recently used goes
    assert len(list(cache.glob("*.tokenizer.json"))) == 3
    calls = []
    for p in (paths[2], paths[0]):
        m = Metadata(p)
        cached_tokenizer(p, m, p.name)
        calls.append(m.calls)
    assert calls == [0, 1]
    assert MAX_CACHED >= 3
