"""The sampling settings of a ModelSettings: temperature, top-p, top-k, min-p, penalty, length, seed."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QPushButton, QSpinBox

from .model_settings import MODEL_DEFAULTS, SAMPLING_LIMITS, SAMPLING_PRESETS, ModelSettings, preset_of


class SamplingForm(QGroupBox):
    """Shows and reads the sampling fields; `edited` on any change by the user."""

    edited = Signal()
    preset_chosen = Signal(str)  # a SAMPLING_PRESETS name, or MODEL_DEFAULTS ("Model defaults" too)

    def __init__(self, parent=None):
        super().__init__("Sampling", parent)
        lim = SAMPLING_LIMITS
        self.preset = QComboBox()
        self.preset.setAccessibleName("Sampling preset")
        self.preset.addItem("Custom", None)  # shown while the boxes match no preset
        self.preset.addItem("The model's defaults", MODEL_DEFAULTS)
        for name in SAMPLING_PRESETS:
            self.preset.addItem(name, name)
        self.preset.setToolTip("Sets temperature, top-p, top-k, min-p and the repetition penalty")
        self.temperature = _double(*lim["temperature"], 0.05, 2)
        self.temperature.setToolTip("0 always picks the most likely token")
        self.top_p = _double(*lim["top_p"], 0.05, 2)
        self.top_k = _int(*lim["top_k"], "off")
        self.min_p = _double(*lim["min_p"], 0.01, 2)
        self.repetition_penalty = _double(*lim["repetition_penalty"], 0.05, 2)
        self.max_tokens = _int(*lim["max_tokens"], None)
        self.seed = _int(-1, 2**31 - 1, "random")
        form = QFormLayout(self)
        form.addRow("Preset", self.preset)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repetition penalty", self.repetition_penalty)
        form.addRow("Max new tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        self.reset_button = QPushButton("Model defaults")
        self.reset_button.setToolTip("The sampling the model comes with (its generation_config.json)")
        form.addRow("", self.reset_button)
        self.reset_button.clicked.connect(lambda: self.preset_chosen.emit(MODEL_DEFAULTS))
        self.preset.activated.connect(self._preset_activated)
        self.defaults = ModelSettings()  # the model's own sampling, to tell when the boxes hold it
        for box in (self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty,
                    self.max_tokens, self.seed):
            box.valueChanged.connect(self.edited)
            box.valueChanged.connect(self._show_preset)

    def _preset_activated(self, index: int) -> None:
        name = self.preset.itemData(index)
        if name is None:
            self._show_preset()  # "Custom" is what the boxes say, not a choice
        else:
            self.preset_chosen.emit(name)

    def _show_preset(self, *_) -> None:
        self.preset.setCurrentIndex(max(0, self.preset.findData(preset_of(self.read(self.defaults), self.defaults))))

    def show_settings(self, s: ModelSettings) -> None:
        p = s.sampling
        self.blockSignals(True)  # the boxes' own signals still fire; the panel ignores them while it updates
        self.temperature.setValue(p.temperature)
        self.top_p.setValue(p.top_p)
        self.top_k.setValue(p.top_k)
        self.min_p.setValue(p.min_p)
        self.repetition_penalty.setValue(p.repetition_penalty)
        self.max_tokens.setValue(p.max_tokens)
        self.seed.setValue(-1 if p.seed is None else p.seed)
        self.blockSignals(False)
        self._show_preset()

    def read(self, s: ModelSettings) -> ModelSettings:
        """`s` with the sampling the boxes show."""
        return replace(s, sampling=replace(
            s.sampling,
            temperature=self.temperature.value(),
            top_p=self.top_p.value(),
            top_k=self.top_k.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition_penalty.value(),
            max_tokens=self.max_tokens.value(),
            seed=None if self.seed.value() < 0 else self.seed.value(),
        ))


def _double(lo: float, hi: float, step: float, decimals: int) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    return box


def _int(lo: int, hi: int, special: str | None) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    if special:
        box.setSpecialValueText(special)
    return box
