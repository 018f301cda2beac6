"""The model box: the model list (local folders, then remote servers' models), Folder…, Server…, a line on it."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QFileDialog, QGroupBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout

from .model_catalog import ModelEntry
from .remote_source import RemoteModel

ERROR_STYLE = "color: #b00020;"
NOTE_STYLE = "color: #555;"


class ModelPicker(QGroupBox):
    """Item data: a model folder (str) or a RemoteModel."""

    model_chosen = Signal(str)  # a model folder to inspect
    remote_chosen = Signal(object)  # a RemoteModel to ask its server about
    server_requested = Signal()  # Server…: the user wants to add a remote server
    forget_requested = Signal(str)  # Forget server: the base URL of the chosen server's model

    def __init__(self, models: list[ModelEntry], parent=None):
        super().__init__("Model", parent)
        self.combo = QComboBox()
        self.combo.setAccessibleName("Model")
        # Long names (Hugging Face repo ids) must not widen the panel past the window: they elide instead.
        self.combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.combo.setMinimumContentsLength(12)
        self.browse_button = QPushButton("Folder…")
        self.browse_button.setToolTip("Choose a model folder (config.json and *.safetensors)")
        self.server_button = QPushButton("Server…")
        self.server_button.setToolTip("Add an OpenAI-compatible server (vLLM, Ray Serve, llama.cpp, Ollama, "
                                      "Stowage): its models join this list")
        self.info = QLabel("No model chosen")
        self.info.setWordWrap(True)
        self.info.setStyleSheet(NOTE_STYLE)
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.forget_button = QPushButton("Forget server")
        self.forget_button.setToolTip("Take this server and its models out of the list (and its key)")
        self.forget_button.hide()
        row = QHBoxLayout()
        row.addWidget(self.combo, 1)
        row.addWidget(self.browse_button)
        row.addWidget(self.server_button)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.info)
        layout.addWidget(self.forget_button, 0, Qt.AlignmentFlag.AlignRight)
        self.set_models(models)
        self.combo.activated.connect(self._chosen)
        self.browse_button.clicked.connect(self.browse)
        self.server_button.clicked.connect(self.server_requested)
        self.combo.currentIndexChanged.connect(
            lambda index: self.forget_button.setVisible(isinstance(self.combo.itemData(index), RemoteModel)))
        self.forget_button.clicked.connect(lambda: self.forget_requested.emit(self.combo.currentData().base_url))

    def say(self, text: str, error: bool = False) -> None:
        self.info.setStyleSheet(ERROR_STYLE if error else NOTE_STYLE)
        self.info.setText(text)

    # -- local folders ---------------------------------------------------------------------------
    def set_models(self, models: list[ModelEntry]) -> None:
        self.combo.clear()
        self.combo.addItem("Choose a model…", None)
        self.catalog_dirs = {str(entry.path) for entry in models}
        for entry in models:
            self._add(entry.label, str(entry.path), str(entry.path))

    def add_folder(self, model_dir: str) -> int:
        """Offer `model_dir` (one the user opened with Folder…) in the list; its index."""
        index = self.combo.findData(str(model_dir))
        if index < 0:
            index = self._add(Path(model_dir).name, str(model_dir), str(model_dir), before_remote=True)
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
        """Folder…: pick a model folder and choose it."""
        folder = QFileDialog.getExistingDirectory(self, "Choose a model folder")
        if folder:
            self.select_model_dir(folder)
            self.model_chosen.emit(folder)

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
