import json
import shutil

from stowage.app.model_catalog import ModelEntry, find_models


def test_finds_models_folder_and_hf_cache(tmp_path, tiny_model_dir):
    models = tmp_path / "models"
    shutil.copytree(tiny_model_dir, models / "my-llama")
    (models / "not-a-model").mkdir()
    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny-chat"
    old, new = repo / "snapshots" / "aaa", repo / "snapshots" / "bbb"
    shutil.copytree(tiny_model_dir, old)
    shutil.copytree(tiny_model_dir, new)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa\n")  # refs/main wins over the newer snapshot
    partial = hub / "models--someone--partial" / "snapshots" / "ccc"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # weights not downloaded yet: not offered

    found = [e for e in find_models(hf_cache=hub, stowage_models=models, home=tmp_path / "home")
             if e.source != "demo"]
    assert [(e.name, e.source) for e in found] == [("my-llama", "stowage"), ("someone/tiny-chat", "huggingface")]
    assert found[1].path == old
    assert found[1].label == "someone/tiny-chat (HF cache)"


def test_offers_lm_studio_and_ollama_models_in_place(tmp_path, tiny_model_dir):
    from gguf_factory import write_gguf

    home = tmp_path / "home"
    lm = home / ".lmstudio" / "models" / "someone" / "Tiny-GGUF"
    lm.mkdir(parents=True)
    write_gguf(tiny_model_dir, lm / "Tiny-Q8_0.gguf", "q8_0")
    store = home / ".ollama" / "models"
    (store / "blobs").mkdir(parents=True)
    blob = store / "blobs" / ("sha256-" + "a" * 64)  # a real GGUF file under its digest, as Ollama keeps it
    shutil.copy(lm / "Tiny-Q8_0.gguf", blob)
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:" + "a" * 64}]}))
    (store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "broken").write_text("{")  # skipped

    found = [e for e in find_models(hf_cache=tmp_path / "no-hub", stowage_models=tmp_path / "models", home=home)
             if e.source != "demo"]
    assert found == [ModelEntry("someone/Tiny-GGUF/Tiny-Q8_0", lm / "Tiny-Q8_0.gguf", "lmstudio", "Q8_0"),
                     ModelEntry("tiny:latest", blob, "ollama", "Q8_0")]
    assert [e.label for e in found] == ["someone/Tiny-GGUF/Tiny-Q8_0 (Q8_0, LM Studio)", "tiny:latest (Q8_0, Ollama)"]
