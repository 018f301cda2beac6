"""Issue 30, items 1 and 17: the picker opens .gguf files and folders of them, by dialog or by drop; models added
where Stowage looks appear without a restart; a GGUF is named after its file and described by its quantization."""

import os
import shutil

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent
from PySide6.QtWidgets import QFileDialog, QProxyStyle, QStyle, QStyleOptionComboBox

from stowage.app.model_catalog import ModelEntry


@pytest.fixture(scope="module")
def gguf_pair(tiny_model_dir, tmp_path_factory):
    """Two GGUF models in one folder, as a Downloads folder holds them."""
    from gguf_factory import write_gguf

    folder = tmp_path_factory.mktemp("Downloads")
    write_gguf(tiny_model_dir, folder / "Tiny-Chat-Q8_0.gguf", "q8_0")
    write_gguf(tiny_model_dir, folder / "Other-Model-F32.gguf", "f32")
    return folder


def picker_texts(window):
    combo = window.settings_panel.model_combo
    return [combo.itemText(i) for i in range(combo.count())]


def planned_for(window, app_driver, path):
    """Wait until `path` is inspected and planned (not only chosen)."""
    forecast = lambda: window.settings_panel.forecast  # noqa: E731
    app_driver.qtbot.waitUntil(lambda: forecast() is not None and str(forecast().info.model_dir) == str(path)
                               and window.settings_panel.plan is not None, timeout=app_driver.timeout_ms)


def test_the_picker_offers_gguf_files(app_driver, tiny_model_dir, gguf_pair, monkeypatch):
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    asked = {}

    def dialog(parent, caption, folder, filters):
        asked["filters"] = filters
        return str(gguf_pair / "Tiny-Chat-Q8_0.gguf"), filters

    monkeypatch.setattr(QFileDialog, "getOpenFileName", dialog)
    window.settings_panel.picker.file_action.trigger()
    assert "*.gguf" in asked["filters"]
    planned_for(window, app_driver, gguf_pair / "Tiny-Chat-Q8_0.gguf")
    assert window.settings_panel.model_combo.currentText() == "Tiny-Chat-Q8_0 (Q8_0)"


def test_a_folder_of_several_ggufs_lists_every_one_and_opens_the_first(app_driver, tiny_model_dir, gguf_pair,
                                                                      monkeypatch):
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *args: str(gguf_pair))
    window.settings_panel.picker.folder_action.trigger()
    first = gguf_pair / "Other-Model-F32.gguf"
    planned_for(window, app_driver, first)
    texts = picker_texts(window)
    assert "Other-Model-F32 (F32)" in texts and "Tiny-Chat-Q8_0 (Q8_0)" in texts
    # Said under the model's facts (not only until they come): the folder's other model is in the list too.
    info = window.settings_panel.picker.info.text()
    assert "Reading" not in info and f"{gguf_pair.name} holds 2 GGUF models" in info
    assert window.error_box is None  # nothing refused, no "choose one by passing its .gguf file"
    window.choose_model(str(gguf_pair))  # the folder itself (remembered from before it held two): the same
    assert window.model_dir == str(first)  # a file is inspected, never the folder the engine would refuse
    assert "holds 2 GGUF models" in window.settings_panel.picker.info.text()


def test_dropping_a_gguf_file_or_a_model_folder_on_the_window_opens_it(app_driver, tiny_model_dir, gguf_pair,
                                                                      tmp_path):
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)

    def drop(*paths):
        mime = QMimeData()
        mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
        event = QDropEvent(QPointF(50, 50), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                           Qt.KeyboardModifier.NoModifier)
        event.ignore()
        # The offscreen platform has no drag and drop to deliver it: the window's handler is called as Qt would.
        window.dropEvent(event)
        return event.isAccepted()

    gguf = gguf_pair / "Tiny-Chat-Q8_0.gguf"
    assert drop(gguf)
    planned_for(window, app_driver, gguf)
    folder = tmp_path / "dropped-model"
    shutil.copytree(tiny_model_dir, folder)
    assert drop(folder)
    planned_for(window, app_driver, folder)
    assert window.settings_panel.model_combo.currentText() == "dropped-model"
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    assert not drop(text) and window.model_dir == str(folder)


def test_a_folder_with_one_gguf_is_named_after_the_file_and_its_quantization_is_said(app_driver, tiny_model_dir,
                                                                                    tmp_path):
    from gguf_factory import write_gguf

    downloads = tmp_path / "Downloads"
    downloads.mkdir()
    gguf = write_gguf(tiny_model_dir, downloads / "SmolLM2-135M-Instruct-Q4_1.gguf", "q4_1")
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    window.settings_panel.picker.open_path(str(downloads))
    planned_for(window, app_driver, gguf)
    combo = window.settings_panel.model_combo
    assert combo.currentText() == "SmolLM2-135M-Instruct-Q4_1 (Q4_1)" and "Downloads" not in combo.currentText()
    info = window.settings_panel.picker.info.text()
    assert "of Q4_1 weights" in info and "bfloat16" not in info and "float32" not in info


def test_a_long_name_is_elided_in_the_middle_with_the_whole_name_as_tooltip(qtbot):
    from pathlib import Path

    from stowage.app.model_picker import ModelPicker

    name = "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF/Meta-Llama-3.1-8B-Instruct-Q4_K_M"
    picker = ModelPicker([ModelEntry(name, Path("/models/x.gguf"), "lmstudio", "Q4_K_M")])
    qtbot.addWidget(picker)
    picker.resize(360, 120)
    picker.show()
    picker.combo.setCurrentIndex(1)
    assert picker.combo.toolTip() == f"{name} (Q4_K_M, LM Studio)\n/models/x.gguf"  # all that may be elided

    class Recording(QProxyStyle):
        """The style, noting the text each paint gives it to draw as the box's label."""

        labels: list[str] = []

        def drawControl(self, element, option, painter, widget=None):
            if element == QStyle.ControlElement.CE_ComboBoxLabel:
                self.labels.append(option.currentText)
            super().drawControl(element, option, painter, widget)

    style = Recording()
    picker.combo.setStyle(style)
    assert not picker.combo.grab().isNull()  # a real paint of the box
    # What the box draws: the name's start and its quantization, the middle elided, within the box's text field.
    shown = style.labels[-1]
    assert shown.startswith("bartowski") and shown.endswith("LM Studio)") and "…" in shown
    option = QStyleOptionComboBox()
    picker.combo.initStyleOption(option)
    field = style.subControlRect(QStyle.ComplexControl.CC_ComboBox, option, QStyle.SubControl.SC_ComboBoxEditField,
                                 picker.combo)
    assert picker.combo.fontMetrics().horizontalAdvance(shown) <= field.width()


def test_models_added_where_stowage_looks_appear_without_a_restart(app_driver, tiny_model_dir, tmp_path, qtbot,
                                                                   monkeypatch):
    from stowage.app import paths
    from stowage.app.main_window import MainWindow

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    lmstudio = tmp_path / "home" / ".lmstudio" / "models"
    lmstudio.mkdir(parents=True)
    hub = tmp_path / "hf-cache"  # conftest's HF_HUB_CACHE
    hub.mkdir(exist_ok=True)
    window = MainWindow()
    app_driver.windows.append(window)
    qtbot.addWidget(window)
    window.show()
    combo = window.settings_panel.model_combo
    assert combo.findData(str(paths.models_dir() / "copied-in")) < 0

    staged = tmp_path / "staged"
    shutil.copytree(tiny_model_dir, staged)
    os.rename(staged, paths.models_dir() / "copied-in")  # a model folder dropped into Stowage's models folder
    qtbot.waitUntil(lambda: combo.findData(str(paths.models_dir() / "copied-in")) > 0, timeout=10_000)

    snapshot = hub / "models--someone--fresh" / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    shutil.copytree(tiny_model_dir, tmp_path / "download")
    os.rename(tmp_path / "download", snapshot)  # a download into the Hugging Face cache finished
    qtbot.waitUntil(lambda: combo.findData(str(snapshot)) > 0, timeout=10_000)
    assert "someone/fresh (HF cache)" in picker_texts(window)

    from gguf_factory import write_gguf

    publisher = tmp_path / "publisher"
    (publisher / "Tiny-GGUF").mkdir(parents=True)
    write_gguf(tiny_model_dir, publisher / "Tiny-GGUF" / "Tiny-Q8_0.gguf", "q8_0")
    os.rename(publisher, lmstudio / "publisher")  # LM Studio downloaded a model
    qtbot.waitUntil(lambda: "publisher/Tiny-GGUF/Tiny-Q8_0 (Q8_0, LM Studio)" in picker_texts(window), timeout=10_000)
