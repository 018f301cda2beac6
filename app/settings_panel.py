"""The right-hand panel: model picker, context and placement with the live forecast, Load, Serve, sampling, system
prompt. A remote server's model has no forecast: only its context's 'When full' stays of the memory settings."""

from __future__ import annotations

import os

from dataclasses import replace

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from stowage.engine.planning.report import summary
from stowage.engine.units import format_tokens

from . import context_policy, model_facts, theme
from .context_control import ContextControl
from .forecast import Forecast, explain
from .load_controls import LoadControls
from .model_catalog import ModelEntry
from .model_picker import ModelPicker
from .model_settings import ModelSettings, with_preset
from .plan_bar import PlanBar
from .remote_source import RemoteModel
from .sampling_form import SamplingForm
from .serve_switch import ServeSwitch
from .wheel_guard import guard_wheel

# None: the model's compute dtype; "q8_0/q4_0": K in q8_0, V in q4_0 (docs/kernels.md)
KV_DTYPES = (None, "float16", "bfloat16", "float32", "fp8", "q8_0", "q4_0", "q8_0/q4_0")
SHARES = {0.25: "a quarter of the memory", 0.5: "half the memory", 2.0: "twice the memory", 4.0: "four times the memory"}


def kv_dtype_label(info, kv_dtype: str | None) -> str:
    """The KV cache box's entry for `kv_dtype`, with its memory against the model's own ("fp8 (a quarter of the
    memory)" on a float32 model); `info` None: no model yet."""
    if kv_dtype is None:
        return f"Same as the model ({info.compute_dtype})" if info is not None else "Same as the model"
    if info is None:
        return kv_dtype
    try:
        ratio = info.kv_bytes_per_token(kv_dtype) / info.kv_bytes_per_token(None)
    except ValueError:  # q8_0 / q4_0 blocks of 32 along a head_dim that is not a multiple of 32
        return f"{kv_dtype} (not for a head size of {info.config.head_dim})"
    share = SHARES.get(ratio) or f"{ratio:.0%} of the memory"
    return f"{kv_dtype} ({share})" if ratio != 1 else kv_dtype


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
        self.num_seqs = 1  # sequences the forecast holds KV cache for (Serve's "Sequences" while it serves)
        self.settings = ModelSettings()
        self.defaults = ModelSettings()  # the chosen model's own sampling (generation_config.json)
        self.max_fit_tokens = 0
        self._updating = False

        # -- model ----------------------------------------------------------------------------
        self.picker = ModelPicker(models)
        # The parts by name, as tests and the screenshot script reach them.
        self.model_combo, self.model_info = self.picker.combo, self.picker.info
        self.select_model_dir = self.picker.select_model_dir
        self.remote: RemoteModel | None = None  # the chosen model runs on a server (no forecast)

        # -- memory ---------------------------------------------------------------------------
        self.context = ContextControl()
        self.max_label = QLabel()
        self.max_label.setWordWrap(True)
        theme.tint(self.max_label, "muted")
        self.plan_bar = PlanBar()
        self.plan_message = QLabel()
        self.plan_message.setWordWrap(True)
        self.plan_message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.gpu_auto = QCheckBox("Auto")
        self.gpu_auto.setChecked(True)
        self.gpu_layers = QSpinBox()
        self.gpu_layers.setEnabled(False)
        self.gpu_layers.setAccessibleName("GPU layers")
        self.gpu_row = gpu_row = QHBoxLayout()
        gpu_row.addWidget(self.gpu_auto)
        gpu_row.addWidget(self.gpu_layers, 1)
        # a model of experts: how many layers keep their experts in RAM (the last ones), beside GPU layers
        self.expert_auto = QCheckBox("Auto")
        self.expert_auto.setChecked(True)
        self.cpu_expert_layers = QSpinBox()
        self.cpu_expert_layers.setEnabled(False)
        self.cpu_expert_layers.setAccessibleName("CPU expert layers")
        self.expert_auto.setToolTip("Auto: the experts of as many layers as fit go on the GPU beside their layer, "
                                    "after every layer's attention (docs/moe.md); a number keeps that many layers' "
                                    "experts, the last ones, in RAM")
        self.expert_row = expert_row = QHBoxLayout()
        expert_row.addWidget(self.expert_auto)
        expert_row.addWidget(self.cpu_expert_layers, 1)
        self.kv_dtype = QComboBox()
        for value in KV_DTYPES:
            self.kv_dtype.addItem(kv_dtype_label(None, value), value)
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
        self.memory_box = memory_box = QGroupBox("Memory")
        self.memory_form = form = QFormLayout(memory_box)
        form.addRow("Context", self.context)
        # The note gets a row of its own: inside the control's field a form gives it one line and cuts the rest.
        self.context.layout().removeWidget(self.context.note)
        form.addRow("", self.context.note)
        form.addRow("", self.max_label)
        form.addRow(self.plan_bar)
        form.addRow(self.plan_message)
        form.addRow("GPU layers", gpu_row)
        form.addRow("CPU expert layers", expert_row)
        form.addRow("KV cache", self.kv_dtype)
        form.addRow("RAM limit", self.ram_limit)
        form.addRow("When full", self.policy)
        form.addRow("CPU threads", self.cpu_threads)

        # -- load ---------------------------------------------------------------------------
        self.loading = LoadControls()
        self.load_button, self.unload_button = self.loading.load_button, self.loading.unload_button
        self.template_label, self.pending = self.loading.template_label, self.loading.pending
        self.show_loading, self.show_pending = self.loading.show_loading, self.loading.show_pending
        self.serve = ServeSwitch()

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
        column.addWidget(self.picker)
        column.addWidget(memory_box)
        column.addWidget(self.serve)
        column.addWidget(sampling_box)
        column.addWidget(prompt_box)
        column.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidget(inner)
        self.scroll.setWidgetResizable(True)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll, 1)
        # Load stays in sight below the scrolling settings, however short the window.
        self.loading.setContentsMargins(6, 4, 6, 4)
        outer.addWidget(self.loading)
        self.setMinimumWidth(320)
        # Scrolling the panel must not move the slider or a box the pointer passes over (and save it).
        self._wheel_guard = guard_wheel(self.scroll)

        self.picker.model_chosen.connect(self.model_chosen)
        self.context.changed.connect(self._edited)
        self.gpu_auto.toggled.connect(self.gpu_layers.setDisabled)
        self.expert_auto.toggled.connect(self.cpu_expert_layers.setDisabled)
        for signal in (self.gpu_auto.toggled, self.gpu_layers.valueChanged, self.expert_auto.toggled,
                       self.cpu_expert_layers.valueChanged, self.kv_dtype.currentIndexChanged,
                       self.ram_limit.valueChanged, self.policy.currentIndexChanged, self.sampling.edited,
                       self.system_prompt.textChanged):
            signal.connect(self._edited)
        self.sampling.preset_chosen.connect(self._apply_preset)
        self.load_button.clicked.connect(self.load_requested)
        self.unload_button.clicked.connect(self.unload_requested)
        self.loading.cancel_button.clicked.connect(self.cancel_requested)
        self._show_settings(self.settings)
        self._set_model_enabled(False)

    # -- the inspected model --------------------------------------------------------------------
    def set_model(self, forecast: Forecast, settings: ModelSettings, defaults: ModelSettings | None = None) -> None:
        """A model was inspected: show its facts and plan with the settings saved for it."""
        self.forecast = forecast
        self.defaults = defaults or ModelSettings()
        self.sampling.defaults = self.defaults
        self.remote = None
        self._show_memory_rows(True)
        info = forecast.info
        self.picker.say(model_facts.describe(info))
        for index, value in enumerate(KV_DTYPES):
            label = kv_dtype_label(info, value)
            self.kv_dtype.setItemText(index, label)
            self.kv_dtype.model().item(index).setEnabled("not for" not in label)
        self.gpu_layers.blockSignals(True)
        self.gpu_layers.setRange(0, info.num_layers)
        self.gpu_layers.blockSignals(False)
        has_gpu = bool(forecast.detected.gpus)
        self.gpu_auto.setEnabled(has_gpu)
        self.gpu_layers.setEnabled(has_gpu and settings.gpu_layers is not None)
        if not has_gpu:
            self.gpu_layers.setToolTip(forecast.detected.note)
        self.cpu_expert_layers.blockSignals(True)
        self.cpu_expert_layers.setRange(0, sum(1 for n in info.expert_bytes() if n))
        self.cpu_expert_layers.blockSignals(False)
        self.expert_auto.setEnabled(has_gpu)  # without a GPU every expert is in RAM: nothing to choose
        self.cpu_expert_layers.setEnabled(has_gpu and settings.cpu_expert_layers is not None)
        self._show_settings(settings)
        self._set_model_enabled(True)
        self._replan()

    def set_remote(self, model: RemoteModel, settings: ModelSettings) -> None:
        """A server's model: its sampling and system prompt; no forecast (that machine's memory is its own)."""
        self.forecast, self.plan, self.remote = None, None, model
        self.defaults = self.sampling.defaults = ModelSettings()
        context = (f"its context is {model.context_tokens:,} tokens (the server's max_model_len)"
                   if model.max_model_len else f"it does not say its context: {model.context_tokens:,} tokens are "
                                               "assumed")
        self.picker.say(f"{model.model_id} runs on {model.base_url}; {context}. Its memory is that machine's: "
                        "no forecast or memory graphs here.")
        self._show_memory_rows(False)
        self._show_settings(settings)
        self._set_model_enabled(True)
        self.plan_changed.emit(None)

    def _show_memory_rows(self, shown: bool) -> None:
        """The rows of this machine's memory; 'When full' stays, a remote context fills up too."""
        for field in (self.context, self.context.note, self.max_label, self.plan_bar, self.plan_message, self.gpu_row, self.kv_dtype,
                      self.ram_limit, self.cpu_threads):
            self.memory_form.setRowVisible(field, shown)
        is_moe = self.forecast is not None and self.forecast.info.config.is_moe
        self.memory_form.setRowVisible(self.expert_row, shown and is_moe)
        self.context.note.setVisible(shown and bool(self.context.note.text()))  # a row of its own, shown when said
        self.memory_box.setTitle("Memory" if shown else "Context")
        self.load_button.setText("Load" if shown else "Connect")

    @property
    def can_load(self) -> bool:
        return self.remote is not None or (self.plan is not None and self.plan.fits)

    def show_model_error(self, message: str, error: bool = True) -> None:
        """The chosen model could not be read or reached (or is gone from the list, error=False): say why inline,
        and forget the previous forecast."""
        self.forecast = None
        self.plan = None
        self.remote = None
        self._show_memory_rows(True)  # no server's model is chosen any more: the local rows, disabled until one is
        self.picker.say(message, error=error)
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
            self.expert_auto.setChecked(s.cpu_expert_layers is None)
            self.cpu_expert_layers.setValue(s.cpu_expert_layers or 0)
            index = self.kv_dtype.findData(s.kv_dtype)  # one this model cannot take (disabled): its own dtype
            self.kv_dtype.setCurrentIndex(index if index > 0 and self.kv_dtype.model().item(index).isEnabled() else 0)
            self.ram_limit.setValue(s.ram_limit_gib or 0.0)
            self.policy.setCurrentIndex(max(0, self.policy.findData(s.overflow_policy)))
            self.cpu_threads.setValue(s.cpu_threads)
            self.sampling.show_settings(s)
            self.system_prompt.setPlainText(s.system_prompt)
            self.settings = s
            if self.forecast is not None:
                self._update_context_range()
            self.context.set_context_tokens(s.context_tokens)
            # The saved (or default) context may exceed this model's maximum: keep what the box shows.
            self.settings = replace(s, context_tokens=self.context.context_tokens)
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
            context_tokens=self.context.context_tokens,
            gpu_layers=None if self.gpu_auto.isChecked() else self.gpu_layers.value(),
            cpu_expert_layers=None if self.expert_auto.isChecked() else self.cpu_expert_layers.value(),
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
        self.max_fit_tokens = f.max_context(self.settings, num_seqs=self.num_seqs)
        self.context.set_range(self.max_fit_tokens, f.model_max_tokens, f.block_size)
        if self.max_fit_tokens <= 0:
            self.max_label.setText("No context fits with these settings")
        else:
            self.max_label.setText(
                f"Fits up to {format_tokens(self.max_fit_tokens)} (model maximum {f.model_max_tokens:,})"
            )

    def set_num_seqs(self, num_seqs: int) -> None:
        """Forecast the KV cache of num_seqs sequences (each a whole context) from now on."""
        if num_seqs == self.num_seqs:
            return
        self.num_seqs = num_seqs
        if self.forecast is not None:
            self._update_context_range()
            self._replan()

    def _replan(self) -> None:
        self.plan = self.forecast.plan(self.settings, num_seqs=self.num_seqs)
        self.plan_bar.set_bars(self.forecast.bars(self.plan, self.settings))
        if self.plan.fits:
            theme.tint(self.plan_message, "ok")
            self.plan_message.setText(summary(self.plan))
            self.plan_message.setToolTip("")
        else:
            theme.tint(self.plan_message, "error")
            self.plan_message.setText(self.explain(self.plan))
            self.plan_message.setToolTip(self.plan.error)  # the planner's whole reasoning
        self.loading.set_can_load(self.can_load)
        self.plan_changed.emit(self.plan)

    def explain(self, plan) -> str:
        """Why `plan` does not fit, short, proposing no context below the context box's minimum."""
        return explain(plan, self.context.lo, self.settings.ram_limit_gib is not None)

    def show_loaded(self, text: str, template_source: str = "") -> None:
        """Loaded: `text` says what and how fast; `template_source` which chat template it uses ('' if not known)."""
        self.loading.show_loaded(text, template_source, self.can_load)

    def show_unloaded(self, text: str = "", error: bool = False) -> None:
        self.loading.show_unloaded(text, error, self.can_load)


def _placement(s: ModelSettings) -> tuple:
    return (s.context_tokens, s.gpu_layers, s.cpu_expert_layers, s.kv_dtype, s.ram_limit_gib)


def _limits(s: ModelSettings) -> tuple:
    """What moves the slider's top: everything but the context itself."""
    return (s.gpu_layers, s.cpu_expert_layers, s.kv_dtype, s.ram_limit_gib)
