"""What the app opened, `stowage list` lists, on every platform: the app shares it in a JSON file of its data folder
(found by review: the CLI read Qt's settings file by hand, on Linux only, and misread some names)."""

import json

from gguf_factory import write_gguf
from PySide6.QtCore import QSettings

from stowage.engine.cli import main


def listed(capsys) -> list[tuple[str, str]]:
    assert main(["list", "--json"]) == 0
    return [(m["name"], m["source"]) for m in json.loads(capsys.readouterr().out)["models"] if m["source"] == "app"]


def test_models_opened_in_the_app_are_listed_by_the_cli(app_driver, tiny_model_dir, tmp_path, isolated_user_files,
                                                         monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    older = write_gguf(tiny_model_dir, tmp_path / "@weird\tname-Q8_0.gguf", "q8_0")
    isolated_user_files.mkdir(parents=True, exist_ok=True)
    settings = QSettings(str(isolated_user_files / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("model_folders", [str(older)])  # kept by a version that did not share them
    settings.sync()
    assert listed(capsys) == []

    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    assert listed(capsys) == [("@weird\tname-Q8_0", "app")]  # shared when the window starts

    downloads = tmp_path / "Downloads"
    downloads.mkdir()
    opened = write_gguf(tiny_model_dir, downloads / "Opened-Q8_0.gguf", "q8_0")
    window.settings_panel.picker.open_path(str(opened))  # Open… (or a drop) on a .gguf file
    app_driver.qtbot.waitUntil(lambda: window.qsettings.value("last_model") == str(opened),  # inspected
                               timeout=app_driver.timeout_ms)
    assert listed(capsys) == [("@weird\tname-Q8_0", "app"), ("Opened-Q8_0", "app")]
