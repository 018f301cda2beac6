"""The right-hand panel: model picker, context and placement with the live forecast, sampling, system prompt."""

from __future__ import annotations

import os

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.planning.report import summary
from engine.units import format_bytes, format_tokens

from . import context_policy
from .context_control import ContextControl
from .forecast import Forecast
from .model_catalog import ModelEntry
from .model_settings import ModelSettings, with_preset
from .plan_bar import PlanBar
from .sampling_form import SamplingForm
from .wheel_guard import guard_wheel

KV_DTYPE_CHOICES = (("Same as the model", None), ("float16", "float16"), ("bfloat16", "bfloat16"),
                    ("float32", "float32"), ("fp8 (half the memory)", "fp8"))
ERROR_STYLE = "color: #b00020;"


class SettingsPanel(QWidget):
    """Edits a ModelSettings for the chosen model and shows its plan; the main window does the loading."""

    model_chosen = Signal(str)  # a model folder to inspect
    load_requested = Signal()
    unload_requested = Signal()
    cancel_requested = Signal()
    settings_changed = Signal(object)  # ModelSettings
    plan_changed = Signal(object)  # Plan (or None)

    def __init__(self, models: list[ModelEntry], parent=None):
        super().__init__(parent)
        self.forecast: Forecast | None = None
        self.plan = None
        self.settings = ModelSettings()
        self.defaults = ModelSettings()  # the chosen model's own sampling (generation_config.json)
        self.max_fit_tokens = 0
        self._updating = False

        # -- model ----------------------------------------------------------------------------
        self.model_combo = QComboBox()
        self.model_combo.setAccessibleName("Model")
        # Long names (Hugging Face repo ids) must not widen the panel past the window: they elide instead.
        self.model_combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_combo.setMinimumContentsLength(18)
        self.browse_button = QPushButton("Folder…")
        self.browse_button.setToolTip("Choose a model folder (config.json and *.safetensors)")
        self.model_info = QLabel("No model chosen")
        self.model_info.setWordWrap(True)
        self.model_info.setStyleSheet("color: #555;")
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_combo, 1)
        model_row.addWidget(self.browse_button)
        model_box = QGroupBox("Model")
        model_layout = QVBoxLayout(model_box)
        model_layout.addLayout(model_row)
        model_layout.addWidget(self.model_info)
        self.set_models(models)

        # -- memory ---------------------------------------------------------------------------
        self.context = ContextControl()
        self.max_label = QLabel()
        self.max_label.setWordWrap(True)
        self.max_label.setStyleSheet("color: #555;")
        self.plan_bar = PlanBar()
        self.plan_message = QLabel()
        self.plan_message.setWordWrap(True)
        self.plan_message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.gpu_auto = QCheckBox("Auto")
        self.gpu_auto.setChecked(True)
        self.gpu_layers = QSpinBox()
        self.gpu_layers.setEnabled(False)
        self.gpu_layers.setAccessibleName("GPU layers")
        gpu_row = QHBoxLayout()
        gpu_row.addWidget(self.gpu_auto)
        gpu_row.addWidget(self.gpu_layers, 1)
        self.kv_dtype = QComboBox()
        for label, value in KV_DTYPE_CHOICES:
            self.kv_dtype.addItem(label, value)
        self.ram_limit = QDoubleSpinBox()
        self.ram_limit.setDecimals(2)
        self.ram_limit.setSingleStep(0.5)
        self.ram_limit.setRange(0.0, 4096.0)
        self.ram_limit.setSuffix(" GiB")
        self.ram_limit.setSpecialValueText("Available RAM (never swap)")
        self.ram_limit.setToolTip("The most RAM the model may use. Swap is never counted as memory.")
        self.policy = QComboBox()
        for key, label in context_policy.POLICIES.items():
            self.policy.addItem(label, key)
        self.policy.setToolTip("What happens when a conversation outgrows the context")
        self.cpu_threads = QSpinBox()
        self.cpu_threads.setRange(0, max(1, os.cpu_count() or 1))
        self.cpu_threads.setSpecialValueText("Auto")
        self.cpu_threads.setAccessibleName("CPU threads")
        self.cpu_threads.setToolTip("Threads for the CPU's share of the model; Auto leaves the window a core. "
                                    "Applies at the next Load.")
        memory_box = QGroupBox("Memory")
        form = QFormLayout(memory_box)
        form.addRow("Context", self.context)
        form.addRow("", self.max_label)
        form.addRow(self.plan_bar)
        form.addRow(self.plan_message)
        form.addRow("GPU layers", gpu_row)
        form.addRow("KV cache", self.kv_dtype)
        form.addRow("RAM limit", self.ram_limit)
        form.addRow("When full", self.policy)
        form.addRow("CPU threads", self.cpu_threads)

        # -- load -----------------------------------------------------------------------------
        self.load_button = QPushButton("Load")
        self.load_button.setDefault(False)
        self.unload_button = QPushButton("Unload")
        self.unload_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.cancel_button = QPushButton("Cancel")
        self.load_status = QLabel()
        self.load_status.setWordWrap(True)
        self.load_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.template_label = QLabel()  # which chat template the loaded model formats chats with
        self.template_label.setWordWrap(True)
        self.template_label.setStyleSheet("color: #555;")
        self.template_label.setAccessibleName("Chat template")
        self.template_label.hide()
        self.pending = QLabel()  # settings changed since Load, which only the next Load applies
        self.pending.setWordWrap(True)
        self.pending.setStyleSheet("color: #8a5a00;")
        self.pending.hide()
        load_row = QHBoxLayout()
        load_row.addWidget(self.load_button)
        load_row.addWidget(self.unload_button)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.cancel_button)
        self.progress_widget = QWidget()
        self.progress_widget.setLayout(progress_row)
        progress_row.setContentsMargins(0, 0, 0, 0)
        self.progress_widget.hide()
        self._progress: tuple[float, str] | None = None
        self._progress_timer = QTimer(self)
        self._progress_timer.setInterval(100)
        self._progress_timer.timeout.connect(self._draw_progress)

        # -- sampling -------------------------------------------------------------------------
        self.sampling = SamplingForm()
        sampling_box = self.sampling
        # The boxes by name: tests and the screenshot script set them as a user would.
        self.temperature, self.max_tokens, self.seed = self.sampling.temperature, self.sampling.max_tokens, self.sampling.seed

        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("What the model is told first in every chat without a system prompt "
                                              "of its own (Edit above a chat gives it one)")
        self.system_prompt.setFixedHeight(70)
        self.system_prompt.setAccessibleName("Default system prompt")
        prompt_box = QGroupBox("Default system prompt")
        QVBoxLayout(prompt_box).addWidget(self.system_prompt)

        inner = QWidget()
        column = QVBoxLayout(inner)
        column.addWidget(model_box)
        column.addWidget(memory_box)
        column.addLayout(load_row)
        column.addWidget(self.progress_widget)
        column.addWidget(self.load_status)
        column.addWidget(self.template_label)
        column.addWidget(self.pending)
        column.addWidget(sampling_box)
        column.addWidget(prompt_box)
        column.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidget(inner)
        self.scroll.setWidgetResizable(True)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll)
        self.setMinimumWidth(360)
        # Scrolling the panel must not move the slider or a box the pointer passes over (and save it).
        self._wheel_guard = guard_wheel(self.scroll)

        self.model_combo.activated.connect(self._combo_chosen)
        self.browse_button.clicked.connect(self.browse)
        self.context.changed.connect(self._edited)
        self.gpu_auto.toggled.connect(self.gpu_layers.setDisabled)
        for signal in (self.gpu_auto.toggled, self.gpu_layers.valueChanged, self.kv_dtype.currentIndexChanged,
                       self.ram_limit.valueChanged, self.policy.currentIndexChanged, self.sampling.edited,
                       self.system_prompt.textChanged):
            signal.connect(self._edited)
        self.sampling.preset_chosen.connect(self._apply_preset)
        self.load_button.clicked.connect(self.load_requested)
        self.unload_button.clicked.connect(self.unload_requested)
        self.cancel_button.clicked.connect(self.cancel_requested)
        self._show_settings(self.settings)
        self._set_model_enabled(False)

    # -- the model list -------------------------------------------------------------------------
    def set_models(self, models: list[ModelEntry]) -> None:
        self.model_combo.clear()
        self.model_combo.addItem("Choose a model…", None)
        self.catalog_dirs = {str(entry.path) for entry in models}
        for entry in models:
            self.model_combo.addItem(entry.label, str(entry.path))
            self.model_combo.setItemData(self.model_combo.count() - 1, str(entry.path), Qt.ItemDataRole.ToolTipRole)

    def add_folder(self, model_dir: str) -> int:
        """Offer `model_dir` (one the user opened with Folder…) in the list; its index."""
        index = self.model_combo.findData(str(model_dir))
        if index < 0:
            self.model_combo.addItem(Path(model_dir).name, str(model_dir))
            index = self.model_combo.count() - 1
            self.model_combo.setItemData(index, str(model_dir), Qt.ItemDataRole.ToolTipRole)
        return index

    def forget_folder(self, model_dir: str) -> None:
        """Take a folder that could not be used out of the list (the catalog's own models stay)."""
        index = self.model_combo.findData(str(model_dir))
        if index > 0 and str(model_dir) not in self.catalog_dirs:
            self.model_combo.removeItem(index)
            self.model_combo.setCurrentIndex(0)

    def select_model_dir(self, model_dir: str) -> None:
        """Show `model_dir` as the chosen model (adding it to the list if it came from a folder chooser)."""
        self.model_combo.setCurrentIndex(self.add_folder(model_dir))

    def _combo_chosen(self, index: int) -> None:
        model_dir = self.model_combo.itemData(index)
        if model_dir:
            self.model_chosen.emit(model_dir)

    def browse(self) -> None:
        """Folder…: pick a model folder and choose it."""
        folder = QFileDialog.getExistingDirectory(self, "Choose a model folder")
        if folder:
            self.select_model_dir(folder)
            self.model_chosen.emit(folder)

    # -- the inspected model --------------------------------------------------------------------
    def set_model(self, forecast: Forecast, settings: ModelSettings, defaults: ModelSettings | None = None) -> None:
        """A model was inspected: show its facts and plan with the settings saved for it."""
        self.forecast = forecast
        self.defaults = defaults or ModelSettings()
        self.sampling.defaults = self.defaults
        info = forecast.info
        c = info.config
        self.model_info.setStyleSheet("color: #555;")
        self.model_info.setText(
            f"{c.model_type}, {info.num_layers} layers, {format_bytes(info.weights_bytes())} of weights "
            f"({info.compute_dtype}), up to {format_tokens(info.max_position_embeddings)}"
        )
        self.gpu_layers.blockSignals(True)
        self.gpu_layers.setRange(0, info.num_layers)
        self.gpu_layers.blockSignals(False)
        has_gpu = bool(forecast.detected.gpus)
        self.gpu_auto.setEnabled(has_gpu)
        self.gpu_layers.setEnabled(has_gpu and settings.gpu_layers is not None)
        if not has_gpu:
            self.gpu_layers.setToolTip(forecast.detected.note)
        self._show_settings(settings)
        self._set_model_enabled(True)
        self._replan()

    def show_model_error(self, message: str) -> None:
        """The chosen folder could not be read: say why inline, and forget the previous forecast."""
        self.forecast = None
        self.plan = None
        self.model_info.setStyleSheet(ERROR_STYLE)
        self.model_info.setText(message)
        self.plan_bar.set_bars([])
        self.plan_message.clear()
        self.max_label.clear()
        self._set_model_enabled(False)
        self.plan_changed.emit(None)

    def _set_model_enabled(self, enabled: bool) -> None:
        for widget in (self.context, self.kv_dtype, self.ram_limit, self.load_button):
            widget.setEnabled(enabled)

    # -- settings <-> widgets -------------------------------------------------------------------
    def _show_settings(self, s: ModelSettings) -> None:
        self._updating = True
        try:
            self.gpu_auto.setChecked(s.gpu_layers is None)
            self.gpu_layers.setValue(s.gpu_layers or 0)
            self.kv_dtype.setCurrentIndex(max(0, self.kv_dtype.findData(s.kv_dtype)))
            self.ram_limit.setValue(s.ram_limit_gib or 0.0)
            self.policy.setCurrentIndex(max(0, self.policy.findData(s.overflow_policy)))
            self.cpu_threads.setValue(s.cpu_threads)
            self.sampling.show_settings(s)
            self.system_prompt.setPlainText(s.system_prompt)
            self.settings = s
            if self.forecast is not None:
                self._update_context_range()
            self.context.set_tokens(s.context_tokens)
            # The saved (or default) context may exceed this model's maximum: keep what the box shows.
            self.settings = replace(s, context_tokens=self.context.tokens)
        finally:
            self._updating = False

    def _apply_preset(self, preset: str) -> None:
        self._updating = True
        try:
            self.sampling.show_settings(with_preset(self.settings, preset, self.defaults))
        finally:
            self._updating = False
        self._edited()

    def _read_settings(self) -> ModelSettings:
        return replace(
            self.sampling.read(self.settings),
            context_tokens=self.context.tokens,
            gpu_layers=None if self.gpu_auto.isChecked() else self.gpu_layers.value(),
            kv_dtype=self.kv_dtype.currentData(),
            ram_limit_gib=self.ram_limit.value() or None,
            overflow_policy=self.policy.currentData(),
            system_prompt=self.system_prompt.toPlainText(),
            cpu_threads=self.cpu_threads.value(),
        )

    def _edited(self, *_) -> None:
        if self._updating:
            return
        before = self.settings
        self.settings = self._read_settings()
        if self.forecast is not None and _placement(before) != _placement(self.settings):
            if _limits(before) != _limits(self.settings):
                self._update_context_range()
            self._replan()
        self.settings_changed.emit(self.settings)

    # -- the forecast ---------------------------------------------------------------------------
    def _update_context_range(self) -> None:
        """The slider's top is the largest context that fits with the other settings as they are."""
        f = self.forecast
        self.max_fit_tokens = f.max_context(self.settings)
        self.context.set_range(self.max_fit_tokens, f.model_max_tokens, f.block_size)
        if self.max_fit_tokens <= 0:
            self.max_label.setText("No context fits with these settings")
        else:
            self.max_label.setText(
                f"Fits up to {format_tokens(self.max_fit_tokens)} (model maximum {f.model_max_tokens:,})"
            )

    def _replan(self) -> None:
        self.plan = self.forecast.plan(self.settings)
        self.plan_bar.set_bars(self.forecast.bars(self.plan, self.settings))
        if self.plan.fits:
            self.plan_message.setStyleSheet("color: #1b5e20;")
            self.plan_message.setText(summary(self.plan))
        else:
            self.plan_message.setStyleSheet(ERROR_STYLE)
            self.plan_message.setText(self.plan.error)
        self.load_button.setEnabled(self.plan.fits and not self.progress_widget.isVisible())
        self.plan_changed.emit(self.plan)

    def show_pending(self, text: str) -> None:
        """Say what the next Load would change ('' hides it)."""
        self.pending.setText(text)
        self.pending.setVisible(bool(text))

    # -- loading state --------------------------------------------------------------------------
    def show_loading(self, fraction: float, message: str) -> None:
        """Progress from the engine; drawn at most every 100 ms.

        QProgressBar.setValue repaints synchronously (~7 ms here), and a load reports once per layer.
        """
        self._progress = (fraction, message)
        if not self.progress_widget.isVisible():
            self.progress_widget.show()
            self.load_button.setEnabled(False)
            self.load_status.setStyleSheet("")
            self.load_status.clear()
        if not self._progress_timer.isActive():
            self._draw_progress()
            self._progress_timer.start()

    def _draw_progress(self) -> None:
        if self._progress is None or not self.progress_widget.isVisible():
            self._progress_timer.stop()
            return
        fraction, message = self._progress
        self._progress = None
        self.progress.setFormat(f"{message} — %p%")
        self.progress.setValue(int(fraction * 1000))

    def show_loaded(self, text: str, template_source: str = "") -> None:
        """Loaded: `text` says what and how fast; `template_source` which chat template it uses ('' if not known)."""
        self.progress_widget.hide()
        self.template_label.setText(f"Chat template: {template_source}")
        self.template_label.setVisible(bool(template_source))
        self.load_status.setStyleSheet("color: #1b5e20;")
        self.load_status.setText(text)
        self.unload_button.setEnabled(True)
        self.load_button.setEnabled(self.plan is not None and self.plan.fits)

    def show_unloaded(self, text: str = "", error: bool = False) -> None:
        self.progress_widget.hide()
        self.template_label.hide()
        self.load_status.setStyleSheet(ERROR_STYLE if error else "color: #555;")
        self.load_status.setText(text)
        self.unload_button.setEnabled(False)
        self.load_button.setEnabled(self.plan is not None and self.plan.fits)


def _placement(s: ModelSettings) -> tuple:
    return (s.context_tokens, s.gpu_layers, s.kv_dtype, s.ram_limit_gib)


def _limits(s: ModelSettings) -> tuple:
    """What moves the slider's top: everything but the context itself."""
    return (s.gpu_layers, s.kv_dtype, s.ram_limit_gib)
