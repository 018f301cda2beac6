import shutil

from app.model_catalog import find_models


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

    found = [e for e in find_models(hf_cache=hub, stowage_models=models) if e.source != "demo"]
    assert [(e.name, e.source) for e in found] == [("my-llama", "stowage"), ("someone/tiny-chat", "huggingface")]
    assert found[1].path == old
    assert found[1].label == "someone/tiny-chat (HF cache)"
