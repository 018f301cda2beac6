"""The sampling settings of a ModelSettings: temperature, top-p, top-k, min-p, penalty, length, seed."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QGroupBox, QPushButton, QSpinBox

from .model_settings import SAMPLING_LIMITS, ModelSettings


class SamplingForm(QGroupBox):
    """Shows and reads the sampling fields; `edited` on any change by the user."""

    edited = Signal()
    reset_requested = Signal()  # "Model defaults": the panel shows the model's own sampling again

    def __init__(self, parent=None):
        super().__init__("Sampling", parent)
        lim = SAMPLING_LIMITS
        self.temperature = _double(*lim["temperature"], 0.05, 2)
        self.temperature.setToolTip("0 always picks the most likely token")
        self.top_p = _double(*lim["top_p"], 0.05, 2)
        self.top_k = _int(*lim["top_k"], "off")
        self.min_p = _double(*lim["min_p"], 0.01, 2)
        self.repetition_penalty = _double(*lim["repetition_penalty"], 0.05, 2)
        self.max_tokens = _int(*lim["max_tokens"], None)
        self.seed = _int(-1, 2**31 - 1, "random")
        form = QFormLayout(self)
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
        self.reset_button.clicked.connect(self.reset_requested)
        for box in (self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty,
                    self.max_tokens, self.seed):
            box.valueChanged.connect(self.edited)

    def show_settings(self, s: ModelSettings) -> None:
        self.blockSignals(True)  # the boxes' own signals still fire; the panel ignores them while it updates
        self.temperature.setValue(s.temperature)
        self.top_p.setValue(s.top_p)
        self.top_k.setValue(s.top_k)
        self.min_p.setValue(s.min_p)
        self.repetition_penalty.setValue(s.repetition_penalty)
        self.max_tokens.setValue(s.max_tokens)
        self.seed.setValue(-1 if s.seed is None else s.seed)
        self.blockSignals(False)

    def read(self, s: ModelSettings) -> ModelSettings:
        return replace(
            s,
            temperature=self.temperature.value(),
            top_p=self.top_p.value(),
            top_k=self.top_k.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition_penalty.value(),
            max_tokens=self.max_tokens.value(),
            seed=None if self.seed.value() < 0 else self.seed.value(),
        )


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
