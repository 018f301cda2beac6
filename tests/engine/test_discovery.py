"""Models found where people keep them, in a fake HOME: Stowage's folder, LM Studio's, Ollama's store (real
manifests naming a real GGUF blob), the HF cache; `stowage list` prints them. Nothing is copied."""

import argparse
import hashlib
import io
import json
import shutil

import pytest

gguf = pytest.importorskip("gguf")
from factory import make_model  # noqa: E402
from gguf_factory import write_gguf  # noqa: E402

from stowage.engine.formats.discovery import Places, add_list_parser, default_models_dir, discover  # noqa: E402
from stowage.engine.formats.gguf_model import open_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama as a HF folder and as a Q8_0 GGUF file."""
    root = tmp_path_factory.mktemp("tiny")
    hf = make_model(root / "hf", "llama", num_hidden_layers=1, intermediate_size=64)
    return hf, write_gguf(hf, root / "tiny-q8_0.gguf", "q8_0")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def add_ollama_model(store, name_parts, blob: bytes, *, file_type="Q8_0"):
    """An Ollama model as `ollama pull` leaves it: the blobs by digest, a manifest naming them."""
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": file_type}).encode()
    layers = []
    for data, media in [(blob, "application/vnd.ollama.image.model"),
                        (b'{"temperature": 0.7}', "application/vnd.ollama.image.params")]:
        (store / "blobs" / f"sha256-{sha256(data)}").write_bytes(data)
        layers.append({"mediaType": media, "digest": f"sha256:{sha256(data)}", "size": len(data)})
    (store / "blobs" / f"sha256-{sha256(config)}").write_bytes(config)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": f"sha256:{sha256(config)}", "size": len(config)}, "layers": layers}
    path = store / "manifests" / "/".join(name_parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return store / "blobs" / f"sha256-{sha256(blob)}"


@pytest.fixture
def home(tmp_path, tiny):
    """A HOME with a model in each place, and the broken things a real one has."""
    hf, gguf_file = tiny
    home = tmp_path / "home"
    lm = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    lm.mkdir(parents=True)
    shutil.copy(gguf_file, lm / "Tiny-Q8_0.gguf")
    shutil.copy(gguf_file, lm / "Tiny-BF16-00001-of-00002.gguf")  # a split model lists once, by its first part
    shutil.copy(gguf_file, lm / "Tiny-BF16-00002-of-00002.gguf")
    w = gguf.GGUFWriter(lm / "mmproj-Tiny-f16.gguf", "clip")  # a vision projector: not a model
    w.add_tensor("v.weight", __import__("numpy").zeros(4, "float32"))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    (lm / "notes.txt").write_text("not a model")
    (lm / "Broken-Q4_K_M.gguf").write_bytes(b"GGUF\x03\x00")  # a download cut short
    (home / ".cache" / "lm-studio").mkdir(parents=True)
    (home / ".cache" / "lm-studio" / "models").symlink_to(home / ".lmstudio" / "models")  # its old folder, linked
    store = home / ".ollama" / "models"
    add_ollama_model(store, ["registry.ollama.ai", "library", "tiny", "latest"], gguf_file.read_bytes())
    add_ollama_model(store, ["hf.co", "someone", "Tiny-GGUF", "Q8_0"], gguf_file.read_bytes())
    broken = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    gone = store / "manifests" / "registry.ollama.ai" / "someone" / "gone" / "7b"
    gone.parent.mkdir(parents=True)
    gone.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                            "digest": "sha256:" + "0" * 64}]}))
    models = home / "stowage" / "models"
    shutil.copytree(hf, models / "my-llama")
    shutil.copy(gguf_file, models / "dropped-q8_0.gguf")
    (models / "empty-folder").mkdir()
    return home


def places(home, env=None):
    return Places.default(home / "stowage" / "models", home=home, env=env or {})


def test_finds_every_place_and_notes_what_it_skips(home, tiny):
    found = discover(places(home))
    rows = [(m.name, m.source, m.format, m.quant) for m in found.models]
    assert rows == [
        ("dropped-q8_0", "stowage", "gguf", "Q8_0"),
        ("my-llama", "stowage", "safetensors", None),
        ("lmstudio-community/Tiny-GGUF/Tiny-BF16", "lmstudio", "gguf", "Q8_0"),  # the file says Q8_0, not its name
        ("lmstudio-community/Tiny-GGUF/Tiny-Q8_0", "lmstudio", "gguf", "Q8_0"),
        ("hf.co/someone/Tiny-GGUF:Q8_0", "ollama", "gguf", "Q8_0"),
        ("tiny:latest", "ollama", "gguf", "Q8_0"),
    ]
    size = tiny[1].stat().st_size
    by_name = {m.name: m for m in found.models}
    assert by_name["lmstudio-community/Tiny-GGUF/Tiny-BF16"].size_bytes == 2 * size  # both parts
    assert by_name["tiny:latest"].size_bytes == size
    assert by_name["my-llama"].size_bytes == (home / "stowage/models/my-llama/model.safetensors").stat().st_size
    notes = "\n".join(found.notes)
    assert len(found.notes) == 3, notes
    assert "Broken-Q4_K_M.gguf: skipped, not a readable GGUF file" in notes
    assert "Ollama model broken:latest: skipped, its manifest" in notes
    assert "Ollama model someone/gone:7b: skipped, its model layer" in notes


def test_an_ollama_model_is_its_blob_opened_in_place(home, tiny):
    model = next(m for m in discover(places(home)).models if m.name == "tiny:latest")
    store = home / ".ollama" / "models"
    assert model.path.parent == store / "blobs" and model.path.name.startswith("sha256-")
    assert model.path.read_bytes() == tiny[1].read_bytes()
    assert open_model(model.path).config == open_model(tiny[1]).config  # the blob is the model, no .gguf needed
    assert not any(p.suffix == ".gguf" for p in store.rglob("*"))  # nothing copied or linked into the store


def test_ollama_models_env_and_a_missing_home(tmp_path, home):
    moved = tmp_path / "elsewhere"
    shutil.move(home / ".ollama" / "models", moved)
    found = discover(places(home, {"OLLAMA_MODELS": str(moved)}))
    assert {m.name for m in found.models if m.source == "ollama"} == {"tiny:latest", "hf.co/someone/Tiny-GGUF:Q8_0"}
    nothing = discover(Places.default(None, home=tmp_path / "nobody", env={}))
    assert nothing.models == () and nothing.notes == ()


def test_the_hf_cache_follows_its_variables(tmp_path):
    assert Places.default(None, home=tmp_path, env={}).hf_cache == tmp_path / ".cache/huggingface/hub"
    assert Places.default(None, home=tmp_path, env={"HF_HOME": "/h"}).hf_cache.as_posix() == "/h/hub"
    assert Places.default(None, home=tmp_path, env={"HF_HOME": "/h", "HF_HUB_CACHE": "/c"}).hf_cache.as_posix() == "/c"
    assert default_models_dir({"STOWAGE_DATA_DIR": "/d"}).as_posix() == "/d/models"


def run(home, *argv):
    parser = argparse.ArgumentParser()
    add_list_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["list", *argv])
    out = io.StringIO()
    assert args.func(args, places=places(home), out=out) == 0
    return out.getvalue()


def test_stowage_list_prints_a_table_and_json(home, capsys):
    table = run(home).splitlines()
    assert table[0].split() == ["NAME", "SOURCE", "FORMAT", "QUANT", "SIZE", "PATH"]
    tiny = next(line for line in table if line.startswith("tiny:latest"))
    assert tiny.split()[1:4] == ["ollama", "gguf", "Q8_0"] and "KiB" in tiny and "sha256-" in tiny
    assert "note: " in capsys.readouterr().err
    data = json.loads(run(home, "--json"))
    assert [m["name"] for m in data["models"]][:2] == ["dropped-q8_0", "my-llama"]
    assert set(data["models"][0]) == {"name", "path", "format", "size_bytes", "quant", "source"}
    assert len(data["notes"]) == 3


def test_an_ollama_blob_plans_and_generates_like_its_gguf_file(home, tiny):
    from factory import cpu_plan

    from stowage.engine.runtime.engine import Engine
    from stowage.engine.formats.source import is_gguf
    from stowage.engine.runtime.sampler import SamplingParams

    blob = next(m for m in discover(places(home)).models if m.name == "tiny:latest").path
    assert is_gguf(blob)
    results = []
    for path in (blob, tiny[1]):
        plan = cpu_plan(path, 128)
        engine = Engine.load(path, plan)
        ids = engine.tokenizer.encode("hello there")
        reply = engine.generate(ids, SamplingParams(temperature=0, max_tokens=8)).run()
        results.append((plan.devices[0].weights_bytes, reply.token_ids))
    assert results[0] == results[1] and len(results[0][1]) > 0
