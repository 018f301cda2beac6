"""The model box: the model list (local models, then remote servers' models), Open… (a model folder or a .gguf
file; dropping either on the window does the same), Server…, a line on it."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (QComboBox, QFileDialog, QGroupBox, QHBoxLayout, QLabel, QMenu, QPushButton, QStyle,
                               QStyleOptionComboBox, QStylePainter, QVBoxLayout)

from stowage.engine.formats.discovery import gguf_models, gguf_quant, is_model_dir
from stowage.engine.formats.gguf import is_gguf_file

from . import theme
from .model_catalog import ModelEntry
from .remote_source import RemoteModel

GGUF_FILTER = "GGUF models (*.gguf);;All files (*)"


class ModelCombo(QComboBox):
    """A combo box that elides a long name in the middle (its start and its quantization stay readable) and shows
    the whole name as its tooltip; its list is as wide as the longest name."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.view().setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.currentIndexChanged.connect(self._show_whole_name)

    def _show_whole_name(self, index: int) -> None:
        """The tooltip has what the box may elide: the whole name, and where the model is."""
        where = self.itemData(index, Qt.ItemDataRole.ToolTipRole)
        self.setToolTip("\n".join(t for t in (self.itemText(index), where) if t) if index > 0 else "")

    def paintEvent(self, event) -> None:
        painter = QStylePainter(self)
        option = QStyleOptionComboBox()
        self.initStyleOption(option)
        painter.drawComplexControl(QStyle.ComplexControl.CC_ComboBox, option)
        field = self.style().subControlRect(QStyle.ComplexControl.CC_ComboBox, option,
                                            QStyle.SubControl.SC_ComboBoxEditField, self)
        option.currentText = self.fontMetrics().elidedText(option.currentText, Qt.TextElideMode.ElideMiddle,
                                                           field.width())
        painter.drawControl(QStyle.ControlElement.CE_ComboBoxLabel, option)

    def showPopup(self) -> None:
        widest = max((self.fontMetrics().horizontalAdvance(self.itemText(i)) for i in range(self.count())), default=0)
        screen = self.screen().availableGeometry().width() if self.screen() else widest
        self.view().setMinimumWidth(min(widest + 40, screen))
        super().showPopup()


class ModelPicker(QGroupBox):
    """Item data: a model folder (str) or a RemoteModel."""

    model_chosen = Signal(str)  # a model folder to inspect
    remote_chosen = Signal(object)  # a RemoteModel to ask its server about
    server_requested = Signal()  # Server…: the user wants to add a remote server
    forget_requested = Signal(str)  # Forget server: the base URL of the chosen server's model

    def __init__(self, models: list[ModelEntry], parent=None):
        super().__init__("Model", parent)
        self.combo = ModelCombo()
        self.combo.setAccessibleName("Model")
        # Long names (Hugging Face repo ids) must not widen the panel past the window: they elide instead.
        self.combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.combo.setMinimumContentsLength(12)
        self.browse_button = QPushButton("Open…")
        self.browse_button.setToolTip("Open a model: a folder (config.json and *.safetensors, or .gguf files) or a "
                                      ".gguf file. Dropping one on the window does the same.")
        menu = QMenu(self.browse_button)
        self.folder_action = QAction("Model &folder…", self)
        self.file_action = QAction("&GGUF file…", self)
        self.hub_action = QAction("From the &Hugging Face Hub…", self)  # app/menu_bar.py opens app/hub_dialog.py
        menu.addAction(self.folder_action)
        menu.addAction(self.file_action)
        menu.addAction(self.hub_action)
        self.browse_button.setMenu(menu)
        self.server_button = QPushButton("Server…")
        self.server_button.setToolTip("Add an OpenAI-compatible server (vLLM, Ray Serve, llama.cpp, Ollama, "
                                      "Stowage): its models join this list")
        self.info = QLabel("No model chosen")
        self._folder_note = ("", "")  # (a model's path, what to say of the folder it was opened from)
        self.info.setWordWrap(True)
        theme.tint(self.info, "muted")
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.forget_button = QPushButton("Forget server")
        self.forget_button.setToolTip("Take this server and its models out of the list (and its key)")
        self.forget_button.hide()
        # The list has the box's whole width (a GGUF's name with its quantization is long); the buttons go below.
        row = QHBoxLayout()
        row.addWidget(self.browse_button)
        row.addWidget(self.server_button)
        row.addStretch(1)
        row.addWidget(self.forget_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.combo)
        layout.addLayout(row)
        layout.addWidget(self.info)
        self.set_models(models)
        self.combo.activated.connect(self._chosen)
        self.folder_action.triggered.connect(self.browse)
        self.file_action.triggered.connect(self.browse_file)
        self.server_button.clicked.connect(self.server_requested)
        self.combo.currentIndexChanged.connect(
            lambda index: self.forget_button.setVisible(isinstance(self.combo.itemData(index), RemoteModel)))
        self.forget_button.clicked.connect(lambda: self.forget_requested.emit(self.combo.currentData().base_url))

    def say(self, text: str, error: bool = False) -> None:
        """The line under the box; while a model opened from a folder of several is chosen, that is said too."""
        theme.tint(self.info, "error" if error else "muted")
        path, note = self._folder_note
        self.info.setText(f"{text}\n{note}" if note and path == self.combo.currentData() else text)

    # -- local folders ---------------------------------------------------------------------------
    def set_models(self, models: list[ModelEntry]) -> None:
        self.combo.clear()
        self.combo.addItem("Choose a model…", None)
        self.catalog_dirs = {str(entry.path) for entry in models}
        for entry in models:
            self._add(entry.label, str(entry.path), str(entry.path))

    def update_models(self, models: list[ModelEntry]) -> None:
        """The catalog found again (a model was added or removed where models are kept): the list follows, what is
        chosen stays chosen, folders the user opened and servers' models stay."""
        current = self.combo.currentData()
        kept = [(self.combo.itemText(i), self.combo.itemData(i), self.combo.itemData(i, Qt.ItemDataRole.ToolTipRole))
                for i in range(1, self.combo.count()) if self.combo.itemData(i) not in self.catalog_dirs]
        self.combo.blockSignals(True)
        try:
            self.set_models(models)
            for label, data, tooltip in kept:
                if self.combo.findData(data) < 0:
                    self._add(label, data, tooltip)
            self.combo.setCurrentIndex(max(0, self.combo.findData(current)) if current is not None else 0)
        finally:
            self.combo.blockSignals(False)
        self.forget_button.setVisible(isinstance(self.combo.currentData(), RemoteModel))

    def add_folder(self, model_dir: str, label: str | None = None) -> int:
        """Offer `model_dir` (a folder or .gguf file the user opened) in the list; its index."""
        index = self.combo.findData(str(model_dir))
        if index < 0:
            index = self._add(label or _name(Path(model_dir)), str(model_dir), str(model_dir), before_remote=True)
        return index

    def forget_folder(self, model_dir: str) -> None:
        """Take a folder that could not be used out of the list (the catalog's own models stay)."""
        index = self.combo.findData(str(model_dir))
        if index > 0 and str(model_dir) not in self.catalog_dirs:
            self.combo.removeItem(index)
            self.combo.setCurrentIndex(0)

    def select_model_dir(self, model_dir: str) -> None:
        """Show `model_dir` as the chosen model (adding it to the list if it came from a folder chooser)."""
        self.combo.setCurrentIndex(self.add_folder(model_dir))

    def browse(self) -> None:
        """Open ▸ Model folder…: pick a folder and open it."""
        folder = QFileDialog.getExistingDirectory(self, "Choose a model folder")
        if folder:
            self.open_path(folder)

    def browse_file(self) -> None:
        """Open ▸ GGUF file…: pick a .gguf file and open it."""
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model file", "", GGUF_FILTER)
        if path:
            self.open_path(path)

    def open_path(self, path: str) -> None:
        """A folder or file the user opened or dropped: a model folder or .gguf file is chosen; every GGUF model of a
        folder of them is listed, the first chosen."""
        target = Path(path)
        if target.is_dir() and not is_model_dir(target):
            found = gguf_models(target)
            for entry in found:
                self.add_folder(str(entry.path), ModelEntry(entry.name, entry.path, "folder", entry.quant).label)
            if found:
                path = str(found[0].path)  # one GGUF: named after its file, not the folder around it
                if len(found) > 1:  # said under each line about the first, until another model is chosen
                    self._folder_note = (path, f"{target.name} holds {len(found)} GGUF models: all are in the list.")
        self.select_model_dir(path)
        self.model_chosen.emit(path)

    # -- remote servers' models ------------------------------------------------------------------
    def set_remote_models(self, base_url: str, models: list[RemoteModel]) -> None:
        """The models `base_url` lists now, in place of those it listed before (the one shown stays shown)."""
        current = self.combo.currentData()
        for index in reversed(range(self.combo.count())):
            data = self.combo.itemData(index)
            if isinstance(data, RemoteModel) and data.base_url == base_url:
                self.combo.removeItem(index)
        for model in models:
            self._add(model.label, model, f"{model.model_id} on {model.base_url}")
        if isinstance(current, RemoteModel) and current.base_url == base_url:
            self.select_remote(current)

    def select_remote(self, model: RemoteModel) -> None:
        """Show the entry of `model`'s server and id (its context may have changed since it was listed)."""
        for index in range(self.combo.count()):
            data = self.combo.itemData(index)
            if isinstance(data, RemoteModel) and (data.base_url, data.model_id) == (model.base_url, model.model_id):
                self.combo.setCurrentIndex(index)
                return

    # -- the parts -------------------------------------------------------------------------------
    def _add(self, label: str, data, tooltip: str, before_remote: bool = False) -> int:
        index = self.combo.count()
        if before_remote:  # folders stay together above the servers' models
            index = next((i for i in range(self.combo.count()) if isinstance(self.combo.itemData(i), RemoteModel)),
                         index)
        self.combo.insertItem(index, label, data)
        self.combo.setItemData(index, tooltip, Qt.ItemDataRole.ToolTipRole)
        return index

    def _chosen(self, index: int) -> None:
        data = self.combo.itemData(index)
        if isinstance(data, RemoteModel):
            self.remote_chosen.emit(data)
        elif data:
            self.model_chosen.emit(data)


def _name(path: Path) -> str:
    """A model's name in the list: a folder's name, or a GGUF file's without its suffix and with its quantization."""
    if not (path.is_file() and is_gguf_file(path)):
        return path.name
    stem = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
    return ModelEntry(stem, path, "folder", gguf_quant(path)).label
